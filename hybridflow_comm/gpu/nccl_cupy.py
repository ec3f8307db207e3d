"""A communicator backend on NCCL through cupy, for CUDA tensors (import-guarded).

Implements :class:`hybridflow_comm.comm.Backend`.  One NCCL communicator per group, made on
first use: group rank 0 creates the unique id and sends it over the group's existing
torch.distributed group (gloo), every member then joins.  Tensors move as raw bytes
(``ncclUint8``), so every dtype works, bf16 included.  Strided views (the resharder's buckets)
are packed into one contiguous buffer per call, as NCCL needs contiguous memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow_comm.groups import Group

try:  # import-guarded: cupy only exists on GPU machines
    import cupy
    from cupy.cuda import nccl
except ImportError:  # pragma: no cover
    cupy = None
    nccl = None

AVAILABLE = cupy is not None and torch.cuda.is_available()


class CupyNcclBackend:
    """NCCL collectives through cupy on the current CUDA stream."""

    def __init__(self) -> None:
        if not AVAILABLE:
            raise RuntimeError("CupyNcclBackend needs cupy and a CUDA device")
        self._comms: dict[tuple[int, ...], object] = {}

    def _comm(self, group: Group):
        comm = self._comms.get(group.ranks)
        if comm is None:
            uid = [nccl.get_unique_id() if group.rank == 0 else None]
            dist.broadcast_object_list(uid, src=group.ranks[0], group=group.pg)
            comm = nccl.NcclCommunicator(group.size, uid[0], group.rank)
            self._comms[group.ranks] = comm
        return comm

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
        src, dst = inp.contiguous().view(torch.uint8), out.view(torch.uint8)
        self._comm(group).allGather(src.data_ptr(), dst.data_ptr(), src.numel(),
                                    nccl.NCCL_UINT8, self._stream())

    def all_gather_views(self, outputs: list[torch.Tensor], group: Group) -> None:
        mine = outputs[group.rank].contiguous()
        flat = torch.empty((group.size, *mine.shape), dtype=mine.dtype, device=mine.device)
        self.all_gather_into(flat.view(-1), mine.view(-1), group)
        for k, view in enumerate(outputs):
            if k != group.rank:
                view.copy_(flat[k])

    def broadcast_(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        if not tensor.is_contiguous():
            raise ValueError("broadcast_ needs a contiguous tensor")
        buf = tensor.view(torch.uint8)
        self._comm(group).broadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                    nccl.NCCL_UINT8, root, self._stream())
