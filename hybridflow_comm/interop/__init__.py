"""Interop: shard specs and local training shards from other frameworks' parameters.

Every path produces ``(specs, local)`` for a :class:`~hybridflow_comm.reshard.Resharder`:

* :mod:`.state_dict` - a plain local state dict plus explicit ShardSpecs;
* :mod:`.dtensor` - a DTensor-sharded state dict (Shard / Replicate placements);
* :mod:`.fsdp` - an FSDP2 / ZeRO-3 state dict (``Shard(0)`` over a dp mesh axis, optionally x
  TP): :func:`.fsdp.from_fsdp` returns its own transition (generation shards in a separate
  buffer, minimum bytes; pure plan maths in :mod:`.fsdp_plan`), imported on first use;
* :mod:`.megatron` - megatron-core parameters (``tensor_model_parallel``, ``partition_dim``,
  ``partition_stride``), with :func:`.megatron.bind_megatron_params` to alias them to the flat
  buffer; :mod:`.megatron_cpu_shim` is the only module that patches anything for CPU.

The generation side is read back with ``Resharder.named_generation_weights()``: ``(hf_name,
tensor)`` pairs, what inference engines' ``load_weights`` take.  megatron is imported lazily;
this package never imports ``engine`` or ``rlhf``.
"""

from hybridflow_comm.interop.state_dict import (check_local_tensors, from_state_dict,
                                                load_local_tensors, merge_stage_specs)

__all__ = ["check_local_tensors", "from_state_dict", "load_local_tensors", "merge_stage_specs",
           "from_fsdp", "FSDPTransition", "ConcatFusion"]


def __getattr__(name: str):
    """The FSDP entry point, imported on first use (it loads torch.distributed.tensor)."""
    if name in ("from_fsdp", "FSDPTransition", "ConcatFusion"):
        from hybridflow_comm.interop import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'hybridflow_comm.interop' has no attribute {name!r}")
