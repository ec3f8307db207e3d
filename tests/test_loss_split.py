"""The loss of a mini-batch does not depend on how it is split into micro-batches and DP ranks.

``engine.train.TrainEngine.train_step`` minimises the mean of the micro-batch losses of all DP
ranks; the workers hand every micro-batch the mini-batch's denominator divided by (micro-batches
x DP ranks) (:func:`rlhf.workers.common.loss_denominator`), so that mean is the loss of the
whole mini-batch in every ``loss_agg_mode``.  Three tiers:

* the losses on a simulated split (1, 2, 4 micro-batches; 2 DP ranks with their counts summed as
  the all-reduce would) against a float64 python loop over tokens written from the formulas;
* the real ``ActorWorker.update_actor`` / ``CriticWorker.update_critic`` in one process with 1, 2
  and 4 micro-batches: identical gradients;
* the same workers on 2 gloo ranks (dp=2, the real all-reduce): the single-process gradients.

The mini-batch has uneven response lengths, an all-masked row, and (first tier) NaN/inf at
masked positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow_comm.devices import FP32
from rlhf import algos
from rlhf.config import PolicyLossConfig
from rlhf.workers.common import loss_denominator, micro_batch_denominator

MODES = algos.LOSS_AGG_MODES
B, T = 8, 6
LENGTHS = [6, 1, 4, 0, 5, 2, 6, 3]                    # row 3: an empty response
CLIP = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28, clip_ratio_c=3.0)
KL = algos.KLLossTerm(coef=0.1, estimator="k3", log_ratio_clamp=20.0, k3_clamp=10.0)


def _mask(hole: bool) -> torch.Tensor:
    m = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        m[b, :n] = True
    if hole:
        m[4, 2] = False                               # a hole inside a response
    return m


def _garbage(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    off = ~mask
    out[off] = torch.tensor([math.nan, math.inf, -math.inf],
                            dtype=x.dtype)[torch.arange(int(off.sum())) % 3]
    return out


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = _mask(hole=True)
    rnd = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    old = rnd() * 0.3 - 1.0
    x = {"mask": mask, "lp": old + 0.3 * rnd(), "old": old, "A": rnd(), "ref": old + 0.2 * rnd(),
         "H": rnd().abs(), "v": rnd(), "old_v": rnd(), "R": rnd()}
    for k in ("old", "A", "ref", "H", "old_v", "R"):
        x[k] = _garbage(x[k], mask)
    return x


# Reference: float64 loops over tokens, from the formulas -------------------------------------
def _ref_agg(per_tok: list[list], mask: torch.Tensor, mode: str):
    """token-mean: mean over all valid tokens; token-sum: their sum; seq-mean-*: mean over the
    non-empty rows of (row sum | row mean | row sum / T)."""
    valid = [[t for t in range(T) if mask[b, t]] for b in range(B)]
    toks = [per_tok[b][t] for b in range(B) for t in valid[b]]
    if mode == "token-mean":
        return sum(toks) / len(toks)
    if mode == "token-sum":
        return sum(toks)
    rows = []
    for b in range(B):
        if not valid[b]:
            continue
        s = sum(per_tok[b][t] for t in valid[b])
        rows.append({"seq-mean-token-sum": s, "seq-mean-token-mean": s / len(valid[b]),
                     "seq-mean-token-sum-norm": s / T}[mode])
    return sum(rows) / len(rows)


def _ref_actor_token(x: dict, lp: torch.Tensor, b: int, t: int):
    """PPO clipped surrogate with dual clip + 0.1 * k3 - 0.01 * H of one token."""
    ratio = torch.exp(lp[b, t] - float(x["old"][b, t]))
    a = float(x["A"][b, t])
    l1 = -a * ratio
    l2 = -a * torch.clamp(ratio, 1 - CLIP["clip_ratio"], 1 + CLIP["clip_ratio_high"])
    pg = l1 if float(l1.detach()) >= float(l2.detach()) else l2
    if a < 0 and float(pg.detach()) > -a * CLIP["clip_ratio_c"]:
        pg = torch.tensor(-a * CLIP["clip_ratio_c"], dtype=torch.float64)
    d = lp[b, t] - float(x["ref"][b, t])
    k3 = torch.exp(-d) - 1 + d                        # |d| < 2 here: no bound is active
    return pg + 0.1 * k3 - 0.01 * float(x["H"][b, t])


def _ref_value_token(x: dict, v: torch.Tensor, b: int, t: int):
    """0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old + clip(V - old, -0.2, 0.2)."""
    o, r = float(x["old_v"][b, t]), float(x["R"][b, t])
    vc = o + torch.clamp(v[b, t] - o, -0.2, 0.2)
    l1, l2 = (v[b, t] - r) ** 2, (vc - r) ** 2
    return 0.5 * (l1 if float(l1.detach()) >= float(l2.detach()) else l2)


def _reference(x: dict, role: str, mode: str):
    leaf = (x["lp"] if role == "actor" else x["v"]).clone().requires_grad_(True)
    tok = _ref_actor_token if role == "actor" else _ref_value_token
    zero = torch.tensor(0.0, dtype=torch.float64)
    per_tok = [[tok(x, leaf, b, t) if x["mask"][b, t] else zero for t in range(T)]
               for b in range(B)]
    loss = _ref_agg(per_tok, x["mask"], mode)
    loss.backward()
    return float(loss.detach()), leaf.grad


# Our path, on a simulated split ---------------------------------------------------------------
def _loss_of_rows(x: dict, role: str, mode: str, leaf: torch.Tensor, rows: slice,
                  denominator: float | None) -> torch.Tensor:
    m = x["mask"][rows]
    if role == "actor":
        cfg = PolicyLossConfig(loss_agg_mode=mode, entropy_coeff=0.01, **CLIP)
        loss, _ = algos.actor_loss(leaf[rows], x["old"][rows], x["A"][rows], m,
                                   pg_loss=algos.get_policy_loss("ppo"), cfg=cfg,
                                   ref_log_prob=x["ref"][rows], entropy=x["H"][rows],
                                   kl=KL, denominator=denominator)
    else:
        loss, _ = algos.value_loss(leaf[rows], x["old_v"][rows], x["R"][rows], m, 0.2, mode,
                                   denominator)
    return loss


def _split_step(x: dict, role: str, mode: str, n_micro: int, dp: int, global_denominator=True):
    """What one optimizer step minimises: the engine's mean over the n micro-batches of each
    of the dp ranks (rank r holds rows [r B/dp, (r+1) B/dp)); returns (loss, gradient)."""
    from hybridflow_comm.groups import Group

    leaf = (x["lp"] if role == "actor" else x["v"]).clone().requires_grad_(True)
    per_rank, per_micro = B // dp, B // dp // n_micro
    ranks = [[slice(r * per_rank + i * per_micro, r * per_rank + (i + 1) * per_micro)
              for i in range(n_micro)] for r in range(dp)]
    if dp == 1:   # the workers' own function (no DP group to reduce over)
        d = loss_denominator([{"response_mask": x["mask"][s]} for s in ranks[0]], mode,
                             Group(ranks=(0,), rank=0, pg=None))
    else:         # the all-reduce, simulated: the ranks' counts summed
        count = sum(algos.agg_count(x["mask"][s], mode) for rank in ranks for s in rank)
        d = micro_batch_denominator(count, mode, n_micro, dp)
    total = sum(_loss_of_rows(x, role, mode, leaf, s, d if global_denominator else None)
                for rank in ranks for s in rank) / (n_micro * dp)
    total.backward()
    return float(total.detach()), leaf.grad


SPLITS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]     # (micro-batches per rank, dp)


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("mode", MODES)
def test_every_split_gives_the_mini_batch_loss(role, mode):
    x = _inputs()
    want_loss, want_grad = _reference(x, role, mode)
    assert math.isfinite(want_loss) and torch.isfinite(want_grad).all()
    for n_micro, dp in SPLITS:
        loss, grad = _split_step(x, role, mode, n_micro, dp)
        assert math.isclose(loss, want_loss, rel_tol=1e-12, abs_tol=1e-12), (n_micro, dp)
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)


def test_a_per_micro_batch_mean_would_depend_on_the_split():
    """The test above can fail: each micro-batch's own mean (the old rule) differs."""
    x = _inputs()
    for mode in ("token-mean", "seq-mean-token-mean"):
        whole, _ = _split_step(x, "actor", mode, 1, 1, global_denominator=False)
        split, _ = _split_step(x, "actor", mode, 4, 1, global_denominator=False)
        assert abs(whole - split) > 1e-3


