"""Masked reductions over response tokens and the loss aggregation modes.

Every token-level tensor here is ``[B, T]`` over response positions, with a response mask
``[B, T]`` (bool or 0/1 float) that is 1 on real response tokens and 0 on padding.  Positions
where the mask is 0 never change a result, a metric or a gradient, even when they hold NaN or
inf: values are selected with ``torch.where`` on the mask, never multiplied by it
(``NaN * 0 = NaN``), and every function that differentiates through its inputs replaces the
masked entries *before* the arithmetic (:func:`kept`), so no ``0 * inf`` reaches a backward.

Loss aggregation (:func:`agg_loss`) is defined over a whole mini-batch, whatever its split into
micro-batches and DP ranks: the summed part of a mode is additive over rows, and the
denominator is counted once for the mini-batch (:func:`agg_count`, :func:`agg_denominator`) and
handed to every micro-batch.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
_PER_SEQUENCE = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_same_shape(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor has the shape of ``mask``."""
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but the response mask has "
                             f"shape {tuple(mask.shape)}; both must be [B, T]")


def kept(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the mask, 0 off it (``torch.where``: no gradient to, and no NaN from, the
    masked entries)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of the masked entries of ``x`` over ``dim`` (all dims if None)."""
    k = kept(x, mask)
    return k.sum() if dim is None else k.sum(dim)


def _count(mask: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    m = mask.bool()
    return (m.sum() if dim is None else m.sum(dim)).to(dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x on mask) / count(mask)`` over ``dim``; 0 where the mask is empty."""
    return masked_sum(x, mask, dim) / _count(mask, x.dtype, dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``x`` (all dims), two-pass (mean, then centred
    squares); Bessel-corrected if ``unbiased``.  0 for fewer than two entries."""
    n = _count(mask, x.dtype)
    x = kept(x, mask)
    mean = masked_mean(x, mask)
    var = masked_sum((x - mean) ** 2, mask)
    return var / ((n - 1) if unbiased else n).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased var over the masked entries.

    With ``shift_mean=False`` the mean is added back (scale only).  Masked-out entries of the
    result are 0.
    """
    x = kept(x, mask)
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return kept(out, mask)


# Loss aggregation -----------------------------------------------------------------------------
def agg_count(mask: torch.Tensor, mode: str) -> int:
    """What ``mode`` divides by, counted on ``mask [B, T]``: valid tokens (``token-mean``),
    non-empty rows (``seq-mean-*``), 0 (``token-sum``: nothing).  Counts of the micro-batches
    and DP ranks of one mini-batch add up to the mini-batch's count."""
    _check_mode(mode)
    m = mask.bool()
    if mode == "token-mean":
        return int(m.sum())
    if mode in _PER_SEQUENCE:
        return int(m.any(dim=-1).sum())
    return 0


def agg_denominator(count: int | float, mode: str) -> float:
    """The mini-batch's denominator from its total :func:`agg_count`: ``max(1, count)``, or 1
    for ``token-sum`` (an empty mini-batch then has loss 0, not NaN)."""
    _check_mode(mode)
    return 1.0 if mode == "token-sum" else max(1.0, float(count))


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str,
             denominator: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    For a mini-batch ``M`` (all its micro-batches, all DP ranks), with ``m`` the mask,
    ``n_b = sum_t m_bt`` and ``S`` the number of rows of ``M`` with ``n_b > 0``::

        token-mean               sum_{b,t} m l / sum_{b,t} m    every token weighs the same
        token-sum                sum_{b,t} m l                  no normalisation
        seq-mean-token-sum       1/S sum_b sum_t m l            every token of a row the same
        seq-mean-token-mean      1/S sum_b sum_t m l / n_b      every sequence the same
        seq-mean-token-sum-norm  1/S sum_b sum_t m l / T        Dr. GRPO (Liu et al. 2025)

    In ``seq-mean-token-sum-norm`` the constant ``T`` is the response width of the batch, the
    rollout's ``max_new_tokens`` (``data.max_response_len``): the same for every row,
    micro-batch and iteration, so no length bias enters.  An all-masked row contributes
    nothing and is not counted in ``S``.

    This function returns ``numerator(rows given) / denominator``; the numerator is a sum over
    rows, so summing the results of the micro-batches of ``M`` with the same ``denominator``
    gives the loss of ``M`` exactly.

    Args:
        loss_mat: ``[B, T]`` per-token loss.  Anything off the mask, NaN included, is ignored
            and gets gradient 0; compute ``loss_mat`` from :func:`kept` inputs so that the
            operations before it see no NaN either (their backward would give ``0 * NaN``).
        mask: ``[B, T]`` response mask.
        mode: one of :data:`LOSS_AGG_MODES`.
        denominator: the mini-batch's :func:`agg_denominator`, divided as the caller needs
            (the workers pass it divided by micro-batches x DP ranks, see
            :func:`rlhf.workers.common.loss_denominator`); None = these rows are the whole
            mini-batch.
    """
    check_same_shape(mask, loss_mat=loss_mat)
    _check_mode(mode)
    k = kept(loss_mat, mask)
    if mode == "seq-mean-token-mean":
        num = (k.sum(-1) / _count(mask, k.dtype, -1).clamp(min=1)).sum()
    elif mode == "seq-mean-token-sum-norm":
        num = k.sum() / loss_mat.shape[-1]
    else:
        num = k.sum()
    if denominator is None:
        denominator = agg_denominator(agg_count(mask, mode), mode)
    return num / denominator


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
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
    out[torch.arange(mask.shape[0]), last_token_index(mask)] = kept(scores, has_token)
    return out
