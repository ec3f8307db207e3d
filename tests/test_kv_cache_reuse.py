"""A KV cache allocated once per engine (engine/decode_memory.py): reset on the same storage
with zeros past the length, rows kept in place in the tiled layout's flat storage, grown only
for a call that needs more, the static decode steps (their buckets and graphs) kept with the
dense cache, and a second call's tokens those of a fresh engine.  Captures are faked here (a
"graph" that replays the eager step); tests/test_engine_cuda.py has the real ones."""

from __future__ import annotations

import weakref

import pytest
import torch

from engine import cuda_graphs
from engine.cuda_graphs import StaticDecode
from engine.decode_memory import DecodeMemory
from engine.generation import GenerationEngine
from engine.kv_cache import KEY_TILE, KV_CACHES, LAYOUTS, TiledKVCache
from engine.sampling import SamplingParams
from tests.near_ties import assert_clear_picks
from tests.test_kv_cache import CFG, _model, _prompts

G, D = 2, 8
F32 = torch.float32


def _fill(cache, rows: int, n: int, g: torch.Generator) -> None:
    for layer in range(cache.k.shape[0]):
        cache.hook(layer)(torch.randn(rows, n, G, D, generator=g),
                          torch.randn(rows, n, G, D, generator=g))
    cache.advance(n)


@pytest.mark.parametrize("layers", [1, 3])
def test_tiled_keep_rows_moves_rows_in_place_growing_and_shrinking(layers):
    """The kept rows land at the front of the same storage as contiguous tensors (what the
    kernels take), layer after layer in the order that overwrites no layer still to be read;
    K stays zeros past the length."""
    g = torch.Generator().manual_seed(0)
    cache = TiledKVCache(layers, 3, 2 * KEY_TILE, G, D, F32, capacity=7)
    n = KEY_TILE + 9
    _fill(cache, 3, n, g)
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    keys, values = cache.keys(0, n), cache.v[:, :, :, :n].clone()
    for rows in ([2, 0, 0, 1, 2, 1, 0], [1, 3, 4, 6], [3, 2, 1, 0], [2]):
        rows = torch.tensor(rows)
        cache.keep_rows_(rows)
        keys, values = keys[:, rows], values[:, rows]
        assert cache.k.data_ptr() == k_ptr and cache.v.data_ptr() == v_ptr
        assert cache.k.is_contiguous() and cache.v.is_contiguous()
        assert cache.rows == rows.numel()
        assert torch.equal(cache.keys(0, n), keys)
        assert torch.equal(cache.v[:, :, :, :n], values)
        assert not cache.keys(n, 2 * KEY_TILE).any()
    with pytest.raises(ValueError, match="storage"):
        cache.keep_rows_(torch.zeros(8, dtype=torch.long))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reset_reuses_the_storage_with_zeros_past_the_length(layout):
    g = torch.Generator().manual_seed(1)
    cache = KV_CACHES[layout](2, 4, 40, G, D, F32)
    _fill(cache, 4, 5, g)
    for t in ((cache.k_buf, cache.v_buf) if layout == "dense" else (cache.k, cache.v)):
        t.fill_(float("nan"))  # what a diverged call could leave behind
    ptr, nbytes = cache.k.data_ptr(), cache.nbytes
    assert cache.fits(4, 40) and not cache.fits(5, 40) and not cache.fits(4, 41)
    # the tiled storage is flat: fewer rows of more positions fit the same bytes
    assert cache.fits(2, 70) == (layout == "tiled")
    cache.reset_(3, 30)
    assert (cache.length, cache.rows, cache.max_len) == (0, 3, 30)
    assert cache.k.data_ptr() == ptr and cache.nbytes == nbytes
    assert not cache.keys(0, 30).any()
    if layout == "dense":
        assert not cache.k_buf.any() and not cache.v_buf.any()
    k, v = torch.randn(3, 4, G, D, generator=g), torch.randn(3, 4, G, D, generator=g)
    got_k, got_v = cache.hook(1)(k, v)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    with pytest.raises(ValueError, match="does not fit"):
        cache.reset_(5, 40)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_memory_reuses_grows_and_releases(layout):
    """A call that fits reuses the cache; one that does not gets a cache grown to the larger
    of each size (the old one freed first); the static steps stay while the cache and the
    weights' addresses do."""
    made: list[weakref.ref] = []

    def cache_type(*args, **kwargs):
        assert all(r() is None for r in made), "the old cache is freed before the new one"
        made.append(weakref.ref(cache := KV_CACHES[layout](*args, **kwargs)))
        return cache

    mem = DecodeMemory(cache_type, torch.device("cpu"), capture=False)
    sizes = dict(num_layers=2, kv_heads=G, head_dim=D, dtype=F32)
    a = mem.cache_for(batch=3, max_len=20, capacity=4, **sizes)
    assert mem.cache_for(batch=2, max_len=12, capacity=4, **sizes) is a
    assert (a.rows, a.max_len, a.length) == (2, 12, 0)
    del a
    b = mem.cache_for(batch=1, max_len=30, capacity=4, **sizes)
    assert len(made) == 2 and (b.capacity, b.positions) == (4, 30)
    del b
    c = mem.cache_for(batch=8, max_len=10, capacity=16, **sizes)
    assert len(made) == 3 and (c.capacity, c.positions) == (16, 30) and mem.nbytes == c.nbytes
    if layout == "dense":
        embed, layers = (lambda ids: ids), (lambda *a: a[0])
        static = mem.static_decode(embed, layers, weights_key=1)
        assert static.cache is c and mem.static_decode(embed, layers, 1) is static
        assert mem.static_decode(embed, layers, 2) is not static  # weights moved
        static = mem.static
        mem.release(keep=True)  # kept, without the step functions (they hold the weights)
        assert mem.cache is c and mem.static is static and static.layers is None
    mem.release()
    assert mem.cache is None and mem.static is None and mem.nbytes == 0


