"""Stacked <-> logical forms of a tensor partitioned on a non-leading dim.

The generation region of a parameter split on dim ``d`` holds ``m`` training shards stacked on
a new leading dim, ``[m, *shard]``.  Its logical generation shard concatenates them along
``d``.  Viewing the shard as ``[A, L]`` (``A`` = dims before ``d``, ``L`` = the rest), this is a
swap of the two leading dims of ``[m, A, L]``::

    stacked [m, A, L]   slot 0: a0 a1 a2 | slot 1: a0 a1 a2        logical [A, m, L]
    logical             a0: slot0 slot1 | a1: slot0 slot1 | a2: ...

CPU tensors go through the C++ core (parallel row copies), tensors on other devices through
torch's strided copy.  Dim 0 needs no copy at all: it is a view.
"""

from __future__ import annotations

import math

import torch

from hybridflow_comm import _C


def _swap(src: torch.Tensor, dst: torch.Tensor, to_logical: bool) -> None:
    if src.device.type == "cpu":
        (_C.unstack_to_logical if to_logical else _C.stack_from_logical)(src, dst)
        return
    dst.copy_(src.transpose(0, 1))


def logical_from_stacked(stacked: torch.Tensor, dim: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``[m, *shard]`` -> shard with dim ``dim`` concatenated over the m slots."""
    m, shard = stacked.shape[0], tuple(stacked.shape[1:])
    if not 0 <= dim < len(shard):
        raise ValueError(f"dim={dim} is not a dim of the shard shape {shard}")
    logical_shape = shard[:dim] + (m * shard[dim],) + shard[dim + 1:]
    if dim == 0:
        return stacked.reshape(logical_shape)  # a view when stacked is contiguous
    a, length = math.prod(shard[:dim]), math.prod(shard[dim:])
    if out is None:
        out = torch.empty(logical_shape, dtype=stacked.dtype, device=stacked.device)
    _swap(stacked.contiguous().view(m, a, length), out.view(a, m, length), to_logical=True)
    return out


def stacked_from_logical(logical: torch.Tensor, dim: int, m: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`logical_from_stacked`: cut dim ``dim`` into ``m`` slots, stacked."""
    shape = tuple(logical.shape)
    if not 0 <= dim < len(shape) or shape[dim] % m:
        raise ValueError(f"dim={dim} of shape {shape} cannot be cut into m={m} slots")
    shard = shape[:dim] + (shape[dim] // m,) + shape[dim + 1:]
    if out is None:
        out = torch.empty((m, *shard), dtype=logical.dtype, device=logical.device)
    a, length = math.prod(shard[:dim]), math.prod(shard[dim:])
    _swap(logical.contiguous().view(a, m, length), out.view(m, a, length), to_logical=False)
    return out
