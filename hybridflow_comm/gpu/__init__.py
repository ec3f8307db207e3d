"""GPU adapters behind the toolkit's interfaces, import-guarded (CPU machines never need them).

* :mod:`.triton_pack`: Triton kernel for the stacked <-> logical copy of non-leading partition
  dims (runs on CPU under ``TRITON_INTERPRET=1``, which is how it is tested here).
* :mod:`.nccl_cupy`: a communicator on NCCL through cupy, for CUDA tensors.
* CUDA sources in ``csrc/cuda/`` are compiled into ``hybridflow_comm._C`` only when the installed
  torch has CUDA (``_C.has_cuda()``).
"""
