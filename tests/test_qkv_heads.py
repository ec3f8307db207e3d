"""engine.batched_attention.attention_from_qkv (csrc/engine/qkv_heads.cpp: bias, RoPE, query
scale and the grouped layout of the fused q/k/v projection in one C++ pass each way) against the
Python path of engine.layers.attention_block it replaces: the same attention inputs bit for
bit, the same output, and the gradients of qkv and its bias against a float64 reference;
where the layers take it and where they keep the Python path."""

from __future__ import annotations

import math

import pytest
import torch

from engine import batched_attention, onednn
from engine.attention import PackedSeqs, causal_mask
from engine.layers import LayerSpec, attention_block
from engine.rope import apply_rope, position_ids_from_mask, rope_tables
from tests.test_batched_attention import padding_rows

pytestmark = pytest.mark.skipif(batched_attention._kernels is None or not onednn.batched(),
                                reason="needs oneDNN and the engine._kernels extension")


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """These small cases are under engine.onednn.MIN_MACS: run them on oneDNN anyway."""
    monkeypatch.setattr(onednn, "MIN_MACS", 0)


def case(b, s, h_kv, qpg, d, bias, seed):
    g = torch.Generator().manual_seed(seed)
    width = h_kv * (qpg + 2) * d
    qkv = torch.randn(b, s, width, generator=g).requires_grad_()
    w = {"qkv_bias": torch.randn(width, generator=g).requires_grad_()} if bias else {}
    mask2d = padding_rows(b, s, seed)
    cos, sin = rope_tables(position_ids_from_mask(mask2d), d, 10000.0)
    return qkv, w, (cos, sin), causal_mask(mask2d, b, s)


def python_heads(qkv, bias, cos, sin, qpg, d, dtype=torch.float32):
    """The Python path's attention inputs in the grouped layout (``dtype`` throughout)."""
    b, s, width = qkv.shape
    h_kv = width // ((qpg + 2) * d)
    x = qkv.to(dtype) + (0 if bias is None else bias.to(dtype))
    x = x.unflatten(-1, (h_kv, qpg + 2, d))
    c, sn = cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)
    q = apply_rope(x[..., :qpg, :].flatten(2, 3), c.squeeze(2), sn.squeeze(2))
    k = apply_rope(x[..., qpg, :], c.squeeze(2), sn.squeeze(2))
    v = x[..., qpg + 1, :]
    qg = q.view(b, s, h_kv, qpg, d).permute(0, 2, 3, 1, 4).reshape(b * h_kv, qpg * s, d)
    kg, vg = (t.permute(0, 2, 1, 3).reshape(b * h_kv, s, d) for t in (k, v))
    return qg * (1.0 / math.sqrt(d)), kg, vg


@pytest.mark.parametrize("h_kv, qpg, d, bias, threads", [(2, 3, 64, True, 2), (1, 1, 16, False, 1),
                                                          (3, 2, 8, True, 1)])
def test_heads_bit_equal_and_gradients_match_float64(h_kv, qpg, d, bias, threads):
    b, s = 3, 19
    qkv, w, (cos, sin), _ = case(b, s, h_kv, qpg, d, bias, seed=h_kv * 7 + qpg + d)
    qb = w.get("qkv_bias")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = batched_attention._QKVHeads.apply(qkv, qb, cos, sin, qpg, 1.0 / math.sqrt(d))
        g = torch.Generator().manual_seed(5)
        grads = [torch.randn(t.shape, generator=g) for t in got]
        dqkv, *dbias = torch.autograd.grad(got, [qkv] + ([qb] if bias else []), grads)
    finally:
        torch.set_num_threads(before)
    with torch.no_grad():  # float32 Python path: the same roundings, so the same bits
        want = python_heads(qkv, qb, cos, sin, qpg, d)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    # gradients against autograd of the formula in float64
    q64 = qkv.detach().double().requires_grad_()
    b64 = qb.detach().double().requires_grad_() if bias else None
    ref = python_heads(q64, b64, cos, sin, qpg, d, torch.float64)
    want_grads = torch.autograd.grad(ref, [q64] + ([b64] if bias else []),
                                     [t.double() for t in grads])
    for a, e in zip([dqkv, *dbias], want_grads):
        torch.testing.assert_close(a.double(), e, rtol=0, atol=1e-5 * max(1.0, e.abs().max()))


