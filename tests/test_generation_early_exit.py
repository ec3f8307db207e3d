"""Early exit of finished sequences (engine.early_exit): what compacting the running batch may
change.  Each case runs the same engine with ``early_exit`` on and off (the path that computes
every row to the end): on the C++ decode kernels (fixed-tree sums: bit-equal outputs, on any
CPU) and on the Python layers (BLAS: the same tokens up to near-ties judged by a float64
arbiter, log-probs within float rounding, and each run bitwise repeatable), on a Qwen2-style
model (q/k/v biases) too, greedy and three sampling modes, rows of very different lengths (EOS
at different steps, per-row limits), and on 2 gloo ranks (TP and PP generation).  The greedy
tokens are also checked against a cache-free loop, and the pure pieces (the compaction
policy, the row choice, the call plan, the cache's row copy, the random draw) against direct
computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.early_exit import COMPACT_DIVISOR, RunningRows, decode_rows
from engine.forward_paths import ROW_LANES_MIN_ROWS, uses_row_lanes
from engine.generation import GenerationEngine
from engine.generation_io import GenerationOutput
from engine.kv_cache import KEY_TILE, TiledKVCache, untile_keys
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine import sampling
from engine.sampling import SamplingParams, SeedStream, _draw
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests.near_ties import MIN_GAP
from tests.test_generation import loop_reference

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)
QWEN = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                   tie_word_embeddings=True, qkv_bias=True, model_type="qwen2")
N_NEW = 24
MODES = {
    "greedy": SamplingParams(max_new_tokens=N_NEW, temperature=0.0),
    "temp": SamplingParams(max_new_tokens=N_NEW, temperature=1.0, seed=5),
    "top_k": SamplingParams(max_new_tokens=N_NEW, temperature=0.9, top_k=6, top_p=0.9, seed=3),
    "top_p": SamplingParams(max_new_tokens=N_NEW, temperature=1.1, top_p=0.8, seed=4),
}


def batch_of(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts of 1..9 tokens and per-row limits from 1 to N_NEW: about half the
    rows stop within 4 tokens, the rest run long."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 10, (batch,), generator=g)
    ids = torch.randint(1, CFG.vocab_size, (batch, 9), generator=g)
    mask = (torch.arange(9) >= 9 - lengths[:, None]).long()
    short = torch.randint(1, 5, (batch,), generator=g)
    long = torch.randint(N_NEW // 2, N_NEW + 1, (batch,), generator=g)
    limits = torch.where(torch.rand(batch, generator=g) < 0.5, short, long)
    return ids.masked_fill(mask == 0, 0), mask, limits


def engine(cfg: LlamaConfig, fused: bool, early_exit: bool, seed: int = 0,
           greedy_loop: bool = True):
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=seed, std=0.2))
    eng = GenerationEngine(cfg, groups, fused_decode=fused, early_exit=early_exit,
                           greedy_loop=greedy_loop)
    eng.set_weights(model.params)
    return model, eng


def frequent_token(out) -> int:
    """The most frequent response token: as EOS it ends rows at many different steps."""
    return int(torch.bincount(out.responses[out.response_mask.bool()]).argmax())


def assert_same(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.log_probs, b.log_probs)


def arbiter_logits(cfg: LlamaConfig, weights: dict, ids: torch.Tensor, mask: torch.Tensor
                   ) -> torch.Tensor:
    """The last position's logits ``[B, V]`` of the float32 ``weights`` in float64."""
    cfg64 = LlamaConfig(**(cfg.__dict__ | {"dtype": torch.float64}))
    model = ParallelLlama(cfg64, build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1)))
    load_full_state_dict(model, {k: v.double() for k, v in weights.items()})
    with torch.no_grad():
        return model.local_logits(model.stage_forward(ids, mask)[:, -1])


