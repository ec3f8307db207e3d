"""The C++ decode-step kernels (``engine._kernels``) against the Python layers they replace.

References are :mod:`engine.layers` (attention_block / swiglu_block with a KV-cache hook),
which the training model also runs; the engine-level tests compare whole generations with the
kernels on and off."""

from __future__ import annotations

import pytest
import torch

from engine import _kernels
from engine.generation import GenerationEngine
from engine.kv_cache import KVCache
from engine.layers import attention_block, causal_mask, position_ids_from_mask, rms_norm, \
    rope_tables, swiglu_block
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

B, G, QPG, D, H, F = 5, 2, 3, 16, 48, 40
EPS = 1e-5


def weights(gen: torch.Generator, stacked: int = 1) -> dict[str, torch.Tensor]:
    """One layer's shards; ``stacked`` > 1 gives o_proj/down_proj the [m, H, in/m] form."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    w = {"input_norm": 1 + rnd(H), "post_norm": 1 + rnd(H), "qkv": rnd(G * (QPG + 2) * D, H),
         "o_proj": rnd(H, G * QPG * D), "gate_up": rnd(2 * F, H), "down_proj": rnd(H, F)}
    if stacked > 1:  # the stacked form holds the same logical matrix, split along inputs
        for name in ("o_proj", "down_proj"):
            w[name] = w[name].unflatten(1, (stacked, -1)).transpose(0, 1).contiguous()
    return w


def logical(w: torch.Tensor) -> torch.Tensor:
    return w if w.dim() < 3 else w.transpose(0, 1).flatten(1)


def setup_cache(gen: torch.Generator, prompt_len: int):
    """Left-padded prompt masks, the mask with 4 new tokens, and RoPE tables for all of it."""
    lengths = torch.randint(1, prompt_len + 1, (B,), generator=gen)
    mask = (torch.arange(prompt_len) >= prompt_len - lengths[:, None]).long()
    full_mask = torch.cat([mask, torch.ones(B, 4, dtype=torch.long)], 1)
    cos, sin = rope_tables(position_ids_from_mask(full_mask), D, 1000.0)
    return mask, full_mask, cos, sin


@pytest.mark.parametrize("stacked", [1, 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_halves_match_python_layers(stacked, threads):
    gen = torch.Generator().manual_seed(stacked * 10 + threads)
    w = weights(gen, stacked)
    w_ref = {k: logical(v) for k, v in w.items()}
    plen = 7
    mask, full_mask, cos, sin = setup_cache(gen, plen)
    prompt = torch.randn(B, plen, H, generator=gen)
    caches = [KVCache(1, B, plen + 3, G, D, torch.float32) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:  # prefill through the Python layers fills both caches alike
            attention_block(prompt, w_ref, (cos[:, :plen], sin[:, :plen]),
                            causal_mask(mask, B, plen), QPG, D, None, cache.hook(0))
            cache.advance(plen)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for step in range(3):  # three decode steps, keys growing
                pos = plen + step
                x = torch.randn(B, H, generator=gen)
                keys_ok = full_mask.bool()
                ref = attention_block(
                    rms_norm(x, w["input_norm"], EPS).unsqueeze(1), w_ref,
                    (cos[:, pos:pos + 1], sin[:, pos:pos + 1]), keys_ok[:, None, None, :pos + 1],
                    QPG, D, None, caches[0].hook(0))[:, 0]
                got = _kernels.decode_attention(
                    x, w["input_norm"], EPS, w["qkv"], w["o_proj"], cos[:, pos], sin[:, pos],
                    caches[1].k[0], caches[1].v[0], pos, keys_ok, QPG)
                for c in caches:
                    c.advance(1)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
                # the kernel wrote the keys/values the Python hook wrote (up to the rounding of
                # the qkv product: the kernels' small-M GEMM against BLAS)
                filled = {"k": (..., slice(0, pos + 1)),  # [1, B, h_kv, D, L]
                          "v": (slice(None), slice(None), slice(None), slice(0, pos + 1))}
                for kv, index in filled.items():
                    got_kv, ref_kv = getattr(caches[1], kv)[index], getattr(caches[0], kv)[index]
                    torch.testing.assert_close(got_kv, ref_kv, rtol=1e-6, atol=1e-6)
                mlp_ref = swiglu_block(rms_norm(x, w["post_norm"], EPS), w_ref, None)
                mlp = _kernels.decode_mlp(x, w["post_norm"], EPS, w["gate_up"], w["down_proj"])
                torch.testing.assert_close(mlp, mlp_ref, rtol=1e-5, atol=1e-5)
        finally:
            torch.set_num_threads(old)


def test_decode_attention_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    w = weights(gen)
    cache = KVCache(1, B, 8, G, D, torch.float32)
    x, cos = torch.randn(B, H), torch.randn(B, D)
    ok = torch.ones(B, 8, dtype=torch.bool)
    args = (x, w["input_norm"], EPS, w["qkv"], w["o_proj"], cos, cos, cache.k[0], cache.v[0])
    with pytest.raises(RuntimeError, match="pos 8 outside"):
        _kernels.decode_attention(*args, 8, ok, QPG)
    with pytest.raises(RuntimeError, match="qkv rows"):
        _kernels.decode_attention(*args, 3, ok, QPG + 1)
    with pytest.raises(RuntimeError, match="float32"):
        _kernels.decode_attention(x.double(), *args[1:], 3, ok, QPG)


CFG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=64)


def engines(cfg: LlamaConfig):
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=3, std=0.2))
    fused, python = (GenerationEngine(cfg, groups, fused_decode=f) for f in (True, False))
    for e in (fused, python):
        e.set_weights(model.params)
    return fused, python


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=20),
                                      SamplingParams(max_new_tokens=20, temperature=0.9,
                                                     top_k=8, seed=4)])
def test_engine_with_and_without_kernels_agree(sampling):
    fused, python = engines(CFG)
    assert fused.fused_decode and not python.fused_decode
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, CFG.vocab_size, (6, 9), generator=g)
    mask = (torch.arange(9) >= torch.tensor([0, 1, 2, 4, 6, 8])[:, None]).long()
    a, b = fused.generate(ids, mask, sampling), python.generate(ids, mask, sampling)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask,
                                                                 b.attention_mask)
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


def test_decode_with_blas_products_agrees():
    """The small-M kernel and BLAS give the same generation up to float rounding."""
    fused, _ = engines(CFG)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, CFG.vocab_size, (6, 9), generator=g)
    sp = SamplingParams(max_new_tokens=16)
    try:
        _kernels.use_small_gemm(False)
        blas = fused.generate(ids, None, sp)
    finally:
        _kernels.use_small_gemm(True)
    small = fused.generate(ids, None, sp)
    assert torch.equal(small.input_ids, blas.input_ids)
    torch.testing.assert_close(small.log_probs, blas.log_probs, rtol=0, atol=2e-5)
