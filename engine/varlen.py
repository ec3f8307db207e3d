"""Packed sequences' causal attention in one call on CUDA: torch's variable-length flash
attention (``torch.nn.attention.varlen.varlen_attn``, forward and backward).

A packed micro-batch (:class:`engine.attention.PackedSeqs`, padding removed) is one row of ``T``
tokens holding ``n`` sequences; each attends only to itself.  Elsewhere that is one SDPA call
per sequence, which on a GPU launches ``n`` attention kernels (and their backward) per layer
for a micro-batch of often dozens of short sequences.  The varlen kernel takes the row and the
sequence boundaries at once, as verl's ``use_remove_padding`` does with flash-attn::

    q [T, h_q, D], k, v [T, h_kv, D]     cu_seqlens [n + 1] int32 (0, L0, L0 + L1, ..., T)

Its signature changed between torch releases (``is_causal`` in 2.10; ``window_size=(-1, 0)``
for causal and, later, ``enable_gqa``): :func:`call_arguments` reads the installed one.  Where
it lacks ``enable_gqa`` each key/value head is repeated for its query heads.  Used where
:func:`applies`: CUDA tensors in bf16 or fp16 (the flash kernel's dtypes) on a torch from 2.11
(its backward returned one gradient too many before).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

import torch

MIN_TORCH = (2, 11)


@functools.cache
def _varlen_attn() -> Callable | None:
    """torch's ``varlen_attn`` where this torch has a usable one, else None."""
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < MIN_TORCH:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if call_arguments(inspect.signature(varlen_attn).parameters) else None


def call_arguments(params: Mapping[str, object]) -> tuple[dict, bool] | None:
    """``(keyword arguments of a causal call, whether the key/value heads must be repeated
    for GQA)`` for a ``varlen_attn`` with these parameter names (pure); None where it cannot
    be asked for causal attention."""
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        return None
    if "enable_gqa" in params:
        return {**kwargs, "enable_gqa": True}, False
    return kwargs, True


@functools.cache
def _arguments_of(attn: Callable) -> tuple[dict, bool]:
    return call_arguments(inspect.signature(attn).parameters)


def applies(q: torch.Tensor) -> bool:
    """Whether :func:`causal_attention` runs for queries ``q``."""
    return (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)
            and _varlen_attn() is not None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, longest: int,
                     attn: Callable | None = None) -> torch.Tensor:
    """``[1, T, h_q*D]`` causal attention of each packed sequence of ``q [1, T, h_q, D]``,
    ``k, v [1, T, h_kv, D]`` on its own.

    Args:
        cu_seqlens: the sequences' boundaries ``[n + 1]`` int32 on ``q``'s device, made once
            per micro-batch (:meth:`engine.attention.PackedSeqs.boundaries`), not per layer.
        longest: the longest sequence's length (host data: no sync to read it).
        attn: the ``varlen_attn`` to call (default torch's).
    """
    attn = attn or _varlen_attn()
    kwargs, repeat = _arguments_of(attn)
    _, t, h_q, d = q.shape
    qs, ks, vs = q[0], k[0], v[0]  # [T, heads, D]
    if repeat:
        ks = ks.repeat_interleave(h_q // ks.shape[1], dim=1)
        vs = vs.repeat_interleave(h_q // vs.shape[1], dim=1)
    out = attn(qs, ks, vs, cu_seqlens, cu_seqlens, longest, longest, **kwargs)  # [T, h_q, D]
    return out.reshape(1, t, h_q * d)
