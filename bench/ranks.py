"""Start fresh gloo ranks for a benchmark and bring rank 0's result back.

    result = launch(body, nproc, cfg)      # body(rank, world, cfg) -> result (rank 0's is kept)

``body`` must be a module-level function.  Each rank gets ``cpu_count // nproc`` intra-op
threads, so ranks do not fight over the cores.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over all ranks (the slowest rank bounds a collective phase)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed_over_ranks(fn) -> float:
    """``fn()`` after a barrier: the slowest rank's seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return max_over_ranks(time.perf_counter() - t0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, body, world: int, port: int, cfg: dict, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    result = body(rank, world, cfg)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def launch(body, nproc: int, cfg: dict, timeout_s: float = 60.0):
    """Run ``body(rank, nproc, cfg)`` on ``nproc`` spawned ranks; return rank 0's result."""
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_entry, args=(body, nproc, _free_port(), cfg, queue), nprocs=nproc,
                       join=True, start_method="spawn")
    return queue.get(timeout=timeout_s)


def mem_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