class _ReplayEager:
    """A stand-in CUDA graph: its replay runs the captured step eagerly into its output."""

    def __init__(self, static: StaticDecode, buf, keys: int, out: torch.Tensor) -> None:
        self.static, self.buf, self.keys, self.out = static, buf, keys, out

    def replay(self) -> None:
        outs = self.static._run(self.buf, self.keys)
        for held, new in zip(_tensors(self.out), _tensors(outs)):
            held.copy_(new)


def _tensors(out) -> tuple:
    return (out,) if isinstance(out, torch.Tensor) else out


def _fake_capture(self: StaticDecode, buf, keys: int):
    out = self._run(buf, keys)
    return out, _ReplayEager(self, buf, keys, out)


def test_dense_engine_keeps_its_cache_and_static_steps_across_calls(monkeypatch):
    """Second call: the same buffers, buckets and graphs (none captured), the tokens of the
    first call and of a fresh engine; shorter prompts reuse them too (key buckets cut from
    the cache's positions); a larger batch grows the cache; release() drops it."""
    monkeypatch.setattr(cuda_graphs, "KEY_STEP", 4)
    monkeypatch.setattr(StaticDecode, "_capture", _fake_capture)
    model = _model(CFG)
    ids, mask = _prompts(10, 6, padded=True, repeat=False)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, eos_token_id=7)
    limits = torch.tensor([12, 3, 12, 9, 12] * 2)
    eng = GenerationEngine(CFG, model.groups, kv_layout="dense")
    eng.set_weights(model.params)
    first = eng.generate(ids, mask, params, max_new_tokens=limits)
    assert first.stats["graphs_captured"] == 0  # eager on the CPU
    cache, static = eng.memory.cache, eng.memory.static
    static.capture = True  # from now on "captured" (replayed eagerly: the same bits)
    second = eng.generate(ids, mask, params, max_new_tokens=limits)
    assert second.stats["graphs_captured"] == static.graph_count >= 3
    buckets = {b: buf.inputs.data_ptr() for b, buf in static.buckets.items()}
    third = eng.generate(ids, mask, params, max_new_tokens=limits)
    assert eng.memory.cache is cache and eng.memory.static is static
    assert third.stats["graphs_captured"] == 0 and third.stats["capture_s"] == 0
    assert static.embed is None and static.layers is None  # no weights held between calls
    assert {b: buf.inputs.data_ptr() for b, buf in static.buckets.items()} == buckets
    fresh = GenerationEngine(CFG, model.groups, kv_layout="dense")
    fresh.set_weights(model.params)
    want = fresh.generate(ids, mask, params, max_new_tokens=limits)
    for out in (first, second, third):
        assert torch.equal(out.input_ids, want.input_ids)
        assert torch.equal(out.log_probs, want.log_probs)
    # shorter prompts: the same cache and steps (masks narrower than the key buckets); only
    # the (bucket, key bucket) pairs no call ran before are captured
    short_ids, short_mask = _prompts(10, 3, padded=True, repeat=False)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    count = static.graph_count
    short = eng.generate(short_ids, short_mask, greedy)
    assert eng.memory.cache is cache and eng.memory.static is static
    assert static.graph_count == count + short.stats["graphs_captured"]
    assert eng.generate(short_ids, short_mask, greedy).stats["graphs_captured"] == 0
    tiled = GenerationEngine(CFG, model.groups, fused_decode=False, kv_layout="tiled")
    tiled.set_weights(model.params)
    ref = tiled.generate(short_ids, short_mask, greedy)
    assert_clear_picks(model, ref, greedy)
    assert torch.equal(short.input_ids, ref.input_ids)
    assert torch.allclose(short.log_probs, ref.log_probs, atol=2e-5, rtol=0)
    # a larger batch: a larger bucket than the capacity, so a new cache and new steps
    big_ids, big_mask = _prompts(20, 6, padded=True, repeat=True)
    big = eng.generate(big_ids, big_mask, params)
    assert eng.memory.cache is not cache and eng.memory.cache.capacity == 32
    assert eng.memory.static is not static and eng.memory.static.cache is eng.memory.cache
    want = fresh.generate(big_ids, big_mask, params)
    assert torch.equal(big.input_ids, want.input_ids)
    assert torch.equal(big.log_probs, want.log_probs)
    eng.release()
    assert eng.memory.cache is None and eng.memory.static is None


