"""HybridEngine: training <-> generation cycles on 4 gloo ranks and in one process.

Per cycle: reshard (version + 1, timed), every generation replica generates its share of the
DP rank's prompts, the micro-DP all-gather returns the whole share to every rank of the
training replica (equal to the single-process greedy result for those prompts), back to
training with the training shard at the same addresses and unchanged, and the training
model's recomputed log-probs equal the sampling log-probs (greedy at temperature 1, and
sampled at temperature 1.7 on every layout; fp32, atol 1e-5); a train step in between shows the
next cycle generates with the updated weights.
"""

from __future__ import annotations

import pytest
import torch

from engine.generation import GenerationEngine
from engine.hybrid_engine import HybridEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from engine.train import OptimConfig
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests.near_ties import assert_clear_picks

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=8, num_kv_heads=4, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)
B_PER_DP, P, N_NEW = 4, 6, 8
# rollout (KV-cached decode, log-normaliser summed in float32) against the training forward
# (batched attention, oneDNN products): float32 summation orders, log-probs up to ~5 in size
LP_ATOL = 2e-5
HOT = 1.7  # a sampling temperature: rollout and training log-probs are of softmax(z / HOT)
CASES = [((1, 4, 1), (1, 2)), ((1, 4, 1), (1, 1)), ((1, 2, 2), (1, 1)), ((2, 2, 1), (1, 1)),
         ((2, 2, 1), (2, 1))]


def prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(1, CFG.vocab_size, (batch, P), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, :b % 3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def pg_loss(outputs: dict, mb: dict) -> torch.Tensor:
    m = mb["attention_mask"][:, 1:].float()
    return -(outputs["log_probs"] * m).sum() / m.sum()


def build_engine(train: tuple, gen: tuple, full: dict) -> HybridEngine | None:
    layout = HybridLayout(ParallelLayout(*train), *gen)
    groups = build_hybrid_groups(layout, pool=list(range(layout.world_size)))
    if groups is None:
        return None
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, full)
    return HybridEngine(model, OptimConfig(lr=5e-2))


def logprob_gap(engine: HybridEngine, out, temperature: float = 1.0) -> float | None:
    """Max |training recompute - sampling log-prob| over response tokens (last stage only);
    ``temperature``: the rollout's (1.0 for greedy)."""
    res = engine.train.forward([{"input_ids": out.input_ids,
                                 "attention_mask": out.attention_mask}],
                               temperature=temperature)
    if res is None:
        return None
    recomputed = res[0]["log_probs"][:, out.prompt_length - 1:]  # [B, N]
    real = out.response_mask.bool()
    return float((recomputed[real] - out.log_probs[real]).abs().max())


def run_cycles(rank: int, world_size: int, train: tuple, gen: tuple, full: dict,
               ids: torch.Tensor, mask: torch.Tensor) -> dict | None:
    engine = build_engine(train, gen, full)
    if engine is None:
        return None
    model, dp = engine.model, engine.layout.train.coords(engine.groups.rank).dp
    mine = slice(dp * B_PER_DP, (dp + 1) * B_PER_DP)
    sp = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
    ptrs = {n: p.data_ptr() for n, p in model.params.items()}
    before = {n: p.detach().clone() for n, p in model.params.items()}
    cycles = []
    for cycle in range(2):
        with engine.generation_mode() as stats:
            out = engine.generate_sequences(ids[mine], mask[mine], sp)
            buf = engine.resharder.buffer.storage(CFG.dtype).untyped_storage().data_ptr()
            views = all(w.untyped_storage().data_ptr() == buf
                        for w in engine.rollout.weights.values())
            rows_generated = out.stats["new_tokens"]
            hot = engine.generate_sequences(ids[mine], mask[mine], SamplingParams(
                max_new_tokens=N_NEW, temperature=HOT, seed=5 + cycle))
            odd = engine.generate_sequences(ids[mine][:B_PER_DP - 1], mask[mine][:B_PER_DP - 1],
                                            sp)  # not a multiple of the micro-DP size
        back = {
            "ptrs_same": {n: p.data_ptr() for n, p in model.params.items()} == ptrs,
            "shard_same": all(torch.equal(p, before[n]) for n, p in model.params.items()),
            "mode": engine.resharder.mode, "weights_dropped": engine.rollout.weights is None,
        }
        cycles.append({"version": stats.version, "time_s": stats.time_s, "views": views,
                       "out": (out.input_ids, out.attention_mask, out.log_probs),
                       "odd": (odd.input_ids, odd.log_probs),
                       "gap": logprob_gap(engine, out), "hot_gap": logprob_gap(engine, hot, HOT),
                       "own_tokens": rows_generated, **back})
        engine.train.train_step([{"input_ids": out.input_ids,
                                  "attention_mask": out.attention_mask}], pg_loss,
                                temperature=1.0)
        before = {n: p.detach().clone() for n, p in model.params.items()}
    return {"cycles": cycles, "dp": dp, "engine_version": engine.version}


