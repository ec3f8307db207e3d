"""The generation layer paths (:mod:`engine.forward_paths`: the C++ decode kernels of
``engine._kernels``) against the reference path, the Python layers of
:mod:`engine.layers` that the training model also runs: every registered path over the same
prefill and decode steps, outputs and KV-cache contents.  The engine-level tests compare whole
generations with the kernels on and off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import _kernels
from engine.attention import causal_mask
from engine.generation import GenerationEngine
from engine.forward_paths import (DECODE, LAYER_PATHS, PREFILL, KernelStage, PythonLayers,
                                  StageLayers)
from engine.kv_cache import KVCache, TiledKVCache, tile_keys, untile_keys
from engine.llama_spec import LAYER_KEYS, LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.rope import position_ids_from_mask, rope_tables
from engine.sampling import SamplingParams
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests.near_ties import assert_clear_picks

B, G, QPG, D, H, F = 5, 2, 3, 16, 48, 40
EPS = 1e-5


def weights(gen: torch.Generator, stacked: int = 1, qkv_bias: bool = False
            ) -> dict[str, torch.Tensor]:
    """One layer's shards; ``stacked`` > 1 gives o_proj/down_proj the [m, H, in/m] form;
    ``qkv_bias`` adds a Qwen2 q/k/v bias (fused like qkv's rows)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    w = {"input_norm": 1 + rnd(H), "post_norm": 1 + rnd(H), "qkv": rnd(G * (QPG + 2) * D, H),
         "o_proj": rnd(H, G * QPG * D), "gate_up": rnd(2 * F, H), "down_proj": rnd(H, F)}
    if qkv_bias:  # large enough to move q and k before RoPE by as much as the product does
        w["qkv_bias"] = torch.randn(G * (QPG + 2) * D, generator=gen)
    if stacked > 1:  # the stacked form holds the same logical matrix, split along inputs
        for name in ("o_proj", "down_proj"):
            w[name] = w[name].unflatten(1, (stacked, -1)).transpose(0, 1).contiguous()
    return w


def setup_cache(gen: torch.Generator, prompt_len: int, batch: int = B, new_tokens: int = 4):
    """Left-padded prompt masks, the mask with ``new_tokens`` more, and RoPE tables for all of
    it."""
    lengths = torch.randint(1, prompt_len + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_len) >= prompt_len - lengths[:, None]).long()
    full_mask = torch.cat([mask, torch.ones(batch, new_tokens, dtype=torch.long)], 1)
    cos, sin = rope_tables(position_ids_from_mask(full_mask), D, 1000.0)
    return mask, full_mask, cos, sin


LAYERS, N_DECODE = 2, 3
REFERENCE = LAYER_PATHS["python"]


def stage_layers(gen: torch.Generator, stacked: int, qkv_bias: bool = False) -> StageLayers:
    return StageLayers(weights=tuple(weights(gen, stacked, qkv_bias) for _ in range(LAYERS)),
                       q_per_group=QPG, head_dim=D, eps=EPS, tp_group=None, dtype=torch.float32)


def runs(path, seq: int, cached: int) -> bool:
    """Whether ``path`` runs a step of ``seq`` new tokens per row after ``cached`` ones."""
    return (PREFILL in path.steps and cached == 0) or (DECODE in path.steps and seq == 1)


