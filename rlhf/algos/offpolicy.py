"""Corrections for samples drawn by a policy other than the one the loss treats as old.

The generation engine and the training engine compute the same policy with different kernels
(a KV-cache decode against a full forward; vLLM against the TP/PP model), so the rollout's
log-probs ``log mu`` differ from the training engine's ``log pi_old`` by rounding, or by more
with another backend.  The loss's importance ratio is taken against ``pi_old``; the samples
came from ``mu``.  Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training") weights each token by::

    w_t = min(pi_old(y_t) / mu(y_t), C)

which corrects the mismatch in expectation with a variance bounded by ``C``.
"""

from __future__ import annotations

import math

import torch

from rlhf.algos.masked import check_same_shape, kept, masked_mean


def rollout_mismatch(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's log-probs are from the training engine's, over the mask:
    ``{"mean": mean |log pi_old - log mu|, "max": max |...|}`` (0 for an empty mask)."""
    check_same_shape(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    diff = kept((old_log_prob - rollout_log_prob).abs().to(torch.float64), mask)
    return {"mean": float(masked_mean(diff, mask)),
            "max": float(diff.max()) if diff.numel() else 0.0}


def truncated_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                         mask: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS weights ``[B, T]``: ``min(exp(log pi_old - log mu), cap)`` on the mask, 0 off it.

    The pure policy-gradient losses (ppo with its dual clip, gspo, cispo, gmpo, sapo, gpg) are
    positively homogeneous in the advantage, so multiplying ``A_t`` by ``w_t > 0`` is the
    token-weighted loss; the controller applies the weights that way.  (clip_cov picks its
    tokens by a covariance with ``A`` and kl_cov adds a penalty that does not scale with it:
    for them the weights reweight the advantage term only.)
    """
    check_same_shape(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    if not cap > 0:
        raise ValueError(f"tis_cap={cap} must be > 0")
    log_w = kept(old_log_prob - rollout_log_prob, mask).clamp(max=math.log(cap))
    return kept(torch.exp(log_w), mask)
