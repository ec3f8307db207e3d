"""Many-tensor pack/unpack into one flat byte buffer (the C++ core, multi-threaded).

Used to coalesce many parameters into one bucket for a single collective call::

    flat (uint8)  | t0 bytes |pad| t1 bytes |pad| ... |      offsets[i] = start of t_i
"""

from __future__ import annotations

import torch

from hybridflow_comm import _C


def plan_pack(tensors: list[torch.Tensor], align_bytes: int = 16) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a packed buffer, and the buffer's total size."""
    offsets = _C.plan_offsets([t.nbytes for t in tensors], align_bytes)
    return offsets[:-1], offsets[-1]


def _check(tensors: list[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensor {i} (shape {tuple(t.shape)}, {t.device}) must be a "
                             f"contiguous CPU tensor")


def pack_tensors(tensors: list[torch.Tensor], out: torch.Tensor | None = None,
                 offsets: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Copy ``tensors`` (any dtypes and shapes) into one uint8 buffer.

    Args:
        tensors: contiguous CPU tensors.
        out: optional 1-D uint8 destination; allocated when None.
        offsets: byte offsets per tensor; planned with :func:`plan_pack` when None.

    Returns:
        ``(out, offsets)``.
    """
    _check(tensors)
    if offsets is None:
        offsets, total = plan_pack(tensors)
    else:
        total = max((o + t.nbytes for o, t in zip(offsets, tensors)), default=0)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8)
    _C.pack_into(tensors, out, offsets)
    return out, offsets


def unpack_tensors(flat: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]) -> None:
    """Copy the bytes at ``offsets`` of ``flat`` back into ``tensors`` (in place)."""
    _check(tensors)
    _C.unpack_from(flat, tensors, offsets)