def filled(cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys ``[L, B, h_kv, D, end]`` and values ``[L, B, h_kv, end, D]`` so far."""
    return cache.keys(0, end), cache.v[:, :, :, :end]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("plen", [1, 7])
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("stacked", [1, 2])
@pytest.mark.parametrize("name", sorted(LAYER_PATHS))
def test_layer_path_matches_reference(name, stacked, qkv_bias, plen, threads):
    """Every registered layer path against the reference (the Python layers) over the same
    prefill and decode steps: outputs and KV-cache contents, with and without the q/k/v bias.
    Where a path does not run a step (the kernels prefill one token only), its cache takes the
    reference's for the next step."""
    gen = torch.Generator().manual_seed(stacked * 10 + plen + threads + 100 * qkv_bias)
    stage = stage_layers(gen, stacked, qkv_bias)
    path, ref = LAYER_PATHS[name].build(stage), REFERENCE.build(stage)
    # every path reads stacked shards and the q/k/v bias
    assert path is not None, f"{name} declined {stacked} shard(s), qkv_bias={qkv_bias}"
    mask, full_mask, cos, sin = setup_cache(gen, plen)
    keys_ok = full_mask.bool()[:, None, None, :]
    steps = [(torch.randn(B, plen, H, generator=gen), 0, plen, causal_mask(mask, B, plen))]
    steps += [(torch.randn(B, 1, H, generator=gen), pos, pos + 1, keys_ok[..., :pos + 1])
              for pos in range(plen, plen + N_DECODE)]
    ref_cache, cache = (TiledKVCache(LAYERS, B, plen + N_DECODE, G, D, torch.float32)
                        for _ in range(2))
    ran = 0
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for x, start, end, attn in steps:
                rope = (cos[:, start:end], sin[:, start:end])
                want = ref.forward(x, ref_cache, rope, attn)
                if runs(path, end - start, start):
                    got = path.forward(x, cache, rope, attn)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                    # the cache holds what the reference's holds, up to rounding: the kernels'
                    # small-M GEMM against BLAS in the first layer's qkv product (1e-6), and
                    # what the earlier layers' outputs differ by in the later layers'
                    for got_kv, ref_kv in zip(filled(cache, end), filled(ref_cache, end)):
                        torch.testing.assert_close(got_kv[0], ref_kv[0], rtol=1e-6, atol=1e-6)
                        torch.testing.assert_close(got_kv, ref_kv, rtol=1e-5, atol=1e-5)
                    ran += 1
                else:  # the reference's caches as this path's start
                    cache.k.copy_(ref_cache.k)
                    cache.v.copy_(ref_cache.v)
                ref_cache.advance(end - start)
                cache.advance(end - start)
    finally:
        torch.set_num_threads(old)
    assert ran > 0, f"{name} ran none of the steps"


def attention_reference(x, qkv_w, cos, sin, k_cache, v_cache, pos, key_ok, qpg):
    """float64 decode attention of one new token per row (norm weight 1): the output
    ``[B, h_q * D]`` and the key/value it caches at ``pos``."""
    b, h_kv, d, _ = k_cache.shape
    xd = x.double()
    h = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    qkv = (h @ qkv_w.double().T).view(b, h_kv, qpg + 2, d)
    c, s = cos.double()[:, None, None], sin.double()[:, None, None]

    def rope(t):
        t1, t2 = t.chunk(2, dim=-1)
        return t * c + torch.cat([-t2, t1], dim=-1) * s

    q, k, v = rope(qkv[:, :, :qpg]), rope(qkv[:, :, qpg:qpg + 1])[:, :, 0], qkv[:, :, qpg + 1]
    keys = k_cache.double()[..., :pos + 1].clone()  # [B, h_kv, D, pos + 1]
    vals = v_cache.double()[:, :, :pos + 1].clone()  # [B, h_kv, pos + 1, D]
    keys[..., pos], vals[:, :, pos] = k, v
    scores = torch.einsum("bgjd,bgdl->bgjl", q, keys) / d ** 0.5
    scores = scores.masked_fill(~key_ok[:, None, None, :pos + 1], float("-inf"))
    out = torch.einsum("bgjl,bgld->bgjd", torch.softmax(scores, -1), vals)
    return out.reshape(b, -1), k, v


# the blocked loops of csrc/engine/kv_attention.cpp: up to 8 queries per KV group, whole key
# tiles of 64 positions and the filled 1 to 4 vectors of the last one (the last vector partly
# filled or not), head dims that are multiples of 64 for the weighted values; 9 queries and a
# head dim of 16 or 24 take the plain loops; the new key is scored from the rotated key it
# caches (pos 0: no cached key; pos 64: the cached ones end on a tile's edge)
@pytest.mark.parametrize("qpg, d", [(1, 64), (3, 64), (8, 128), (9, 64), (3, 16), (2, 24)])
@pytest.mark.parametrize("pos", [0, 4, 16, 63, 64, 79, 112, 143])
def test_decode_attention_loops_match_float64(qpg, d, pos):
    gen = torch.Generator().manual_seed(qpg * 1000 + d + pos)
    b, h_kv, hidden, max_len = 3, 2, 40, 150
    x = torch.randn(b, hidden, generator=gen)
    qkv_w = torch.randn(h_kv * (qpg + 2) * d, hidden, generator=gen) / hidden ** 0.5
    k_cache = torch.randn(b, h_kv, d, max_len, generator=gen)
    v_cache = torch.randn(b, h_kv, max_len, d, generator=gen)
    key_ok = torch.rand(b, max_len, generator=gen) > 0.3
    key_ok[:, pos] = True  # the new token sees itself
    angle = torch.rand(b, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    want, want_k, want_v = attention_reference(x, qkv_w, cos, sin, k_cache, v_cache, pos,
                                               key_ok, qpg)
    eye = torch.eye(h_kv * qpg * d)  # o projection = identity: the output is the attention's
    k_tiles = tile_keys(k_cache)  # the cache's layout
    got = _kernels.decode_attention(x, torch.ones(hidden), EPS, qkv_w, eye, cos, sin, k_tiles,
                                    v_cache, pos, key_ok, qpg)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    written = untile_keys(k_tiles, pos, pos + 1)[..., 0]
    torch.testing.assert_close(written.double(), want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(untile_keys(k_tiles, 0, pos), k_cache[..., :pos])  # the rest untouched
    torch.testing.assert_close(v_cache[:, :, pos].double(), want_v, rtol=1e-5, atol=1e-5)


def test_decode_attention_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    w = weights(gen)
    cache = TiledKVCache(1, B, 8, G, D, torch.float32)
    x, cos = torch.randn(B, H), torch.randn(B, D)
    ok = torch.ones(B, 8, dtype=torch.bool)
    args = (x, w["input_norm"], EPS, w["qkv"], w["o_proj"], cos, cos, cache.k[0], cache.v[0])
    with pytest.raises(RuntimeError, match="pos 8 outside"):
        _kernels.decode_attention(*args, 8, ok, QPG)
    with pytest.raises(RuntimeError, match="qkv rows"):
        _kernels.decode_attention(*args, 3, ok, QPG + 1)
    with pytest.raises(RuntimeError, match="float32"):
        _kernels.decode_attention(x.double(), *args[1:], 3, ok, QPG)
    with pytest.raises(RuntimeError, match="qkv_bias shape"):
        _kernels.decode_attention(*args, 3, ok, QPG, torch.zeros(G * (QPG + 2) * D - 1))
    with pytest.raises(RuntimeError, match=r"k_cache \[B, h_kv, T, D, 64\] \(keys in tiles"):
        _kernels.decode_attention(*args[:7], cache.keys(0, 8)[0], cache.v[0], 3, ok, QPG)
    with pytest.raises(RuntimeError, match="2 qkv biases for 1 layers"):
        _kernels.decode_layers(x, [w[k] for k in LAYER_KEYS], EPS, cos, cos, cache.k, cache.v,
                               3, ok, QPG, [None, None])


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_layers_rejects_bad_weight_shapes(threads):
    """Weights the threads would read in place past their end are refused before any work,
    on the shared step (2 threads) as on the single call."""
    gen = torch.Generator().manual_seed(1)
    good = weights(gen)
    cache = TiledKVCache(1, B, 8, G, D, torch.float32)
    cache.k.zero_(), cache.v.zero_()
    x, cos = torch.randn(B, H), torch.randn(B, D)
    ok = torch.ones(B, 8, dtype=torch.bool)
    bad = {"o_proj": (good["o_proj"][:, :-1],
                      r"o_proj \[48, 95\] must be \[H, h_q\*D\] = \[48, 96\]"),
           "down_proj": (good["down_proj"][:-1],
                         r"down_proj \[47, 40\] must be \[H, F\] = \[48, 40\]"),
           "gate_up": (good["gate_up"][:-1], r"gate_up \[79, 48\] must be \[2F, H = 48\]"),
           "post_norm": (good["post_norm"][:-2], "norm weights of 48 values expected"),
           "qkv": (good["qkv"][:, :-1], r"qkv weight \[160, 47\] must be \[., H = 48\]")}
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, (tensor, message) in bad.items():
            w = good | {name: tensor}
            with pytest.raises(RuntimeError, match=message):
                _kernels.decode_layers(x, [w[k] for k in LAYER_KEYS], EPS, cos, cos, cache.k,
                                       cache.v, 3, ok, QPG, [])
            assert not cache.k.any() and not cache.v.any()  # nothing written
    finally:
        torch.set_num_threads(old)


CFG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)


def engines(cfg: LlamaConfig):
    """``(model, fused, python)``: a seeded model and engines with the kernels on and off."""
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=3, std=0.2))
    fused, python = (GenerationEngine(cfg, groups, fused_decode=f) for f in (True, False))
    for e in (fused, python):
        e.set_weights(model.params)
    return model, fused, python


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=20, temperature=0.0),
                                      SamplingParams(max_new_tokens=20, temperature=0.9,
                                                     top_k=8, seed=4)])
