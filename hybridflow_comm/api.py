"""Call resharding from your framework: one entry per source, each returning a Transition.

::

    reshard_from_state_dict(local, specs, layout)   plain local shards + explicit ShardSpecs
                                                    (experts=ExpertLayout: expert parallelism)
    from_dtensor(state_dict, layout)                torch DTensor TP state dict (Shard/Replicate)
    from_megatron(model, layout)                    megatron-core parallel layers
    from_fsdp(params, gen)                          FSDP2 (x TP) DTensors; defined in
                                                    :mod:`hybridflow_comm.interop.fsdp`

All four are exported from ``hybridflow_comm``.  The three defined here do the same four steps,
in this order, on every rank of ``layout``::

    1. validate this rank's tensors against the layout     local: ValueError/TypeError, no hang
    2. build the process groups (build_hybrid_groups)      collective (skipped if groups= given)
       and, when pp > 1, exchange the stages' specs         collective over the training PP group
    3. Resharder(specs, groups)                             collective (a digest of the specs)
    4. copy the local shards into its flat buffer           local, one copy per tensor

and return the :class:`~hybridflow_comm.reshard.Resharder`, a
:class:`~hybridflow_comm.transition.Transition`; ``from_fsdp`` returns an ``FSDPTransition``
(it reads the FSDP shards in place at every ``to_generation()``, see its module).  Both answer::

    t.to_generation() -> TransitionStats   collective: builds every generation shard in place
    t.named_generation_weights()          local: (name, tensor) of this rank's generation shards;
                                          views of the flat buffer, except a tensor split on a
                                          dim other than 0 (one copy of that tensor)
    t.accounting() -> TransitionStats     local: bytes sent/received, calls, peak of the last one
    t.minimum_received_bytes()            local: the bytes no transition can do without
    t.to_training()                       local: releases the generation-only pages

What is copied: step 4 copies your tensors once; the transition itself copies nothing it does not
receive.  Your tensors stay yours: after an optimizer step, copy them in again with
:func:`~hybridflow_comm.interop.state_dict.load_local_tensors` (or train on
``t.buffer.train_view(name)`` directly; with experts, ``t.copy_train_(name, tensor)`` takes a
whole expert in its logical shape, as a ``down_proj`` under generation TP is stored as its
pieces).  ``from_megatron(..., bind=True)`` instead re-binds
megatron's parameters as views of the buffer, so training writes where the transition reads and
nothing is copied again.

``t.minimum_received_bytes()`` is the least any transition must bring to a rank (its generation
shard minus the training shard it already holds); ``to_generation()`` receives exactly that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.expert_reshard import MoeResharder, check_expert_specs
from hybridflow_comm.groups import HybridGroups, build_hybrid_groups, check_pool
from hybridflow_comm.interop import dtensor as _dtensor
from hybridflow_comm.interop import megatron as _megatron
from hybridflow_comm.interop.dtensor import HFNames
from hybridflow_comm.interop.state_dict import (check_local_tensors, load_local_tensors,
                                                merge_stage_specs)
from hybridflow_comm.layout import HybridLayout
from hybridflow_comm.reshard import Resharder
from hybridflow_comm.shard_spec import Fusion, ShardSpec
from hybridflow_comm.transition import BUCKET_BYTES, check_bucket_bytes

__all__ = ["from_dtensor", "from_megatron", "reshard_from_state_dict"]


def reshard_from_state_dict(local: Mapping[str, torch.Tensor], specs: Sequence[ShardSpec],
                            layout: HybridLayout, *, experts: ExpertLayout | None = None,
                            groups: HybridGroups | None = None,
                            bucket_bytes: int = BUCKET_BYTES) -> Resharder | MoeResharder:
    """A Transition over this rank's plain training shards, described by explicit specs.

    Args:
        local: this rank's training shard of every parameter of its pipeline stage, by spec
            name (shape ``spec.shard_shape(tp)``, dtype ``spec.dtype``); under expert
            parallelism the whole experts of its EP block only.
        specs: every parameter of the model; the same list on every rank (a mixture of
            experts' expert tensors with ``ShardSpec.expert`` set).
        layout: training and generation layout; covers every rank of the job unless
            ``groups`` is given.
        experts: the experts' layout over ``layout`` (expert parallelism ``ep > 1``: the
            experts move by :class:`~hybridflow_comm.expert_reshard.ExpertResharder`).
        groups: groups already built for ``layout`` (e.g. on a resource pool).
        bucket_bytes: bucket size of the coalesced collectives.

    Returns:
        The Resharder, or with ``ep > 1`` the
        :class:`~hybridflow_comm.expert_reshard.MoeResharder` (either a Transition), in
        training mode, holding a copy of ``local``.

    Collective over the layout's ranks; every input is checked locally first.
    """
    rank = _layout_rank(layout, groups, bucket_bytes)
    if experts is not None and experts.hybrid != layout:
        raise ValueError(f"experts are laid out over {experts.hybrid}, not {layout}")
    if experts is not None and experts.ep > 1:
        check_expert_specs([s for s in specs if s.expert is not None], experts)
    check_local_tensors(specs, local, layout.train, rank, experts)
    groups = build_hybrid_groups(layout) if groups is None else groups
    if experts is None or experts.ep == 1:
        return _loaded(list(specs), groups, local, bucket_bytes)
    rs = MoeResharder(list(specs), groups, experts, bucket_bytes=bucket_bytes,
                      device=_device_of(local))
    for name, t in local.items():
        rs.copy_train_(name, t)
    return rs


def from_dtensor(state_dict: Mapping[str, torch.Tensor], layout: HybridLayout, *,
                 tp_axis: int | str = "tp", fusions: Mapping[str, Fusion] | None = None,
                 hf_names: HFNames | None = None, groups: HybridGroups | None = None,
                 bucket_bytes: int = BUCKET_BYTES) -> Resharder:
    """A Transition over a tensor-parallel DTensor state dict (e.g. ``parallelize_module``'s).

    Args:
        state_dict: this rank's pipeline stage, name -> DTensor (``Shard(d)`` or
            ``Replicate()`` on the TP mesh axis, ``Replicate()`` elsewhere) or plain tensor
            (replicated).
        layout: training and generation layout; the mesh's TP axis must be the training TP
            group (see :mod:`hybridflow_comm.interop.dtensor`).
        tp_axis: mesh axis name or index of tensor parallelism.
        fusions: fused layouts by name (e.g. ``QKVFusion`` for a per-query-group qkv).
        hf_names: Hugging Face names by name (mapping or callable), for
            ``named_generation_weights()``.
        groups: groups already built for ``layout``.
        bucket_bytes: bucket size of the coalesced collectives.

    Returns:
        The Resharder (a Transition) in training mode, holding a copy of each ``to_local()``.

    Collective over the layout's ranks; placements, mesh and shapes are checked locally first.
    """
    rank = _layout_rank(layout, groups, bucket_bytes)
    specs, local = _dtensor.stage_specs_from_dtensor(state_dict, layout.train, rank,
                                                     tp_axis=tp_axis, fusions=fusions,
                                                     hf_names=hf_names)
    groups = build_hybrid_groups(layout) if groups is None else groups
    return _loaded(merge_stage_specs(specs, groups.train_pp), groups, local, bucket_bytes)


def from_megatron(model: nn.Module, layout: HybridLayout, *,
                  hf_names: Callable[[str], tuple[str, ...]] | None = None, bind: bool = False,
                  groups: HybridGroups | None = None,
                  bucket_bytes: int = BUCKET_BYTES) -> Resharder | MoeResharder:
    """A Transition over a megatron-core 0.16.1 model's parameters (this rank's stage).

    A mixture of experts (SequentialMLP experts, built with
    :func:`~hybridflow_comm.interop.megatron.interleaved_glu_layer_spec` ``(num_experts=E)``)
    is named by global expert index; with megatron's expert parallelism (``ep > 1``,
    ``expert_tensor_parallel_size=1``) its experts move by the
    :class:`~hybridflow_comm.expert_reshard.MoeResharder` over the
    :class:`~hybridflow_comm.expert_layout.ExpertLayout` whose EP groups must be megatron's
    (checked; ``bind`` is not available there).

    Args:
        model: this rank's megatron module; megatron's TP group must be the training TP group.
        layout: training and generation layout.
        hf_names: megatron name -> Hugging Face names (e.g.
            :func:`~hybridflow_comm.interop.megatron.gpt_hf_names`).
        bind: after the copy, set every ``param.data`` to its flat-buffer view, so training
            updates the buffer in place and later transitions need no copy.  Leave it False
            when something else already owns ``param.data`` (megatron's DDP grad buffers).
        groups: groups already built for ``layout``.
        bucket_bytes: bucket size of the coalesced collectives.

    Returns:
        The Resharder (a Transition) in training mode.

    Collective over the layout's ranks; partitioning and TP groups are checked locally first.
    """
    rank = _layout_rank(layout, groups, bucket_bytes)
    specs, params = _megatron.stage_specs_from_megatron(model, layout.train, rank, hf_names)
    moe = _megatron.megatron_experts(model)
    experts = None
    if moe is not None and moe[1] > 1:
        num, ep, ep_ranks = moe
        experts = ExpertLayout(layout, num, ep=ep)
        ours = next(g for g in experts.ep_groups() if rank in g)
        if ep_ranks != ours:
            raise ValueError(f"rank {rank}: megatron's expert-parallel group is {ep_ranks}, the "
                             f"expert layout's (ep={ep} over {layout.train}) {ours}")
        if bind:
            raise ValueError("bind=True with megatron's expert parallelism: a trained expert "
                             "is stored in the flat buffer's own form; use bind=False")
    groups = build_hybrid_groups(layout) if groups is None else groups
    specs = merge_stage_specs(specs, groups.train_pp)
    if experts is not None:
        return reshard_from_state_dict({n: p.detach() for n, p in params.items()}, specs,
                                       layout, experts=experts, groups=groups,
                                       bucket_bytes=bucket_bytes)
    if not bind:
        return _loaded(specs, groups, {n: p.detach() for n, p in params.items()}, bucket_bytes)
    rs = Resharder(specs, groups, bucket_bytes=bucket_bytes, device=_device_of(params))
    _megatron.bind_megatron_params(params, rs.buffer)
    return rs


def _layout_rank(layout: HybridLayout, groups: HybridGroups | None, bucket_bytes: int) -> int:
    """This process's rank in ``layout``, checking everything about the call that is local."""
    if not isinstance(layout, HybridLayout):
        raise TypeError(f"layout must be a HybridLayout, got {type(layout).__name__}")
    check_bucket_bytes(bucket_bytes)
    if groups is not None:
        if groups.layout != layout:
            raise ValueError(f"groups were built for {groups.layout}, not {layout}")
        return groups.rank
    initialized = dist.is_available() and dist.is_initialized()
    check_pool(layout, None, dist.get_world_size() if initialized else 1)
    return dist.get_rank() if initialized else 0


def _loaded(specs: list[ShardSpec], groups: HybridGroups, local: Mapping[str, torch.Tensor],
            bucket_bytes: int) -> Resharder:
    rs = Resharder(specs, groups, bucket_bytes=bucket_bytes, device=_device_of(local))
    load_local_tensors(rs.buffer, local)
    return rs


def _device_of(local: Mapping[str, torch.Tensor]) -> torch.device:
    """The buffer's device: the training tensors' (cpu for a rank that holds none)."""
    return next(iter(local.values())).device if local else torch.device("cpu")
