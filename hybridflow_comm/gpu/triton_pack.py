"""Triton kernel: ``dst[j, i, :] = src[i, j, :]`` for ``src [D0, D1, L]`` (any device triton
drives; on CPU only under ``TRITON_INTERPRET=1``).

This is the strided pack/unpack of a non-leading partition dim: the stacked generation form
``[m, A, L]`` to the logical ``[A, m, L]`` and back.  One program per (destination row, block of
``BLOCK`` elements); rows are contiguous, so every load and store is coalesced.
"""

from __future__ import annotations

import torch

try:  # import-guarded: triton is optional
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

AVAILABLE = triton is not None

if AVAILABLE:

    @triton.jit
    def _swap_leading_dims_kernel(src, dst, D0, D1, L, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # destination row r = j * D0 + i
        blk = tl.program_id(1)
        j = row // D0
        i = row % D0
        idx = blk * BLOCK + tl.arange(0, BLOCK)
        mask = idx < L
        values = tl.load(src + (i * D1 + j) * L + idx, mask=mask)
        tl.store(dst + row * L + idx, values, mask=mask)


def swap_leading_dims(src: torch.Tensor, dst: torch.Tensor, block: int = 4096) -> None:
    """``dst[j, i, :] = src[i, j, :]`` with the Triton kernel.

    Args:
        src: contiguous ``[D0, D1, L]``.
        dst: contiguous ``[D1, D0, L]`` of the same dtype and device.
        block: elements per program (large under the interpreter, which is slow per program).
    """
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    if src.dim() != 3 or dst.shape != (src.shape[1], src.shape[0], src.shape[2]):
        raise ValueError(f"shapes {tuple(src.shape)} -> {tuple(dst.shape)} are not "
                         f"[D0, D1, L] -> [D1, D0, L]")
    if not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype:
        raise ValueError("src and dst must be contiguous and of one dtype")
    d0, d1, length = src.shape
    if src.numel() == 0:
        return
    grid = (d0 * d1, triton.cdiv(length, block))
    _swap_leading_dims_kernel[grid](src, dst, d0, d1, length, BLOCK=block)