def assert_same_up_to_rounding(a, b, cfg: LlamaConfig, greedy: bool,
                               weights: dict | None = None) -> None:
    """What early exit guarantees where BLAS computes the rows: the same tokens and masks,
    except that a greedy row may part at a near-tie (both picks within
    :data:`tests.near_ties.MIN_GAP` of the float64 arbiter's best logit on their common
    prefix; ``weights``: the model's, default the seed-0 ones of :func:`engine`), and
    log-probs within float rounding on the rows that agree."""
    same = (a.input_ids == b.input_ids).all(1) & (a.attention_mask == b.attention_mask).all(1)
    for r in (~same).nonzero().flatten().tolist():
        assert greedy, f"row {r} of a sampled call differs"
        col = int((a.input_ids[r] != b.input_ids[r]).nonzero()[0])
        weights = weights or init_full_state_dict(cfg, seed=0, std=0.2)
        logits = arbiter_logits(cfg, weights, a.input_ids[r:r + 1, :col],
                                a.attention_mask[r:r + 1, :col])[0]
        picks = (int(a.input_ids[r, col]), int(b.input_ids[r, col]))
        assert float(logits.max() - logits[list(picks)].min()) < MIN_GAP, (r, col, picks)
    assert int(same.sum()) >= same.numel() - 1, "more than one row parted"
    torch.testing.assert_close(a.log_probs[same], b.log_probs[same], atol=1e-5, rtol=0)


# Pure pieces ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draw_is_the_first_clock_and_independent_of_running_rows(dtype):
    """Each row's pick is the candidate whose exponential clock of rate ``p_j`` rings first
    (arrival time ``-log(U_j) / p_j``, a direct loop over SplitMix64 uniforms of the seed a
    generator in the same state gives), truncated candidates are never picked, and a subset
    of rows draws what those rows draw in the full batch, leaving the stream where the
    full batch leaves it."""
    g = torch.Generator().manual_seed(0)
    for batch, vocab in ((5, 7), (32, 96), (8, 4096)):
        z = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)
        z[:, :2] = float("-inf")  # truncated candidates are never drawn
        a, b = SeedStream(9), SeedStream(9)
        for _ in range(5):
            seed = a.next()
            uniforms = [[splitmix64_uniform(seed, row, j) for j in range(vocab)]
                        for row in range(batch)]
            got = _draw(z, b)[:, 0].tolist()
            for row in range(batch):
                probs = torch.softmax(z[row], -1).tolist()
                arrival = [-math.log(u) / p if p > 0 and u > 0 else math.inf
                           for u, p in zip(uniforms[row], probs)]
                assert got[row] == arrival.index(min(arrival)), (batch, vocab, row)
        rows = torch.rand(batch, generator=g) < 0.5
        rows[0] = True
        full, part = SeedStream(4), SeedStream(4)
        for _ in range(3):
            assert torch.equal(_draw(z, full)[rows], _draw(z[rows], part, rows))
        assert full.steps == part.steps == 3


