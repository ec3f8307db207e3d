"""engine.batched_attention (grouped-query attention by batched oneDNN products) against a
float64 reference written out head by head: causal and padding masks, one and several query
heads per KV head, the gradients of q, k and v; where engine.attention.attention uses it and where
it keeps scaled_dot_product_attention, and that both give the same values."""

from __future__ import annotations

import math

import pytest
import torch

from engine import attention as attention_mod, batched_attention, onednn

pytestmark = pytest.mark.skipif(not onednn.batched(),
                                reason="needs oneDNN and the engine._kernels extension")


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The products of these small cases are under engine.onednn.MIN_MACS: run them anyway
    (test_small_problems_keep_flash checks the bound itself)."""
    monkeypatch.setattr(onednn, "MIN_MACS", 0)


def reference(q, k, v, mask):
    """float64 loop over query heads: ``softmax(q_h k_g^T / sqrt(D), masked) v_g``, g = h // qpg."""
    b, s, h_q, d = q.shape
    qpg = h_q // k.shape[2]
    allowed = (torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s) if mask is None
               else mask[:, 0])
    heads = []
    for h in range(h_q):
        scores = q[:, :, h].double() @ k[:, :, h // qpg].double().transpose(1, 2) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        heads.append(probs @ v[:, :, h // qpg].double())
    return torch.stack(heads, dim=2).flatten(2)  # [B, S, h_q * D]


def operands(b, s, h_q, h_kv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).requires_grad_() for h in (h_q, h_kv, h_kv)]


def padding_rows(b, s, seed):
    """An RL micro-batch's ``[B, S]`` 0/1 mask: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, s // 3, (b,), generator=g)
    end = torch.randint(2 * s // 3, s + 1, (b,), generator=g)
    pos = torch.arange(s)
    return ((pos >= start[:, None]) & (pos < end[:, None])).long()


def padding_mask(b, s, seed):
    """:func:`padding_rows` as the layers' boolean ``[B, 1, S, S]`` causal mask."""
    return attention_mod.causal_mask(padding_rows(b, s, seed), b, s)


@pytest.mark.parametrize("h_q, h_kv", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding"])
def test_matches_float64_reference_and_its_gradients(h_q, h_kv, masked):
    b, s, d = 3, 21, 16
    q, k, v = operands(b, s, h_q, h_kv, d, seed=h_q * 10 + h_kv)
    mask = padding_mask(b, s, seed=h_q) if masked else None
    assert batched_attention.applies(q, k, mask)
    out = batched_attention.attention(q, k, v, mask)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference(q64, k64, v64, mask)
    want.backward(grad.double())
    for got, ref in ((out, want), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert float((got.double() - ref).abs().max()) <= 2e-5 * max(1.0, float(ref.abs().max()))


def test_layers_choose_it_for_short_sequences_and_agree_with_flash(monkeypatch):
    b, s, d = 2, 40, 32
    q, k, v = operands(b, s, 4, 2, d, seed=7)
    mask = padding_mask(b, s, seed=3)
    chosen = []
    real = batched_attention.attention
    monkeypatch.setattr(batched_attention, "attention",
                        lambda *a: chosen.append(True) or real(*a))
    budget = batched_attention.MAX_SCORE_BYTES
    for m in (None, mask):
        monkeypatch.setattr(batched_attention, "MAX_SCORE_BYTES", budget)
        short = attention_mod.attention(q, k, v, m)
        assert chosen.pop()
        # above the score budget: scaled_dot_product_attention (flash) does the same work
        monkeypatch.setattr(batched_attention, "MAX_SCORE_BYTES", b * 4 * s * s * 4 - 1)
        long = attention_mod.attention(q, k, v, m)
        assert not chosen
        torch.testing.assert_close(short, long, atol=2e-6, rtol=0)


def test_without_autograd_long_batches_go_in_chunks(monkeypatch):
    """Without autograd only one sequence's scores must fit: the batch is taken in chunks
    (here 2 + 2 + 1 sequences), with the values of flash attention; with autograd the whole
    batch must fit, else flash runs."""
    b, s, h_q, d = 5, 24, 4, 16
    q, k, v = operands(b, s, h_q, 2, d, seed=5)
    mask = padding_mask(b, s, seed=5)
    per_seq = h_q * s * s * 4
    monkeypatch.setattr(batched_attention, "MAX_SCORE_BYTES", 2 * per_seq)
    assert batched_attention._batch_chunks(b, s, h_q, s) == [(0, 2), (2, 4), (4, 5)]
    calls = []
    real = batched_attention._GroupedAttention.apply
    monkeypatch.setattr(batched_attention._GroupedAttention, "apply",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    assert not batched_attention.applies(q, k, mask)  # autograd: 5 sequences do not fit
    with torch.no_grad():
        for m in (None, mask):
            assert batched_attention.applies(q, k, m)
            got = attention_mod.attention(q, k, v, m)
            assert calls == [2 * 2, 2 * 2, 1 * 2]  # B * h_kv per chunk
            calls.clear()
            torch.testing.assert_close(got.double(), reference(q, k, v, m), atol=1e-5, rtol=0)
        monkeypatch.setattr(batched_attention, "MAX_SCORE_BYTES", per_seq - 1)
        assert not batched_attention.applies(q, k, mask)  # not even one sequence: flash


def test_packed_sequences_each_attend_to_themselves():
    lengths = (5, 1, 12)
    q, k, v = operands(1, sum(lengths), 4, 2, 8, seed=11)
    packed = attention_mod.PackedSeqs((0, 5, 6, 18))
    out = attention_mod.attention(q, k, v, packed)
    starts = packed.cu_seqlens
    want = torch.cat([reference(q[:, a:e], k[:, a:e], v[:, a:e], None)
                      for a, e in zip(starts, starts[1:])], dim=1)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_where_it_does_not_apply():
    q, k, _ = operands(2, 8, 4, 2, 8, seed=0)
    assert batched_attention.applies(q, k, None)
    assert not batched_attention.applies(q.bfloat16(), k.bfloat16(), None)
    assert not batched_attention.applies(q, k, torch.zeros(2, 1, 8, 8))  # additive mask
    assert not batched_attention.applies(q, k, torch.ones(2, 4, 8, 8, dtype=torch.bool))
    previous = onednn.set_enabled(False)
    try:
        assert not batched_attention.applies(q, k, None)
    finally:
        onednn.set_enabled(previous)


def test_small_problems_keep_flash(monkeypatch):
    """Below engine.onednn.MIN_MACS multiply-adds of q k^T the layers keep
    scaled_dot_product_attention; from it on, the batched products."""
    q, k, _ = operands(2, 16, 4, 2, 8, seed=2)
    macs = 2 * 4 * 16 * 16 * 8
    monkeypatch.setattr(onednn, "MIN_MACS", macs + 1)
    assert not batched_attention.applies(q, k, None)
    monkeypatch.setattr(onednn, "MIN_MACS", macs)
    assert batched_attention.applies(q, k, None)
