"""Advantage estimators: GAE, ReMax, GRPO, RLOO, REINFORCE++.

Shapes: token-level tensors are ``[B, T]`` over response positions with a response mask
``[B, T]``; sequence scores are ``[B]``.  Every estimator returns ``(advantages, returns)``, both
``[B, T]`` and 0 where the mask is 0.

Masked positions *inside* a response are skipped, not treated as episode ends: recursions over
time carry their state across them, so a sequence with holes gives the same result as the
sequence with the holes removed.  For right-padded responses this is the usual convention.

Group-based estimators (GRPO, RLOO) take ``group`` = one id per row (the prompt uid); rows with
equal ids are samples of the same prompt.  The sequence score of a row is the sum of its
token-level rewards, so a KL penalty folded into the rewards is included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.algos.masked import check_same_shape, masked_sum, masked_whiten


def _discounted_sum_skip_masked(rewards: torch.Tensor, mask: torch.Tensor,
                                gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{next valid t}`` over valid tokens, right to left."""
    m = mask.to(rewards.dtype)
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        new = rewards[:, t] + gamma * running
        running = m[:, t] * new + (1 - m[:, t]) * running
        out[:, t] = new
    return out * m


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
    m = mask.to(values.dtype)
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        next_adv = torch.zeros_like(values[:, 0])
        adv = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            a = delta + gamma * lam * next_adv
            adv[:, t] = a
            # a masked position passes the state of the next valid position through
            next_adv = m[:, t] * a + (1 - m[:, t]) * next_adv
            next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        returns = (adv + values) * m
        adv = masked_whiten(adv, m) if whiten else adv * m
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
    m = mask.to(token_rewards.dtype)
    with torch.no_grad():
        returns = _discounted_sum_skip_masked(token_rewards, m, 1.0)
        adv = (returns - baseline_scores.to(returns.dtype)[:, None]) * m
    return adv, returns


def group_index(group: Sequence | torch.Tensor) -> torch.Tensor:
    """Map arbitrary hashable group ids (uids, ints) to dense ints ``[B]`` in first-seen order."""
    if isinstance(group, torch.Tensor):
        group = group.tolist()
    ids: dict = {}
    return torch.tensor([ids.setdefault(g, len(ids)) for g in group], dtype=torch.long)


def _group_stats(scores: torch.Tensor, group: Sequence | torch.Tensor):
    idx = group_index(group)
    if idx.shape[0] != scores.shape[0]:
        raise ValueError(f"group has {idx.shape[0]} ids but scores has {scores.shape[0]} rows")
    n_groups = int(idx.max()) + 1 if idx.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, idx, torch.ones_like(scores))
    total = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, idx, scores)
    sq = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, idx, scores * scores)
    return idx, count, total, sq


def grpo_scores(scores: torch.Tensor, group: Sequence | torch.Tensor, norm_by_std: bool,
                eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024) sequence advantages ``[B]``.

    For a group ``g`` with ``n`` samples, mean ``mu_g`` and unbiased std ``sigma_g``::

        A_i = (s_i - mu_g) / (sigma_g + eps)     if norm_by_std
        A_i =  s_i - mu_g                        otherwise (Dr. GRPO)

    A group of one sample has ``mu = 0, sigma = 1`` (its score passes through), as in verl.
    """
    idx, count, total, sq = _group_stats(scores, group)
    mean = total / count
    var = (sq - count * mean * mean) / (count - 1).clamp(min=1)
    std = var.clamp(min=0).sqrt()
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    out = scores - mean[idx]
    return out / (std[idx] + eps) if norm_by_std else out


def rloo_scores(scores: torch.Tensor, group: Sequence | torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024) sequence advantages ``[B]``: leave-one-out baseline.

    ``A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1)``; a group of one keeps ``A_i = s_i``.
    """
    idx, count, total, _ = _group_stats(scores, group)
    n = count[idx]
    baseline = (total[idx] - scores) / (n - 1).clamp(min=1)
    return torch.where(n > 1, scores - baseline, scores)


def _broadcast(seq_adv: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = seq_adv[:, None] * mask.to(seq_adv.dtype)
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