def test_engine_with_and_without_kernels_agree(sampling):
    model, fused, python = engines(CFG)
    assert fused.fused_decode and not python.fused_decode
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, CFG.vocab_size, (6, 9), generator=g)
    mask = (torch.arange(9) >= torch.tensor([0, 1, 2, 4, 6, 8])[:, None]).long()
    a, b = fused.generate(ids, mask, sampling), python.generate(ids, mask, sampling)
    assert_clear_picks(model, b, sampling)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask,
                                                                 b.attention_mask)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=2e-5)


QWEN2 = LlamaConfig(**(CFG.__dict__ | {"qkv_bias": True, "model_type": "qwen2"}))  # q/k/v biases


def test_qwen2_engine_decodes_on_kernels():
    """A model with q/k/v biases decodes on the kernel stage by default (its prompts prefill on
    the Python layers, as every model's) and generates the greedy tokens of the Python layers,
    log-probs to float rounding."""
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    assert GenerationEngine(QWEN2, groups).fused_decode  # the default picks the kernels
    model, fused, python = engines(QWEN2)
    assert isinstance(fused.paths.decode, KernelStage)
    assert isinstance(fused.paths.prefill, PythonLayers)
    assert isinstance(python.paths.decode, PythonLayers)
    assert all(b is not None for b in fused.paths.decode.qkv_biases)
    g = torch.Generator().manual_seed(8)  # prompts without a near-tie
    ids = torch.randint(1, QWEN2.vocab_size, (6, 9), generator=g)
    mask = (torch.arange(9) >= torch.tensor([0, 1, 2, 4, 6, 8])[:, None]).long()
    sp = SamplingParams(max_new_tokens=20, temperature=0.0)
    a, b = fused.generate(ids, mask, sp), python.generate(ids, mask, sp)
    assert_clear_picks(model, b, sp)
    assert torch.equal(a.input_ids, b.input_ids)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=2e-5)


