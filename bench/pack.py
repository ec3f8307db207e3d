"""Pack/unpack of many small tensors against one memcpy of the same bytes.

    python bench/pack.py [--tensors 2000] [--total-mib 256] [--repeat 5] [--json PATH]

Prints the bandwidth of the C++ pack and unpack as a fraction of a single contiguous copy of
the same number of bytes (torch ``copy_``, same threads), measured in one run. Goal: >= 0.8.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import write_json  # noqa: E402
from bench.timing import median_time  # noqa: E402
from hybridflow_comm.pack import pack_tensors, plan_pack, unpack_tensors  # noqa: E402


def make_tensors(n: int, total_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` float32 tensors of log-uniform sizes adding up to about ``total_bytes``."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(n, generator=g) * 6.0)
    numels = (weights / weights.sum() * (total_bytes // 4)).long().clamp(min=1)
    return [torch.ones(int(k)) for k in numels]




def run(n_tensors: int = 2000, total_mib: int = 256, repeat: int = 5) -> dict:
    tensors = make_tensors(n_tensors, total_mib << 20)
    offsets, total = plan_pack(tensors)
    flat = torch.empty(total, dtype=torch.uint8)
    outs = [torch.empty_like(t) for t in tensors]
    src = torch.empty(total, dtype=torch.uint8).fill_(1)
    dst = torch.empty(total, dtype=torch.uint8)
    # one untimed call first: the first touch of the pages
    t_memcpy, _ = median_time(lambda: dst.copy_(src), repeat)
    t_pack, _ = median_time(lambda: pack_tensors(tensors, flat, offsets), repeat)
    t_unpack, _ = median_time(lambda: unpack_tensors(flat, outs, offsets), repeat)
    gib = total / 2**30
    return {
        "tensors": n_tensors, "bytes": total, "threads": torch.get_num_threads(),
        "memcpy_gib_s": gib / t_memcpy, "pack_gib_s": gib / t_pack, "unpack_gib_s": gib / t_unpack,
        "pack_ratio": t_memcpy / t_pack, "unpack_ratio": t_memcpy / t_unpack,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = run(a.tensors, a.total_mib, a.repeat)
    print(f"{r['tensors']} tensors, {r['bytes'] / 2**20:.0f} MiB, {r['threads']} threads")
    print(f"  memcpy  {r['memcpy_gib_s']:6.2f} GiB/s")
    print(f"  pack    {r['pack_gib_s']:6.2f} GiB/s  ratio {r['pack_ratio']:.2f} of memcpy")
    print(f"  unpack  {r['unpack_gib_s']:6.2f} GiB/s  ratio {r['unpack_ratio']:.2f} of memcpy")
    write_json(r, a.json, indent=2)


if __name__ == "__main__":
    main()
