"""Interop from a DTensor-sharded state dict (torch.distributed.tensor, Shard / Replicate).

A tensor-parallel DTensor maps onto a :class:`ShardSpec` one to one::

    DTensor(global shape S, mesh axis "tp": Shard(d))     -> ShardSpec(S, partition_dim=d)
    DTensor(global shape S, mesh axis "tp": Replicate())  -> ShardSpec(S, partition_dim=None)
    plain torch.Tensor                                    -> replicated ShardSpec
    local tensor                                          =  dt.to_local()   (no copy)

The mesh's TP axis must be the training layout's TP dimension: same size, and this rank's
coordinate on it equal to its training ``tp`` rank with the same member ranks (for a 2-D
``("dp", "tp")`` mesh built by ``init_device_mesh`` on a pp=1 layout this holds, since both
order ranks tp fastest).  Every other mesh axis must be ``Replicate()`` (a ``Shard`` there is
FSDP-style sharding, which is not a tensor-parallel layout) and ``Partial`` is rejected.
DTensor permits uneven shards; a ShardSpec does not, so a dim that ``tp`` does not divide is an
error.  Every check is local: a bad input raises ValueError naming the tensor before any
collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybridflow_comm.groups import HybridGroups
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import Fusion, ShardSpec
from hybridflow_comm.interop.state_dict import merge_stage_specs

HFNames = Mapping[str, tuple[str, ...]] | Callable[[str], tuple[str, ...]]


def _tp_axis(name: str, dt: DTensor, tp_axis: int | str) -> int:
    mesh = dt.device_mesh
    if isinstance(tp_axis, str):
        names = mesh.mesh_dim_names or ()
        if tp_axis not in names:
            raise ValueError(f"{name}: mesh axes {names} have no TP axis named {tp_axis!r}")
        return names.index(tp_axis)
    if not 0 <= tp_axis < mesh.ndim:
        raise ValueError(f"{name}: tp_axis={tp_axis} is not an axis of a {mesh.ndim}-D mesh")
    return tp_axis


def _check_mesh(name: str, dt: DTensor, axis: int, train: ParallelLayout, rank: int) -> None:
    mesh = dt.device_mesh
    size = mesh.size(axis)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"{name}: rank {rank} is not in the tensor's device mesh")
    c = train.coords(rank)
    index = list(coord)
    index[axis] = slice(None)
    members = sorted(int(r) for r in mesh.mesh[tuple(index)].flatten().tolist())
    ours = next(g for g in train.tp_groups() if rank in g)
    if size != train.tp or coord[axis] != c.tp or members != ours:
        raise ValueError(f"{name}: mesh TP axis {axis} has size {size}, ranks {members}, "
                         f"this rank at {coord[axis]}; the training layout {train} has TP "
                         f"group {ours} with this rank at {c.tp}")


def stage_specs_from_dtensor(state_dict: Mapping[str, torch.Tensor], train: ParallelLayout,
                             rank: int, *, tp_axis: int | str = "tp", stage: int | None = None,
                             fusions: Mapping[str, Fusion] | None = None,
                             hf_names: HFNames | None = None
                             ) -> tuple[list[ShardSpec], dict[str, torch.Tensor]]:
    """Specs and local shards of one pipeline stage's DTensor state dict (local only).

    Args:
        state_dict: name -> DTensor (or plain tensor, replicated).
        train: the training layout; its TP dimension is the mesh axis ``tp_axis``.
        rank: this rank in ``train`` (its global rank: the layout covers the whole job).
        tp_axis: mesh axis name or index of tensor parallelism.
        stage: training stage of these tensors (default: this rank's pp rank).
        fusions: fused layouts by name (e.g. QKVFusion for a per-query-group qkv).
        hf_names: Hugging Face names by name (mapping or callable).

    Returns:
        ``(specs, local)``: this stage's specs and ``dt.to_local()`` by name.
    """
    fusions = fusions or {}
    unknown = sorted(set(fusions) - set(state_dict))
    if unknown:
        raise ValueError(f"fusions given for tensors not in the state dict: {unknown}")
    stage = train.coords(rank).pp if stage is None else stage
    specs, local = [], {}
    for name, value in state_dict.items():
        dim = None
        if isinstance(value, DTensor):
            axis = _tp_axis(name, value, tp_axis)
            for i, pl in enumerate(value.placements):
                if i == axis:
                    if isinstance(pl, Shard):
                        dim = pl.dim % value.ndim
                    elif not isinstance(pl, Replicate):
                        raise ValueError(f"{name}: placement {pl} on the TP axis is not "
                                         f"Shard or Replicate")
                elif not isinstance(pl, Replicate):
                    raise ValueError(f"{name}: placement {pl} on mesh axis {i} (not TP) must "
                                     f"be Replicate()")
            _check_mesh(name, value, axis, train, rank)
            if dim is not None and value.shape[dim] % train.tp:
                raise ValueError(f"{name}: dim {dim} of global shape {tuple(value.shape)} is "
                                 f"not divisible by tp={train.tp} (uneven DTensor shards)")
            tensor = value.to_local()
        elif isinstance(value, torch.Tensor):
            tensor = value
        else:
            raise TypeError(f"{name}: expected a DTensor or torch.Tensor, got "
                            f"{type(value).__name__}")
        if name in fusions and dim != 0:
            raise ValueError(f"{name}: a fused tensor must be Shard(0) on the TP axis, "
                             f"got partition_dim={dim}")
        names = () if hf_names is None else (
            hf_names(name) if callable(hf_names) else hf_names.get(name, ()))
        spec = ShardSpec(name, tuple(value.shape), dtype=value.dtype, partition_dim=dim,
                         stage=stage, fusion=fusions.get(name), hf_names=names)
        spec.check_layout(train)
        specs.append(spec)
        local[name] = tensor
    return specs, local


def from_dtensor(state_dict: Mapping[str, torch.Tensor], groups: HybridGroups, **kwargs
                 ) -> tuple[list[ShardSpec], dict[str, torch.Tensor]]:
    """Whole-model specs (merged over the training PP group) and this rank's local shards.

    ``kwargs`` as for :func:`stage_specs_from_dtensor`; validation is local, the only
    collective is the spec exchange when pp > 1.
    """
    specs, local = stage_specs_from_dtensor(state_dict, groups.layout.train, groups.rank,
                                            **kwargs)
    return merge_stage_specs(specs, groups.train_pp), local
