"""PPO losses: clipped surrogate (with dual-clip and DAPO's asymmetric clip), clipped value
loss, entropy bonus.

Shapes: ``[B, T]`` per response token with a response mask ``[B, T]``; every loss is reduced
with :func:`rlhf.algos.masked.agg_loss` in one of ``LOSS_AGG_MODES``, with the mini-batch's
``denominator`` when the rows are one micro-batch of it (None: the rows are the whole
mini-batch).  Each function returns ``(loss, metrics)`` where ``loss`` is a differentiable
scalar and ``metrics`` holds detached scalars for logging.  Every input is passed through
:func:`rlhf.algos.masked.kept` first, so NaN or inf at masked positions never reaches a loss,
a metric or a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf.algos.masked import agg_loss, check_same_shape, kept, masked_mean

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps a wild ratio finite; such tokens are clipped anyway


def policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_ratio: float, clip_ratio_low: float | None,
                clip_ratio_high: float | None, clip_ratio_c: float | None,
                loss_agg_mode: str, denominator: float | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), optional dual-clip (Ye et al. 2020).

    With ``rho = exp(log_prob - old_log_prob)``, ``eps_lo = clip_ratio_low or clip_ratio``,
    ``eps_hi = clip_ratio_high or clip_ratio`` (DAPO's clip-higher when ``eps_hi > eps_lo``)::

        L_clip = max(-A rho, -A clip(rho, 1 - eps_lo, 1 + eps_hi))
        L      = min(L_clip, -A c)  if A < 0 and clip_ratio_c = c is set, else L_clip

    Args:
        log_prob: ``[B, T]`` log-probs under the current policy (carries the gradient).
        old_log_prob: ``[B, T]`` log-probs under the rollout policy.
        advantages: ``[B, T]``.
        mask: ``[B, T]`` response mask.
        clip_ratio, clip_ratio_low, clip_ratio_high: clip range.
        clip_ratio_c: dual-clip bound ``c > 1`` or None.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "clipfrac", "clipfrac_lower", "approx_kl"})``; ``clipfrac`` is the
        masked fraction of tokens where the clipped term is the larger one, ``clipfrac_lower``
        where the dual clip bites, ``approx_kl = mean(old_log_prob - log_prob)`` (k1).
    """
    check_same_shape(mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    eps_lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    eps_hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if not (0 <= eps_lo < 1 and eps_hi >= 0):
        raise ValueError(f"clip_ratio_low={eps_lo} must be in [0, 1) and clip_ratio_high="
                         f"{eps_hi} >= 0")
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (or None to disable)")
    log_prob, old_log_prob = kept(log_prob, mask), kept(old_log_prob, mask)
    advantages = kept(advantages, mask)
    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi)
    clipped = torch.maximum(loss1, loss2)
    if clip_ratio_c is not None:
        loss3 = -advantages * clip_ratio_c
        dual = torch.minimum(clipped, loss3)
        lower = (advantages < 0) & (clipped > loss3)
        losses = torch.where(advantages < 0, dual, clipped)
    else:
        lower = torch.zeros_like(mask, dtype=torch.bool)
        losses = clipped
    loss = agg_loss(losses, mask, loss_agg_mode, denominator)
    with torch.no_grad():
        metrics = {"pg_loss": loss.detach(),
                   "clipfrac": masked_mean((loss2 > loss1).to(log_prob.dtype), mask),
                   "clipfrac_lower": masked_mean(lower.to(log_prob.dtype), mask),
                   "approx_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip_range: float | None, loss_agg_mode: str,
               denominator: float | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 style)::

        V_clip = old_V + clip(V - old_V, -c, c)
        L      = 0.5 * max((V - R)^2, (V_clip - R)^2)     (0.5 * (V - R)^2 when c is None)

    Args:
        values: ``[B, T]`` current critic values (carries the gradient).
        old_values: ``[B, T]`` values at rollout time.
        returns: ``[B, T]`` targets (GAE returns).
        mask: ``[B, T]``.
        clip_range: ``c`` or None for no value clipping.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"vf_loss", "vf_clipfrac", "vpred_mean"})``.
    """
    check_same_shape(mask, values=values, old_values=old_values, returns=returns)
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"value clip_range={clip_range} must be > 0 (or None to disable)")
    values, old_values, returns = kept(values, mask), kept(old_values, mask), kept(returns, mask)
    loss1 = (values - returns) ** 2
    if clip_range is None:
        losses, loss2 = loss1, loss1
    else:
        clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        loss2 = (clipped - returns) ** 2
        losses = torch.maximum(loss1, loss2)
    loss = 0.5 * agg_loss(losses, mask, loss_agg_mode, denominator)
    with torch.no_grad():
        metrics = {"vf_loss": loss.detach(),
                   "vf_clipfrac": masked_mean((loss2 > loss1).to(values.dtype), mask),
                   "vpred_mean": masked_mean(values, mask)}
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` of ``[..., V]`` logits -> ``[...]``."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def entropy_loss(entropy: torch.Tensor, mask: torch.Tensor, coeff: float, loss_agg_mode: str,
                 denominator: float | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss term: ``-coeff * agg(H)`` (minimising it raises the entropy).

    Args:
        entropy: ``[B, T]`` per-token entropy (e.g. :func:`entropy_from_logits`).
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"entropy"})`` with the aggregated entropy (not scaled).
    """
    check_same_shape(mask, entropy=entropy)
    h = agg_loss(entropy, mask, loss_agg_mode, denominator)
    return -coeff * h, {"entropy": h.detach()}


def actor_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, *, pg_loss: Callable, cfg: Any,
               ref_log_prob: torch.Tensor | None = None, kl_loss_coef: float,
               kl_estimator: str, kl_log_ratio_clamp: float, kl_k3_clamp: float,
               entropy: torch.Tensor | None = None, denominator: float | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's whole loss for one micro-batch::

        L = L_pg + kl_loss_coef * agg(k(log_prob, ref_log_prob)) - entropy_coeff * agg(H)

    ``L_pg`` is ``pg_loss`` (a registered policy loss, :mod:`rlhf.algos.policy_losses`) with
    the loss section ``cfg`` (:class:`rlhf.config.PolicyLossConfig`: its clip ranges and
    per-loss settings, ``loss_agg_mode``, ``entropy_coeff``).  The KL term is added only when
    ``ref_log_prob`` is given (KL as a loss, GRPO style; its estimator and bounds are
    :func:`rlhf.algos.kl.kl_estimate`'s), the entropy term only when ``entropy`` (``[B, T]``)
    is given.  Every term is aggregated with ``cfg.loss_agg_mode`` and the same
    ``denominator``.

    Returns:
        ``(loss, metrics)`` with the policy loss's metrics plus ``kl_loss`` and ``entropy``
        when those terms are present.
    """
    from rlhf.algos.kl import kl_loss

    mode = cfg.loss_agg_mode
    loss, metrics = pg_loss(log_prob, old_log_prob, advantages, mask, cfg=cfg,
                            loss_agg_mode=mode, denominator=denominator)
    if ref_log_prob is not None:
        kl, m = kl_loss(log_prob, ref_log_prob, mask, kl_estimator, mode,
                        log_ratio_clamp=kl_log_ratio_clamp, k3_clamp=kl_k3_clamp,
                        denominator=denominator)
        loss = loss + kl_loss_coef * kl
        metrics.update(m)
    if entropy is not None:
        ent, m = entropy_loss(entropy, mask, cfg.entropy_coeff, mode, denominator)
        loss = loss + ent
        metrics.update(m)
    return loss, metrics