@pytest.fixture(scope="module")
def full_and_reference():
    full = init_full_state_dict(CFG, seed=9, std=0.2)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, full)
    eng = GenerationEngine(CFG, groups)
    eng.set_weights(model.params)
    ids, mask = prompts(2 * B_PER_DP)
    greedy = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
    ref = eng.generate(ids, mask, greedy)
    assert_clear_picks(model, ref, greedy)  # so every layout's tokens are these
    return full, ref


@pytest.mark.parametrize("train, gen", CASES)
def test_hybrid_engine_cycle(pool4, full_and_reference, train, gen):
    full, ref = full_and_reference
    ids, mask = prompts(2 * B_PER_DP)
    results = pool4.run(run_cycles, train, gen, full, ids, mask)
    layout = HybridLayout(ParallelLayout(*train), *gen)
    m = layout.micro_dp_size
    gaps = []
    for rank, r in enumerate(results):
        assert r["engine_version"] == 2
        for i, c in enumerate(r["cycles"]):
            assert c["version"] == i + 1 and c["time_s"] > 0
            assert c["views"] and c["ptrs_same"] and c["shard_same"], (rank, i)
            assert c["mode"] == "training" and c["weights_dropped"]
            if c["gap"] is not None:
                gaps.extend((c["gap"], c["hot_gap"]))
        # cycle 1: the whole DP share, in prompt order, on every rank of the replica
        got_ids, got_mask, got_lp = r["cycles"][0]["out"]
        rows = slice(r["dp"] * B_PER_DP, (r["dp"] + 1) * B_PER_DP)
        assert got_ids.shape[0] == B_PER_DP
        assert torch.equal(got_ids, ref.input_ids[rows]), rank
        assert torch.equal(got_mask, ref.attention_mask[rows])
        torch.testing.assert_close(got_lp, ref.log_probs[rows], atol=2e-5, rtol=0)
        odd_ids, odd_lp = r["cycles"][0]["odd"]  # B_PER_DP - 1 rows: the same rollouts
        assert torch.equal(odd_ids, ref.input_ids[rows][:B_PER_DP - 1]), rank
        torch.testing.assert_close(odd_lp, ref.log_probs[rows][:B_PER_DP - 1], atol=2e-5,
                                   rtol=0)
        # each replica generated only its 1/m of the rows
        own = r["cycles"][0]["own_tokens"]
        assert own == int(ref.attention_mask[rows][:, P:].reshape(m, -1).sum(1)[
            layout.gen_coords(rank).micro_dp])
        # cycle 2 ran on updated weights: its sequences differ from cycle 1's
        assert not torch.equal(r["cycles"][1]["out"][2], got_lp)
    assert gaps and max(gaps) < LP_ATOL, gaps


def test_single_process_cycle_and_misuse():
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, init_full_state_dict(CFG, seed=9, std=0.2))
    engine = HybridEngine(model)
    ids, mask = prompts(3)
    with pytest.raises(RuntimeError, match="inside generation_mode"):
        engine.generate_sequences(ids, mask)
    with pytest.raises(ValueError, match="top_p"):
        with engine.generation_mode():
            engine.generate_sequences(ids, mask, SamplingParams(top_p=2.0, temperature=0.0))
    assert engine.resharder.mode == "training" and engine.version == 1
    with engine.generation_mode() as stats:
        with pytest.raises(RuntimeError, match="already active"):
            with engine.generation_mode():
                pass
        out = engine.generate_sequences(ids, mask, SamplingParams(max_new_tokens=5,
                                                                  temperature=0.0))
        cache = engine.rollout.memory.cache  # kept for the block's next calls
        again = engine.generate_sequences(ids, mask, SamplingParams(max_new_tokens=5,
                                                                    temperature=0.0))
        assert engine.rollout.memory.cache is cache and torch.equal(again.input_ids,
                                                                    out.input_ids)
    assert engine.rollout.memory.cache is None  # back to training: its memory given back
    assert stats.version == 2 and out.input_ids.shape == (3, P + 5)
    assert logprob_gap(engine, out) < LP_ATOL


def test_refill_false_needs_kept_slots():
    """``to_generation(refill=False)`` reuses kept generation slots (a frozen LoRA base) and
    refuses slots that were released or never filled."""
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    resharder = HybridEngine(model).resharder
    with pytest.raises(RuntimeError, match="never filled"):
        resharder.to_generation(refill=False)
    resharder.to_generation()
    resharder.to_training(release=False)
    stats = resharder.to_generation(refill=False)
    assert stats.received_bytes == 0 and stats.version == 2
    resharder.to_training()  # released
    with pytest.raises(RuntimeError, match="released"):
        resharder.to_generation(refill=False)
