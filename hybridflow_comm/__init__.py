"""hybridflow_comm: layouts, flat parameter buffers, process groups and resharding.

The low-level toolkit of HybridFlow. Pure layout maths lives in :mod:`.layout`; the C++ core
(``hybridflow_comm._C``) owns page-aligned flat storages and multi-threaded pack/unpack.

An outside framework calls one entry per source (see :mod:`.api`): ``reshard_from_state_dict``,
``from_dtensor``, ``from_megatron``, ``from_fsdp``; each returns a :class:`Transition` with
``to_generation()``, ``to_training()``, ``named_generation_weights()``, ``accounting()`` and
``minimum_received_bytes()``.

The names below are imported on first use, so that ``python -m hybridflow_comm.layout`` does
not find its own module already imported by the package.
"""

import importlib

_EXPORTS = {
    "reshard_from_state_dict": "api", "from_dtensor": "api", "from_megatron": "api",
    "from_fsdp": "interop.fsdp",
    "Resharder": "reshard", "Transition": "transition", "TransitionStats": "transition",
    "ExpertLayout": "expert_layout", "ExpertResharder": "expert_reshard",
    "MoeResharder": "expert_reshard",
    "ShardSpec": "shard_spec", "QKVFusion": "shard_spec", "GateUpFusion": "shard_spec",
    "load_local_tensors": "interop.state_dict",
    "FlatParamBuffer": "flat_buffer", "SlotSpec": "flat_buffer",
    "Group": "groups", "HybridGroups": "groups", "build_hybrid_groups": "groups",
    "ExpertGroups": "groups", "build_expert_groups": "groups",
    "HybridLayout": "layout", "ParallelLayout": "layout",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridflow_comm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridflow_comm.{_EXPORTS[name]}"), name)
