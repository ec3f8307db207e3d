"""Reshard a model sharded with FSDP2 (fully_shard) over 4 ranks to generation tp=2.

    torchrun --nproc_per_node=4 examples/reshard_fsdp2.py [--device auto|cpu|cuda]
"""
import argparse
import os
import sys
from collections import OrderedDict
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hybridflow_comm as hc
from hybridflow_comm.devices import init_process_group, resolve_device

cli = argparse.ArgumentParser()
cli.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
device = resolve_device(cli.parse_args().device)  # cuda:<LOCAL_RANK> or cpu
init_process_group(device, timeout_s=300)  # gloo on cpu, NCCL (and gloo) on cuda
rank = dist.get_rank()

# A torchtitan-style Llama's weights and names (forward left out), from one seed on every rank.
V, H, FF, LAYERS = 512, 256, 512, 2
linear = partial(nn.Linear, bias=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(H), nn.RMSNorm(H)
        self.wq, self.wk, self.wv, self.wo = (linear(H, H) for _ in range(4))
        self.w1, self.w2, self.w3 = linear(H, FF), linear(FF, H), linear(H, FF)


torch.manual_seed(0)
model = nn.Sequential(OrderedDict(
    tok_embeddings=nn.Embedding(V, H), layers=nn.Sequential(*(Block() for _ in range(LAYERS))),
    norm=nn.RMSNorm(H), output=linear(H, V)))
model.to(device)  # initialised on the host from the seed, the same on every device
full = {n: t.detach().clone() for n, t in model.state_dict().items()}

mesh = init_device_mesh(device.type, (4,), mesh_dim_names=("dp",))
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)  # every parameter: a DTensor, Shard(0) over "dp"

# FSDP knows no tensor parallelism: say how generation splits each tensor (0 = by rows).
tp_dims = {n: None if "norm" in n else 1 if n.endswith(("wo.weight", "w2.weight")) else 0
           for n in full}
transition = hc.from_fsdp(dict(model.named_parameters()), (1, 2), tp_dims=tp_dims)
stats = transition.to_generation()

# Every generation tensor against the full one: generation TP rank tp_g's chunk of it.
tp_g_rank = transition.placement.coord(rank)[1]
gen = dict(transition.named_generation_weights())
want = {n: t if tp_dims[n] is None else t.chunk(2, tp_dims[n])[tp_g_rank]
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
    print(f"reshard_fsdp2: {len(gen)} tensors {verdict}, received "
          f"{stats.received_bytes / 2**20:.2f} MiB/rank (minimum {minimum / 2**20:.2f} MiB)")
transition.to_training()
dist.destroy_process_group()
sys.stdout.flush()  # exit without interpreter teardown: it can abort in gloo's threads
os._exit(1 if failures.item() else 0)
