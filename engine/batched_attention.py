"""Grouped-query attention of short sequences by batched products on oneDNN (float32 CPU).

PyTorch's CPU flash attention runs its blocks on MKL, which takes its AVX2 kernels on this AMD
machine, and its backward recomputes the probabilities block by block.  Below a few hundred
tokens the whole score matrix fits in cache, so writing it out costs little: two batched
products forward and four backward on oneDNN's AVX-512 kernels (:mod:`engine.onednn`).  At
the ``small`` training shape (8 sequences of 192 tokens, 6 query / 2 KV heads of 64) forward
and backward take 5.7-7.4 ms against 11.7-13.8 ms for ``scaled_dot_product_attention``.

The query heads that share a KV head are stacked on the rows, so one product per (sequence,
KV head) serves the whole group and the key/value gradients are summed over it by the
product itself::

    q  [B, S, h_kv * qpg, D] -> [B * h_kv, qpg * S, D]     rows (head j of the group, pos s)
    k, v [B, S, h_kv, D]     -> [B * h_kv, S, D]
    scores = q @ k.T * scale [B * h_kv, qpg * S, S]        + mask bias (0 / -inf), softmax
    out  = probs @ v         [B * h_kv, qpg * S, D]     -> [B, S, h_q * D]

Used by :func:`engine.layers.attention` without a KV cache, for a causal or boolean mask,
where the scores of one call stay under :data:`MAX_SCORE_BYTES` (longer sequences keep the
flash kernel, whose memory does not grow with ``S^2``) and the products reach
:data:`engine.onednn.MIN_MACS`.  Every query row must see at least
one key (:func:`engine.layers.causal_mask` always lets a row see itself).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from engine import onednn

MAX_SCORE_BYTES = 32 << 20
"""Largest score matrix (``B * h_q * S * S_kv`` float32) one call writes out."""


def applies(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention` runs for these operands (see the module docstring)."""
    if not (onednn.batched() and q.dtype == torch.float32 and k.dtype == torch.float32
            and q.device.type == "cpu" and not torch.compiler.is_compiling()):
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1):
        return False
    b, s, h_q, d = q.shape
    scores = b * h_q * s * k.shape[1]
    return scores * 4 <= MAX_SCORE_BYTES and scores * d >= onednn.MIN_MACS


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
    qpg = h_q // h_kv
    if mask is None:
        mask = torch.ones(s, kv_len, dtype=torch.bool).tril_()
    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    bias = bias.expand(b, 1, s, kv_len)
    qg = q.view(b, s, h_kv, qpg, d).permute(0, 2, 3, 1, 4).reshape(b * h_kv, qpg * s, d)
    kg, vg = (t.permute(0, 2, 1, 3).reshape(b * h_kv, kv_len, d) for t in (k, v))
    out = _GroupedAttention.apply(qg * (1.0 / math.sqrt(d)), kg, vg, bias)
    return out.view(b, h_kv, qpg, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h_q * d)