def test_denominators():
    mask = _mask(hole=True)
    assert algos.agg_count(mask, "token-mean") == sum(LENGTHS) - 1
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert algos.agg_count(mask, mode) == 7
    assert algos.agg_count(mask, "token-sum") == 0
    assert micro_batch_denominator(0, "token-sum", 4, 2) == 1 / 8
    assert micro_batch_denominator(0, "token-mean", 1, 1) == 1.0   # all masked: loss 0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        loss = algos.agg_loss(torch.full((2, 3), math.nan), empty, mode)
        assert float(loss) == 0.0
    with pytest.raises(ValueError, match="'token-median'"):
        algos.agg_count(mask, "token-median")


# The real workers --------------------------------------------------------------------------
P = 3                                                  # prompt width


def _rollout():
    from rlhf.controller import Batch

    g = torch.Generator().manual_seed(1)
    mask = _mask(hole=False).long()
    ids = torch.randint(1, 24, (B, P + T), generator=g)
    ids[:, P:][mask == 0] = 0
    rnd = lambda: torch.randn(B, T, generator=g)  # noqa: E731
    old = -math.log(24) + 0.1 * rnd()
    return Batch({"input_ids": ids,
                  "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), mask], 1),
                  "response_mask": mask, "old_log_probs": _garbage(old, mask.bool()),
                  "ref_log_probs": _garbage(old + 0.1 * rnd(), mask.bool()),
                  "advantages": _garbage(rnd(), mask.bool()),
                  "values": _garbage(rnd(), mask.bool()), "returns": _garbage(rnd(), mask.bool())})


