"""The fused training blocks (C++ forward + hand-written backward, :mod:`engine.fused_layers`)
against the Python layers of :mod:`engine.layers` differentiated by autograd.

The whole-model tests compare ParallelLlama with the blocks on and off; the multi-rank engine
tests (every TP/PP layout against one process) and the transformers round trip run on the
blocks by default."""

from __future__ import annotations

import pytest
import torch

from engine import fused_layers, layers
from engine.generation import GenerationEngine
from engine.kv_cache import KVCache
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

EPS = 1e-5
NAMES = ("input_norm", "qkv", "o_proj", "post_norm", "gate_up", "down_proj")


def layer_weights(gen, hidden, groups, qpg, head_dim, inner):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    return {"input_norm": 1 + rnd(hidden) / 3, "post_norm": 1 + rnd(hidden) / 3,
            "qkv": rnd(groups * (qpg + 2) * head_dim, hidden),
            "o_proj": rnd(hidden, groups * qpg * head_dim), "gate_up": rnd(2 * inner, hidden),
            "down_proj": rnd(hidden, inner)}


def padded_mask(gen, batch, seq, side):
    """[B, S] masks with random lengths padded on ``side`` (row 0 always full)."""
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    pos = torch.arange(seq)
    keep = pos >= seq - lengths[:, None] if side == "left" else pos < lengths[:, None]
    return keep.long()


def value_and_grads(layer_fn, x, w, rope, mask, qpg, head_dim, dy):
    x = x.clone().requires_grad_()
    w = {k: v.clone().requires_grad_() for k, v in w.items()}
    y = layer_fn(x, w, rope, mask, qpg, head_dim, EPS, None)
    grads = torch.autograd.grad(y, [x, *w.values()], dy)
    return y.detach(), dict(zip(("x", *w), grads))


@pytest.mark.parametrize("qpg, padding, threads", [(1, "left", 1), (3, "left", 2),
                                                   (2, "right", 1), (2, None, 2)])
def test_layer_matches_autograd_of_python_layer(qpg, padding, threads):
    gen = torch.Generator().manual_seed(qpg * 7 + threads)
    batch, seq, hidden, groups, head_dim, inner = 4, 9, 32, 2, 8, 40
    w = layer_weights(gen, hidden, groups, qpg, head_dim, inner)
    x = torch.randn(batch, seq, hidden, generator=gen)
    dy = torch.randn(batch, seq, hidden, generator=gen)
    if padding is None:
        am, mask = None, None
        pos = torch.arange(seq).expand(batch, seq)
    else:
        am = padded_mask(gen, batch, seq, padding)
        mask = layers.causal_mask(am, batch, seq).contiguous()
        pos = layers.position_ids_from_mask(am)
    rope = layers.rope_tables(pos, head_dim, 500.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref_y, ref_g = value_and_grads(layers.decoder_layer, x, w, rope, mask, qpg, head_dim, dy)
        got_y, got_g = value_and_grads(fused_layers.decoder_layer, x, w, rope, mask, qpg,
                                       head_dim, dy)
        with torch.no_grad():  # the inference path calls the kernels directly
            got_nograd = fused_layers.decoder_layer(x, w, rope, mask, qpg, head_dim, EPS, None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got_y, ref_y, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_nograd, got_y)
    for name, ref in ref_g.items():
        scale = ref.abs().max().item()
        torch.testing.assert_close(got_g[name], ref, rtol=0, atol=2e-6 * max(scale, 1.0),
                                   msg=lambda m: f"grad of {name}: {m}")


def test_rms_norm_matches_formula_and_gradient():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 24, generator=gen, dtype=torch.float64)
    w = 1 + torch.randn(24, generator=gen, dtype=torch.float64) / 4
    dy = torch.randn(5, 7, 24, generator=gen, dtype=torch.float64)
    # reference in float64 by the formula, gradient by autograd of it
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = wr * xr / torch.sqrt(xr.pow(2).mean(-1, keepdim=True) + EPS)
    ref_dx, ref_dw = torch.autograd.grad(ref, [xr, wr], dy)
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    got = fused_layers.rms_norm(xf, wf, EPS)
    dx, dw = torch.autograd.grad(got, [xf, wf], dy.float())
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=1e-4, atol=1e-5)


