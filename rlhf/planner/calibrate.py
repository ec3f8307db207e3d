"""Measure this machine into a :class:`DeviceProfile` with short micro-benchmarks (~10 s).

* matmul: FLOP/s of a square fp32 matmul on ``threads`` threads (one rank's share of cores)
  -> ``peak_flops`` (``mfu_*`` stay 1 minus a small margin: the benchmark already *is* the
  achievable rate).
* memcpy: bytes/s of a large tensor copy (read + write) -> ``mem_bw``.
* overhead: seconds of one small decoder-layer-like op sequence -> ``layer_overhead_s``.
* gloo all-reduce on ``world`` local processes: latency of a 4-byte all-reduce and bus
  bandwidth of a 4 MiB one -> ``intra_latency_s``/``inter_latency_s``, ``intra_bw``/``inter_bw``.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow_comm import devices
from rlhf.planner.profile import DeviceProfile


def best_time(fn, repeat: int) -> float:
    """Fastest of ``repeat`` timed calls after one warm-up (a limit is the best case)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(size: int = 512, repeat: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / best_time(lambda: torch.mm(a, b), repeat)


def memcpy_bandwidth(mib: int = 64, repeat: int = 5) -> float:
    src = torch.empty(mib << 18)                   # fp32: mib MiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src), repeat)


def layer_overhead(repeat: int = 20) -> float:
    """One tiny decoder layer's worth of small ops (norms, projections, attention, MLP)."""
    h = 64
    x = torch.randn(2, 16, h)
    w = [torch.randn(h, h) for _ in range(6)]

    def layer():
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = y @ w[0], y @ w[1], y @ w[2]
        a = torch.softmax(q @ k.transpose(1, 2) / 8.0, dim=-1) @ v
        y = x + a @ w[3]
        z = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y + (torch.nn.functional.silu(z @ w[4]) * (z @ w[5])) @ w[0]

    return best_time(layer, repeat)


def _allreduce_rank(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    cpu = torch.device("cpu")  # the host interconnect's figures (gloo)
    devices.init_process_group(cpu, 120, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                               world_size=world)
    small, big = torch.zeros(1, device=cpu), torch.zeros(1 << 20, device=cpu)  # 4 B, 4 MiB
    lat = best_time(lambda: dist.all_reduce(small), 20)
    t = best_time(lambda: dist.all_reduce(big), 5)
    if rank == 0:
        # ring all-reduce moves 2 (w-1)/w of the buffer per rank
        out.put((lat, 2 * (world - 1) / world * big.numel() * 4 / max(t - lat, 1e-9)))
    dist.destroy_process_group()


def allreduce_gloo(world: int = 2) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of gloo all-reduces among ``world`` local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
    return result


def calibrate(world: int = 4, threads: int | None = None, memory_gb: float | None = None,
              name: str = "calibrated-cpu") -> DeviceProfile:
    """Measure this machine as a profile for ``world`` ranks sharing it.

    Args:
        world: ranks that will share the machine (each gets ``cores / world`` threads).
        threads: threads per rank for the compute benchmarks (default as above, >= 1).
        memory_gb: memory per rank (default: physical memory / world).
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    cores = os.cpu_count() or 1
    threads = threads or max(1, cores // world)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # one rank alone; ranks beyond the cores share them (profile.host_cores)
        flops, bw, overhead = matmul_flops(), memcpy_bandwidth(), layer_overhead()
    finally:
        torch.set_num_threads(old)
    lat, net = allreduce_gloo(min(world, 2) if world > 1 else 2)
    if memory_gb is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory_gb = total / 2**30 / world
    return DeviceProfile(
        name=name, memory_gb=round(memory_gb, 2), peak_flops=flops, mfu_train=0.9,
        mfu_infer=0.9, mem_bw=bw, mem_bw_eff=0.9, per_node=max(world, 1), intra_bw=net,
        inter_bw=net, intra_latency_s=lat, inter_latency_s=lat, layer_overhead_s=overhead,
        call_overhead_s=20 * lat, param_bytes=4, grad_bytes=4, optim_bytes=8, act_bytes=4,
        memory_reserve=0.2, host_cores=max(1, cores // threads),
        notes=f"measured by rlhf.planner.calibrate: {cores} cores, {threads} threads per rank, "
              f"{world} ranks; matmul 512^2 fp32, memcpy 64 MiB, gloo all-reduce 4 B / 4 MiB")
