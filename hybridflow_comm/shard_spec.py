"""Shard specs: how one global parameter is cut over the training and generation layouts.

A :class:`ShardSpec` names a parameter by its *global* shape in the stored layout, its partition
dim (None: replicated), an optional fused layout, and the training pipeline stage that owns it.
Everything else (training shard, generation shard, slot specs of the flat buffer) is derived
from it and a layout, by pure functions.

Fused tensors are stored so that cutting dim 0 into ``tp`` equal pieces gives valid TP shards
for *every* tp that divides the number of fusion units, and concatenating ``m`` neighbouring
shards gives a valid shard of ``tp/m``; this is what lets the micro-DP all-gather produce a
generation shard with no reordering.

* ``QKVFusion``: units are query groups (one KV head each)::

      [ q(group 0) | k(group 0) | v(group 0) | q(group 1) | k(group 1) | v(group 1) | ... ]
        (heads/kv_heads)*hd rows    hd rows      hd rows

* ``GateUpFusion``: units are rows of the intermediate size, gate and up interleaved::

      [ gate[0] | up[0] | gate[1] | up[1] | ... ]      # [2*ffn, hidden]

Both pieces of a fused weight stay in the same TP shard, so ``split`` works on any shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hybridflow_comm.flat_buffer import SlotSpec
from hybridflow_comm.layout import HybridLayout, ParallelLayout


@dataclass(frozen=True)
class QKVFusion:
    """Fused Q, K, V projection laid out per query group (see module docstring)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def units(self) -> int:
        return self.num_kv_heads

    @property
    def rows_per_unit(self) -> int:
        return (self.num_heads // self.num_kv_heads + 2) * self.head_dim

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [g*qpg*hd, *rest]``, ``k, v [g*hd, *rest]`` (any g groups) -> fused rows."""
        g = k.shape[0] // self.head_dim
        rest = q.shape[1:]
        parts = (q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def split(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`fuse` for the full tensor or any TP shard of it (views)."""
        rest = w.shape[1:]
        grouped = w.reshape(-1, self.rows_per_unit, *rest)  # [g, rows_per_unit, *rest]
        q_rows = (self.num_heads // self.num_kv_heads) * self.head_dim
        q, k, v = grouped.split([q_rows, self.head_dim, self.head_dim], dim=1)
        return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


@dataclass(frozen=True)
class GateUpFusion:
    """Fused gate and up projections, rows interleaved (see module docstring)."""

    @property
    def rows_per_unit(self) -> int:
        return 2

    def fuse(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])

    def split(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = w.reshape(-1, 2, *w.shape[1:])
        return pairs[:, 0], pairs[:, 1]


Fusion = QKVFusion | GateUpFusion


@dataclass(frozen=True)
class ShardSpec:
    """One parameter: global shape, how it is partitioned, and who owns it.

    Attributes:
        name: global parameter name (the same on every rank).
        shape: global shape in the stored layout (fused tensors already fused).
        dtype: element type.
        partition_dim: dim split over tensor-parallel ranks; None for a replicated tensor.
        stage: training pipeline stage that holds the parameter.
        fusion: fused layout along dim 0, or None.
        hf_names: Hugging Face names; one per fused part (q, k, v or gate, up), else one.
        expert: index of the expert this tensor belongs to within its layer (a mixture of
            experts' expert weights, see :mod:`hybridflow_comm.expert_layout`); None otherwise.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    partition_dim: int | None = None
    stage: int = 0
    fusion: Fusion | None = None
    hf_names: tuple[str, ...] = ()
    expert: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "hf_names", tuple(self.hf_names))
        d = self.partition_dim
        if d is not None and not 0 <= d < len(self.shape):
            raise ValueError(f"{self.name}: partition_dim={d} is not a dim of shape {self.shape}")
        if self.fusion is not None:
            if d != 0:
                raise ValueError(f"{self.name}: a fused tensor must be partitioned on dim 0, "
                                 f"got partition_dim={d}")
            if self.shape[0] % self.fusion.rows_per_unit:
                raise ValueError(f"{self.name}: {self.shape[0]} rows do not hold whole "
                                 f"{type(self.fusion).__name__} units")
        if self.stage < 0:
            raise ValueError(f"{self.name}: stage={self.stage} must be >= 0")
        if self.expert is not None and self.expert < 0:
            raise ValueError(f"{self.name}: expert={self.expert} must be >= 0")

    @property
    def units(self) -> int:
        """How many indivisible pieces the partition dim holds."""
        if self.partition_dim is None:
            return 1
        if self.fusion is not None:
            return self.shape[0] // self.fusion.rows_per_unit
        return self.shape[self.partition_dim]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def check_layout(self, train: ParallelLayout) -> None:
        """Raise ValueError unless ``train`` can shard this parameter."""
        if self.stage >= train.pp:
            raise ValueError(f"{self.name}: stage={self.stage} but the layout has pp={train.pp}")
        if self.partition_dim is not None and self.units % train.tp:
            raise ValueError(f"{self.name}: {self.units} units along dim {self.partition_dim} "
                             f"cannot be split over tp={train.tp}")

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one of ``tp`` shards (the full shape when replicated)."""
        if self.partition_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.partition_dim] //= tp
        return tuple(shape)


def check_specs(specs: list[ShardSpec], train: ParallelLayout) -> None:
    """Validate a model's specs against a training layout (unique names, divisibility)."""
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate parameter names: {dup}")
    for s in specs:
        s.check_layout(train)


def slot_specs(specs: list[ShardSpec], hybrid: HybridLayout, rank: int) -> list[SlotSpec]:
    """The flat-buffer regions of ``rank``: its generation shard of every parameter.

    A partitioned parameter gets ``micro_tp`` slots (slot ``i`` = training TP shard
    ``tp_g_rank * micro_tp + i``); a replicated one gets one slot.  Parameters of other
    generation stages get no region; parameters of other training stages of the same
    generation stage get a region with ``own_slot=None``.
    """
    check_specs(specs, hybrid.train)
    c = hybrid.train.coords(rank)
    g = hybrid.gen_coords(rank)
    out = []
    for s in specs:
        if s.stage // hybrid.micro_pp != g.pp_g:
            continue
        mine = s.stage == c.pp
        if s.partition_dim is None:
            out.append(SlotSpec(s.name, s.dtype, s.shape, 1, 0 if mine else None))
        else:
            out.append(SlotSpec(s.name, s.dtype, s.shard_shape(hybrid.train.tp), hybrid.micro_tp,
                                c.tp % hybrid.micro_tp if mine else None))
    stage = {s.name: s.stage for s in specs}
    return sorted(out, key=lambda ss: (stage[ss.name], str(ss.dtype), ss.num_slots,
                                       ss.slot_shape))


def train_shard(full: torch.Tensor, spec: ShardSpec, train: ParallelLayout,
                rank: int) -> torch.Tensor | None:
    """Reference: ``rank``'s training shard of the global tensor ``full`` (None if not held)."""
    c = train.coords(rank)
    if spec.stage != c.pp:
        return None
    if spec.partition_dim is None:
        return full
    return full.chunk(train.tp, dim=spec.partition_dim)[c.tp]


def gen_shard(full: torch.Tensor, spec: ShardSpec, hybrid: HybridLayout,
              rank: int) -> torch.Tensor | None:
    """Reference: ``rank``'s generation shard of ``full`` in logical (unstacked) form."""
    g = hybrid.gen_coords(rank)
    if spec.stage // hybrid.micro_pp != g.pp_g:
        return None
    if spec.partition_dim is None:
        return full
    return full.chunk(hybrid.tp_g, dim=spec.partition_dim)[g.tp_g]


def stacked_to_logical(stacked: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``[m, *shard]`` generation region -> the logical generation shard.

    A view for dim-0 (and replicated) tensors; for another partition dim a copy bounded by
    this one tensor.
    """
    if spec.partition_dim in (None, 0):
        return stacked.flatten(0, 1) if spec.partition_dim == 0 else stacked[0]
    from hybridflow_comm.strided import logical_from_stacked

    return logical_from_stacked(stacked, spec.partition_dim)


def hf_named(name: str, tensor: torch.Tensor, hf_names: tuple[str, ...],
             fusion) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` under its Hugging Face names, what inference engines' ``load_weights``
    take: a fused tensor split into its parts (``fusion.split``: views), another one under its
    single name, and under ``name`` when ``hf_names`` is empty."""
    if not hf_names:
        yield name, tensor
    elif fusion is not None:
        yield from zip(hf_names, fusion.split(tensor))
    else:
        yield hf_names[0], tensor