CFG = LlamaConfig(vocab_size=40, hidden_size=48, intermediate_size=72, num_layers=3,
                  num_heads=6, num_kv_heads=2, max_position_embeddings=32,
                  tie_word_embeddings=False)


def single_groups():
    return build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


@pytest.mark.parametrize("head", ["lm", "value"])
def test_model_outputs_and_param_grads_match_python_layers(head):
    full = init_full_state_dict(CFG, seed=5, head=head, std=0.2)
    models = [ParallelLlama(CFG, single_groups(), head=head, fused_layers=f) for f in (True, False)]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (3, 11), generator=gen)
    am = padded_mask(gen, 3, 11, "left")
    results = []
    for m in models:
        load_full_state_dict(m, full)
        out = m.head_outputs(m.stage_forward(ids, am), ids, temperature=1.0)
        key = "log_probs" if head == "lm" else "values"
        (out[key] * torch.linspace(0.5, 1.5, out[key].shape[-1])).sum().backward()
        results.append((out[key].detach(), {n: p.grad for n, p in m.params.items()}))
    (got, got_g), (ref, ref_g) = results
    assert models[0].fused_layers and not models[1].fused_layers
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for name, ref_grad in ref_g.items():  # float rounding relative to the largest entry
        tol = 5e-6 * max(ref_grad.abs().max().item(), 1.0)
        torch.testing.assert_close(got_g[name], ref_grad, rtol=0, atol=tol,
                                   msg=lambda m: f"{name}: {m}")


def test_prefill_fills_the_cache_like_the_python_hook():
    gen = torch.Generator().manual_seed(9)
    batch, seq, hidden, groups, qpg, head_dim, inner = 3, 6, 32, 2, 2, 8, 16
    w = layer_weights(gen, hidden, groups, qpg, head_dim, inner)
    x = torch.randn(batch, seq, hidden, generator=gen)
    am = padded_mask(gen, batch, seq, "left")
    mask = layers.causal_mask(am, batch, seq).contiguous()
    rope = layers.rope_tables(layers.position_ids_from_mask(am), head_dim, 500.0)
    caches = [KVCache(1, batch, seq + 2, groups, head_dim, torch.float32) for _ in range(2)]
    with torch.no_grad():
        ref = layers.decoder_layer(x, w, rope, mask, qpg, head_dim, EPS, None,
                                   kv_hook=caches[0].hook(0))
        got = fused_layers.decoder_layer(x, w, rope, mask, qpg, head_dim, EPS, None,
                                         kv_sink=caches[1].sink(0))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].k[..., :seq], caches[0].k[..., :seq], rtol=0, atol=1e-6)
    torch.testing.assert_close(caches[1].v[:, :, :, :seq], caches[0].v[:, :, :, :seq], rtol=0,
                               atol=1e-6)


def test_bad_inputs_raise():
    gen = torch.Generator().manual_seed(0)
    w = layer_weights(gen, 32, 2, 2, 8, 16)
    x = torch.randn(2, 5, 32, generator=gen)
    rope = layers.rope_tables(torch.arange(5).expand(2, 5), 8, 500.0)
    with pytest.raises(ValueError, match="kv_sink is for inference"):
        fused_layers.decoder_layer(x.requires_grad_(), w, rope, None, 2, 8, EPS, None,
                                   kv_sink=lambda k, v: None)
    x = x.detach()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="does not fit input"):  # wrong queries per group
            fused_layers.decoder_layer(x, w, rope, None, 3, 8, EPS, None)
        with pytest.raises(RuntimeError, match="mask must be a contiguous bool"):
            fused_layers.decoder_layer(x, w, rope, torch.ones(2, 1, 5, 4, dtype=torch.bool),
                                       2, 8, EPS, None)
        with pytest.raises(RuntimeError, match="float32"):
            fused_layers.decoder_layer(x.double(), w, rope, None, 2, 8, EPS, None)
    auto, forced = ParallelLlama(CFG, single_groups()), ParallelLlama(CFG, single_groups(),
                                                                       fused_layers=True)
    long = fused_layers.AUTO_MAX_SEQ + 1  # automatic choice: Python layers for long sequences
    assert auto.uses_fused_layers(long - 1) and not auto.uses_fused_layers(long)
    assert forced.uses_fused_layers(long)
    bf16 = LlamaConfig(**(CFG.__dict__ | {"dtype": torch.bfloat16}))
    assert not ParallelLlama(bf16, single_groups()).fused_layers
    with pytest.raises(ValueError, match="fused_layers=True needs"):
        ParallelLlama(bf16, single_groups(), fused_layers=True)


