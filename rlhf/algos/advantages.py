"""Advantage estimators: GAE, ReMax, GRPO, RLOO, REINFORCE++ (with and without a group
baseline), Dr. GRPO, OPO, pass@k.

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

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

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


# Outcome estimators with group baselines: REINFORCE++-baseline, Dr. GRPO, OPO, pass@k ----------
def _row_groups(group: Sequence | torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    """Dense group index ``[B]`` and the number of groups; ValueError unless one id per row."""
    idx = group_index(group)
    if idx.shape[0] != rows:
        raise ValueError(f"group has {idx.shape[0]} ids but token_rewards has {rows} rows")
    return idx, (int(idx.max()) + 1 if rows else 0)


def reinforce_pp_baseline(token_rewards: torch.Tensor, mask: torch.Tensor,
                          group: Sequence | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu et al. 2025, "REINFORCE++"; verl's
    ``reinforce_plus_plus_baseline``).

    With ``s_i = sum_t m r`` the row's score and ``mu_g`` the mean score of its group::

        b_i = s_i - mu_g                  (a group of one keeps b_i = s_i, as in verl)
        A   = whiten(b broadcast to the valid tokens)   over all masked tokens of the batch
        R   = b broadcast to the valid tokens           (centred, not whitened)

    The group mean is taken in float64 (:class:`GroupStats`), so a group of identical scores has
    ``b = 0`` exactly; the whitening runs in float64 too.  Both results are in the dtype of
    ``token_rewards``.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (KL penalty folded in, if any).
        mask: ``[B, T]`` response mask.
        group: one id per row (the prompt uid).
    Returns:
        ``(advantages, returns)``, ``[B, T]`` each, 0 off the mask.
    """
    check_same_shape(mask, token_rewards=token_rewards)
    with torch.no_grad():
        s = masked_sum(token_rewards, mask, -1).to(torch.float64)
        st = _group_stats(s, group)
        centred, returns = _broadcast(torch.where(st.n == 1, s, st.centred), mask)
        adv = masked_whiten(centred, mask)
        return adv.to(token_rewards.dtype), returns.to(token_rewards.dtype)


