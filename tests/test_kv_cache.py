"""The KV cache's two classes (engine/kv_cache.py) against plain concatenation, and a
generation on the dense layout (the CUDA one, forced on the CPU) against the tiled one
(their reuse across calls: tests/test_kv_cache_reuse.py).

Keys of the tiled layout live in tiles of KEY_TILE positions; a step's keys may cross a tile
boundary (a prefill longer than a tile, or a decode step at the first position of a tile).
The reference is the list of every step's keys concatenated along the positions.  The dense
layout's decode steps run at the static shapes of engine.cuda_graphs (eagerly here): their
tokens equal the tiled layout's (C++ kernels, or the Python layers) wherever the reference
logits have no near-tie."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import cuda_graphs
from engine.cuda_graphs import BUCKET_STEP, SMALL_BUCKETS, StaticDecode, bucket, key_bucket, \
    resolve_graphs
from engine.generation import GenerationEngine
from engine.kv_cache import KEY_TILE, KV_CACHES, DenseKVCache, TiledKVCache, key_tiles, \
    kv_cache_nbytes, resolve_layout, tile_keys, untile_keys
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests.near_ties import assert_clear_picks

B, G, D = 3, 2, 8


@pytest.mark.parametrize("steps", [[1] * 70, [5, KEY_TILE - 6, 1, 1, 1], [KEY_TILE + 3, 2],
                                   [2 * KEY_TILE + 1, 1, KEY_TILE - 2]])
@pytest.mark.parametrize("layout", ["tiled", "dense"])
def test_hook_writes_and_returns_every_step_across_tiles(steps, layout):
    g = torch.Generator().manual_seed(sum(steps))
    max_len = sum(steps)
    cache = KV_CACHES[layout](2, B, max_len, G, D, torch.float32)
    if layout == "tiled":
        assert cache.k.shape == (2, B, G, key_tiles(max_len), D, KEY_TILE)
    else:
        assert cache.k.shape == (2, B, G, max_len, D)
    written = {layer: ([], []) for layer in range(2)}
    for s in steps:
        for layer in range(2):
            k, v = torch.randn(B, s, G, D, generator=g), torch.randn(B, s, G, D, generator=g)
            written[layer][0].append(k)
            written[layer][1].append(v)
            got_k, got_v = cache.hook(layer)(k, v)
            want_k, want_v = (torch.cat(t, dim=1) for t in written[layer])
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        cache.advance(s)
    keys = torch.stack([torch.cat(written[layer][0], dim=1) for layer in range(2)])
    assert torch.equal(cache.keys(0, max_len), keys.permute(0, 1, 3, 4, 2))  # [L, B, G, D, S]
    assert torch.equal(cache.keys(3, max_len - 1), keys.permute(0, 1, 3, 4, 2)[..., 3:-1])
    if layout == "tiled":  # positions past the filled ones are zeros (whole tile rows read)
        tail = cache.k[:, :, :, -1, :, max_len - (key_tiles(max_len) - 1) * KEY_TILE:]
        assert tail.numel() == 0 or not tail.any()


def test_overflow_raises_before_writing():
    cache = TiledKVCache(1, B, KEY_TILE + 1, G, D, torch.float32)
    cache.hook(0)(torch.ones(B, KEY_TILE, G, D), torch.ones(B, KEY_TILE, G, D))
    cache.advance(KEY_TILE)
    with pytest.raises(RuntimeError, match="KV cache overflow: 66 > max_len=65"):
        cache.hook(0)(torch.ones(B, 2, G, D), torch.ones(B, 2, G, D))
    assert not cache.k[..., 1, :, :].any()


def test_tile_round_trip_and_sizes():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, G, D, 2 * KEY_TILE + 5, generator=g)
    tiles = tile_keys(keys)
    assert tiles.shape == (2, G, 3, D, KEY_TILE) and tiles.is_contiguous()
    assert torch.equal(untile_keys(tiles, 0, keys.shape[-1]), keys)
    assert torch.equal(untile_keys(tiles, KEY_TILE + 1, KEY_TILE + 2), keys[..., 65:66])
    assert torch.equal(tiles[:, :, 1, 3, 7], keys[:, :, 3, KEY_TILE + 7])  # tile 1, dim 3
    assert not tiles[:, :, 2, :, 5:].any()
    inside_one_tile = untile_keys(tiles, 1, 5)
    inside_one_tile.add_(1.0)  # a copy, never a view of the cache
    assert torch.equal(untile_keys(tiles, 1, 5), keys[..., 1:5])
    cache = TiledKVCache(3, B, 2 * KEY_TILE + 5, G, D, torch.float32)
    assert cache.nbytes == kv_cache_nbytes(3, B, 2 * KEY_TILE + 5, G, D, torch.float32)
    assert cache.nbytes == 3 * B * G * D * 4 * (3 * KEY_TILE + 2 * KEY_TILE + 5)


def test_keep_rows_copies_whole_tiles_of_the_kept_rows():
    g = torch.Generator().manual_seed(1)
    cache = TiledKVCache(2, 4, 2 * KEY_TILE, G, D, torch.float32)
    n = KEY_TILE + 9
    cache.hook(0)(torch.randn(4, n, G, D, generator=g), torch.randn(4, n, G, D, generator=g))
    cache.hook(1)(torch.randn(4, n, G, D, generator=g), torch.randn(4, n, G, D, generator=g))
    cache.advance(n)
    before = cache.keys(0, n)
    rows = torch.tensor([3, 0, 0])
    cache.keep_rows_(rows)
    assert cache.k.shape[1] == 3
    assert torch.equal(cache.keys(0, n), before[:, rows])
    assert not cache.keys(n, 2 * KEY_TILE).any()


def test_dense_hook_returns_views_of_the_cache():
    cache = DenseKVCache(1, B, 10, G, D, torch.float32)
    k, v = cache.hook(0)(torch.ones(B, 4, G, D), torch.ones(B, 4, G, D))
    assert k.shape == (B, 4, G, D)
    for got, buf in ((k, cache.k_buf), (v, cache.v_buf)):  # no copy of the cache
        assert got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert cache.hook(0).stacked_decode is True
    assert TiledKVCache(1, B, 10, G, D, torch.float32).hook(0).stacked_decode is False


def test_dense_keep_rows_moves_rows_within_its_buffers():
    g = torch.Generator().manual_seed(2)
    cache = DenseKVCache(2, 3, 20, G, D, torch.float32, capacity=8)
    n = 7
    for layer in range(2):
        cache.hook(layer)(torch.randn(3, n, G, D, generator=g), torch.randn(3, n, G, D,
                                                                            generator=g))
    cache.advance(n)
    before_k, before_v = cache.keys(0, n), cache.v[:, :, :, :n].clone()
    ptr = cache.k_buf.data_ptr()
    rows = torch.tensor([2, 0, 0, 1, 2])  # the copies of shared prompts: more rows than before
    cache.keep_rows_(rows)
    assert cache.k_buf.data_ptr() == ptr and cache.rows == 5
    assert torch.equal(cache.keys(0, n), before_k[:, rows])
    assert torch.equal(cache.v[:, :, :, :n], before_v[:, rows])
    cache.keep_rows_(torch.tensor([3]))
    assert cache.rows == 1 and torch.equal(cache.keys(0, n), before_k[:, [1]])
    with pytest.raises(ValueError, match="capacity 8"):
        cache.keep_rows_(torch.zeros(9, dtype=torch.long))


def test_decode_slots_write_at_the_device_position():
    g = torch.Generator().manual_seed(3)
    cache = DenseKVCache(2, 2, 6, G, D, torch.float32, capacity=4)
    prompt = [torch.randn(2, 3, G, D, generator=g) for _ in range(2)]
    for layer in range(2):
        cache.hook(layer)(prompt[layer], prompt[layer] * 2)
    cache.advance(3)
    slots = cache.slots(4, torch.tensor([3]))
    new = torch.randn(4, 1, G, D, generator=g)
    k, v = slots.hook(1)(new, -new)
    assert k.shape == (4, 6, G, D)  # every position of every slot row
    assert torch.equal(k[:2, :3], prompt[1]) and torch.equal(v[:2, :3], prompt[1] * 2)
    assert torch.equal(k[:, 3:4], new) and torch.equal(v[:, 3:4], -new)
    assert not k[:, 4:].any() and not cache.k_buf[0, :, :, 3].any()  # layer 0 untouched
    with pytest.raises(ValueError, match="capacity"):
        cache.slots(5, torch.tensor([3]))
    with pytest.raises(ValueError, match="positions 6"):
        cache.slots(2, torch.tensor([3]), positions=7)
    assert not hasattr(TiledKVCache(1, 2, 6, G, D, torch.float32), "slots")  # dense only


def test_layouts_resolve_by_device_and_size_their_bytes():
    assert resolve_layout(None, "cpu") == "tiled" and resolve_layout(None, "cuda") == "dense"
    assert resolve_layout("dense", "cpu") == "dense"
    with pytest.raises(ValueError, match="'flat'"):
        resolve_layout("flat", "cpu")
    cache = DenseKVCache(3, B, 70, G, D, torch.bfloat16, capacity=B + 2)
    assert cache.nbytes == kv_cache_nbytes(3, B, 70, G, D, torch.bfloat16, "dense", B + 2)
    assert cache.nbytes == 2 * 3 * (B + 2) * G * 70 * D * 2
    with pytest.raises(ValueError, match="capacity=2 < batch=3"):
        DenseKVCache(1, 3, 4, G, D, torch.float32, capacity=2)


def test_buckets_are_the_smallest_allowed_size_that_holds_the_rows():
    allowed = sorted(set(SMALL_BUCKETS) | set(range(BUCKET_STEP, 1000, BUCKET_STEP)))
    for rows in range(1, 300):
        assert bucket(rows) == min(b for b in allowed if b >= rows), rows
    with pytest.raises(ValueError, match="rows=0"):
        bucket(0)
    with pytest.raises(ValueError, match="device=cpu"):
        resolve_graphs(True, torch.device("cpu"))
    assert not resolve_graphs(None, torch.device("cpu"))


def test_key_buckets_are_the_next_multiple_of_the_step_up_to_max_len():
    step = cuda_graphs.KEY_STEP
    for max_len in (1, step - 1, step, step + 1, 4 * step + 63):
        for keys in range(1, max_len + 1):
            b = key_bucket(keys, max_len)
            assert b == max_len or (b % step == 0 and b < max_len), (keys, max_len)
            assert keys <= b and (b == max_len or b - keys < step), (keys, max_len)
    for bad in (0, 10):
        with pytest.raises(ValueError, match=f"keys={bad}"):
            key_bucket(bad, 9)


@pytest.mark.parametrize("early_exit", [False, True])
def test_dense_steps_attend_over_their_key_buckets(monkeypatch, early_exit):
    """A call crossing several key buckets (KEY_STEP = 4 here): each static step reads the
    cache's first key_bucket(position + 1) positions, and the tokens are still the tiled
    layout's (which reads the filled positions only), log-probs within float32 rounding."""
    monkeypatch.setattr(cuda_graphs, "KEY_STEP", 4)
    model = _model(CFG)
    ids, mask = _prompts(10, 6, padded=True, repeat=False)
    params = SamplingParams(max_new_tokens=14, temperature=0.0, eos_token_id=7)
    limits = torch.tensor([14, 3, 14, 9, 14] * 2)
    seen = []
    slots = DenseKVCache.slots

    def spy(cache, rows, pos, positions=None):
        seen.append((cache.length, positions))
        return slots(cache, rows, pos, positions)

    monkeypatch.setattr(DenseKVCache, "slots", spy)
    outs = {}
    for layout in ("tiled", "dense"):
        eng = GenerationEngine(CFG, model.groups, fused_decode=False, kv_layout=layout,
                               early_exit=early_exit)
        eng.set_weights(model.params)
        outs[layout] = eng.generate(ids, mask, params, max_new_tokens=limits)
    tiled, dense = outs["tiled"], outs["dense"]
    max_len = 6 + 14 - 1
    assert len({p for _, p in seen}) >= 3  # 8, 12, 16, 19: several key buckets
    assert all(p == key_bucket(length + 1, max_len) for length, p in seen), seen
    assert_clear_picks(model, tiled, params)
    assert torch.equal(dense.input_ids, tiled.input_ids)
    assert torch.allclose(dense.log_probs, tiled.log_probs, atol=2e-5, rtol=0)


CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)


def _model(cfg: LlamaConfig) -> ParallelLlama:
    model = ParallelLlama(cfg, build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1)))
    load_full_state_dict(model, init_full_state_dict(cfg, seed=5, std=0.2))
    return model


def _prompts(batch: int, plen: int, padded: bool, repeat: bool):
    ids = torch.randint(1, CFG.vocab_size, (batch, plen),
                        generator=torch.Generator().manual_seed(6))
    pads = torch.arange(batch) % 3 if padded else torch.zeros(batch, dtype=torch.long)
    mask = (torch.arange(plen) >= pads[:, None]).long()  # row b: b % 3 pads on the left
    if repeat:  # pairs of identical prompts: one prefill each, then copied
        ids, mask = ids[::2].repeat_interleave(2, 0), mask[::2].repeat_interleave(2, 0)
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("padded, repeat, fused", [(True, False, None), (False, True, None),
                                                   (True, True, False)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dense_generation_matches_the_tiled_layout(padded, repeat, fused, temperature):
    model = _model(CFG)
    ids, mask = _prompts(10, 6, padded, repeat)  # 10 rows: bucket 16, six pad rows
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3)
    outs = {}
    for layout in ("tiled", "dense"):
        eng = GenerationEngine(CFG, model.groups, fused_decode=fused if layout == "tiled"
                               else None, kv_layout=layout)
        eng.set_weights(model.params)
        outs[layout] = eng.generate(ids, mask, params)
    tiled, dense = outs["tiled"], outs["dense"]
    assert dense.stats["kv_layout"] == "dense" and not dense.stats["cuda_graphs"]
    assert_clear_picks(model, tiled, params)
    assert torch.equal(dense.input_ids, tiled.input_ids)
    assert torch.allclose(dense.log_probs, tiled.log_probs, atol=2e-5, rtol=0)


def test_dense_generation_with_early_exit_matches_the_tiled_layout():
    """Rows end at EOS and at their own limits: the dense cache compacts in place and the
    static steps move to smaller buckets."""
    model = _model(CFG)
    ids, mask = _prompts(20, 5, padded=True, repeat=False)
    first = SamplingParams(max_new_tokens=14, temperature=0.0)
    limits = torch.tensor([14, 3, 14, 2, 14] * 4)
    engines = {}
    for layout in ("tiled", "dense"):
        engines[layout] = GenerationEngine(CFG, model.groups, fused_decode=False,
                                           kv_layout=layout)
        engines[layout].set_weights(model.params)
    # EOS = a token row 0 produces mid-way: rows finish at different steps
    params = replace(first, eos_token_id=int(engines["tiled"].generate(ids, mask, first)
                                             .responses[0, 5]))
    outs = {layout: eng.generate(ids, mask, params, max_new_tokens=limits)
            for layout, eng in engines.items()}
    tiled, dense = outs["tiled"], outs["dense"]
    assert tiled.stats["compactions"] >= 1 and dense.stats["compactions"] >= 1
    assert_clear_picks(model, tiled, params)
    assert torch.equal(dense.input_ids, tiled.input_ids)
    assert torch.equal(dense.attention_mask, tiled.attention_mask)
    assert torch.allclose(dense.log_probs, tiled.log_probs, atol=2e-5, rtol=0)


def test_dense_layout_refuses_the_kernels():
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    with pytest.raises(ValueError, match="kv_layout='dense'"):
        GenerationEngine(CFG, groups, fused_decode=True, kv_layout="dense")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        GenerationEngine(CFG, groups, kv_layout="dense", cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA cache"):
        StaticDecode(lambda ids: ids, lambda *a: a[0],
                     DenseKVCache(1, 2, 4, G, D, torch.float32), capture=True)
    eng = GenerationEngine(CFG, groups, kv_layout="dense")
    assert not eng.fused_decode and eng.static_decode and not eng.cuda_graphs
    assert eng.kv_cache_bytes(10, 6, 12) == kv_cache_nbytes(
        2, 10, 17, 2, 16, torch.float32, "dense", bucket(10))


def test_compiled_decode_layers_match_the_tiled_layout():
    """The static steps through the compiled layers (inductor's CPU backend here; Triton on a
    GPU): one compile serves every layer and, after one recompile, every bucket (rows leave:
    16 -> 8 -> 4 rows), the cache written in place; tokens as the tiled layout's, log-probs
    within float32 summation order."""
    import torch._dynamo

    from engine import compiled_decode

    torch._dynamo.reset()
    counted = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the process's so far
    model = _model(CFG)
    ids, mask = _prompts(12, 5, padded=True, repeat=False)
    limits = torch.tensor([14, 3, 14, 2, 5, 14] * 2)
    params = SamplingParams(max_new_tokens=14, temperature=0.0)
    outs = {}
    for layout, compiled in (("tiled", False), ("dense", True)):
        eng = GenerationEngine(CFG, model.groups, fused_decode=False, kv_layout=layout,
                               compile_decode=compiled)
        eng.set_weights(model.params)
        assert eng.compile_decode == compiled
        outs[layout] = eng.generate(ids, mask, params, max_new_tokens=limits)
    tiled, dense = outs["tiled"], outs["dense"]
    assert dense.stats["compile_decode"] and dense.stats["compactions"] >= 1
    assert not any(c._broken or c.eager_calls for c in compiled_decode.COMPILED)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - counted
    assert 1 <= graphs <= 3, graphs  # not one compile per layer or per step
    assert_clear_picks(model, tiled, params)
    assert torch.equal(dense.input_ids, tiled.input_ids)
    assert torch.allclose(dense.log_probs, tiled.log_probs, atol=2e-5, rtol=0)
    # off by default on the CPU, and where the steps are not static (the tiled layout)
    assert not GenerationEngine(CFG, model.groups, kv_layout="dense").compile_decode
    assert not GenerationEngine(CFG, model.groups, kv_layout="tiled",
                                compile_decode=True).compile_decode
