"""Interop from a plain local state dict plus explicit :class:`ShardSpec` s.

Every interop path (this one, :mod:`.megatron`, :mod:`.dtensor`) ends in the same pair::

    specs:  list[ShardSpec]          the whole model, identical on every rank
    local:  dict[str, Tensor]        this rank's training shard of each parameter of its stage

which a :class:`~hybridflow_comm.reshard.Resharder` consumes: build it from ``specs`` and call
:func:`load_local_tensors` to copy ``local`` into its flat buffer (one copy, once; after that
transitions are in place).  Everything in this module is local to the rank (no collective)
except :func:`merge_stage_specs`, so a bad input raises before any rank can hang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridflow_comm import comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import Group
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import ShardSpec, check_specs


def check_local_tensors(specs: Sequence[ShardSpec], local: Mapping[str, torch.Tensor],
                        train: ParallelLayout, rank: int,
                        experts: ExpertLayout | None = None) -> None:
    """Raise ValueError unless ``local`` holds exactly this rank's training shards.

    Every spec of this rank's training stage must be present with shape
    ``spec.shard_shape(train.tp)`` and dtype ``spec.dtype``; under expert parallelism
    (``experts`` with ``ep > 1``) an expert's tensors only on the ranks of its EP block, whole.
    Names of other stages or experts, and unknown names, are errors.  Local only: call it
    before any collective.
    """
    check_specs(list(specs), train)
    stage = train.coords(rank).pp
    by_name = {s.name: s for s in specs}
    held = experts.train_experts(rank) if experts is not None and experts.ep > 1 else None
    mine = {s.name for s in specs if s.stage == stage
            and (held is None or s.expert is None or s.expert in held)}
    unknown = sorted(set(local) - set(by_name))
    if unknown:
        raise ValueError(f"rank {rank}: tensors {unknown} have no shard spec")
    missing = sorted(mine - set(local))
    if missing:
        raise ValueError(f"rank {rank} (stage {stage}): no local tensor for {missing}")
    for name, t in local.items():
        s = by_name[name]
        if s.stage != stage:
            raise ValueError(f"rank {rank}: {name!r} belongs to stage {s.stage}, "
                             f"but this rank holds stage {stage}")
        if name not in mine:
            raise ValueError(f"rank {rank}: {name!r} is expert {s.expert}, held by the ranks "
                             f"of another EP block (this rank trains experts {list(held)})")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
        want = s.shape if held is not None and s.expert is not None else \
            s.shard_shape(train.tp)
        if tuple(t.shape) != want:
            raise ValueError(f"{name!r}: local shape {tuple(t.shape)} != training shard shape "
                             f"{want} (global {s.shape}, partition_dim={s.partition_dim}, "
                             f"tp={train.tp})")
        if t.dtype != s.dtype:
            raise ValueError(f"{name!r}: local dtype {t.dtype} != spec dtype {s.dtype}")


def from_state_dict(local: Mapping[str, torch.Tensor], specs: Sequence[ShardSpec],
                    train: ParallelLayout, rank: int
                    ) -> tuple[list[ShardSpec], dict[str, torch.Tensor]]:
    """Validate a plain local state dict against explicit specs.

    Args:
        local: this rank's training shards, by spec name.
        specs: every parameter of the model (the same list on every rank).
        train: the training layout.
        rank: this rank in ``train``.

    Returns:
        ``(specs, local)`` ready for a Resharder and :func:`load_local_tensors`.
    """
    check_local_tensors(specs, local, train, rank)
    return list(specs), dict(local)


def load_local_tensors(buffer: FlatParamBuffer, local: Mapping[str, torch.Tensor]) -> None:
    """Copy each local training shard into ``buffer.train_view(name)`` (in place)."""
    for name, t in local.items():
        view = buffer.train_view(name)
        if view.shape != t.shape:
            raise ValueError(f"{name!r}: tensor shape {tuple(t.shape)} != buffer slot "
                             f"{tuple(view.shape)}")
        view.copy_(t)


def merge_stage_specs(stage_specs: Sequence[ShardSpec], train_pp: Group,
                      ledger: CommLedger | None = None) -> list[ShardSpec]:
    """Collective over the training PP group: every stage's specs, in stage order.

    Spec builders that see only one stage's parameters (megatron, DTensor) call this so that
    every rank ends with the whole model's list; with ``pp == 1`` it is a no-op.
    """
    if train_pp.size == 1:
        return list(stage_specs)
    per_stage = comm.all_gather_object(list(stage_specs), train_pp, ledger or CommLedger(),
                                       "meta")
    out = [s for specs in per_stage for s in specs]
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"parameter names {dup} appear on several pipeline stages")
    return out