def test_static_steps_stay_over_weights_at_the_same_addresses():
    """New weights at the same addresses (a resharder's views, refilled in place) keep the
    graphs; weights at other addresses drop them, the cache stays."""
    model = _model(CFG)
    ids, mask = _prompts(4, 5, padded=False, repeat=False)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    eng = GenerationEngine(CFG, model.groups, kv_layout="dense", keep_cache=True)
    eng.set_weights(model.params)
    eng.generate(ids, mask, greedy)
    cache, static = eng.memory.cache, eng.memory.static
    eng.release()
    eng.set_weights(model.params)
    eng.generate(ids, mask, greedy)
    assert eng.memory.cache is cache and eng.memory.static is static
    eng.set_weights({n: t.clone() for n, t in model.params.items()})
    eng.generate(ids, mask, greedy)
    assert eng.memory.cache is cache and eng.memory.static is not static


@pytest.mark.parametrize("free", [True, False])
def test_rollout_free_cache_engine_decides_what_the_actor_keeps(free):
    """``rollout.free_cache_engine`` from the command line to the actor's engine: leaving
    generation for training drops the KV cache (true, the default) or keeps it for the next
    iteration (false); a rollout pool, which never trains, keeps it either way."""
    from engine.hybrid_engine import HybridEngine
    from engine.train import OptimConfig
    from rlhf.config import load_config
    from rlhf.workers.rollout_engine import build_rollout

    settings = load_config([f"rollout.free_cache_engine={str(free).lower()}"]).rollout
    assert load_config([]).rollout.free_cache_engine is True
    model = _model(CFG)
    ids, mask = _prompts(4, 5, padded=False, repeat=False)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    for actor in (True, False):
        rollout = build_rollout(settings, CFG, model.groups, torch.device("cpu"), None, 0,
                                sleep_between_phases=actor)
        assert rollout.engine.keep_cache == (not free or not actor)
        if not actor:
            continue
        hybrid = HybridEngine(model, OptimConfig(lr=1e-3), rollout=rollout)
        with hybrid.generation_mode():
            hybrid.rollout.generate(ids, mask, greedy)
            cache = rollout.engine.memory.cache
        assert cache is not None
        assert (rollout.engine.memory.cache is None) == free
    with pytest.raises(ValueError, match="rollout.free_cache_engine.*'maybe'"):
        load_config(["rollout.free_cache_engine=maybe"])
