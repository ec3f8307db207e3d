"""Interop: shard specs and local training shards from other frameworks' parameters.

Every path produces ``(specs, local)`` for a :class:`~hybridflow_comm.reshard.Resharder`:

* :mod:`.state_dict` - a plain local state dict plus explicit ShardSpecs;
* :mod:`.dtensor` - a DTensor-sharded state dict (Shard / Replicate placements);
* :mod:`.megatron` - megatron-core parameters (``tensor_model_parallel``, ``partition_dim``,
  ``partition_stride``), with :func:`.megatron.bind_megatron_params` to alias them to the flat
  buffer; :mod:`.megatron_cpu_shim` is the only module that patches anything for CPU.

The generation side is read back with ``Resharder.named_generation_weights()``: ``(hf_name,
tensor)`` pairs, what inference engines' ``load_weights`` take.  megatron is imported lazily;
this package never imports ``engine`` or ``rlhf``.
"""

from hybridflow_comm.interop.state_dict import (check_local_tensors, from_state_dict,
                                                load_local_tensors, merge_stage_specs)

__all__ = ["check_local_tensors", "from_state_dict", "load_local_tensors", "merge_stage_specs"]
