"""Masked reductions over response tokens and the loss aggregation modes.

Every token-level tensor here is ``[B, T]`` over response positions, with a response mask
``[B, T]`` (bool or 0/1 float) that is 1 on real response tokens and 0 on padding.  Positions
where the mask is 0 never change a result.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def check_same_shape(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor has the shape of ``mask``."""
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but the response mask has "
                             f"shape {tuple(mask.shape)}; both must be [B, T]")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all dims if None)."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim``; 0 where the mask is empty."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``x`` (all dims); Bessel-corrected if ``unbiased``."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = masked_sum(x, m) / n.clamp(min=1)
    var = masked_sum((x - mean) ** 2, m) / n.clamp(min=1)
    if unbiased:
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased var over the masked entries.

    With ``shift_mean=False`` the mean is added back (scale only).  Masked-out entries of the
    result are 0.
    """
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    out = (x - mean) * torch.rsqrt(masked_var(x, m) + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    * ``token-mean``:           sum_{b,t} m l / sum_{b,t} m            (every token weighs the same)
    * ``seq-mean-token-sum``:   1/B sum_b sum_t m l                    (Dr. GRPO style)
    * ``seq-mean-token-mean``:  1/B sum_b (sum_t m l / max(1, sum_t m)) (every sequence the same)

    B counts every row, so an all-masked row contributes 0 to the seq-mean modes.
    """
    check_same_shape(mask, loss_mat=loss_mat)
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, m, dim=-1).mean()
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, m, dim=-1).mean()
    raise ValueError(f"loss_agg_mode={mode!r} is not one of {LOSS_AGG_MODES}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index ``[B]`` of the last position where ``mask`` is 1 (0 for an all-masked row)."""
    t = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), t, torch.zeros_like(t)).amax(dim=-1)


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place one sequence score ``[B]`` on the last response token: ``[B, T]``, zeros elsewhere.

    An all-masked row gets no reward at all.
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must have shape [B]={mask.shape[0]}, got {tuple(scores.shape)}")
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has_token = mask.bool().any(dim=-1)
    out[torch.arange(mask.shape[0]), last_token_index(mask)] = scores * has_token.to(scores.dtype)
    return out