def test_fused_decode_needs_float32():
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    cfg = LlamaConfig(**(CFG.__dict__ | {"dtype": torch.bfloat16}))
    assert not GenerationEngine(cfg, groups).fused_decode  # default: Python layers
    with pytest.raises(ValueError, match="fused_decode=True needs"):
        GenerationEngine(cfg, groups, fused_decode=True)


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (3, 7, 19), (8, 1536, 256), (16, 256, 768),
                                     (5, 9, 8), (32, 130, 33)])
def test_small_gemm_matches_float64(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 3, generator=g)[:, 3:]  # row stride != K: views are read in place
    w = torch.randn(n, k, generator=g)
    ref = x.double() @ w.double().t()
    got = _kernels.small_linear(x, w)
    blas = (x @ w.t()).double()
    # no worse than BLAS's own float32 rounding (plus one ulp-ish slack)
    bound = (blas - ref).abs().max().item() * 2 + 1e-6 * max(1.0, ref.abs().max().item())
    assert (got.double() - ref).abs().max().item() <= bound
    assert torch.equal(_kernels.small_linear(x, w), got)  # deterministic


@pytest.mark.parametrize("m, n, k", [(1, 2048, 384), (32, 1152, 384), (4, 13, 1000)])
def test_small_gemm_same_bits_on_any_thread_count(m, n, k):
    """The threads split the weight rows: every output is the same sum on 1 or 2 threads
    (sizes above and below the kernel's per-thread work floor)."""
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernels.small_linear(x, w)
        torch.set_num_threads(2)
        two = _kernels.small_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(two.double(), x.double() @ w.double().t(), rtol=0,
                               atol=1e-4 * max(1.0, k ** 0.5))
    # and the same bits for a row whatever rows come with it (whole 4-row blocks, the tail
    # rows, alone): a sequence's logits do not change when others leave the batch
    for rows in ([0], [m - 1], list(range(0, m, 3))):
        assert torch.equal(_kernels.small_linear(x[rows], w), two[rows])