def _worker(role: str, mode: str, rows: int, micro: int, groups):
    """An ActorWorker / CriticWorker built the way the runtime builds it (groups set first)."""
    from engine.llama_spec import LlamaConfig
    from engine.train import OptimConfig
    from rlhf.config import PolicyLossConfig, RolloutConfig, ValueLossConfig
    from rlhf.workers import ActorSpec, ActorWorker, CriticSpec, CriticWorker, ModelSpec
    from rlhf.workers import UpdateSpec

    config = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=16)
    optim, update = OptimConfig(max_grad_norm=None), UpdateSpec(1, rows, micro, None)
    if role == "actor":
        cls, spec = ActorWorker, ActorSpec(
            model=ModelSpec(config=config, head="lm", init_from=None, seed=0, fresh_head=False,
                            lora=None, lora_init_from=None),
            precision=FP32, optim=optim,
            loss=PolicyLossConfig(loss_agg_mode=mode, entropy_coeff=0.01, clip_ratio_c=3.0),
            update=update, algo="grpo", kl_loss=KL, temperature=1.0,
            offload_during_generation=False, rollout=RolloutConfig(), router_replay=False)
    else:
        cls, spec = CriticWorker, CriticSpec(
            model=ModelSpec(config=config, head="value", init_from=None, seed=0,
                            fresh_head=False, lora=None, lora_init_from=None),
            precision=FP32, optim=optim,
            loss=ValueLossConfig(value_clip=0.2, loss_agg_mode=mode), update=update,
            algo="ppo", value_key="values", return_key="returns")
    w = cls.__new__(cls)
    w.groups = groups
    w.__init__(spec)
    return w


def _step_grads(role: str, mode: str, rows: slice, micro: int,
                groups) -> tuple[torch.Tensor, dict]:
    """One update (one mini-batch) of a fresh worker on ``rows``: its gradient and metrics."""
    batch = _rollout().rows(rows)
    w = _worker(role, mode, len(batch), micro, groups)
    if role == "actor":
        out, engine = w.update_actor(batch), w.engine.train
    else:
        out, engine = w.update_critic(batch), w.engine
    metrics = {k: float(v) for k, v in out.tensors.items()}
    return engine.grads.flat[torch.float32].clone(), metrics


def _single_groups():
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    return build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


@pytest.fixture(scope="module")
def single_process():
    """(role, mode) -> (gradient, metrics) of the whole mini-batch as one micro-batch."""
    groups = _single_groups()
    return {(role, mode): _step_grads(role, mode, slice(0, B), B, groups)
            for role in ("actor", "critic") for mode in MODES}


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_workers_give_the_same_gradient_for_every_micro_batch_size(single_process, role):
    groups = _single_groups()
    key = "pg_loss" if role == "actor" else "vf_loss"
    for mode in MODES:
        want, want_m = single_process[(role, mode)]
        assert torch.isfinite(want).all() and want.abs().sum() > 0
        for micro in (4, 2):                          # 2 and 4 micro-batches
            got, m = _step_grads(role, mode, slice(0, B), micro, groups)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7, msg=f"{mode} {micro}")
            # the logged loss is the mini-batch's, too
            assert math.isclose(m[key], want_m[key], rel_tol=1e-4, abs_tol=1e-7), (mode, micro)


def dp2_grads(rank: int, world_size: int) -> dict:
    """On each of 2 gloo ranks: workers with dp=2, rank r holding rows [4r, 4r + 4)."""
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    torch.manual_seed(0)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 2), 1, 1), pool=[0, 1])
    half = slice(rank * B // 2, (rank + 1) * B // 2)
    return {(role, mode, micro): _step_grads(role, mode, half, micro, groups)[0]
            for role in ("actor", "critic") for mode in MODES for micro in (4, 2)}


def test_two_dp_ranks_give_the_single_process_gradient(pool2, single_process):
    results = pool2.run(dp2_grads)
    for key, got in results[0].items():
        role, mode, micro = key
        torch.testing.assert_close(got, results[1][key], rtol=0, atol=0)   # DP-averaged
        torch.testing.assert_close(got, single_process[(role, mode)][0], rtol=1e-4, atol=1e-7,
                                   msg=f"{key}")
