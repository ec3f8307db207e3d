"""Reshard a model parallelized with torch's DTensor TP plan: train tp=4 -> generate tp=2.

    torchrun --nproc_per_node=4 examples/reshard_dtensor_tp.py [--device auto|cpu|cuda]
"""
import argparse
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import hybridflow_comm as hc
from hybridflow_comm.devices import init_process_group, resolve_device

cli = argparse.ArgumentParser()
cli.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
device = resolve_device(cli.parse_args().device)  # cuda:<LOCAL_RANK> or cpu
init_process_group(device, timeout_s=300)  # gloo on cpu, NCCL (and gloo) on cuda
rank = dist.get_rank()
layout = hc.HybridLayout(hc.ParallelLayout(pp=1, tp=4, dp=1), pp_g=1, tp_g=2)

# A torchtitan-style Llama (its names and TP plan), from one seed on every rank.
V, H, FF, LAYERS = 512, 256, 512, 2
linear = partial(nn.Linear, bias=False)
torch.manual_seed(0)
model = nn.ModuleDict({"tok_embeddings": nn.Embedding(V, H), "layers": nn.ModuleList(
    nn.ModuleDict({"attention_norm": nn.RMSNorm(H), "wq": linear(H, H), "wk": linear(H, H),
                   "wv": linear(H, H), "wo": linear(H, H), "ffn_norm": nn.RMSNorm(H),
                   "w1": linear(H, FF), "w2": linear(FF, H), "w3": linear(H, FF)})
    for _ in range(LAYERS)), "norm": nn.RMSNorm(H), "output": linear(H, V)})
model.to(device)  # initialised on the host from the seed, the same on every device
full = {n: t.detach().clone() for n, t in model.state_dict().items()}

mesh = init_device_mesh(device.type, (4,), mesh_dim_names=("tp",))
plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel()}
plan |= {f"layers.*.{w}": ColwiseParallel() for w in ("wq", "wk", "wv", "w1", "w3")}
plan |= {f"layers.*.{w}": RowwiseParallel() for w in ("wo", "w2")}
parallelize_module(model, mesh, plan)

state_dict = model.state_dict()  # DTensors: Shard(0) / Shard(1) on "tp"; norms plain tensors
transition = hc.from_dtensor(state_dict, layout)
stats = transition.to_generation()

# Every generation tensor against the full one, cut where the DTensor placement says.
tp_g_rank = layout.gen_coords(rank).tp_g
dims = {n: t.placements[0].dim if isinstance(t, DTensor) and t.placements[0].is_shard()
        else None for n, t in state_dict.items()}
want = {n: t if dims[n] is None else t.chunk(layout.tp_g, dims[n])[tp_g_rank]
        for n, t in full.items()}
gen = dict(transition.named_generation_weights())
bad = [n for n in gen.keys() | want.keys()
       if n not in gen or n not in want or not torch.equal(gen[n], want[n])]
if bad:
    print(f"rank {rank}: generation tensors differ: {sorted(bad)}", file=sys.stderr)
failures = torch.tensor([len(bad)], device=device)
dist.all_reduce(failures)
minimum = transition.minimum_received_bytes()
if rank == 0:
    verdict = f"{failures.item()} MISMATCHED" if failures else "bit-exact"
    print(f"reshard_dtensor_tp: {len(gen)} tensors {verdict}, received "
          f"{stats.received_bytes / 2**20:.2f} MiB/rank (minimum {minimum / 2**20:.2f} MiB)")
transition.to_training()
dist.destroy_process_group()
sys.stdout.flush()  # exit without interpreter teardown: it can abort in gloo's threads
os._exit(1 if failures.item() else 0)
