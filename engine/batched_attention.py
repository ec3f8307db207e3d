"""Grouped-query attention of short sequences by batched products on oneDNN (float32 CPU).

PyTorch's CPU flash attention runs its blocks on MKL, which may take its AVX2 kernels on AMD
processors, and its backward recomputes the probabilities block by block.  Below a few
hundred tokens the whole score matrix fits in cache, so writing it out costs little: two
batched products forward and four backward on oneDNN (:mod:`engine.onednn`), which
JIT-compiles for the CPU's own vector width.

The query heads that share a KV head are stacked on the rows, so one product per (sequence,
KV head) serves the whole group and the key/value gradients are summed over it by the
product itself::

    q  [B, S, h_kv * qpg, D] -> [B * h_kv, qpg * S, D]     rows (head j of the group, pos s)
    k, v [B, S, h_kv, D]     -> [B * h_kv, S, D]
    scores = q @ k.T * scale [B * h_kv, qpg * S, S]        + mask bias (0 / -inf), softmax
    out  = probs @ v         [B * h_kv, qpg * S, D]     -> [B, S, h_q * D]

Used by :func:`engine.attention.attention` without a KV cache, for a causal or boolean mask,
where the scores stay under :data:`MAX_SCORE_BYTES` (longer sequences keep the flash kernel,
whose memory does not grow with ``S^2``): those of the whole batch under autograd (the
backward keeps them), those of one sequence without it, the batch then taken in chunks (the
reference forward of 64 sequences of 192 tokens at ``small``); and where the products reach
:data:`engine.onednn.MIN_MACS`.  Every query row must see at least
one key (:func:`engine.attention.causal_mask` always lets a row see itself).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from engine import onednn

try:  # torch (imported above) must be loaded before the extension
    from engine import _kernels
except ImportError:  # extension not built: attention_from_qkv does not apply
    _kernels = None

MAX_SCORE_BYTES = 32 << 20
"""Largest score matrix (``B * h_q * S * S_kv`` float32) one call writes out."""
MAX_HEAD_DIM = 512
"""Largest head dim of :func:`attention_from_qkv` (csrc/engine/row_ops.h kMaxHeadDim)."""


def applies(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention` runs for these operands (see the module docstring)."""
    b, s, h_q, d = q.shape
    return _applies(b, s, h_q, k.shape[1], d, (q, k), mask)


def _applies(b: int, s: int, h_q: int, kv_len: int, d: int, tensors: tuple[torch.Tensor, ...],
             mask: torch.Tensor | None) -> bool:
    if not (onednn.batched() and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                      for t in tensors) and not torch.compiler.is_compiling()):
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1):
        return False
    scores = b * h_q * s * kv_len
    # with autograd the probabilities of every sequence are kept for the backward: the whole
    # batch within the budget; without (reference and critic forwards) the batch is taken in
    # chunks of sequences (:func:`_batch_chunks`), one sequence within the budget
    budget = b if _records_graph(tensors) else 1
    return (budget * h_q * s * kv_len * 4 <= MAX_SCORE_BYTES
            and scores * d >= onednn.MIN_MACS)


