"""Policy losses by name: a registry, PPO, and the PPO-family losses of 2025.

Every registered loss has one signature::

    fn(log_prob, old_log_prob, advantages, mask, *, cfg, loss_agg_mode, denominator=None)
        -> (loss, metrics)

``log_prob`` (carries the gradient), ``old_log_prob``, ``advantages`` and ``mask`` are ``[B, T]``
over response tokens.  ``cfg`` is any object with the attributes of
``rlhf.config.PolicyLossConfig`` (read by name; this package imports torch only).
``loss_agg_mode`` and ``denominator`` are :func:`rlhf.algos.masked.agg_loss`'s: the loss of one
micro-batch is its numerator over the whole mini-batch's denominator, so micro-batch losses add
up to the mini-batch's.  ``loss`` is a differentiable scalar; ``metrics`` holds detached
scalars: always ``pg_loss`` and ``approx_kl`` (masked mean of ``old_log_prob - log_prob``),
``clipfrac`` where the loss clips.  Every input goes through :func:`kept` before any arithmetic,
so NaN or inf at masked positions never reaches a loss, a metric or a gradient.

With ``r = exp(log_prob - old_log_prob)`` (log ratio clamped to +-20), ``A`` the advantage and
``sg`` the stop-gradient, the per-token losses are::

    ppo       max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi)), dual clip     Schulman 2017, Ye 2020
    gspo      max(-A s, -A clip(s, 1-eps_lo, 1+eps_hi)), s = sequence ratio     Zheng 2025
    cispo     -sg(min(r, 1+eps_hi)) A log_prob                              MiniMax-M1 2025
    clip_cov  ppo's clip, gradient cut on random high-covariance tokens         Cui 2025
    kl_cov    -A r + coef |log r| on the highest-covariance tokens              Cui 2025
    gmpo      -A_i exp(mean_t clip(log r)), one loss per sequence               Zhao 2025
    sapo      -A sigmoid(tau (r - 1)) 4 / tau                                   Gao 2025
    gpg       -A log_prob                                                       Chu 2025

Losses are added with :func:`register_policy_loss` (a user's ``algo.module`` may add its own)
and found with :func:`get_policy_loss`; :data:`POLICY_LOSSES` is the one list of names.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rlhf.algos.masked import agg_loss, check_same_shape, kept, masked_mean

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps a wild ratio finite; such tokens are clipped anyway

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering a policy loss (the signature of this module's docstring) as
    ``name``; ValueError if ``name`` is taken."""
    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice (registered: "
                             f"{sorted(POLICY_LOSSES)})")
        POLICY_LOSSES[name] = fn
        return fn
    return add


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; ValueError listing the registered ones."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"loss.mode={name!r} is not a registered policy loss; choose from "
                         f"{sorted(POLICY_LOSSES)}") from None


# Shared steps --------------------------------------------------------------------------------
def _inputs(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_prob, advantages, log_ratio)`` kept on the mask (0 off it), the log ratio
    ``log_prob - old_log_prob`` clamped to +-20 (exp(20) ~ 5e8 stays finite)."""
    check_same_shape(mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    log_prob, advantages = kept(log_prob, mask), kept(advantages, mask)
    log_ratio = (log_prob - kept(old_log_prob, mask)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_prob, advantages, log_ratio


def _clip_range(cfg: Any) -> tuple[float, float]:
    """``(eps_lo, eps_hi)``: ``clip_ratio_low``/``clip_ratio_high``, each defaulting to
    ``clip_ratio``."""
    eps_lo = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    eps_hi = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    if not (0 <= eps_lo < 1 and eps_hi >= 0):
        raise ValueError(f"clip_ratio_low={eps_lo} must be in [0, 1) and clip_ratio_high="
                         f"{eps_hi} >= 0")
    return eps_lo, eps_hi


def _metrics(loss: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
             **fractions: torch.Tensor) -> dict[str, torch.Tensor]:
    """``pg_loss``, ``approx_kl`` (k1) and, per boolean ``[B, T]`` in ``fractions``, its
    masked fraction."""
    with torch.no_grad():
        out = {"pg_loss": loss.detach(), "approx_kl": masked_mean(-log_ratio, mask)}
        for name, flags in fractions.items():
            out[name] = masked_mean(flags.to(log_ratio.dtype), mask)
    return out


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_lo: float,
                       eps_hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max(-A x, -A clip(x, 1-eps_lo, 1+eps_hi)), clipped)`` per token; ``clipped`` marks
    where the clipped term is the larger one (its gradient is 0)."""
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi)
    return torch.maximum(loss1, loss2), loss2 > loss1


