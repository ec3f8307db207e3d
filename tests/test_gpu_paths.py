"""GPU paths: CUDA kernel and the cupy/NCCL backend. Skipped on machines without CUDA; the
Triton kernel is covered on CPU by tests/test_strided.py (TRITON_INTERPRET=1)."""

import socket

import pytest
import torch

from hybridflow_comm import _C

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_swap_kernel_matches_cpu():
    if not _C.has_cuda():
        pytest.skip("extension built without CUDA sources")
    src = torch.randn(3, 5, 1000)
    ref = torch.empty(5, 3, 1000)
    _C.unstack_to_logical(src, ref)
    out = torch.empty(5, 3, 1000, device="cuda")
    _C.swap_leading_dims_cuda(src.cuda(), out)
    assert torch.equal(out.cpu(), ref)


def _nccl_rank(rank, world, port, queue):
    import torch.distributed as dist

    from hybridflow_comm.flat_buffer import FlatParamBuffer
    from hybridflow_comm.gpu.nccl_cupy import CupyNcclBackend
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from hybridflow_comm.reshard import Resharder
    from hybridflow_comm.shard_spec import ShardSpec, slot_specs, stacked_to_logical

    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    hl = HybridLayout(ParallelLayout(1, world, 1), pp_g=1, tp_g=1)
    groups = build_hybrid_groups(hl)
    specs = [ShardSpec("col", (8 * world, 16), partition_dim=0),
             ShardSpec("row", (16, 8 * world), partition_dim=1)]
    full = {s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(1)) for s in specs}
    buf = FlatParamBuffer(slot_specs(specs, hl, rank), device="cuda")
    rs = Resharder(specs, groups, buffer=buf, backend=CupyNcclBackend())
    for s in specs:
        buf.train_view(s.name).copy_(full[s.name].chunk(world, s.partition_dim)[rank])
    rs.to_generation()
    torch.cuda.synchronize()
    ok = all(torch.equal(stacked_to_logical(buf.gen_view(s.name), s).cpu(), full[s.name])
             for s in specs)
    rs.verify()
    queue.put((rank, ok))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cupy_nccl_backend_reshard():
    pytest.importorskip("cupy")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_nccl_rank, args=(2, port, queue), nprocs=2, start_method="spawn")
    results = sorted(queue.get(timeout=60) for _ in range(2))
    assert results == [(0, True), (1, True)]
