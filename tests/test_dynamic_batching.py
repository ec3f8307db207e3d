"""Dynamic batching by token budget and padding removal (engine/micro_batches.py) give the loss
and the gradients of the padded fixed-micro-batch path.

* the partitioner, by enumeration of every multiset of small lengths: every sequence exactly
  once, the budget respected, FFD's count within its proven bound of a brute-force optimum,
  any requested count in range honoured, LPT's loads within one sequence of each other;
* the packing maps against direct loops, and the packed model against the padded one (float64:
  the same maths; float32: within the rounding bound below), forward and one train step;
* the real ActorWorker / CriticWorker (policy loss, value loss) with ``max_tokens`` against the
  same workers with fixed padded micro-batches, on one process and on 2 DP gloo ranks.

Float32 tolerances are derived, not picked: ``e`` is the float32 padded path's own distance to
the same path in float64 (max over the tensor, at least one ulp of its scale).  The packed
float32 path must be as accurate (within ``2e`` of float64), hence within ``3e`` of the padded
float32 path.  In float64 the two model forwards agree to 1e-12 of the scale (the same maths);
a whole update agrees within ``e`` (its log-softmax and loss stay float32).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.attention import PackedSeqs, attention
from engine.micro_batches import (_lpt, count_micro_batches, first_fit_decreasing, pack_rows,
                                  partition_by_tokens)
from engine.rope import position_ids_from_mask

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: a float32 ulp at 1 (>= one ulp of x at |x|)


# Partitioner --------------------------------------------------------------------------------
def _optimum(lengths: list[int], cap: int) -> int:
    """Fewest bins of ``cap`` holding ``lengths`` (exhaustive search, longest first)."""
    items = sorted(lengths, reverse=True)
    best = len(items) or 0

    def place(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best and i < len(items):
            return
        if i == len(items):
            best = min(best, len(loads))
            return
        for j in range(len(loads)):
            if loads[j] + items[i] <= cap:
                loads[j] += items[i]
                place(i + 1, loads)
                loads[j] -= items[i]
        place(i + 1, loads + [items[i]])

    place(0, [])
    return best


def _check_parts(parts: list[list[int]], lengths: list[int], cap: int) -> None:
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # each exactly once
    assert all(p == sorted(p) and p for p in parts)
    assert [p[0] for p in parts] == sorted(p[0] for p in parts)
    assert all(sum(lengths[i] for i in p) <= cap for p in parts)


CASES = [(list(ls), cap) for n in range(1, 7) for cap in (6, 8, 11)
         for ls in itertools.combinations_with_replacement(range(7), n)]


def test_partition_by_enumeration():
    for lengths, cap in CASES:
        for order in (lengths, lengths[::-1]):
            parts = partition_by_tokens(order, cap)
            _check_parts(parts, order, cap)
            ffd = first_fit_decreasing(order, cap)
            assert len(parts) == len(ffd) == count_micro_batches(order, cap)
            assert parts == partition_by_tokens(order, cap)  # deterministic
        loads = sorted(sum(lengths[i] for i in b) for b in first_fit_decreasing(lengths, cap))
        # first fit: no two bins fit into one (so at most one is half full or less)
        assert all(a + b > cap for a, b in itertools.combinations(loads, 2)), (lengths, cap)
        opt = _optimum(lengths, cap)
        assert max(1, math.ceil(sum(lengths) / cap)) <= opt <= len(loads) \
            <= 11 / 9 * opt + 6 / 9, (lengths, cap)


def test_partition_into_any_count_in_range():
    for lengths, cap in CASES[::7]:
        low = count_micro_batches(lengths, cap)
        for k in range(low, len(lengths) + 1):
            parts = partition_by_tokens(lengths, cap, parts=k)
            assert len(parts) == k
            _check_parts(parts, lengths, cap)
        for bad in (low - 1, len(lengths) + 1):
            if bad >= 0:
                with pytest.raises(ValueError, match=f"parts={bad}"):
                    partition_by_tokens(lengths, cap, parts=bad)


def test_lpt_loads_differ_by_at_most_the_longest_sequence():
    found = 0
    for lengths, cap in CASES[::3]:
        for k in range(1, len(lengths) + 1):
            bins = _lpt(lengths, cap, k)
            if bins is None:
                continue
            found += 1
            loads = [sum(lengths[i] for i in b) for b in bins]
            assert max(loads) <= cap and max(loads) - min(loads) <= max(lengths)
    assert found > 1000


def test_lpt_failure_falls_back_to_ffd_bins():
    """Cases where LPT cannot fill FFD's count of bins (e.g. 3 3 2 2 2 into 2 bins of 6: LPT
    gives 3+2 | 3+2 and the last 2 fits neither) still get FFD's count, valid."""
    assert _lpt([3, 3, 2, 2, 2], 6, 2) is None and count_micro_batches([3, 3, 2, 2, 2], 6) == 2
    seen = 0
    for lengths, cap in CASES:
        k = count_micro_batches(lengths, cap)
        if _lpt(lengths, cap, k) is None:
            seen += 1
            parts = partition_by_tokens(lengths, cap)
            assert len(parts) == k
            _check_parts(parts, lengths, cap)
    assert seen > 0  # the fallback is exercised


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, None])
def test_bad_budget(bad):
    with pytest.raises(ValueError, match=f"max_token_len_per_micro_batch={bad!r}"):
        partition_by_tokens([3, 1], bad)


