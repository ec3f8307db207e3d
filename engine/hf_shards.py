"""Which block of which HF tensor a rank reads for its training shard: the slice maths of
loading a transformers checkpoint, written once.

A rank's training shard (:func:`hybridflow_comm.shard_spec.train_shard`) is chunk ``t`` of
``tp`` along the partition dim.  A fused tensor is stored as whole fusion units (query groups,
gate/up row pairs), each unit the concatenation of the parts' rows for it, so chunk ``t`` of
the fused rows holds units ``[t*u/tp, (t+1)*u/tp)`` and takes from every HF part exactly its
chunk ``t``, a contiguous block of rows::

    qkv shard t: u/tp query groups                    HF blocks read (tp = 2, t = 1)
    | q rows (Q/G*D) | k rows (D) | v rows (D) |  x u/tp   q_proj  rows [Q*D/2, Q*D)
      \\ part 0         \\ part 1     \\ part 2                 k_proj  rows [G*D/2, G*D)
                                                          v_proj  rows [G*D/2, G*D)
    gate_up shard t: F/tp units
    | gate row | up row |  x F/tp                          gate_proj, up_proj rows [F/2, F)

So each block lands in a strided view of the shard (:func:`shard_parts`): viewed as
``[u/tp, rows_per_unit, *rest]``, part ``p`` is ``[:, off_p:off_p + unit_rows_p]``.  A
loader copies every block straight into the flat buffer through these views, with no fused
temporary and no full tensor.  Unfused partitioned tensors read chunk ``t`` along their
partition dim (rows or columns); replicated ones read everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import Fusion, GateUpFusion, QKVFusion, ShardSpec


@dataclass(frozen=True)
class HFRead:
    """One block of one HF tensor that a rank reads."""

    hf_name: str
    hf_shape: tuple[int, ...]
    """Full shape of the HF tensor (the file's must equal it)."""
    index: tuple[slice, ...]
    """The block, one slice per dim of the HF tensor."""
    part: int
    """The view of :func:`shard_parts` it fills (0 for an unfused tensor)."""


def unit_rows(fusion: Fusion) -> tuple[int, ...]:
    """Rows each HF part gives one fusion unit, in stored order (sum: ``rows_per_unit``)."""
    if isinstance(fusion, QKVFusion):
        d = fusion.head_dim
        return fusion.num_heads // fusion.num_kv_heads * d, d, d
    if isinstance(fusion, GateUpFusion):
        return 1, 1
    raise TypeError(f"unknown fusion {type(fusion).__name__}")


def hf_shapes(spec: ShardSpec) -> tuple[tuple[int, ...], ...]:
    """Full shape of each of ``spec``'s HF tensors (one per ``hf_names`` entry)."""
    if spec.fusion is None:
        return (spec.shape,)
    return tuple((spec.units * r, *spec.shape[1:]) for r in unit_rows(spec.fusion))


def hf_reads(spec: ShardSpec, train: ParallelLayout, rank: int) -> list[HFRead] | None:
    """The HF blocks ``rank`` reads for its training shard of ``spec`` (None: not its stage).

    Args:
        spec: the parameter (its ``hf_names`` name the tensors).
        train: training layout.
        rank: rank in the layout.

    Returns:
        One read per HF tensor; filling :func:`shard_parts` of the shard with them gives
        ``train_shard(full, spec, train, rank)``.
    """
    c = train.coords(rank)
    if spec.stage != c.pp:
        return None
    out = []
    for part, (name, shape) in enumerate(zip(spec.hf_names, hf_shapes(spec), strict=True)):
        index = [slice(0, n) for n in shape]
        d = spec.partition_dim
        if d is not None:
            size = shape[d] // train.tp
            index[d] = slice(c.tp * size, (c.tp + 1) * size)
        out.append(HFRead(name, shape, tuple(index), part))
    return out


def shard_parts(spec: ShardSpec, shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of a (training) shard of ``spec``, one per HF tensor, each shaped so that the
    block read for it reshapes into it (``block.view(part.shape)``).  Unfused: the shard."""
    if spec.fusion is None:
        return (shard,)
    rows = unit_rows(spec.fusion)
    rest = shard.shape[1:]
    grouped = shard.view(-1, sum(rows), *rest)  # [units here, rows_per_unit, *rest]
    starts = [0, *accumulate(rows)]
    return tuple(grouped[:, a:a + r] for a, r in zip(starts, rows))
