"""Masked grouped-query attention (engine/attention.py ``repeat_kv_heads``): on CUDA each
key/value head is repeated for its query heads so that SDPA's memory-efficient kernel takes the
padding mask (with ``enable_gqa`` SDPA would fall back to its math kernel); the same results as
SDPA's own group broadcast, on the CPU in float64 and on a GPU with the math kernel barred."""

from __future__ import annotations

import pytest
import torch

from engine import attention as attention_mod
from engine.attention import attention, causal_mask, repeat_kv_heads


def test_repeat_kv_heads_only_on_cuda_with_a_mask_and_groups():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert repeat_kv_heads(cuda, True, 14, 2)
    assert not repeat_kv_heads(cuda, False, 14, 2)  # causal: flash takes the groups
    assert not repeat_kv_heads(cuda, True, 4, 4)  # no groups
    assert not repeat_kv_heads(cpu, True, 14, 2)


def _operands(device, dtype, generator_seed=0):
    g = torch.Generator().manual_seed(generator_seed)
    q = torch.randn(3, 20, 6, 16, generator=g)
    k, v = (torch.randn(3, 20, 2, 16, generator=g) for _ in range(2))
    am = torch.ones(3, 20, dtype=torch.long)
    am[0, :4] = 0  # left padding
    am[2, -5:] = 0  # right padding
    return [t.to(device, dtype) for t in (q, k, v)], causal_mask(am.to(device), 3, 20), am


def test_repeated_heads_equal_the_broadcast_groups(monkeypatch):
    (q, k, v), mask, am = _operands("cpu", torch.float64)
    want = attention(q, k, v, mask)
    monkeypatch.setattr(attention_mod, "repeat_kv_heads", lambda *a: True)
    got = attention(q, k, v, mask)
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-12, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masked_gqa_on_cuda_runs_without_the_math_kernel():
    """bf16 forward and backward with a padding mask under every SDPA backend but math (no
    "No available kernel" error), against the math kernel's own GQA result."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (q, k, v), mask, am = _operands("cuda", torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):
        out = attention(q, k, v, mask)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2).flatten(2)
        ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    real = am.cuda().bool()
    torch.testing.assert_close(out[real].float(), ref[real].float(), atol=3e-2, rtol=3e-2)
    for a, b in zip(grads, ref_grads):
        cos = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(),
                                                    dim=0)
        assert float(cos) > 0.999