def dr_grpo(token_rewards: torch.Tensor, mask: torch.Tensor, group: Sequence | torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective")
    estimator: ``A_i = s_i - mu_g`` on every valid token, no division by the group std.

    This is the estimator half of Dr. GRPO; the other half is the length-unbiased loss
    aggregation ``seq-mean-token-sum-norm`` (:func:`rlhf.algos.masked.agg_loss`).  Same as
    :func:`grpo` with ``norm_by_std=False`` (a group of one keeps its score).
    """
    return grpo(token_rewards, mask, group, norm_by_std=False)


def opo(token_rewards: torch.Tensor, mask: torch.Tensor, group: Sequence | torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): length-weighted
    group baseline.

    The variance-optimal baseline ``E[|grad log pi|^2 s] / E[|grad log pi|^2]`` with the
    squared gradient norm approximated by the response length ``L_j = sum_t m_jt``::

        b_g = sum_{j in g} L_j s_j / sum_{j in g} L_j
        A_i = s_i - b_g            on every valid token of row i;  returns = A

    All-masked rows (``L = 0``) get 0 and do not enter the baseline; a group of one has
    ``A = 0``.  Computed in float64 on scores shifted by the group's first non-empty row, so a
    group of identical scores gets ``A = 0`` exactly and a shared offset never enters a sum.
    Results are in the dtype of ``token_rewards``.
    """
    check_same_shape(mask, token_rewards=token_rewards)
    rows = mask.shape[0]
    idx, n_groups = _row_groups(group, rows)
    with torch.no_grad():
        s = masked_sum(token_rewards, mask, -1).to(torch.float64)
        length = mask.bool().sum(-1).to(torch.float64)
        live = length > 0
        pos = torch.arange(rows)
        first = torch.full((n_groups,), rows, dtype=torch.long).scatter_reduce(
            0, idx[live], pos[live], reduce="amin")      # `rows` for a group with no tokens
        ref = torch.cat([s, s.new_zeros(1)])[first]
        zero = s.new_zeros(())
        d = torch.where(live, s - ref[idx], zero)
        zeros = torch.zeros(n_groups, dtype=torch.float64)
        base = (zeros.index_add(0, idx, length * d)
                / zeros.index_add(0, idx, length).clamp(min=1))
        adv, returns = _broadcast(torch.where(live, d - base[idx], zero), mask)
        return adv.to(token_rewards.dtype), returns.to(token_rewards.dtype)


def passk_group_advantages(n: int, n_neg: int, k: int) -> tuple[float, float]:
    """``(A_pos, A_neg)`` of the analytic pass@k advantage for a group of ``n`` samples with
    ``n_neg`` incorrect ones (see :func:`grpo_passk`); ``(0, 0)`` when ``sigma == 0``.

    Exact rational arithmetic (:class:`fractions.Fraction` of ``math.comb``) up to the square
    root, so ``sigma == 0`` is decided exactly.
    """
    r_bar = 1 - Fraction(math.comb(n_neg, k), math.comb(n, k))
    var = r_bar * (1 - r_bar)
    if var == 0:        # every k-subset passes (n_neg < k) or none does (n_neg == n)
        return 0.0, 0.0
    sigma = math.sqrt(var)
    a_neg = 1 - r_bar - Fraction(math.comb(n_neg - 1, k - 1), math.comb(n - 1, k - 1))
    return float(1 - r_bar) / sigma, float(a_neg) / sigma


def grpo_passk(token_rewards: torch.Tensor, mask: torch.Tensor, group: Sequence | torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage, analytic form (Chen et al. 2025, "Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models").

    The scores ``s_i = sum_t m r`` must be binary (correct 1, incorrect 0).  For a group of
    ``N`` samples with ``N_neg`` incorrect, the reward of a k-subset is 1 if it holds a correct
    sample; over all ``C(N, k)`` subsets its mean and (population) std are::

        R_bar = 1 - C(N_neg, k) / C(N, k)
        sigma = sqrt(R_bar (1 - R_bar))
        A_pos = (1 - R_bar) / sigma
        A_neg = (1 - R_bar - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma

    i.e. a sample's advantage is the mean of ``(R_subset - R_bar) / sigma`` over the subsets
    that contain it.  ``sigma == 0`` (all correct, all incorrect, or ``N_neg < k``: no subset
    can fail) gives 0.  ``A`` is put on every valid token; returns = A.  An all-masked row is a
    sample with score 0 (an incorrect answer), as in :func:`grpo`.

    Args:
        token_rewards: ``[B, T]``, each row summing to 0 or 1 (within 1e-6).
        mask: ``[B, T]`` response mask.
        group: one id per row (the prompt uid).
        k: the k of pass@k, ``1 <= k <= N`` for every group.
    Returns:
        ``(advantages, returns)``, ``[B, T]`` each, 0 off the mask, dtype of ``token_rewards``.
    """
    check_same_shape(mask, token_rewards=token_rewards)
    k = operator.index(k)
    idx, n_groups = _row_groups(group, mask.shape[0])
    sizes = torch.bincount(idx, minlength=n_groups).tolist()
    if k < 1:
        raise ValueError(f"grpo_passk needs k >= 1, got k={k}")
    if k > min(sizes, default=k):
        raise ValueError(f"grpo_passk needs k <= N for every group of N samples; got k={k} and "
                         f"a group of N={min(sizes)} (group sizes {sorted(set(sizes))}); lower "
                         f"algo.pass_k or sample more responses per prompt")
    with torch.no_grad():
        s = masked_sum(token_rewards, mask, -1).to(torch.float64)
        correct = (s - 1).abs() <= 1e-6
        binary = correct | (s.abs() <= 1e-6)
        if not bool(binary.all()):
            row = int((~binary).nonzero()[0])
            raise ValueError(f"grpo_passk needs binary scores (0 or 1 within 1e-6); row {row} "
                             f"has score {float(s[row])!r}")
        n_neg = torch.bincount(idx[~correct], minlength=n_groups).tolist()
        table = [passk_group_advantages(n, neg, k) for n, neg in zip(sizes, n_neg)]
        a_pos, a_neg = torch.tensor(table, dtype=torch.float64).reshape(n_groups, 2).unbind(1)
        adv, returns = _broadcast(torch.where(correct, a_pos[idx], a_neg[idx]), mask)
        return adv.to(token_rewards.dtype), returns.to(token_rewards.dtype)