def _records_graph(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _batch_chunks(b: int, s: int, h_q: int, kv_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of sequences whose scores stay within the budget (one range
    when the whole batch does)."""
    per_chunk = max(1, MAX_SCORE_BYTES // (4 * h_q * s * kv_len))
    return [(i, min(b, i + per_chunk)) for i in range(0, b, per_chunk)]


def _rows(t: torch.Tensor | None, start: int, end: int, b: int) -> torch.Tensor | None:
    """Sequences ``[start, end)`` of ``t`` (None, or broadcast over the batch: as it is)."""
    return t if t is None or t.shape[0] != b else t[start:end]


def qkv_applies(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None, q_per_group: int,
                head_dim: int) -> bool:
    """Whether :func:`attention_from_qkv` runs: :func:`applies` for the heads of ``qkv``, the
    extension built, and per-token RoPE tables ``[B, S, D]``."""
    if _kernels is None or qkv.dim() != 3 or head_dim % 2 or head_dim > MAX_HEAD_DIM:
        return False
    b, s, width = qkv.shape
    groups, rest = divmod(width, (q_per_group + 2) * head_dim)
    tables = (b, s, head_dim)
    if rest or groups == 0 or cos.shape != tables or sin.shape != tables:
        return False
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return False
    tensors = (qkv, cos, sin) if bias is None else (qkv, cos, sin, bias)
    return _applies(b, s, groups * q_per_group, s, head_dim, tensors, mask)


class _GroupedAttention(torch.autograd.Function):
    """``softmax(q k^T + bias) v`` of the stacked layout above (``q`` already scaled by
    ``1/sqrt(D)``); ``bias`` is the additive ``[B, 1, S, S_kv]`` mask, 0 or -inf (one add
    over the scores: a broadcast ``masked_fill_`` took ten times as long)."""

    @staticmethod
    def forward(ctx, q, k, v, bias):
        # q [G, R, D], k/v [G, S_kv, D]; G = B * h_kv, R = qpg * S
        scores = onednn.mm(q, k.transpose(1, 2))  # [G, R, S_kv]
        batch, _, seq, kv_len = bias.shape
        scores.view(batch, -1, seq, kv_len).add_(bias)
        probs = torch.softmax(scores, dim=-1)
        out = onednn.mm(probs, v)
        ctx.save_for_backward(q, k, v, probs, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, probs, out = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_v = onednn.mm(probs.transpose(1, 2), grad_out)  # [G, S_kv, D]
        grad_p = onednn.mm(grad_out, v.transpose(1, 2))  # [G, R, S_kv]
        delta = (grad_out * out).sum(-1, keepdim=True)  # = sum_j p_j dP_j per row
        grad_s = grad_p.sub_(delta).mul_(probs)  # d scores
        grad_q = onednn.mm(grad_s, k)
        grad_k = onednn.mm(grad_s.transpose(1, 2), q)
        return grad_q, grad_k, grad_v, None


class _QKVHeads(torch.autograd.Function):
    """The stacked layout above from the fused projection ``qkv [B, S, h_kv*(qpg+2)*D]``:
    bias, RoPE and the query scale in one pass each way (csrc/engine/qkv_heads.cpp)."""

    @staticmethod
    def forward(ctx, qkv, bias, cos, sin, q_per_group, scale):
        q, k, v = _kernels.qkv_heads_forward(qkv, bias, cos, sin, q_per_group, scale)
        ctx.save_for_backward(cos, sin)
        ctx.q_per_group, ctx.scale = q_per_group, scale
        return q, k, v

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin = ctx.saved_tensors  # unused outputs' gradients come as zeros (materialised)
        dqkv = _kernels.qkv_heads_backward(grad_q, grad_k, grad_v, cos, sin, ctx.q_per_group,
                                           ctx.scale)
        dbias = dqkv.view(-1, dqkv.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dqkv, dbias, None, None, None, None


def _mask_bias(mask: torch.Tensor | None, b: int, s: int, kv_len: int,
               like: torch.Tensor) -> torch.Tensor:
    """The additive ``[B, 1, S, S_kv]`` form (0 / -inf) of a boolean mask (None: causal), of
    ``like``'s dtype and device."""
    if mask is None:
        mask = torch.ones(s, kv_len, dtype=torch.bool, device=like.device).tril_()
    bias = like.new_zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    return bias.expand(b, 1, s, kv_len)


def _merge_heads(out: torch.Tensor, b: int, s: int, h_kv: int, qpg: int, d: int
                 ) -> torch.Tensor:
    """``[B * h_kv, qpg * S, D]`` -> ``[B, S, h_q * D]``."""
    return out.view(b, h_kv, qpg, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h_kv * qpg * d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention, as ``scaled_dot_product_attention(enable_gqa=True)``.

    Args:
        q: ``[B, S, h_q, D]``.
        k, v: ``[B, S_kv, h_kv, D]``; ``h_q`` a multiple of ``h_kv``.
        mask: boolean ``[B, 1, S, S_kv]`` (True = attend), or None for causal (``S_kv = S``).

    Returns:
        ``[B, S, h_q * D]``.
    """
    b, s, h_q, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    chunks = _batch_chunks(b, s, h_q, kv_len)
    if len(chunks) > 1:
        return torch.cat([attention(q[i:j], k[i:j], v[i:j], _rows(mask, i, j, b))
                          for i, j in chunks])
    qpg = h_q // h_kv
    bias = _mask_bias(mask, b, s, kv_len, q)
    qg = q.view(b, s, h_kv, qpg, d).permute(0, 2, 3, 1, 4).reshape(b * h_kv, qpg * s, d)
    kg, vg = (t.permute(0, 2, 1, 3).reshape(b * h_kv, kv_len, d) for t in (k, v))
    out = _GroupedAttention.apply(qg * (1.0 / math.sqrt(d)), kg, vg, bias)
    return _merge_heads(out, b, s, h_kv, qpg, d)


def attention_from_qkv(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, mask: torch.Tensor | None, q_per_group: int,
                       head_dim: int) -> torch.Tensor:
    """:func:`attention` of the heads of a fused projection, where :func:`qkv_applies`.

    Args:
        qkv: ``[B, S, h_kv * (qpg + 2) * D]`` per KV group: ``qpg`` query heads, a key, a
            value (:mod:`engine.layers`' layout), before the bias.
        bias: ``[h_kv * (qpg + 2) * D]`` or None.
        cos, sin: RoPE tables ``[B, S, D]``.
        mask: as for :func:`attention`.

    Returns:
        ``[B, S, h_q * D]``: the values of ``attention(rope(q), rope(k), v, mask)`` after the
        bias add and split of :func:`engine.layers.attention_block`, rounded alike.
    """
    b, s, width = qkv.shape
    h_kv = width // ((q_per_group + 2) * head_dim)
    chunks = _batch_chunks(b, s, h_kv * q_per_group, s)
    if len(chunks) > 1:
        return torch.cat([attention_from_qkv(qkv[i:j], bias, cos[i:j], sin[i:j],
                                             _rows(mask, i, j, b), q_per_group, head_dim)
                          for i, j in chunks])
    qg, kg, vg = _QKVHeads.apply(qkv, bias, cos, sin, q_per_group, 1.0 / math.sqrt(head_dim))
    out = _GroupedAttention.apply(qg, kg, vg, _mask_bias(mask, b, s, s, qkv))
    return _merge_heads(out, b, s, h_kv, q_per_group, head_dim)
