"""What DAPO adds around the task reward: the overlong penalty and the filter of groups whose
rewards carry no signal (dynamic sampling)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per response ``[B]``::

        R_len(L) = 0                                  L <= L_max - buffer
                 = (L_max - buffer - L) / buffer * f  L_max - buffer < L <= L_max

    a linear ramp from 0 to ``-factor`` over the last ``buffer`` tokens before the length
    limit ``L_max``, added to the task reward (a truncated response gets the full ``-factor``).

    Args:
        lengths: ``[B]`` response lengths in tokens (valid tokens of the response mask).
        max_len: ``L_max``, the rollout's ``data.max_response_len``.
        buffer: ramp length, ``0 < buffer <= max_len``.
        factor: penalty at the limit, ``>= 0``.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_buffer={buffer} must be in (0, max_response_len={max_len}]")
    if factor < 0:
        raise ValueError(f"overlong_penalty_factor={factor} must be >= 0")
    expected = max_len - buffer
    excess = lengths.to(torch.float32) - expected
    penalty = (-excess / buffer * factor).clamp(min=-factor)  # a longer one: the full penalty
    return torch.where(excess > 0, penalty, torch.zeros_like(excess))


def varied_groups(scores: torch.Tensor, group: Sequence | torch.Tensor) -> torch.Tensor:
    """Row mask ``[B]`` (bool): True where the row's group has at least two different scores.

    DAPO's dynamic sampling (Yu et al. 2025, eq. 11) keeps only such groups: in a group of equal
    scores (all correct, all wrong) every group-relative advantage is 0, so it adds no gradient
    and only dilutes the batch.  Equality is exact (a group of one is never varied).

    Args:
        scores: ``[B]`` sequence scores.
        group: one id per row (the prompt uid), as for :func:`rlhf.algos.grpo`.
    """
    from rlhf.algos.advantages import group_index

    idx = group_index(group)
    if idx.shape[0] != scores.shape[0]:
        raise ValueError(f"group has {idx.shape[0]} ids but scores has {scores.shape[0]} rows")
    if not idx.numel():
        return torch.zeros(0, dtype=torch.bool)
    n = int(idx.max()) + 1
    s = scores.detach().to(torch.float64)
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, idx, s, "amin")
    hi = torch.full((n,), float("-inf"), dtype=torch.float64).scatter_reduce(0, idx, s, "amax")
    return (hi > lo)[idx]