# PPO -----------------------------------------------------------------------------------------
@register_policy_loss("ppo")
def ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, cfg: Any, loss_agg_mode: str,
             denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO's asymmetric clip and the dual
    clip (Ye et al. 2020)::

        L_t = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi))
        L_t = min(L_t, -A c)   where A < 0, when cfg.clip_ratio_c = c is set

    ``eps_lo = cfg.clip_ratio_low``, ``eps_hi = cfg.clip_ratio_high`` (each defaulting to
    ``cfg.clip_ratio``; clip-higher when ``eps_hi > eps_lo``).

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        cfg: the clip range fields and ``clip_ratio_c`` (> 1, or None: no dual clip).
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl", "clipfrac", "clipfrac_lower"})``: ``clipfrac`` the
        fraction of valid tokens where the clipped term is the larger one, ``clipfrac_lower``
        where the dual clip bites.
    """
    eps_lo, eps_hi = _clip_range(cfg)
    c = cfg.clip_ratio_c
    if c is not None and not c > 1:
        raise ValueError(f"clip_ratio_c={c} must be > 1 (or None to disable)")
    _, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    losses, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, eps_lo, eps_hi)
    lower = torch.zeros_like(clipped)
    if c is not None:
        dual = -advantages * c
        lower = (advantages < 0) & (losses > dual)
        losses = torch.where(advantages < 0, torch.minimum(losses, dual), losses)
    loss = agg_loss(losses, mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask, clipfrac=clipped, clipfrac_lower=lower)


# GSPO ----------------------------------------------------------------------------------------
@register_policy_loss("gspo")
def gspo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, cfg: Any, loss_agg_mode: str,
              denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization, token form (Zheng et al. 2025, GSPO-token).

    The importance ratio is the sequence's length-normalised likelihood ratio, carried on each
    token so that every token gets its own gradient::

        s_i  = exp(1/|y_i| sum_t log r_it)                  (valid tokens of row i)
        s_it = sg(s_i) exp(log_prob_it - sg(log_prob_it))    value s_i, d s_it/d logp_it = s_i
        L_it = max(-A_it s_it, -A_it clip(s_it, 1 - eps_lo, 1 + eps_hi))

    ``eps_lo = cfg.clip_ratio_low``, ``eps_hi = cfg.clip_ratio_high`` (each defaulting to
    ``cfg.clip_ratio``; the paper uses much smaller ranges than PPO, e.g. 3e-4 / 4e-4).  Each
    ``log r_it`` is clamped to +-20.  The paper aggregates with ``seq-mean-token-mean``; any
    ``loss_agg_mode`` is accepted.

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        cfg: the clip range fields.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl", "clipfrac"})``, ``clipfrac`` the fraction of valid
        tokens whose sequence ratio is clipped.
    """
    eps_lo, eps_hi = _clip_range(cfg)
    log_prob, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    seq_log_ratio = masked_mean(log_ratio, mask, -1).detach()                  # [B]
    ratio = torch.exp(log_prob - log_prob.detach() + seq_log_ratio[:, None])   # [B, T]
    losses, clipped = _clipped_surrogate(ratio, advantages, eps_lo, eps_hi)
    loss = agg_loss(losses, mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask, clipfrac=clipped)