def fma_chains(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with every output one float32 fused multiply-add chain over k = 0, 1, ... from
    +0: each step exact in float64 (a float32 product has 48 bits), then rounded to float32
    (for these seeds no double rounding moves a result)."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for kk in range(x.shape[1]):
        acc = (x[:, kk, None].double() * w[None, :, kk].double() + acc.double()).float()
    return acc


@pytest.mark.skipif(not _kernels.row_lanes_supported, reason="no AVX-512 (x86-64-v4)")
@pytest.mark.parametrize("m, n, k", [(20, 13, 100), (32, 9, 384), (1, 17, 33), (17, 4, 16),
                                     (16, 5, 48), (45, 3, 40)])
def test_small_gemm_row_lanes_are_fma_chains(m, n, k):
    """The row-lane form: each output is one FMA chain over k in order (the formula, computed
    step by step in Python), whatever block the output falls in (n not a multiple of 8 or
    16, k not a multiple of 16, rows in one vector or two, more than 32 rows in passes)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 3, generator=g)[:, 3:]  # row stride != K
    w = torch.randn(n, k, generator=g)
    want = fma_chains(x, w)
    assert torch.equal(_kernels.small_linear(x, w, row_lanes=True), want)
    assert not torch.equal(_kernels.small_linear(x, w), want)  # the k-lane form rounds otherwise


@pytest.mark.parametrize("m, n, k", [(32, 1152, 384), (29, 640, 1000), (1, 2048, 384),
                                     (8, 13, 40), (16, 100, 64), (17, 100, 64)])
def test_small_gemm_row_lanes_same_bits_on_any_thread_count_and_rows(m, n, k):
    """The row-lane form too gives every output the same bits on 1 or 2 threads and whatever
    rows come with it (one vector of rows or two), within float rounding of float64.  Where
    the CPU lacks AVX-512 it is the k-lane form."""
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernels.small_linear(x, w, row_lanes=True)
        torch.set_num_threads(2)
        two = _kernels.small_linear(x, w, row_lanes=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(two.double(), x.double() @ w.double().t(), rtol=0,
                               atol=1e-4 * max(1.0, k ** 0.5))
    for rows in ([0], [m - 1], list(range(0, m, 3)), list(range(m // 2))):
        if rows:
            assert torch.equal(_kernels.small_linear(x[rows], w, row_lanes=True), two[rows])
    if not _kernels.row_lanes_supported:
        assert torch.equal(two, _kernels.small_linear(x, w))


def test_decode_with_blas_products_agrees():
    """The small-M kernel and BLAS give the same generation up to float rounding."""
    model, fused, _ = engines(CFG)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, CFG.vocab_size, (6, 9), generator=g)
    sp = SamplingParams(max_new_tokens=16, temperature=0.0)
    try:
        _kernels.use_small_gemm(False)
        blas = fused.generate(ids, None, sp)
    finally:
        _kernels.use_small_gemm(True)
    small = fused.generate(ids, None, sp)
    assert_clear_picks(model, blas, sp)
    assert torch.equal(small.input_ids, blas.input_ids)
    torch.testing.assert_close(small.log_probs, blas.log_probs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("row_lanes", [False, True])
@pytest.mark.parametrize("stacked, qkv_bias", [(1, False), (2, True)])
@pytest.mark.parametrize("batch", [1, 2, 5, 32, 33])
def test_decode_layers_same_bits_on_any_thread_count(batch, stacked, qkv_bias, row_lanes):
    """``decode_layers`` on one thread (one call through every layer) and on 2 and 3 threads:
    up to 32 rows the threads share one step (the products split the weight rows, the norms
    and the attention split the batch rows; 3 threads leave a thread without rows at 2), above
    it each thread takes a block of rows.  Outputs and the caches written are the same bits
    either way, in either form of the small products, and within float rounding of the
    Python layers (those on one thread)."""
    gen = torch.Generator().manual_seed(batch * 10 + stacked)
    stage = stage_layers(gen, stacked, qkv_bias)
    path = dataclasses.replace(KernelStage.build(stage), row_lanes=row_lanes)
    pos, max_len = 6, 9
    x = torch.randn(batch, 1, H, generator=gen)
    _, mask, cos, sin = setup_cache(gen, pos, batch, max_len - pos)
    rope = (cos[:, pos:pos + 1], sin[:, pos:pos + 1])
    attn = mask.bool()[:, None, None, :pos + 1]
    start = TiledKVCache(LAYERS, batch, max_len, G, D, torch.float32)
    start.k.normal_(generator=gen)
    start.v.normal_(generator=gen)
    start.advance(pos)

    def run(threads: int, layer_path):
        cache = TiledKVCache(LAYERS, batch, max_len, G, D, torch.float32)
        cache.k.copy_(start.k)
        cache.v.copy_(start.v)
        cache.advance(pos)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                return layer_path.forward(x, cache, rope, attn), cache
        finally:
            torch.set_num_threads(old)

    # one thread with more rows than the small GEMM takes runs BLAS: compare 2 with 3 there
    first = 1 if batch <= _kernels.small_gemm_max_rows else 2
    one, one_cache = run(first, path)
    for threads in range(first + 1, 4):
        got, cache = run(threads, path)
        assert torch.equal(got, one), threads
        assert torch.equal(cache.k, one_cache.k) and torch.equal(cache.v, one_cache.v)
    if row_lanes and _kernels.row_lanes_supported:  # the flag reaches the products
        assert not torch.equal(run(first, dataclasses.replace(path, row_lanes=False))[0], one)
    want, ref_cache = run(1, REFERENCE.build(stage))
    torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
    for got_kv, ref_kv in zip(filled(one_cache, pos + 1), filled(ref_cache, pos + 1)):
        torch.testing.assert_close(got_kv, ref_kv, rtol=1e-5, atol=1e-5)
