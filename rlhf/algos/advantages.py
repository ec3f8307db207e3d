"""Advantage estimators: GAE, ReMax, GRPO, RLOO, REINFORCE++.

Shapes: token-level tensors are ``[B, T]`` over response positions with a response mask
``[B, T]``; sequence scores are ``[B]``.  Every estimator returns ``(advantages, returns)``, both
``[B, T]`` and 0 where the mask is 0.

Masked positions *inside* a response are skipped, not treated as episode ends: recursions over
time carry their state across them, so a sequence with holes gives the same result as the
sequence with the holes removed.  For right-padded responses this is the usual convention.
Whatever a masked position holds (NaN and inf included) never reaches a result: inputs are
selected with ``torch.where`` on the mask before any arithmetic.

Group-based estimators (GRPO, RLOO) take ``group`` = one id per row (the prompt uid); rows with
equal ids are samples of the same prompt.  The sequence score of a row is the sum of its
token-level rewards, so a KL penalty folded into the rewards is included.  Their group
statistics are computed in float64 on scores shifted by one member of the group, mean first
and centred squares second (:func:`_group_stats`), so large offsets do not cancel and a group
of identical scores gets an advantage of exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf.algos.masked import check_same_shape, kept, masked_sum, masked_whiten


def _discounted_sum_skip_masked(rewards: torch.Tensor, mask: torch.Tensor,
                                gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{next valid t}`` over valid tokens, right to left."""
    m = mask.bool()
    rewards = kept(rewards, m)
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return kept(out, m)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gamma: float, lam: float, whiten: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over masked response tokens.

    With ``t' `` the next valid position after ``t`` (value 0 past the last one)::

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                      (value target, before whitening)

    Args:
        token_rewards: ``[B, T]`` per-token rewards (score on the last token, minus any KL).
        values: ``[B, T]`` critic values of the same positions.
        mask: ``[B, T]`` response mask.
        gamma, lam: discount and GAE lambda, in [0, 1].
        whiten: whiten advantages over all masked tokens of the batch (PPO default).
    Returns:
        ``(advantages, returns)``, ``[B, T]`` each, 0 off the mask.
    """
    check_same_shape(mask, token_rewards=token_rewards, values=values)
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    m = mask.bool()
    with torch.no_grad():
        token_rewards, values = kept(token_rewards, m), kept(values, m)
        next_value = torch.zeros_like(values[:, 0])
        next_adv = torch.zeros_like(values[:, 0])
        adv = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            a = delta + gamma * lam * next_adv
            adv[:, t] = a
            # a masked position passes the state of the next valid position through
            next_adv = torch.where(m[:, t], a, next_adv)
            next_value = torch.where(m[:, t], values[:, t], next_value)
        returns = kept(adv + values, m)
        adv = masked_whiten(adv, m) if whiten else kept(adv, m)
    return adv, returns


def remax(token_rewards: torch.Tensor, baseline_scores: torch.Tensor, mask: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): REINFORCE with the reward of a greedy response as the baseline.

    ``G_t = sum_{t' >= t} r_{t'}`` (undiscounted return-to-go over valid tokens),
    ``A_t = G_t - b`` with ``b = baseline_scores[b]`` the greedy response's score.

    Args:
        token_rewards: ``[B, T]`` rewards of the sampled responses.
        baseline_scores: ``[B]`` score of the greedy response to the same prompt.
        mask: ``[B, T]``.
    Returns:
        ``(advantages, returns)`` with ``returns = G``.
    """
    check_same_shape(mask, token_rewards=token_rewards)
    _check_rows("baseline_scores", baseline_scores, mask)
    with torch.no_grad():
        returns = _discounted_sum_skip_masked(token_rewards, mask, 1.0)
        adv = kept(returns - baseline_scores.to(returns.dtype)[:, None], mask)
    return adv, returns


def group_index(group: Sequence | torch.Tensor) -> torch.Tensor:
    """Map arbitrary hashable group ids (uids, ints) to dense ints ``[B]`` in first-seen order."""
    if isinstance(group, torch.Tensor):
        group = group.tolist()
    ids: dict = {}
    return torch.tensor([ids.setdefault(g, len(ids)) for g in group], dtype=torch.long)


@dataclass(frozen=True)
class GroupStats:
    """Per-row group statistics of sequence scores ``[B]``, float64.

    Each group is shifted by one of its members (``d_i = s_i - s_ref(g)``) before anything is
    summed: identical scores give ``d = 0`` exactly, and an offset shared by the group (a score
    of 1000 +- 0.01) never enters a sum, so no digits cancel.
    """

    n: torch.Tensor
    """``[B]`` size of the row's group."""
    centred: torch.Tensor
    """``[B]`` ``s_i - mean_g`` (as ``d_i - mean(d)_g``)."""
    others_centred: torch.Tensor
    """``[B]`` ``s_i - mean of the other members of g`` (``s_i`` for a group of one)."""
    std: torch.Tensor
    """``[B]`` unbiased std of the group, two-pass: ``sqrt(sum (s - mean)^2 / (n - 1))``."""