def splitmix64_uniform(seed: int, row: int, col: int) -> float:
    """SplitMix64 (Steele, Lea, Flood 2014) of counter ``row << 32 | col`` with Python
    integers: the reference of engine.sampling's uniforms."""
    mask = (1 << 64) - 1
    z = (seed + (((row << 32) | col) + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return ((z >> 40) + 1) / 2.0 ** 24


def test_counter_uniforms_kernel_and_formula_are_splitmix64():
    """engine._kernels.counter_uniforms and the tensor-op formula against the Python-integer
    SplitMix64, on seeds with the top bit patterns and large row ids; uniform on (0, 1]."""
    row_ids = torch.tensor([0, 1, 5, 31, (1 << 31) + 7])
    for seed in (0, 1, 123456789, (1 << 63) - 1, 0x5DEECE66D << 20):
        want = torch.tensor([[splitmix64_uniform(seed, int(r), j) for j in range(70)]
                             for r in row_ids])
        formula = sampling.counter_uniforms_formula(seed, row_ids, 70)
        assert torch.equal(formula.double(), want.double())
        if sampling._kernels is not None:
            assert torch.equal(sampling._kernels.counter_uniforms(seed, row_ids, 70), formula)
    u = sampling.clock_uniforms(SeedStream(1), torch.arange(64), 1 << 14)
    assert float(u.min()) > 0 and float(u.max()) <= 1
    assert abs(float(u.double().mean()) - 0.5) < 2e-3  # sd of the mean of 1M: 2.9e-4
    assert abs(float(u.double().var()) - 1 / 12) < 1e-3
    if sampling._kernels is not None:
        with pytest.raises(RuntimeError, match="row_ids must be a 1-D int64"):
            sampling._kernels.counter_uniforms(0, torch.zeros(2, 2, dtype=torch.long), 4)


def test_draw_frequencies_follow_the_softmax():
    z = torch.log(torch.tensor([1.0, 0.0, 3.0, 6.0, 0.0]))  # two impossible candidates
    picks = _draw(z.expand(200_000, -1), SeedStream(3))[:, 0]
    freq = torch.bincount(picks, minlength=5).double() / len(picks)
    torch.testing.assert_close(freq, torch.tensor([0.1, 0, 0.3, 0.6, 0], dtype=torch.float64),
                               atol=0.005, rtol=0)
    assert float(freq[1]) == float(freq[4]) == 0


def test_decode_rows_policy():
    """Every answer of the policy, against its rule written out: the alive rows once the
    finished ones are at least 1/COMPACT_DIVISOR of the running rows, else no change."""
    for running in range(1, 80):
        for alive in range(1, running + 1):
            want = alive if (running - alive) * COMPACT_DIVISOR >= running else running
            assert decode_rows(running, alive) == want
    assert decode_rows(32, 28) == 28 and decode_rows(32, 29) == 32


def test_row_lanes_policy():
    """The row-lane form for calls of ROW_LANES_MIN_ROWS to block_rows rows whose rows all run
    every step, where the CPU has it, never without the kernels: the rule written out."""
    for batch, block, supported, stay in itertools.product(range(1, 70), (None, 16, 32),
                                                           (False, True), (False, True)):
        want = supported and stay and block is not None and ROW_LANES_MIN_ROWS <= batch <= block
        assert uses_row_lanes(batch, block, supported, stay) == want


def test_call_plan_rules():
    """plan_call against its rules written out, for every batch around the kernels' block:
    the head on the kernels only at batches the small product takes and with the head read
    in place (greedy_head when greedy on the whole vocabulary), the one-call greedy finish
    only with greedy_head where no row leaves and the step is one kernel call, the row-lane
    form only by uses_row_lanes, and the kernel stage carries the plan's form."""
    from engine.forward_paths import plan_call
    _, eng = engine(CFG, True, early_exit=True)
    if eng.block_rows is None:
        pytest.skip("C++ kernels not built")
    from engine import _kernels
    block = eng.block_rows
    for batch, stay, in_place, greedy, loop in itertools.product(
            range(1, 2 * block + 2), *[(False, True)] * 4):
        plan = plan_call(eng.paths, batch, block, stay, in_place, greedy, loop)
        kernel_head = batch <= block and in_place
        want_head = ("greedy_head" if kernel_head and greedy else
                     "small_linear" if kernel_head else "blas")
        lanes = uses_row_lanes(batch, block, _kernels.row_lanes_supported, stay)
        assert (plan.head, plan.row_lanes) == (want_head, lanes)
        assert plan.greedy_rest == (want_head == "greedy_head" and stay and loop)
        assert plan.paths.decode.row_lanes == lanes
    python = plan_call(engine(CFG, False, early_exit=True)[1].paths, 32, None, True, True, True,
                       True)
    assert python.head == "blas" and not (python.row_lanes or python.greedy_rest)


def test_running_rows_keep_the_alive_rows_in_order():
    """RunningRows against a direct loop over rows: alive after EOS and per-row limits, a
    compaction keeps exactly the alive running rows (ascending) and maps them to their full
    rows, and the sampler's row mask marks them."""
    g = torch.Generator().manual_seed(0)
    for batch in (1, 5, 12, 33):
        limits = torch.randint(1, 6, (batch,), generator=g)
        rows = RunningRows(limits, eos_token_id=3)
        want_alive = [True] * batch
        for step in range(6):
            tokens = torch.randint(0, 5, (rows.run.numel(),), generator=g)
            running = rows.run.tolist()
            n = rows.finish_step(step, tokens)
            for j, r in enumerate(running):
                want_alive[r] = want_alive[r] and tokens[j] != 3 and limits[r] > step + 1
            assert rows.alive.tolist() == want_alive and n == sum(want_alive)
            if n == 0:
                break
            keep = rows.compact(n)
            if keep is None:
                assert rows.run.tolist() == running
                continue
            assert keep.tolist() == [j for j, r in enumerate(running) if want_alive[r]]
            assert rows.run.tolist() == [r for r in running if want_alive[r]]
            assert rows.mask.nonzero().flatten().tolist() == rows.run.tolist()


def test_kv_cache_keeps_rows():
    g = torch.Generator().manual_seed(0)
    cache = TiledKVCache(num_layers=3, batch=6, max_len=11, kv_heads=2, head_dim=4,
                         dtype=torch.float32)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.length = 7
    k, v = cache.k.clone(), cache.v.clone()
    rows = torch.tensor([1, 2, 5])
    cache.keep_rows_(rows)
    assert cache.k.shape == (3, 3, 2, 1, 4, KEY_TILE) and cache.v.shape == (3, 3, 2, 11, 4)
    for j, r in enumerate(rows.tolist()):
        assert torch.equal(cache.keys(0, 7)[:, j], untile_keys(k, 0, 7)[:, r])
        assert torch.equal(cache.v[:, j, :, :7], v[:, r, :, :7])


# One process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, fused", [(CFG, False), (CFG, True), (QWEN, False),
                                        (QWEN, True)],
                         ids=["python", "kernels", "qwen2", "qwen2-kernels"])
