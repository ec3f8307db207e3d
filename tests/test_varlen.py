"""engine/varlen.py: the causal call's arguments for each varlen_attn signature torch has had,
and the packed attention through it (a stand-in varlen_attn here, one SDPA per sequence, that
checks what it is given) against one attention per sequence; on CUDA torch's own kernel
against the padded batch."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from engine import varlen
from engine.attention import PackedSeqs, _packed_attention
from engine.varlen import call_arguments, causal_attention

SIGNATURES = {  # torch 2.10, 2.11, 2.12 and later
    "is_causal": ("is_causal", "return_aux"),
    "window": ("return_aux", "scale", "window_size"),
    "window_gqa": ("return_aux", "scale", "window_size", "enable_gqa", "seqused_k"),
}


def test_call_arguments_for_each_signature():
    assert call_arguments(dict.fromkeys(SIGNATURES["is_causal"])) == ({"is_causal": True}, True)
    assert call_arguments(dict.fromkeys(SIGNATURES["window"])) == (
        {"window_size": (-1, 0)}, True)
    assert call_arguments(dict.fromkeys(SIGNATURES["window_gqa"])) == (
        {"window_size": (-1, 0), "enable_gqa": True}, False)
    assert call_arguments({"return_aux": None}) is None  # no way to ask for causal


def stand_in(names: tuple[str, ...]):
    """A varlen_attn with keyword-only parameters ``names``: one causal SDPA per sequence of
    ``q [T, h_q, D]``, keys and values with as many heads unless it takes enable_gqa."""
    calls = []

    def attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        assert set(kwargs) <= set(names) and cu_q.dtype == torch.int32
        assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        gqa = kwargs.get("enable_gqa", False)
        assert gqa or k.shape[1] == q.shape[1]
        assert kwargs.get("is_causal") or kwargs.get("window_size") == (-1, 0)
        calls.append((kwargs, cu_q))
        out = [F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
            is_causal=True, enable_gqa=gqa).transpose(0, 1)
            for a, b in zip(cu_q.tolist(), cu_q[1:].tolist()) if b > a]
        return torch.cat(out)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
              for n in ("q", "k", "v", "cu_q", "cu_k", "max_q", "max_k")]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names]
    attn.__signature__ = inspect.Signature(params)
    return attn, calls


@pytest.mark.parametrize("signature", sorted(SIGNATURES))
def test_packed_attention_through_varlen_equals_one_attention_per_sequence(signature):
    g = torch.Generator().manual_seed(0)
    cu = (0, 5, 5, 12, 30)  # an empty sequence among them
    q = torch.randn(1, 30, 6, 8, generator=g)
    k, v = (torch.randn(1, 30, 2, 8, generator=g) for _ in range(2))
    attn, calls = stand_in(SIGNATURES[signature])
    packed = PackedSeqs(cu)
    got = causal_attention(q, k, v, packed.boundaries(q.device), packed.longest, attn=attn)
    want = _packed_attention(q, k, v, PackedSeqs(cu))  # on the CPU: one per sequence
    assert len(calls) == 1 and got.shape == want.shape == (1, 30, 48)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_the_boundaries_go_to_the_device_once_per_micro_batch(monkeypatch):
    """Every layer's varlen call of one micro-batch gets the same int32 boundaries tensor
    (one host-to-device copy per micro-batch, not one per layer), which the positions use
    too."""
    attn, calls = stand_in(SIGNATURES["window_gqa"])
    monkeypatch.setattr(varlen, "applies", lambda q: True)
    monkeypatch.setattr(varlen, "_varlen_attn", lambda: attn)
    g = torch.Generator().manual_seed(2)
    packed = PackedSeqs((0, 5, 5, 12, 30))
    q = torch.randn(1, 30, 6, 8, generator=g)
    k, v = (torch.randn(1, 30, 2, 8, generator=g) for _ in range(2))
    outs = [_packed_attention(q, k, v, packed) for _ in range(3)]  # three layers
    cu = packed.boundaries(q.device)
    assert len(calls) == 3 and all(c is cu for _, c in calls) and cu.dtype == torch.int32
    assert all(torch.equal(o, outs[0]) for o in outs) and packed.longest == 18
    assert packed.position_ids().tolist() == [list(range(5)) + list(range(7))
                                              + list(range(18))]
    assert packed.boundaries("cpu") is cu and packed == PackedSeqs((0, 5, 5, 12, 30))


def test_varlen_applies_only_to_cuda_half_precision():
    assert not varlen.applies(torch.zeros(1, 2, 2, 4))
    assert not varlen.applies(torch.zeros(1, 2, 2, 4, dtype=torch.bfloat16))
    assert not varlen.applies(torch.zeros(1, 2, 2, 4, device="meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_varlen_on_cuda_matches_one_attention_per_sequence():
    """torch's kernel, forward and backward, against one SDPA per sequence in bf16."""
    g = torch.Generator().manual_seed(1)
    cu = (0, 17, 17, 64, 200)
    q, k, v = (torch.randn(1, 200, h, 64, generator=g).cuda().bfloat16().requires_grad_()
               for h in (14, 2, 2))
    assert varlen.applies(q)
    out = _packed_attention(q, k, v, PackedSeqs(cu))
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref = torch.cat([F.scaled_dot_product_attention(
        q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2),
        is_causal=True, enable_gqa=True).transpose(1, 2).flatten(2)
        for a, b in zip(cu, cu[1:]) if b > a], dim=1)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, ref_grads):
        cos = F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0)
        assert float(cos) > 0.999