def graph_names(t):
    """Names of every node of ``t``'s autograd graph."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def layer_weights(h, h_kv, qpg, d, bias, seed):
    g = torch.Generator().manual_seed(seed)
    width = h_kv * (qpg + 2) * d
    w = {"qkv": torch.randn(width, h, generator=g) / math.sqrt(h),
         "o_proj": torch.randn(h, h_kv * qpg * d, generator=g) / math.sqrt(h_kv * qpg * d)}
    if bias:
        w["qkv_bias"] = torch.randn(width, generator=g)
    return {k: t.requires_grad_() for k, t in w.items()}


def run_block(x, w, rope, mask, qpg, d):
    out = attention_block(x, w, rope, mask, LayerSpec(qpg, d, 1e-6))
    g = torch.Generator().manual_seed(11)
    dy = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, [x, *w.values()], dy)
    return out, grads


@pytest.mark.parametrize("masked", [True, False], ids=["rl-mask", "causal"])
def test_layers_take_it_with_the_python_paths_values(masked, monkeypatch):
    b, s, h, h_kv, qpg, d = 2, 23, 32, 2, 3, 16
    _, _, rope, mask = case(b, s, h_kv, qpg, d, False, seed=3)
    mask = mask if masked else None
    if not masked:  # plain causal: positions 0..S-1
        rope = rope_tables(torch.arange(s).expand(b, s), d, 10000.0)
    w = layer_weights(h, h_kv, qpg, d, True, seed=4)
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(6)).requires_grad_()
    fused, fused_grads = run_block(x, w, rope, mask, qpg, d)
    assert "_QKVHeadsBackward" in graph_names(fused)
    monkeypatch.setattr(batched_attention, "qkv_applies", lambda *a: False)
    plain, plain_grads = run_block(x, w, rope, mask, qpg, d)
    assert "_QKVHeadsBackward" not in graph_names(plain)
    assert torch.equal(fused, plain)  # the same attention inputs, the same products
    for a, e in zip(fused_grads, plain_grads):  # float32 orders of summation
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_where_it_does_not_apply():
    b, s, h_kv, qpg, d = 2, 9, 1, 2, 8
    qkv, w, (cos, sin), mask = case(b, s, h_kv, qpg, d, True, seed=8)
    bias = w["qkv_bias"]
    assert batched_attention.qkv_applies(qkv, bias, cos, sin, mask, qpg, d)
    # tables broadcast over the batch, a width that is no whole number of groups, an odd head
    # dim, another dtype, a float mask
    assert not batched_attention.qkv_applies(qkv, bias, cos[:1], sin[:1], mask, qpg, d)
    assert not batched_attention.qkv_applies(qkv[..., :-d], bias, cos, sin, mask, qpg, d)
    assert not batched_attention.qkv_applies(qkv, bias, cos[..., :7], sin[..., :7], mask, qpg, 7)
    assert not batched_attention.qkv_applies(qkv.double(), bias, cos, sin, mask, qpg, d)
    assert not batched_attention.qkv_applies(qkv, bias, cos, sin, mask.float(), qpg, d)
    # the layers keep the Python path for q/k norms (Qwen3), a KV cache and packed sequences
    h = 16
    wq = layer_weights(h, h_kv, qpg, d, False, seed=9)
    wq.update(q_norm=torch.ones(d), k_norm=torch.ones(d))
    x = torch.randn(b, s, h, requires_grad=True)
    out = attention_block(x, wq, (cos, sin), mask, LayerSpec(qpg, d, 1e-6))
    assert "_QKVHeadsBackward" not in graph_names(out)
    w = layer_weights(h, h_kv, qpg, d, False, seed=10)
    out = attention_block(x, w, (cos, sin), mask, LayerSpec(qpg, d, 1e-6),
                                 kv_hook=lambda k, v: (k, v))
    assert "_QKVHeadsBackward" not in graph_names(out)
    packed = PackedSeqs((0, 4, 9))
    rope = rope_tables(packed.position_ids(), d, 10000.0)
    out = attention_block(x[:1], w, rope, packed, LayerSpec(qpg, d, 1e-6))
    assert "_QKVHeadsBackward" not in graph_names(out)
    assert "_QKVHeadsBackward" in graph_names(
        attention_block(x, w, (cos, sin), mask, LayerSpec(qpg, d, 1e-6)))


def test_bad_arguments_raise():
    from engine import _kernels
    qkv = torch.randn(2, 5, 4 * 8)
    cos = sin = torch.ones(2, 5, 8)
    with pytest.raises(RuntimeError, match="divide qkv's width 32"):
        _kernels.qkv_heads_forward(qkv, None, cos, sin, 3, 1.0)  # 5 heads of 8 per group
    with pytest.raises(RuntimeError, match="cos/sin must be"):
        _kernels.qkv_heads_forward(qkv, None, torch.ones(1, 5, 8), torch.ones(1, 5, 8), 2, 1.0)
    with pytest.raises(RuntimeError, match="bias"):
        _kernels.qkv_heads_forward(qkv, torch.ones(7), cos, sin, 2, 1.0)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        _kernels.qkv_heads_forward(qkv.double(), None, cos, sin, 2, 1.0)
    with pytest.raises(RuntimeError, match="grad_q"):
        _kernels.qkv_heads_backward(torch.ones(2, 9, 8), torch.ones(2, 5, 8),
                                    torch.ones(2, 5, 8), cos, sin, 2, 1.0)


def test_chunked_without_autograd(monkeypatch):
    """A long batch without autograd: attention_from_qkv in chunks of sequences, the same
    values as the Python path on flash attention."""
    b, s, h, h_kv, qpg, d = 5, 17, 32, 2, 3, 16
    _, _, rope, mask = case(b, s, h_kv, qpg, d, False, seed=12)
    w = layer_weights(h, h_kv, qpg, d, True, seed=13)
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(14))
    monkeypatch.setattr(batched_attention, "MAX_SCORE_BYTES", 2 * h_kv * qpg * s * s * 4)
    calls = []
    real = batched_attention._QKVHeads.apply
    monkeypatch.setattr(batched_attention._QKVHeads, "apply",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad():
        got = attention_block(x, w, rope, mask, LayerSpec(qpg, d, 1e-6))
        assert calls == [2, 2, 1]
        monkeypatch.setattr(batched_attention, "MAX_SCORE_BYTES", 0)  # flash, Python path
        want = attention_block(x, w, rope, mask, LayerSpec(qpg, d, 1e-6))
    assert calls == [2, 2, 1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