@pytest.mark.parametrize("mode", list(MODES))
def test_early_exit_keeps_the_results(cfg, fused, mode):
    """Bit-equal to early_exit=False on the kernels; on the Python layers within rounding
    (same tokens up to near-ties) and each call bitwise repeatable."""
    if fused and not GenerationEngine(CFG, build_hybrid_groups(HybridLayout(
            ParallelLayout(1, 1, 1), 1, 1))).fused_decode:
        pytest.skip("C++ kernels not built")
    _, on = engine(cfg, fused, early_exit=True)
    _, off = engine(cfg, fused, early_exit=False)
    assert (on.block_rows is not None) == fused  # the decode path under test
    ids, mask, limits = batch_of(32)
    sp = MODES[mode]
    eos = frequent_token(off.generate(ids, mask, sp))
    sp = SamplingParams(**(sp.__dict__ | {"eos_token_id": eos}))
    for lim in (limits, None):
        a, b = on.generate(ids, mask, sp, lim), off.generate(ids, mask, sp, lim)
        if fused:
            assert_same(a, b)
        else:
            assert_same_up_to_rounding(a, b, cfg, sp.greedy)
            assert_same(a, on.generate(ids, mask, sp, lim))
        lengths = a.response_mask.sum(1)
        assert int(lengths.min()) < N_NEW // 4 and int(lengths.max()) > N_NEW // 2, lengths
        assert a.stats["compactions"] >= 1 and b.stats["compactions"] == 0
        assert a.stats["row_steps"] < b.stats["row_steps"]
        assert a.stats["forward_steps"] == b.stats["forward_steps"]


@pytest.mark.parametrize("mode", list(MODES))
def test_early_exit_across_the_head_kernel_bound(mode):
    """A batch above the kernels' row block (64 rows, 2 threads) that compacts to 8: the LM
    head's product is chosen by the full batch, so it stays BLAS after compaction (BLAS
    rows: the same results within rounding)."""
    _, on = engine(CFG, True, early_exit=True)
    _, off = engine(CFG, True, early_exit=False)
    if on.block_rows is None:
        pytest.skip("C++ kernels not built")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids, mask, limits = batch_of(2 * on.block_rows, seed=3)
        limits[8:] = 2  # all but 8 rows stop after 2 tokens: the run compacts to 8 rows
        sp = MODES[mode]
        a, b = on.generate(ids, mask, sp, limits), off.generate(ids, mask, sp, limits)
    finally:
        torch.set_num_threads(threads)
    assert_same_up_to_rounding(a, b, CFG, sp.greedy)
    assert a.stats["compactions"] >= 1 and a.stats["row_steps"] < b.stats["row_steps"]