# CISPO ---------------------------------------------------------------------------------------
@register_policy_loss("cispo")
def cispo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, *, cfg: Any, loss_agg_mode: str,
               denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

    REINFORCE with a truncated, stop-gradient importance weight: the weight is clipped, never
    the gradient, so a token whose weight is truncated still learns::

        L_it = -sg(min(r_it, 1 + eps_hi)) A_it log_prob_it

    ``eps_hi = cfg.clip_ratio_high`` (default ``cfg.clip_ratio``); no lower bound.

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        cfg: the clip range fields.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl", "clipfrac"})``, ``clipfrac`` the fraction of valid
        tokens whose weight is truncated.
    """
    _, eps_hi = _clip_range(cfg)
    log_prob, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, max=1 + eps_hi)
    loss = agg_loss(-weight * advantages * log_prob, mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask, clipfrac=ratio > 1 + eps_hi)


# Clip-Cov and KL-Cov -------------------------------------------------------------------------
def token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """Each token's centred covariance term between advantage and log-prob (Cui et al. 2025)::

        cov_bt = (A_bt - mean(A)) (logp_bt - mean(logp))

    Means over all valid tokens of the given rows.  Detached; 0 off the mask.
    """
    with torch.no_grad():
        a, lp = kept(advantages, mask), kept(log_prob, mask)
        return kept((a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask)), mask)


def clip_cov_tokens(cov: torch.Tensor, mask: torch.Tensor, eligible: torch.Tensor, *,
                    ratio: float, lb: float, ub: float) -> torch.Tensor:
    """The tokens whose gradient Clip-Cov cuts: bool ``[B, T]``.

    Candidates are valid, ``eligible`` tokens with ``lb <= cov <= ub``.  Of them,
    ``k = min(n_candidates, max(1, int(ratio * n_valid)))`` are cut (none when ``ratio == 0``
    or there is no candidate), ``n_valid`` counting the mask.  The ``k`` are a uniformly random
    subset: a CPU ``torch.Generator`` seeded with ``n_valid * 1_000_003 + n_candidates``
    permutes the candidates (row-major order) and the first ``k`` are kept.  The same inputs
    give the same cut on every run and device; batches differ through their candidates.
    """
    m = mask.bool()
    cand = torch.nonzero((m & eligible & (cov >= lb) & (cov <= ub)).flatten()).squeeze(-1)
    n_valid, n_cand = int(m.sum()), cand.numel()
    cut = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    if ratio <= 0 or n_cand == 0:
        return cut
    k = min(n_cand, max(1, int(ratio * n_valid)))
    gen = torch.Generator().manual_seed(n_valid * 1_000_003 + n_cand)
    pick = torch.randperm(n_cand, generator=gen)[:k].to(cand.device)
    cut.view(-1)[cand[pick]] = True
    return cut


def kl_cov_tokens(cov: torch.Tensor, mask: torch.Tensor, *, ratio: float) -> torch.Tensor:
    """The tokens KL-Cov penalises: bool ``[B, T]``, the ``max(1, int(ratio * n_valid))``
    valid tokens of largest ``cov`` (none when ``ratio == 0``); ties go to the earlier token
    (row-major), so the choice is deterministic."""
    m = mask.bool()
    top = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    valid = torch.nonzero(m.flatten()).squeeze(-1)
    n_valid = valid.numel()
    if ratio <= 0 or n_valid == 0:
        return top
    k = min(n_valid, max(1, int(ratio * n_valid)))
    order = torch.sort(cov.flatten()[valid], descending=True, stable=True).indices[:k]
    top.view(-1)[valid[order]] = True
    return top


def _check_unit(**ratios: float) -> None:
    for name, v in ratios.items():
        if not 0 <= v <= 1:
            raise ValueError(f"loss.{name}={v} must be in [0, 1]")


@register_policy_loss("clip_cov")
def clip_cov_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                  advantages: torch.Tensor, mask: torch.Tensor, *, cfg: Any,
                  loss_agg_mode: str, denominator: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models").

    Entropy collapses through tokens with a large covariance between advantage and
    log-prob; Clip-Cov stops the gradient of a few of them::

        L_it = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi))       (no dual clip)
        L_it = sg(L_it)   on the tokens of :func:`clip_cov_tokens`

    with ``cov`` from :func:`token_covariance` over the given rows, candidates in
    ``[cfg.clip_cov_lb, cfg.clip_cov_ub]`` that the PPO clip has not already cut (as in the
    authors' code: a clipped token has no gradient to cut), ``cfg.clip_cov_ratio`` of the
    valid tokens cut.  The loss value is unchanged, only gradients differ.  The selection is
    per call (micro-batch), as in the authors' code.

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        cfg: clip range, ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl", "clipfrac", "clip_cov_frac"})``: fractions of valid
        tokens the PPO clip cuts and the covariance cut cuts.
    """
    eps_lo, eps_hi = _clip_range(cfg)
    _check_unit(clip_cov_ratio=cfg.clip_cov_ratio)
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        raise ValueError(f"loss.clip_cov_lb={cfg.clip_cov_lb} must be < clip_cov_ub="
                         f"{cfg.clip_cov_ub}")
    log_prob, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    losses, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, eps_lo, eps_hi)
    cut = clip_cov_tokens(token_covariance(advantages, log_prob, mask), mask, ~clipped,
                          ratio=cfg.clip_cov_ratio, lb=cfg.clip_cov_lb, ub=cfg.clip_cov_ub)
    losses = torch.where(cut, losses.detach(), losses)
    loss = agg_loss(losses, mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask, clipfrac=clipped, clip_cov_frac=cut)


