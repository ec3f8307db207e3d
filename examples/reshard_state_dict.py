"""Reshard a plain tensor-parallel state dict: train tp=4 -> generate tp=2, bit-exact.

    torchrun --nproc_per_node=4 examples/reshard_state_dict.py [--device auto|cpu|cuda]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import hybridflow_comm as hc
from hybridflow_comm.devices import init_process_group, resolve_device

cli = argparse.ArgumentParser()
cli.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
device = resolve_device(cli.parse_args().device)  # cuda:<LOCAL_RANK> or cpu
init_process_group(device, timeout_s=300)  # gloo on cpu, NCCL (and gloo) on cuda
rank = dist.get_rank()
layout = hc.HybridLayout(hc.ParallelLayout(pp=1, tp=4, dp=1), pp_g=1, tp_g=2)

# The full model, from one seed on every rank; dim 0 = column-parallel, 1 = row-parallel.
H, FF, LAYERS = 256, 512, 4
g = torch.Generator().manual_seed(0)
full, dims = {}, {}
for i in range(LAYERS):
    for name, shape, dim in [("q", (H, H), 0), ("o", (H, H), 1), ("norm", (H,), None),
                             ("up", (FF, H), 0), ("down", (H, FF), 1)]:
        full[f"layers.{i}.{name}"] = torch.randn(shape, generator=g).to(device)
        dims[f"layers.{i}.{name}"] = dim

# This rank's training shards, cut the Megatron way, and one spec per tensor.
tp_rank = layout.train.coords(rank).tp
local = {n: t if dims[n] is None else t.chunk(4, dims[n])[tp_rank] for n, t in full.items()}
specs = [hc.ShardSpec(n, t.shape, partition_dim=dims[n]) for n, t in full.items()]

transition = hc.reshard_from_state_dict(local, specs, layout)
stats = transition.to_generation()

# Every generation tensor against the full one: generation TP rank tp_g's chunk of it.
tp_g_rank = layout.gen_coords(rank).tp_g
gen = dict(transition.named_generation_weights())
want = {n: t if dims[n] is None else t.chunk(layout.tp_g, dims[n])[tp_g_rank]
        for n, t in full.items()}
bad = [n for n in gen.keys() | want.keys()
       if n not in gen or n not in want or not torch.equal(gen[n], want[n])]
if bad:
    print(f"rank {rank}: generation tensors differ: {sorted(bad)}", file=sys.stderr)
failures = torch.tensor([len(bad)], device=device)
dist.all_reduce(failures)
minimum = transition.minimum_received_bytes()
if rank == 0:
    verdict = f"{failures.item()} MISMATCHED" if failures else "bit-exact"
    print(f"reshard_state_dict: {len(gen)} tensors {verdict}, received "
          f"{stats.received_bytes / 2**20:.2f} MiB/rank (minimum {minimum / 2**20:.2f} MiB)")
transition.to_training()
dist.destroy_process_group()
sys.stdout.flush()  # exit without interpreter teardown: it can abort in gloo's threads
os._exit(1 if failures.item() else 0)