def test_generation_prefill_uses_blocks_only_for_2d_weights():
    """A stack of several row-parallel shards (tp_g < tp) keeps the Python prefill; 2-D weights
    and a stack of one shard use the blocks; wide prompts always the Python layers."""
    model = ParallelLlama(CFG, single_groups())
    load_full_state_dict(model, init_full_state_dict(CFG, seed=2, std=0.2))
    eng = GenerationEngine(CFG, single_groups())
    weights = dict(model.params)
    eng.set_weights(weights)
    long = fused_layers.AUTO_MAX_SEQ + 1
    assert [eng.paths.for_prompt(n).name for n in (1, 2, long - 1, long)] == [
        "kernel_stage", "fused_blocks", "fused_blocks", "python"]
    o = model.params["layers.0.o_proj"]
    eng.set_weights(weights | {"layers.0.o_proj": o.unsqueeze(0)})
    assert eng.paths.prefill.name == "fused_blocks"
    assert eng.paths.prefill.layers[0]["o_proj"].data_ptr() == o.data_ptr()  # a view, no copy
    eng.set_weights(weights | {"layers.0.o_proj": o.unflatten(1, (2, -1)).transpose(0, 1)
                               .contiguous()})
    assert eng.paths.prefill.name == "python" and eng.paths.decode.name == "kernel_stage"


def test_fully_masked_row_rope_broadcast_and_no_double_backward():
    """A query row with no allowed key gives zeros (no NaN); [1, S, D] RoPE tables broadcast
    like the Python layer's; the hand-written backward refuses a second derivative."""
    gen = torch.Generator().manual_seed(11)
    batch, seq, hidden, groups, qpg, head_dim, inner = 2, 5, 32, 2, 2, 8, 16
    w = layer_weights(gen, hidden, groups, qpg, head_dim, inner)
    x = torch.randn(batch, seq, hidden, generator=gen, requires_grad=True)
    rope = layers.rope_tables(torch.arange(seq)[None], head_dim, 500.0)  # [1, S, D]
    mask = layers.causal_mask(None, batch, seq).contiguous().clone()
    mask[1, 0, 3] = False  # row 3 of sequence 1 may attend to nothing
    y = fused_layers.decoder_layer(x, w, rope, mask, qpg, head_dim, EPS, None)
    (gx,) = torch.autograd.grad(y.sum(), [x])
    assert torch.isfinite(y).all() and torch.isfinite(gx).all()
    with torch.no_grad():
        a = layers.rms_norm(x, w["input_norm"], EPS)
        attn = fused_layers._kernels.attention_forward(
            a.contiguous(), w["qkv"], w["o_proj"], rope[0].expand(batch, -1, -1).contiguous(),
            rope[1].expand(batch, -1, -1).contiguous(), mask, qpg)
    assert torch.equal(attn[0][1, 3], torch.zeros(hidden))  # the row's attention is 0
    ok = layers.causal_mask(None, batch, seq).contiguous()
    torch.testing.assert_close(  # broadcast tables: same as the Python layer
        fused_layers.decoder_layer(x, w, rope, ok, qpg, head_dim, EPS, None),
        layers.decoder_layer(x, w, rope, ok, qpg, head_dim, EPS, None), rtol=1e-5, atol=1e-5)
    y = fused_layers.decoder_layer(x, w, rope, ok, qpg, head_dim, EPS, None)
    (g,) = torch.autograd.grad(y.pow(2).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
