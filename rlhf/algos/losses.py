"""The actor's and the critics' losses: the actor's whole loss (a registered policy loss,
:mod:`rlhf.algos.policy_losses`, plus the KL and entropy terms), the clipped value loss, the
entropy bonus, and :func:`policy_loss`, the registered PPO loss with its clip settings passed
one by one.

Shapes: ``[B, T]`` per response token with a response mask ``[B, T]``; every loss is reduced
with :func:`rlhf.algos.masked.agg_loss` in one of ``LOSS_AGG_MODES``, with the mini-batch's
``denominator`` when the rows are one micro-batch of it (None: the rows are the whole
mini-batch).  Each function returns ``(loss, metrics)`` where ``loss`` is a differentiable
scalar and ``metrics`` holds detached scalars for logging.  Every input is passed through
:func:`rlhf.algos.masked.kept` first, so NaN or inf at masked positions never reaches a loss,
a metric or a gradient.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from rlhf.algos.kl import KLLossTerm, kl_loss
from rlhf.algos.masked import agg_loss, check_same_shape, kept, masked_mean
from rlhf.algos.policy_losses import get_policy_loss


def policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_ratio: float, clip_ratio_low: float | None,
                clip_ratio_high: float | None, clip_ratio_c: float | None,
                loss_agg_mode: str, denominator: float | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered ``ppo`` policy loss (:func:`rlhf.algos.policy_losses.ppo_loss`, where its
    formula is) with the clip settings given one by one instead of as a loss section.

    Args:
        log_prob, old_log_prob, advantages, mask: ``[B, T]``.
        clip_ratio, clip_ratio_low, clip_ratio_high: clip range.
        clip_ratio_c: dual-clip bound ``c > 1`` or None.
        loss_agg_mode, denominator: see :func:`agg_loss`.
    Returns:
        ``(loss, {"pg_loss", "approx_kl", "clipfrac", "clipfrac_lower"})``.
    """
    cfg = types.SimpleNamespace(clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                                clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    return get_policy_loss("ppo")(log_prob, old_log_prob, advantages, mask, cfg=cfg,
                                  loss_agg_mode=loss_agg_mode, denominator=denominator)


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
               ref_log_prob: torch.Tensor | None = None, kl: KLLossTerm | None = None,
               entropy: torch.Tensor | None = None, denominator: float | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's whole loss for one micro-batch::

        L = L_pg + kl.coef * agg(k(log_prob, ref_log_prob)) - entropy_coeff * agg(H)

    ``L_pg`` is ``pg_loss`` (a registered policy loss, :mod:`rlhf.algos.policy_losses`) with
    the loss section ``cfg`` (:class:`rlhf.config.PolicyLossConfig`: its clip ranges and
    per-loss settings, ``loss_agg_mode``, ``entropy_coeff``).  The KL term (KL as a loss, GRPO
    style) is added when ``kl`` is given, with the reference's ``ref_log_prob`` ``[B, T]``;
    the entropy term only when ``entropy`` (``[B, T]``) is given.  Every term is aggregated
    with ``cfg.loss_agg_mode`` and the same ``denominator``.

    Returns:
        ``(loss, metrics)`` with the policy loss's metrics plus ``kl_loss`` and ``entropy``
        when those terms are present.
    """
    if (kl is None) != (ref_log_prob is None):
        raise ValueError(f"the KL loss term needs both kl settings and ref_log_prob; got "
                         f"kl={kl} and ref_log_prob {'None' if ref_log_prob is None else 'given'}")
    mode = cfg.loss_agg_mode
    loss, metrics = pg_loss(log_prob, old_log_prob, advantages, mask, cfg=cfg,
                            loss_agg_mode=mode, denominator=denominator)
    if kl is not None:
        k, m = kl_loss(log_prob, ref_log_prob, mask, kl.estimator, mode,
                       log_ratio_clamp=kl.log_ratio_clamp, k3_clamp=kl.k3_clamp,
                       denominator=denominator)
        loss = loss + kl.coef * k
        metrics.update(m)
    if entropy is not None:
        ent, m = entropy_loss(entropy, mask, cfg.entropy_coeff, mode, denominator)
        loss = loss + ent
        metrics.update(m)
    return loss, metrics