def record_forms(monkeypatch, calls: list | None = None) -> set:
    """The ``row_lanes`` of every decode call from now on: decode_layers (a step) or
    greedy_decode (the rest of a generation in one call); ``calls`` gets each call's name."""
    from engine import _kernels
    forms = set()

    def recording(name):
        original = getattr(_kernels, name)

        def recorded(*args, row_lanes=False, **kwargs):
            forms.add(row_lanes)
            if calls is not None:
                calls.append(name)
            return original(*args, row_lanes=row_lanes, **kwargs)
        return recorded
    for name in ("decode_layers", "greedy_decode"):
        monkeypatch.setattr(_kernels, name, recording(name))
    return forms


@pytest.mark.parametrize("fused, batch", [(False, 16), (True, 16), (True, 32)])
def test_early_exit_greedy_matches_cache_free_loop(fused, batch, monkeypatch):
    """Independent of both engine paths: the training model's full forward on the whole
    sequence, step by step, with EOS and per-row limits (rows leave: the k-lane form, also at
    32 rows)."""
    model, eng = engine(CFG, fused, early_exit=True)
    if fused and not eng.fused_decode:
        pytest.skip("C++ kernels not built")
    ids, mask, limits = batch_of(batch, seed=2)
    first = eng.generate(ids, mask, SamplingParams(max_new_tokens=N_NEW, temperature=0.0))
    eos = frequent_token(first)
    forms = record_forms(monkeypatch) if fused else set()
    toks, lps, live = loop_reference(model, ids, mask, N_NEW, limits=limits, eos=eos)
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=N_NEW, temperature=0.0,
                                                 eos_token_id=eos), max_new_tokens=limits)
    assert out.stats["compactions"] >= 1
    assert torch.equal(out.response_mask, live)
    assert torch.equal(out.responses, toks)
    torch.testing.assert_close(out.log_probs, lps, atol=1e-5, rtol=0)
    assert forms == ({False} if fused else set())


@pytest.mark.parametrize("eos_from, limited, row_lanes", [
    (None, False, True),       # no EOS
    (N_NEW, False, True),      # EOS banned on every step
    (N_NEW - 1, False, True),  # EOS allowed at the last step only: it ends nothing early
    (N_NEW - 2, False, False),
    (None, True, False),       # one row's own limit is shorter
])
def test_row_lanes_only_where_every_row_runs_every_step(eos_from, limited, row_lanes,
                                                        monkeypatch):
    """generate picks the row-lane form (where the CPU has it) for 32 rows only when no row
    can finish before the last step; the form it ran is recorded on every decode step."""
    from engine import _kernels
    _, eng = engine(CFG, True, early_exit=True)
    if not eng.fused_decode:
        pytest.skip("C++ kernels not built")
    ids, mask, _ = batch_of(32, seed=5)
    limits = torch.full((32,), N_NEW)
    if limited:
        limits[3] = N_NEW - 1
    sp = SamplingParams(max_new_tokens=N_NEW, temperature=0.0,
                        eos_token_id=None if eos_from is None else 1,
                        min_new_tokens=0 if eos_from is None else eos_from)
    forms = record_forms(monkeypatch)
    eng.generate(ids, mask, sp, limits)
    assert forms == {row_lanes and _kernels.row_lanes_supported}


@pytest.mark.parametrize("batch, early_exit", [(32, True), (28, False), (27, True)])
def test_row_lane_generation_matches_cache_free_loop(batch, early_exit, monkeypatch):
    """A call whose rows all run every step, from ROW_LANES_MIN_ROWS rows: the kernels' products
    in the row-lane form where the CPU has it (27 rows: the k-lane form), the same greedy tokens
    as the training model's full forward and log-probs within float rounding of it."""
    from engine import _kernels
    model, eng = engine(CFG, True, early_exit=early_exit)
    if not eng.fused_decode:
        pytest.skip("C++ kernels not built")
    forms = record_forms(monkeypatch)
    ids, mask, _ = batch_of(batch, seed=4)
    toks, lps, _ = loop_reference(model, ids, mask, N_NEW)
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=N_NEW, temperature=0.0))
    assert torch.equal(out.responses, toks)
    torch.testing.assert_close(out.log_probs, lps, atol=1e-5, rtol=0)
    assert forms == {_kernels.row_lanes_supported and batch >= ROW_LANES_MIN_ROWS}


