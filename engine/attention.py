"""Grouped-query attention: the masks, sequences packed on one row, and the attention kernels
each case takes.

Shapes use B batch, S queries, S_kv keys, D head dim, ``h_q`` query and ``h_kv`` key/value heads
(``h_q`` a multiple of ``h_kv``).  Which kernel runs :func:`attention`::

    case                                 kernel
    no mask, no cache (causal)           engine.batched_attention (short float32 CPU) or SDPA
                                         is_causal
    boolean mask, no cache               engine.batched_attention (short float32 CPU) or SDPA
    packed sequences (PackedSeqs)        engine.varlen (CUDA bf16/fp16) or one causal
                                         attention per sequence
    packed, in traced code (PackedBounds) engine.varlen (CUDA bf16/fp16) or SDPA with the
                                         block-diagonal causal mask (document_mask)
    after a KV hook                      decode_attention (a dense cache's views, one new
                                         token) or SDPA
    SDPA with a mask on CUDA, GQA        keys/values repeated per query head (repeat_kv_heads)

The CPU and CUDA kernels' modules, :mod:`engine.batched_attention` and :mod:`engine.varlen`,
each say where they apply (``applies``); :func:`attention` asks them in this order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine import batched_attention, varlen

# kv_hook(k, v) -> (k_all, v_all): lets a KV cache append the new keys/values ([B, S, h_kv, D])
# and return everything attention should see ([B, S_kv, h_kv, D]).  A hook whose attribute
# stacked_decode is True hands out views of a dense cache: one new token then attends by
# decode_attention (no GQA expansion of the cache).
KVHook = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def causal_mask(attention_mask: torch.Tensor | None, batch: int, seq: int,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` (True = may attend): causal, keys restricted to real tokens.

    Every query may always see itself, so a padding row is never fully masked (no NaN); its
    output is meaningless and must be masked out of the loss by the caller.  The mask lives on
    ``attention_mask``'s device, or on ``device`` when there is no ``attention_mask``.
    """
    if attention_mask is not None:
        device = attention_mask.device
    elif device is None:
        raise ValueError("causal_mask without an attention_mask needs a device")
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if attention_mask is None:
        return causal.expand(batch, 1, seq, seq)
    keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return (causal & keys) | torch.eye(seq, dtype=torch.bool, device=device)


@dataclass(frozen=True)
class PackedSeqs:
    """Sequences packed back to back on one row (padding removed): sequence ``i`` is the
    positions ``[cu_seqlens[i], cu_seqlens[i+1])``, causal inside itself, blind to the others::

        row   | seq 0 (L0) | seq 1 (L1) | ... |        T = cu_seqlens[-1]
        mask  block-diagonal causal [T, T] (never built: one attention per sequence)

    :func:`attention` takes it in place of a mask and runs one causal attention per sequence
    (:mod:`engine.batched_attention`, or CPU flash attention for long sequences; on CUDA all
    of them in one varlen flash call, :mod:`engine.varlen`), so the cost is ``sum L_i^2``, not
    ``T^2``.
    Built by :func:`engine.micro_batches.pack_rows`.
    """

    cu_seqlens: tuple[int, ...]
    """``0, L0, L0+L1, ..., T`` (non-decreasing; an empty sequence is allowed)."""
    _on_device: dict[torch.device, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = self.cu_seqlens
        if not c or c[0] != 0 or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError(f"cu_seqlens={c} must start at 0 and never decrease")

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def longest(self) -> int:
        """The longest sequence's length."""
        return max((b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:])), default=0)

    def boundaries(self, device: torch.device | str) -> torch.Tensor:
        """``cu_seqlens`` as ``[n + 1]`` int32 on ``device``: copied from the host on the
        first call per device and kept, so that every layer's attention (and the positions)
        of the micro-batch share one host-to-device copy."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = torch.tensor(self.cu_seqlens, dtype=torch.int32,
                                                   device=device)
        return self._on_device[device]

    def bounds(self, device: torch.device | str) -> PackedBounds:
        """The packing as traced code takes it (:class:`PackedBounds`)."""
        return PackedBounds(self.boundaries(device), self.longest)

    def position_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[1, T]`` on ``device``: ``0..L_i-1`` inside every sequence (what the padded row's
        :func:`position_ids_from_mask` gives its real tokens), from :meth:`boundaries`."""
        c = self.boundaries(device).long()
        lengths = c[1:] - c[:-1]
        starts = torch.repeat_interleave(c[:-1], lengths, output_size=self.total)
        return (torch.arange(self.total, device=device) - starts).unsqueeze(0)


class PackedBounds(NamedTuple):
    """:class:`PackedSeqs` as compiled code takes it: the boundaries on the device and the
    longest length, no host tuple to guard on (a compiled layer serves every packing)."""

    cu_seqlens: torch.Tensor
    """``[n + 1]`` int32 (:meth:`PackedSeqs.boundaries`)."""
    longest: int


AttentionMask = torch.Tensor | PackedSeqs | PackedBounds | None
"""What :func:`attention` takes as its mask."""