def test_sequence_longer_than_the_budget():
    with pytest.raises(ValueError, match=r"max_token_len_per_micro_batch=5 .* sequence 2 .*7"):
        partition_by_tokens([3, 1, 7], 5)


# Packing ------------------------------------------------------------------------------------
def _masks():
    g = torch.Generator().manual_seed(0)
    yield (torch.rand(5, 9, generator=g) > 0.4).long()  # holes anywhere
    m = torch.zeros(4, 7, dtype=torch.long)  # left-padded prompt, right-padded response
    for b, (lo, hi) in enumerate([(0, 7), (3, 5), (2, 2), (1, 4)]):
        m[b, lo:hi] = 1
    yield m


def test_pack_rows_against_loops():
    for mask in _masks():
        p = pack_rows(mask)
        b, s = mask.shape
        real = [(r, c) for r in range(b) for c in range(s) if mask[r, c]]
        x = torch.randn(b, s, 3)
        assert torch.equal(p.pack(x)[0], torch.stack([x[r, c] for r, c in real]))
        assert list(p.seqs.cu_seqlens) == [0, *itertools.accumulate(int(m.sum()) for m in mask)]
        assert p.has_next.tolist() == [c + 1 < s and bool(mask[r, c + 1]) for r, c in real]
        pos = position_ids_from_mask(mask)
        assert p.seqs.position_ids()[0].tolist() == [int(pos[r, c]) for r, c in real]
        keep = p.cols >= 2
        back = p.scatter(p.pack(x)[0][keep], keep, 2, s - 2)
        want = torch.zeros(b, s - 2, 3)
        for r, c in real:
            if c >= 2:
                want[r, c - 2] = x[r, c]
        assert torch.equal(back, want)
        # attention per packed sequence = attention under the block-causal mask of a loop
        seq_of = [i for i, m in enumerate(mask) for _ in range(int(m.sum()))]
        t = len(real)
        block = torch.tensor([[seq_of[i] == seq_of[j] and j <= i for j in range(t)]
                              for i in range(t)])
        g = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(1, t, h, 4, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        torch.testing.assert_close(attention(q, k, v, p.seqs),
                                   attention(q, k, v, block[None, None]), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="no real token"):
        pack_rows(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedSeqs((0, 3, 2))


# The packed model against the padded one ----------------------------------------------------
B, P, N, V = 8, 6, 26, 48
PROMPTS = [6, 1, 3, 6, 2, 5, 4, 1]
RESPONSES = [26, 1, 26, 13, 2, 0, 7, 3]  # 2 to 32 real tokens; one empty response


def _rollout():
    from rlhf.controller import Batch

    g = torch.Generator().manual_seed(1)
    am = torch.zeros(B, P + N, dtype=torch.long)
    rm = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        am[b, P - PROMPTS[b]:P + RESPONSES[b]] = 1
        rm[b, :RESPONSES[b]] = 1
    ids = torch.randint(1, V, (B, P + N), generator=g) * am
    rnd = lambda: torch.randn(B, N, generator=g)  # noqa: E731
    old = -math.log(V) + 0.1 * rnd()
    return Batch({"input_ids": ids, "attention_mask": am, "response_mask": rm,
                  "old_log_probs": old, "ref_log_probs": old + 0.1 * rnd(),
                  "advantages": rnd(), "values": rnd(), "returns": rnd()})


def _config(dtype=torch.float32):
    from engine.llama_spec import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                       max_position_embeddings=64, dtype=dtype)


def _single_groups():
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    return build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


def _engine(head: str, dtype):
    from engine.llama_spec import init_full_state_dict
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.train import TrainEngine

    config = _config(dtype)
    model = ParallelLlama(config, _single_groups(), head=head)
    load_full_state_dict(model, init_full_state_dict(config, 0, head))
    return TrainEngine(model)


def _predicted(head: str) -> torch.Tensor:
    """Positions from P-1 on where the padded path's output means something."""
    am = _rollout()["attention_mask"].bool()
    return am[:, P - 1:] if head == "value" else am[:, P - 1:-1] & am[:, P:]


def _noise(want32: torch.Tensor, want64: torch.Tensor) -> float:
    """The float32 path's own error: max distance to float64, at least one ulp of the scale."""
    want64 = want64.double()
    return max((want32.double() - want64).abs().max().item(), EPS32 * want64.abs().max().item())


def _assert_float32_close(got32, want32, want64, what=""):
    e = _noise(want32, want64)
    got, want, ref = got32.double(), want32.double(), want64.double()
    assert (got - ref).abs().max().item() <= 2 * e, f"{what}: less accurate than the padded path"
    assert (got - want).abs().max().item() <= 3 * e, what


@pytest.mark.parametrize("head", ["lm", "value"])
def test_packed_forward_equals_padded(head):
    batch = _rollout()
    mbs = [{"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}]
    sel = _predicted(head)
    outs = {}
    for dtype in (torch.float64, torch.float32):
        eng = _engine(head, dtype)
        for packed in (False, True):
            o = eng.forward(mbs, with_logits=head == "lm", head_from=P - 1, temperature=0.7,
                            remove_padding=packed)[0]
            outs[dtype, packed] = o
    for key in outs[torch.float64, False]:
        want64 = outs[torch.float64, False][key]
        packed64 = outs[torch.float64, True][key]
        s = sel if key != "logits" else _predicted("value")  # logits at every real position
        assert torch.equal(packed64[~s], torch.zeros_like(packed64[~s]))  # zeros off the mask
        scale = want64[s].abs().max().item()
        assert (packed64[s] - want64[s]).abs().max().item() <= 1e-12 * scale, key
        _assert_float32_close(outs[torch.float32, True][key][s],
                              outs[torch.float32, False][key][s], want64[s], key)


def _nll_step(eng, mbs, packed: bool):
    """One train step on the batch's masked NLL summed over tokens / 100, whatever the split
    (the engine averages its micro-batches' losses): (loss, flat gradient)."""
    def loss(outputs, mb):
        m = (mb["attention_mask"][:, :-1] * mb["attention_mask"][:, 1:]).bool()
        return -outputs["log_probs"].masked_fill(~m, 0.0).sum() * len(mbs) / 100
    out = eng.train_step(mbs, loss, temperature=1.0, remove_padding=packed)
    return torch.tensor([out["loss"]], dtype=torch.float64), eng.grads.flat[
        eng.model.config.dtype].clone()


def _nll_micro_batches(parts):
    batch = _rollout()
    return [{"input_ids": batch["input_ids"][p], "attention_mask": batch["attention_mask"][p]}
            for p in parts]


def test_packed_train_step_equals_padded():
    """The packed step's loss and gradient (dynamic micro-batches) against the padded fixed
    micro-batches' in float32, the padded float64 step as the truth."""
    fixed = _nll_micro_batches([list(range(i, i + 2)) for i in range(0, B, 2)])
    want64 = _nll_step(_engine("lm", torch.float64), fixed, False)
    want32 = _nll_step(_engine("lm", torch.float32), fixed, False)
    lengths = _rollout()["attention_mask"].sum(1).tolist()
    dynamic = _nll_micro_batches(partition_by_tokens(lengths, BUDGET))
    got32 = _nll_step(_engine("lm", torch.float32), dynamic, True)
    for i, what in enumerate(("loss", "gradient")):
        _assert_float32_close(got32[i], want32[i], want64[i], what)


def test_packed_stage_rejects_a_padded_batch():
    eng = _engine("lm", torch.float32)
    seqs = PackedSeqs((0, 2, 5))
    with pytest.raises(ValueError, match="one row of 5 tokens"):
        eng.model.stage_forward(torch.zeros(2, 5, dtype=torch.long), packed=seqs)


# The real workers ---------------------------------------------------------------------------
BUDGET = 48  # tokens per micro-batch: 1 to 4 sequences each


def _worker(role: str, dtype, micro: int, max_tokens: int | None, groups, rows: int = B):
    from engine.train import OptimConfig
    from hybridflow_comm.devices import Precision
    from rlhf.algos import KLLossTerm
    from rlhf.config import PolicyLossConfig, RolloutConfig, ValueLossConfig
    from rlhf.workers import (ActorSpec, ActorWorker, CriticSpec, CriticWorker, ModelSpec,
                              UpdateSpec)

    update = UpdateSpec(epochs=1, mini_batch_rows=rows, micro_batch_size=micro,
                        max_tokens=max_tokens)
    head = "lm" if role == "actor" else "value"
    model = ModelSpec(config=_config(dtype), head=head, init_from=None, seed=0, fresh_head=False,
                      lora=None, lora_init_from=None)
    optim, precision = OptimConfig(max_grad_norm=None), Precision.of_dtype(dtype)
    if role == "actor":
        cls, spec = ActorWorker, ActorSpec(
            model=model, precision=precision, optim=optim,
            loss=PolicyLossConfig(loss_agg_mode="token-mean", entropy_coeff=0.01),
            update=update, algo="grpo",
            kl_loss=KLLossTerm(coef=0.1, estimator="k3", log_ratio_clamp=20.0, k3_clamp=10.0),
            temperature=0.9, offload_during_generation=False, rollout=RolloutConfig(),
            router_replay=False)
    else:
        cls, spec = CriticWorker, CriticSpec(
            model=model, precision=precision, optim=optim,
            loss=ValueLossConfig(value_clip=0.2, loss_agg_mode="seq-mean-token-mean"),
            update=update, algo="ppo", value_key="values", return_key="returns")
    w = cls.__new__(cls)
    w.groups = groups
    w.__init__(spec)
    return w


def _update(role: str, dtype, micro: int, max_tokens: int | None, groups=None,
            rows: slice = slice(0, B)):
    """One update of a fresh worker on ``rows``: (loss, flat gradient, forward outputs)."""
    batch = _rollout().rows(rows)
    w = _worker(role, dtype, micro, max_tokens, groups or _single_groups(), len(batch))
    if role == "actor":
        fwd = w.compute_log_prob(batch)["old_log_probs"]
        out, engine, key = w.update_actor(batch), w.engine.train, "pg_loss"
    else:
        fwd = w.compute_values(batch)["values"]
        out, engine, key = w.update_critic(batch), w.engine, "vf_loss"
    return out[key].double(), engine.grads.flat[dtype].clone(), fwd


@pytest.fixture(scope="module")
def padded():
    """(role, dtype) -> the padded path with 4 fixed micro-batches of 2 rows."""
    return {(role, dtype): _update(role, dtype, 2, None)
            for role in ("actor", "critic") for dtype in (torch.float32, torch.float64)}


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_dynamic_packed_update_equals_padded(padded, role):
    mask = _rollout()["response_mask"].bool()
    want64, want32 = padded[role, torch.float64], padded[role, torch.float32]
    got64 = _update(role, torch.float64, 2, BUDGET)
    got32 = _update(role, torch.float32, 2, BUDGET)
    for i, what in enumerate(("loss", "gradient")):
        assert want64[i].abs().max() > 0
        # the head's log-softmax and the loss are float32 in a float64 model too (engine.tp_ops;
        # the rollout fields are float32), so the float64 paths agree to those parts' rounding:
        # within the padded float32 path's whole error e, far below any packing mistake
        e = _noise(want32[i], want64[i])
        assert (got64[i] - want64[i]).abs().max().item() <= e, what
        _assert_float32_close(got32[i], want32[i], want64[i], what)
    assert (got64[2][mask] - want64[2][mask]).abs().max() <= 1e-12 * want64[2].abs().max()
    _assert_float32_close(got32[2][mask], want32[2][mask], want64[2][mask], "forward")


def test_reference_log_probs_by_token_budget():
    from hybridflow_comm.devices import Precision
    from rlhf.workers import ModelSpec, ReferenceSpec, ReferenceWorker

    batch, mask = _rollout(), _rollout()["response_mask"].bool()
    out = {}
    for dtype in (torch.float32, torch.float64):
        for budget in (None, BUDGET):
            spec = ReferenceSpec(model=ModelSpec(config=_config(dtype), head="lm",
                                                 init_from=None, seed=0, fresh_head=False,
                                                 lora=None, lora_init_from=None),
                                 precision=Precision.of_dtype(dtype), temperature=0.9,
                                 max_tokens=budget, micro_batch_size=3)
            w = ReferenceWorker.__new__(ReferenceWorker)
            w.groups = _single_groups()
            w.__init__(spec)
            out[dtype, budget] = w.compute_ref_log_prob(batch)["ref_log_probs"][mask]
    want64 = out[torch.float64, None]
    assert (out[torch.float64, BUDGET] - want64).abs().max() <= 1e-12 * want64.abs().max()
    _assert_float32_close(out[torch.float32, BUDGET], out[torch.float32, None], want64, "ref")


def dp2_dynamic(rank: int, world_size: int) -> dict:
    """On each of 2 gloo ranks (dp=2, rank r holding rows [4r, 4r+4)): the dynamic update, and
    the micro-batch count each rank would need alone and got."""
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from rlhf.workers.common import token_minibatches

    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 2), 1, 1), pool=[0, 1])
    rows = slice(rank * B // 2, (rank + 1) * B // 2)
    half = _rollout().rows(rows)
    alone = count_micro_batches(half["attention_mask"].sum(1).tolist(), BUDGET)
    got = len(token_minibatches(half, len(half), BUDGET, groups.train_dp)[0])
    return {"alone": alone, "got": got,
            **{role: _update(role, torch.float32, 2, BUDGET, groups, rows)[:2]
               for role in ("actor", "critic")}}


def test_two_dp_ranks_equal_the_single_process_padded_path(pool2, padded):
    r0, r1 = pool2.run(dp2_dynamic)
    assert r0["alone"] != r1["alone"]  # the halves need different counts ...
    assert r0["got"] == r1["got"] == max(r0["alone"], r1["alone"])  # ... and get the same
    for role in ("actor", "critic"):
        torch.testing.assert_close(r0[role][1], r1[role][1], rtol=0, atol=0)  # DP-averaged
        # each rank logs its share; the controller's mean over the replicas is the loss
        loss = (r0[role][0] + r1[role][0]) / 2
        for i, got in enumerate((loss, r0[role][1])):
            _assert_float32_close(got, padded[role, torch.float32][i],
                                  padded[role, torch.float64][i], f"{role} dp=2")


def pp2_tp2_packed(rank: int, world_size: int) -> dict:
    """pp=2, then tp=2, over the 2 gloo ranks: each rank's packed step (pp: activations
    [1, T_i, H] of a different T_i per micro-batch; tp: vocab-parallel head on the packed
    tokens) against its padded step."""
    from engine.llama_spec import init_full_state_dict
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.train import TrainEngine
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    lengths = _rollout()["attention_mask"].sum(1).tolist()
    dynamic = _nll_micro_batches(partition_by_tokens(lengths, BUDGET))
    out = {}
    for pp, tp in ((2, 1), (1, 2)):
        groups = build_hybrid_groups(HybridLayout(ParallelLayout(pp, tp, 1), pp, tp),
                                     pool=[0, 1])
        for dtype in (torch.float32, torch.float64):
            config = _config(dtype)
            for packed in (False, True):  # a fresh engine each: a step moves the weights
                model = ParallelLlama(config, groups)
                load_full_state_dict(model, init_full_state_dict(config, 0, "lm"))
                out[pp, dtype, packed] = _nll_step(TrainEngine(model), dynamic, packed)
    return out


def test_pipeline_and_tensor_parallel_packed_steps(pool2):
    for r in pool2.run(pp2_tp2_packed):  # each rank: its shard's gradient; both: the loss
        for pp in (2, 1):
            for i in (0, 1):
                _assert_float32_close(r[pp, torch.float32, True][i],
                                      r[pp, torch.float32, False][i],
                                      r[pp, torch.float64, False][i], f"pp={pp} {i}")


def test_budget_errors_come_before_the_collective(monkeypatch):
    from hybridflow_comm.groups import Group
    from rlhf.workers import common

    calls = []
    monkeypatch.setattr(common.dist, "all_reduce", lambda *a, **k: calls.append(a))
    dp = Group(ranks=(0, 1), rank=0, pg=object())  # a DP group of 2 (never reached)
    for budget, match in ((0, "=0 must be an int > 0"), (20, "sequence 0 of the batch")):
        with pytest.raises(ValueError, match=match):
            common.token_minibatches(_rollout(), B, budget, dp)
    assert calls == []


# Config -------------------------------------------------------------------------------------
def test_config_keys():
    from rlhf.builders import reference_spec, update_spec
    from rlhf.config import load_config, resolve_devices
    from rlhf.world_plan import validate_for_world

    with pytest.raises(ValueError, match=r"actor.max_token_len_per_micro_batch=13 .* = 14"):
        load_config(["actor.use_dynamic_bsz=true", "actor.max_token_len_per_micro_batch=13"])
    with pytest.raises(ValueError, match=r"critic.max_token_len_per_micro_batch=10 .*"):
        load_config(["critic.use_dynamic_bsz=true", "critic.max_token_len_per_micro_batch=10"])
    for key in ("actor", "critic"):
        with pytest.raises(ValueError, match="max_token_len_per_micro_batch=0 must be > 0"):
            load_config([f"{key}.max_token_len_per_micro_batch=0"])
    # fixed micro-batches: 8 rows per step do not split into dp=2 x 8; by tokens they do
    args = ["algo=grpo", "actor.layout.tp=1", "data.mini_batch_size=8",
            "data.micro_batch_size=8"]
    with pytest.raises(ValueError, match="dp=2 x micro_batch_size=8"):
        validate_for_world(load_config(args), 2)
    cfg = load_config(args + ["actor.use_dynamic_bsz=true",
                              "actor.max_token_len_per_micro_batch=64"])
    plan = validate_for_world(cfg, 2)
    assert plan.roles["actor"].grad_accum == 0
    assert update_spec(cfg, plan, "actor").max_tokens == 64
    assert update_spec(load_config(args), plan, "actor").max_tokens is None
    assert reference_spec(resolve_devices(cfg)[0]).max_tokens == 64


def test_padded_log_prob_pass_runs_micro_batches_of_micro_rows(monkeypatch):
    """Without a token budget the log-prob pass runs at least ``micro_rows`` rows per forward,
    more while their logits fit ``LOGITS_PER_FORWARD`` (one micro-batch's logits at a time),
    with the outputs of one whole-batch forward."""
    from rlhf.workers import common
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.llama_spec import init_full_state_dict
    from engine.train import TrainEngine
    from rlhf.workers.common import forward_outputs

    cfg = _config(torch.float64)
    model = ParallelLlama(cfg, _single_groups())
    load_full_state_dict(model, init_full_state_dict(cfg, seed=2))
    engine = TrainEngine(model, frozen=True)
    seen = []
    forward = engine.forward
    engine.forward = lambda mbs, **kw: seen.append([m["input_ids"].shape[0] for m in mbs]) \
        or forward(mbs, **kw)
    batch = _rollout()
    whole = forward_outputs(engine, batch, None, temperature=0.9, micro_rows=3)  # all fit
    per_row = (batch["input_ids"].shape[1] - (P - 1)) * V  # logit elements of one row
    monkeypatch.setattr(common, "LOGITS_PER_FORWARD", 2 * per_row)  # 2 rows fit: 3 run
    split = forward_outputs(engine, batch, None, temperature=0.9, micro_rows=3)
    monkeypatch.setattr(common, "LOGITS_PER_FORWARD", 5 * per_row)  # 5 fit: more than 3
    wider = forward_outputs(engine, batch, None, temperature=0.9, micro_rows=3)
    assert seen == [[B], [3, 3, B - 6], [5, B - 5]]
    for k in whole:
        assert (split[k] - whole[k]).abs().max() <= 1e-6, k
        assert (wider[k] - whole[k]).abs().max() <= 1e-6, k