@register_policy_loss("kl_cov")
def kl_cov_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, cfg: Any, loss_agg_mode: str,
                denominator: float | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025): an unclipped surrogate, with a KL penalty on the tokens of
    highest advantage/log-prob covariance::

        L_it = -A r + kl_cov_coef |log r|   on the top kl_cov_ratio of valid tokens by cov
        L_it = -A r                         elsewhere

    ``cov`` from :func:`token_covariance` over the given rows, the tokens from
    :func:`kl_cov_tokens` (per call, as in the authors' code).

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        cfg: ``kl_cov_ratio``, ``kl_cov_coef``.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl", "kl_cov_frac"})``, the fraction of valid tokens
        penalised.
    """
    _check_unit(kl_cov_ratio=cfg.kl_cov_ratio)
    if not cfg.kl_cov_coef >= 0:
        raise ValueError(f"loss.kl_cov_coef={cfg.kl_cov_coef} must be >= 0")
    log_prob, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    surrogate = -advantages * torch.exp(log_ratio)
    top = kl_cov_tokens(token_covariance(advantages, log_prob, mask), mask,
                        ratio=cfg.kl_cov_ratio)
    losses = torch.where(top, surrogate + cfg.kl_cov_coef * log_ratio.abs(), surrogate)
    loss = agg_loss(losses, mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask, kl_cov_frac=top)


# GMPO ----------------------------------------------------------------------------------------
@register_policy_loss("gmpo")
def gmpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, cfg: Any, loss_agg_mode: str,
              denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric-Mean Policy Optimization (Zhao et al. 2025).

    The sequence ratio is the geometric mean of token ratios, each clipped in log space,
    pessimistically with the sign of the sequence's advantage ``A_i`` (the masked mean of its
    row of ``advantages``; the paper's advantages are per sequence)::

        l_it   = log r_it,   c = cfg.gmpo_clip
        l'_it  = sgn(A_i) min(sgn(A_i) l_it, sgn(A_i) clip(l_it, -c, c))
        L_i    = -A_i exp(1/|y_i| sum_t l'_it)

    ``L_i`` is placed on every valid token of row ``i`` and reduced with ``loss_agg_mode``:
    ``seq-mean-token-mean`` gives the paper's ``1/S sum_i L_i`` (mean over the non-empty rows
    of the mini-batch), while the token modes weigh sequence ``i`` by ``|y_i|``.  Going through
    :func:`agg_loss` keeps the caller's ``denominator`` right in every mode.  An all-masked
    row contributes nothing.

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        cfg: ``gmpo_clip`` (> 0).
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl", "clipfrac"})``, ``clipfrac`` the fraction of valid
        tokens whose log ratio the clip replaced.
    """
    c = cfg.gmpo_clip
    if not c > 0:
        raise ValueError(f"loss.gmpo_clip={c} must be > 0")
    _, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    seq_adv = masked_mean(advantages, mask, -1)                               # [B]
    sgn = torch.sign(seq_adv)[:, None]                                        # [B, 1]
    log_ratio_c = log_ratio.clamp(-c, c)
    pessimistic = sgn * torch.minimum(sgn * log_ratio, sgn * log_ratio_c)     # [B, T]
    seq_loss = -seq_adv * torch.exp(masked_mean(pessimistic, mask, -1))       # [B]
    loss = agg_loss(seq_loss[:, None].expand_as(log_ratio), mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask, clipfrac=sgn * log_ratio_c < sgn * log_ratio)


# SAPO ----------------------------------------------------------------------------------------
@register_policy_loss("sapo")
def sapo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, cfg: Any, loss_agg_mode: str,
              denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Soft Adaptive Policy Optimization (Gao et al. 2025, Qwen).

    A smooth gate in place of the hard clip: the gradient fades as ``r`` leaves 1 instead of
    stopping at a bound::

        f_tau(r) = sigmoid(tau (r - 1)) 4 / tau,   f_tau'(1) = 1
        L_it     = -f_tau(r_it) A_it,   tau = cfg.sapo_tau_pos if A_it > 0 else sapo_tau_neg

    so at ``r = 1`` the gradient is the plain policy gradient ``-A grad(log_prob)``.

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        cfg: ``sapo_tau_pos``, ``sapo_tau_neg`` (> 0).
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl"})``.
    """
    if not (cfg.sapo_tau_pos > 0 and cfg.sapo_tau_neg > 0):
        raise ValueError(f"loss.sapo_tau_pos={cfg.sapo_tau_pos} and sapo_tau_neg="
                         f"{cfg.sapo_tau_neg} must be > 0")
    _, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    tau = torch.where(advantages > 0, advantages.new_tensor(cfg.sapo_tau_pos),
                      advantages.new_tensor(cfg.sapo_tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1)) * 4 / tau
    loss = agg_loss(-gate * advantages, mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask)


# GPG -----------------------------------------------------------------------------------------
@register_policy_loss("gpg")
def gpg_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, cfg: Any, loss_agg_mode: str,
             denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Policy Gradient (Chu et al. 2025): the plain policy gradient, no ratio, no clip::

        L_it = -A_it log_prob_it

    ``old_log_prob`` only feeds ``approx_kl``; ``cfg`` is unused.

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl"})``.
    """
    log_prob, advantages, log_ratio = _inputs(log_prob, old_log_prob, advantages, mask)
    loss = agg_loss(-advantages * log_prob, mask, loss_agg_mode, denominator)
    return loss, _metrics(loss, log_ratio, mask)