def _group_stats(scores: torch.Tensor, group: Sequence | torch.Tensor) -> GroupStats:
    """:class:`GroupStats` of ``scores [B]`` for the group ids ``group`` (one per row)."""
    idx = group_index(group)
    if idx.shape[0] != scores.shape[0]:
        raise ValueError(f"group has {idx.shape[0]} ids but scores has {scores.shape[0]} rows")
    rows = idx.shape[0]
    n_groups = int(idx.max()) + 1 if rows else 0
    s = scores.detach().to(torch.float64)
    first = torch.full((n_groups,), rows, dtype=torch.long).scatter_reduce(
        0, idx, torch.arange(rows), reduce="amin")
    d = s - s[first][idx]                                  # shifted by the group's first member
    zeros = torch.zeros(n_groups, dtype=torch.float64)
    count = zeros.index_add(0, idx, torch.ones_like(d))
    total = zeros.index_add(0, idx, d)
    centred = d - (total / count)[idx]                     # pass 1: the mean
    sq = zeros.index_add(0, idx, centred * centred)        # pass 2: centred squares
    n = count[idx]
    std = (sq / (count - 1).clamp(min=1)).sqrt()[idx]
    others = d - (total[idx] - d) / (n - 1).clamp(min=1)
    return GroupStats(n=n, centred=centred, others_centred=torch.where(n > 1, others, s),
                      std=std)


def grpo_scores(scores: torch.Tensor, group: Sequence | torch.Tensor, norm_by_std: bool,
                eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024) sequence advantages ``[B]``, in the dtype of ``scores``.

    For a group ``g`` with ``n`` samples, mean ``mu_g`` and unbiased std ``sigma_g``::

        A_i = (s_i - mu_g) / (sigma_g + eps)     if norm_by_std
        A_i =  s_i - mu_g                        otherwise (Dr. GRPO)

    A group of one sample has ``mu = 0, sigma = 1`` (its score passes through), as in verl; a
    group of identical scores has ``A = 0`` exactly.  Statistics in float64 (:class:`GroupStats`).
    """
    st = _group_stats(scores, group)
    single = st.n == 1
    s = scores.detach().to(torch.float64)
    centred = torch.where(single, s, st.centred)
    std = torch.where(single, torch.ones_like(st.std), st.std)
    out = centred / (std + eps) if norm_by_std else centred
    return out.to(scores.dtype)


def rloo_scores(scores: torch.Tensor, group: Sequence | torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024) sequence advantages ``[B]``: leave-one-out baseline.

    ``A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1)``; a group of one keeps ``A_i = s_i``;
    a group of identical scores has ``A = 0`` exactly.  Computed in float64, returned in the
    dtype of ``scores``.
    """
    return _group_stats(scores, group).others_centred.to(scores.dtype)


def _broadcast(seq_adv: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = kept(seq_adv[:, None].expand(mask.shape), mask)
    return adv, adv.clone()


def grpo(token_rewards: torch.Tensor, mask: torch.Tensor, group: Sequence | torch.Tensor,
         norm_by_std: bool, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: :func:`grpo_scores` of ``s = sum_t m r`` on every valid token."""
    check_same_shape(mask, token_rewards=token_rewards)
    with torch.no_grad():
        return _broadcast(grpo_scores(masked_sum(token_rewards, mask, -1), group,
                                      norm_by_std, eps), mask)


def rloo(token_rewards: torch.Tensor, mask: torch.Tensor, group: Sequence | torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO outcome advantage: :func:`rloo_scores` of ``s = sum_t m r`` on every valid token."""
    check_same_shape(mask, token_rewards=token_rewards)
    with torch.no_grad():
        return _broadcast(rloo_scores(masked_sum(token_rewards, mask, -1), group), mask)


def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): whitened discounted returns, KL folded into the rewards.

    ``G_t = r_t + gamma * G_{t'}`` over valid tokens; ``A = whiten(G)`` over all masked tokens of
    the batch (mean shifted, unbiased std).
    """
    check_same_shape(mask, token_rewards=token_rewards)
    _check_unit("gamma", gamma)
    with torch.no_grad():
        returns = _discounted_sum_skip_masked(token_rewards, mask, gamma)
        return masked_whiten(returns, mask), returns


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1]")


def _check_rows(name: str, t: torch.Tensor, mask: torch.Tensor) -> None:
    if t.dim() != 1 or t.shape[0] != mask.shape[0]:
        raise ValueError(f"{name} must have shape [B]=[{mask.shape[0]}], got {tuple(t.shape)}")