@pytest.mark.parametrize("cfg, batch, eos_last, copies", [
    (CFG, 32, False, False), (CFG, 5, False, False), (QWEN, 32, True, False),
    (QWEN, 1, False, False), (CFG, 28, True, True)],
    ids=["llama-32", "llama-5", "qwen2-32-eos-last", "qwen2-1", "llama-28-eos-last-copies"])
def test_greedy_loop_in_kernels_matches_python_loop(cfg, batch, eos_last, copies, monkeypatch):
    """Rows that all run every step: the decode steps after the prefill in one greedy_decode
    call give the Python loop's tokens, log-probs, mask and step counts bit for bit (batches
    in both product forms, Qwen2 biases, EOS allowed at the last step only, prompts shared by
    several sequences); a call where rows can stop early keeps the Python loop."""
    _, looped = engine(cfg, True, early_exit=True, greedy_loop=False)
    if not looped.fused_decode:
        pytest.skip("C++ kernels not built")
    _, fused = engine(cfg, True, early_exit=True)
    ids, mask, _ = batch_of(batch, seed=7)
    if copies:  # 4 sequences per prompt: the prefill runs each prompt once
        ids, mask = ids[:batch // 4].repeat(4, 1), mask[:batch // 4].repeat(4, 1)
    sp = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
    if eos_last:  # a token some row draws at the last step: EOS there ends nothing early
        eos = int(torch.mode(looped.generate(ids, mask, sp).responses[:, -1]).values)
        sp = SamplingParams(max_new_tokens=N_NEW, temperature=0.0, eos_token_id=eos,
                            min_new_tokens=N_NEW - 1)
    want = looped.generate(ids, mask, sp)
    calls = []
    record_forms(monkeypatch, calls)
    got = fused.generate(ids, mask, sp)
    assert_same(got, want)
    for key in ("forward_steps", "row_steps", "compactions", "prefill_rows", "new_tokens"):
        assert got.stats[key] == want.stats[key], key
    assert calls == ["greedy_decode"]
    if eos_last:
        assert bool((got.responses[:, -1] == sp.eos_token_id).any())
    if copies:
        assert got.stats["prefill_rows"] == batch // 4
    calls.clear()  # EOS from the step before the last: rows may stop early, the Python loop
    early = SamplingParams(max_new_tokens=N_NEW, temperature=0.0, eos_token_id=1,
                           min_new_tokens=N_NEW - 2)
    assert_same(fused.generate(ids, mask, early), looped.generate(ids, mask, early))
    assert "greedy_decode" not in calls and "decode_layers" in calls


def test_greedy_decode_checks_its_operands():
    """greedy_decode refuses operands that do not describe the steps it is asked for."""
    from engine import _kernels
    _, eng = engine(CFG, True, early_exit=True)
    if not eng.fused_decode:
        pytest.skip("C++ kernels not built")
    w, d = eng.weights, eng.paths.decode
    plen, b = 4, 2
    cache = TiledKVCache(**eng._kv_cache_sizes(b, plen, N_NEW))
    tables = torch.zeros(b, plen + N_NEW, CFG.head_dim)
    keys = torch.ones(b, plen + N_NEW, dtype=torch.bool)

    def call(first, steps, banned, start=plen):
        return _kernels.greedy_decode(first, steps, w["embed_tokens"], d.flat_weights,
                                      CFG.rms_norm_eps, tables, tables, cache.k, cache.v, start,
                                      keys, d.stage.q_per_group, d.qkv_biases, w["norm"],
                                      CFG.rms_norm_eps, w[eng.head_name], banned)
    first = torch.tensor([3, 5])
    with pytest.raises(RuntimeError, match="banned columns for 3 steps"):
        call(first, 3, [-1, -1])
    with pytest.raises(RuntimeError, match=r"positions \[4, 29\)"):
        call(first, N_NEW + 1, [-1] * (N_NEW + 1))
    with pytest.raises(RuntimeError, match="first_tokens outside"):
        call(torch.tensor([3, CFG.vocab_size]), 2, [-1, -1])
    with pytest.raises(RuntimeError, match="first_tokens must be int64"):
        call(first.int(), 2, [-1, -1])
    with pytest.raises(RuntimeError, match="banned column 999"):
        call(first, 2, [-1, 999])
    toks, lps = call(first, 0, [])
    assert toks.shape == (b, 0) and lps.shape == (b, 0)


@pytest.mark.parametrize("batch", [32, 5])
def test_greedy_loop_same_bits_on_one_thread(batch, monkeypatch):
    """greedy_decode on one thread (each step the decode_layers and greedy_head calls) and on
    two (every step in one parallel region the threads share) give the Python loop's tokens
    and log-probs up to rounding: the rows a thread takes change the products' shapes, which
    BLAS may round differently (seen on an Intel Xeon under AVX2 at batch 5)."""
    _, looped = engine(CFG, True, early_exit=True, greedy_loop=False)
    if not looped.fused_decode:
        pytest.skip("C++ kernels not built")
    _, fused = engine(CFG, True, early_exit=True)
    ids, mask, _ = batch_of(batch, seed=9)
    sp = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
    want = looped.generate(ids, mask, sp)
    calls = []
    record_forms(monkeypatch, calls)
    threads = torch.get_num_threads()
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            got = fused.generate(ids, mask, sp)
        finally:
            torch.set_num_threads(threads)
        assert_same_up_to_rounding(got, want, CFG, greedy=True)
    assert calls.count("greedy_decode") == 2


# Two ranks -------------------------------------------------------------------------------------
def resharded(train: tuple, gen: tuple):
    """``(groups, resharder)``: CFG's seeded model on this rank, moved to the generation
    layout (``train`` = (p, t, d), ``gen`` = (p_g, t_g))."""
    from hybridflow_comm.reshard import Resharder

    layout = HybridLayout(ParallelLayout(*train), *gen)
    groups = build_hybrid_groups(layout, pool=list(range(layout.world_size)))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, init_full_state_dict(CFG, seed=0, std=0.2))
    resharder = Resharder(model.specs, groups, buffer=model.buffer)
    resharder.to_generation()
    return groups, resharder


