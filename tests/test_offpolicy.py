"""Rollout-vs-training log-prob mismatch and truncated importance sampling (TIS)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf import algos
from rlhf.config import PolicyLossConfig

HOMOGENEOUS = ("ppo", "gspo", "cispo", "gmpo", "sapo", "gpg")


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    rollout = old + 0.4 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    rollout[0, 3], old[1, 1] = float("nan"), float("inf")  # garbage at masked positions
    return g, old, rollout, mask


@pytest.mark.parametrize("seed", range(3))
def test_tis_weights_and_mismatch_against_a_loop(seed):
    _, old, rollout, mask = _inputs(seed)
    w = algos.truncated_is_weights(old, rollout, mask, cap=1.5)
    diffs = []
    for b in range(4):
        for t in range(5):
            if mask[b, t]:
                d = float(old[b, t] - rollout[b, t])
                assert math.isclose(float(w[b, t]), min(math.exp(d), 1.5), rel_tol=1e-12)
                diffs.append(abs(d))
            else:
                assert w[b, t] == 0
    gap = algos.rollout_mismatch(old, rollout, mask)
    assert math.isclose(gap["mean"], sum(diffs) / len(diffs), rel_tol=1e-12)
    assert gap["max"] == pytest.approx(max(diffs), rel=1e-12)
    with pytest.raises(ValueError, match="tis_cap=0"):
        algos.truncated_is_weights(old, rollout, mask, cap=0)


@pytest.mark.parametrize("name", HOMOGENEOUS)
def test_weighted_advantages_are_the_token_weighted_loss(name):
    """TIS multiplies the advantages: for the pure PG losses that is the per-token weighted
    loss, value and gradient (token-sum: each token's loss separately)."""
    g, old, rollout, mask = _inputs(1)
    mask = torch.ones_like(mask)  # every row has tokens; sequence losses need whole rows
    old, rollout = torch.nan_to_num(old, posinf=-1.0), torch.nan_to_num(rollout)  # all valid
    lp = old + 0.2 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(old.shape, generator=g, dtype=torch.float64)
    adv = adv.mean(-1, keepdim=True).expand_as(adv).clone()  # one advantage per row (gmpo)
    w = algos.truncated_is_weights(old, rollout, mask, cap=2.0)
    cfg = PolicyLossConfig(loss_agg_mode="token-sum")
    fn = algos.get_policy_loss(name)
    leaf = lp.clone().requires_grad_(True)
    weighted, _ = fn(leaf, old, adv * w, mask, cfg=cfg, loss_agg_mode="token-sum",
                     denominator=None)
    weighted.backward()
    # the same from single-token rows, each scaled by its own weight
    want, grad = 0.0, torch.zeros_like(lp)
    row_w = w[:, :1]  # gmpo/gspo are sequence-level: use row-constant weights for them
    if name in ("gspo", "gmpo"):
        leaf2 = lp.clone().requires_grad_(True)
        w_rows = row_w.expand_as(w)
        weighted2, _ = fn(leaf2, old, adv * w_rows, mask, cfg=cfg, loss_agg_mode="token-sum",
                          denominator=None)
        weighted2.backward()
        for b in range(4):
            one = lp[b:b + 1].clone().requires_grad_(True)
            loss_b, _ = fn(one, old[b:b + 1], adv[b:b + 1], mask[b:b + 1], cfg=cfg,
                           loss_agg_mode="token-sum", denominator=None)
            (float(row_w[b]) * loss_b).backward()
            want += float(row_w[b]) * float(loss_b)
            grad[b] = one.grad[0]
        assert math.isclose(float(weighted2), want, rel_tol=1e-10)
        torch.testing.assert_close(leaf2.grad, grad, rtol=1e-10, atol=1e-12)
        return
    for b in range(4):
        for t in range(5):
            one = lp[b:b + 1, t:t + 1].clone().requires_grad_(True)
            loss_bt, _ = fn(one, old[b:b + 1, t:t + 1], adv[b:b + 1, t:t + 1],
                            mask[b:b + 1, t:t + 1], cfg=cfg, loss_agg_mode="token-sum",
                            denominator=None)
            (float(w[b, t]) * loss_bt).backward()
            want += float(w[b, t]) * float(loss_bt)
            grad[b, t] = one.grad[0, 0]
    assert math.isclose(float(weighted), want, rel_tol=1e-10)
    torch.testing.assert_close(leaf.grad, grad, rtol=1e-10, atol=1e-12)


def test_tis_needs_recomputed_log_probs():
    from rlhf.config import AlgoConfig

    assert AlgoConfig(tis_cap=2.0).tis_cap == 2.0
    with pytest.raises(ValueError, match="needs algo.recompute_log_prob=true"):
        AlgoConfig(tis_cap=2.0, recompute_log_prob=False)
    with pytest.raises(ValueError, match="algo.tis_cap"):
        AlgoConfig(tis_cap=-1.0)