def document_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Boolean ``[1, 1, T, T]`` (True = may attend): causal inside each packed sequence,
    blind across them (``cu_seqlens``: ``[n + 1]`` boundaries, ``T = total``)."""
    pos = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens.long(), pos, right=True)  # sequence of each token
    return ((seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :]))[None, None]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, S, h_q*D]`` causal attention of ``q [B, S, h_q, D]``, ``k, v [B, S, h_kv, D]``."""
    if batched_attention.applies(q, k, None):
        return batched_attention.attention(q, k, v, None)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


def _packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      packed: PackedSeqs) -> torch.Tensor:
    """``[1, T, h_q*D]`` attention of every packed sequence on its own: in one varlen call
    on CUDA (:mod:`engine.varlen`), else one attention per sequence."""
    if varlen.applies(q) and packed.total > 0:
        return varlen.causal_attention(q, k, v, packed.boundaries(q.device), packed.longest)
    c = packed.cu_seqlens
    return torch.cat([_causal_attention(q[:, a:b], k[:, a:b], v[:, a:b])
                      for a, b in zip(c, c[1:]) if b > a], dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: AttentionMask,
              kv_hook: KVHook | None = None) -> torch.Tensor:
    """Grouped-query scaled dot-product attention.

    Args:
        q: ``[B, S, h_q, D]`` (RoPE applied).
        k, v: ``[B, S, h_kv, D]``; ``h_q`` is a multiple of ``h_kv``.
        mask: boolean ``[B, 1, S, S_kv]`` (True = attend); None where no key is padding:
            causal (``S = S_kv``), or after a KV hook one new query seeing every key
            (``S = 1``); or :class:`PackedSeqs` for sequences packed on one row (``B = 1``, no
            KV hook), in compiled code as :class:`PackedBounds`.  Without a mask SDPA runs
            ``is_causal`` (CUDA: its flash or efficient kernels); a boolean mask is only for
            padding.
        kv_hook: optional KV-cache hook, see :data:`KVHook`.

    Returns:
        ``[B, S, h_q*D]``.
    """
    if isinstance(mask, PackedSeqs):
        if q.shape[0] != 1 or q.shape[1] != mask.total or kv_hook is not None:
            raise ValueError(f"packed attention needs one row of {mask.total} tokens and no "
                             f"KV hook, got q {tuple(q.shape)}")
        return _packed_attention(q, k, v, mask)
    if isinstance(mask, PackedBounds):
        if q.shape[0] != 1 or kv_hook is not None:
            raise ValueError(f"packed attention needs one row and no KV hook, got q "
                             f"{tuple(q.shape)}")
        if varlen.applies(q) and q.shape[1] > 0:
            return varlen.causal_attention(q, k, v, mask.cu_seqlens, mask.longest)
        mask = document_mask(mask.cu_seqlens, q.shape[1])
    if kv_hook is not None:
        k, v = kv_hook(k, v)
        if q.shape[1] == 1 and getattr(kv_hook, "stacked_decode", False):
            return decode_attention(q, k, v, mask)
    elif mask is None:
        return _causal_attention(q, k, v)
    elif batched_attention.applies(q, k, mask):  # short sequences, no cache
        return batched_attention.attention(q, k, v, mask)
    queries, keys = q.shape[1], k.shape[1]
    if mask is None and queries not in (1, keys):
        raise ValueError(f"{queries} queries after {keys - queries} cached keys need a mask "
                         f"(without one: a prefill, S = S_kv, or one new token, S = 1)")
    repeat = repeat_kv_heads(q.device, mask is not None, q.shape[2], k.shape[2])
    if repeat:
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
    # no mask where none is needed (SDPA's flash and efficient kernels on CUDA): causal for a
    # prefill; one new token after the cache sees every key (is_causal would align its one
    # query with the first key)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                         is_causal=mask is None and queries > 1,
                                         enable_gqa=not repeat)
    return out.transpose(1, 2).flatten(2)


def repeat_kv_heads(device: torch.device, masked: bool, h_q: int, h_kv: int) -> bool:
    """Whether attention repeats each key/value head for its query heads (pure): on CUDA
    with a mask, where SDPA's memory-efficient kernel (the one that takes a mask) refuses
    ``enable_gqa`` and SDPA would fall back to its math kernel, which materialises the
    ``[B, h_q, S, S_kv]`` float32 scores; the repeated keys and values are ``h_q / h_kv``
    times their size, ``O(S)``.  Elsewhere SDPA broadcasts the groups itself."""
    return device.type == "cuda" and masked and h_q != h_kv


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """One new query per row against cached ``k, v [B, S_kv, h_kv, D]`` (views of a dense
    KV cache), each KV group's query heads stacked as the rows of one SDPA call::

        q [B, 1, h_kv * qpg, D] -> [B, h_kv, qpg, D]    (query head g * qpg + j: group g)
        k, v                    -> [B, h_kv, S_kv, D]   (views, never expanded per query)
        mask [B, 1, 1, S_kv]       broadcast over the heads and the stacked queries

    The same maths as ``scaled_dot_product_attention(enable_gqa=True)``; the mask (None:
    every key) leaves SDPA's memory-efficient kernel eligible on CUDA, where GQA with a mask
    would take the math kernel and copy the cache per query head.

    Returns:
        ``[B, 1, h_q * D]``.
    """
    b, _, h_q, d = q.shape
    h_kv = k.shape[2]
    qg = q.reshape(b, h_kv, h_q // h_kv, d)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask)
    return out.reshape(b, 1, h_q * d)