def two_rank_case(rank: int, world_size: int, train: tuple, gen: tuple, fused: bool) -> dict:
    groups, resharder = resharded(train, gen)
    engines = {flag: GenerationEngine(CFG, groups, fused_decode=fused, early_exit=flag)
               for flag in (True, False)}
    for e in engines.values():
        e.load_weights(resharder)
    ids, mask, limits = batch_of(32)
    out = {"path": engines[True].paths.decode.name}
    for mode, sp in MODES.items():
        eos = frequent_token(engines[False].generate(ids, mask, sp))
        sp = SamplingParams(**(sp.__dict__ | {"eos_token_id": eos}))
        for flag, e in engines.items():
            o = e.generate(ids, mask, sp, limits)
            out[mode, flag] = (o.input_ids, o.attention_mask, o.log_probs,
                               o.stats["compactions"])
    return out


@pytest.mark.parametrize("train, gen, fused", [((1, 2, 1), (1, 2), True),
                                               ((1, 2, 1), (1, 2), False),
                                               ((2, 1, 1), (2, 1), True)],
                         ids=["tp2-kernels", "tp2-python", "pp2-kernels"])
def test_early_exit_on_two_ranks(pool2, train, gen, fused):
    """TP generation (every rank sees the same tokens, so all compact alike) and PP
    generation (hidden states of the running rows only cross the stage boundary); every rank
    gets the same outputs, bit-equal to early_exit=False on the kernels and within rounding
    on the Python layers."""
    if fused and not GenerationEngine(CFG, build_hybrid_groups(HybridLayout(
            ParallelLayout(1, 1, 1), 1, 1))).fused_decode:
        pytest.skip("C++ kernels not built")
    results = pool2.run(two_rank_case, train, gen, fused)
    for mode in MODES:
        on, off = results[0][mode, True], results[0][mode, False]
        assert on[3] >= 1 and off[3] == 0
        for r in results:  # every rank: the same outputs as rank 0
            for flag in (True, False):
                for x, y in zip(r[mode, flag][:3], results[0][mode, flag][:3]):
                    assert torch.equal(x, y), (mode, r["path"])
        a, b = (GenerationOutput(input_ids=o[0], attention_mask=o[1], log_probs=o[2],
                                 prompt_length=9) for o in (on, off))
        if fused:
            assert_same(a, b)
        else:
            assert_same_up_to_rounding(a, b, CFG, MODES[mode].greedy)
