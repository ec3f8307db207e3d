"""Reshard a megatron-core GPTModel (CPU, gloo): train tp=4 -> generate tp=2, Hugging Face names.

    torchrun --nproc_per_node=4 examples/reshard_megatron.py [--device auto|cpu|cuda]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

import hybridflow_comm as hc
from hybridflow_comm.devices import init_process_group, resolve_device
from hybridflow_comm.interop import megatron_cpu_shim as shim
from hybridflow_comm.interop.megatron import gpt_hf_names, interleaved_glu_layer_spec

cli = argparse.ArgumentParser()
cli.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
device = resolve_device(cli.parse_args().device)  # cuda:<LOCAL_RANK> or cpu
init_process_group(device, timeout_s=300)  # gloo on cpu, NCCL (and gloo) on cuda
rank = dist.get_rank()
layout = hc.HybridLayout(hc.ParallelLayout(pp=1, tp=4, dp=1), pp_g=1, tp_g=2)
parallel_state.initialize_model_parallel(4, create_gloo_process_groups=False)
V, H, HEADS, GROUPS, FF, LAYERS = 512, 256, 8, 4, 512, 2
config = TransformerConfig(
    num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS,
    ffn_hidden_size=FF, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
    use_te_activation_func=True, bias_activation_fusion=False, add_bias_linear=False,
    use_cpu_initialization=True, tensor_model_parallel_size=4)
with shim.cpu_device():
    shim.seed_model_parallel_rng(0)
    model = GPTModel(config, interleaved_glu_layer_spec(), vocab_size=V, max_sequence_length=64,
                     position_embedding_type="rope").to(device)  # built on the host

# A seeded Hugging Face Llama checkpoint loaded the megatron way: q/k/v, gate/up fused, chunked.
KV = GROUPS * H // HEADS
layer = {"input_layernorm": (H,), "self_attn.q_proj": (H, H), "self_attn.k_proj": (KV, H),
         "self_attn.v_proj": (KV, H), "self_attn.o_proj": (H, H), "mlp.gate_proj": (FF, H),
         "post_attention_layernorm": (H,), "mlp.up_proj": (FF, H), "mlp.down_proj": (H, FF)}
shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
shapes |= {f"model.layers.{i}.{n}.weight": s for i in range(LAYERS) for n, s in layer.items()}
g = torch.Generator().manual_seed(0)
hf = {n: torch.randn(s, generator=g).to(device) for n, s in shapes.items()}
fuse = {1: lambda t: t, 2: hc.GateUpFusion().fuse, 3: hc.QKVFusion(HEADS, GROUPS, H // HEADS).fuse}
tp_rank = parallel_state.get_tensor_model_parallel_rank()
with torch.no_grad():
    for name, p in model.named_parameters():
        t = fuse[len(gpt_hf_names(name))](*(hf[n] for n in gpt_hf_names(name)))
        split = getattr(p, "tensor_model_parallel", False)
        p.copy_(t.chunk(4, p.partition_dim)[tp_rank] if split else t)

# bind=True: the megatron parameters become views of the flat buffer (training writes there).
transition = hc.from_megatron(model, layout, hf_names=gpt_hf_names, bind=True)
stats = transition.to_generation()

# Each generation tensor vs the checkpoint cut as engines do (o/down by columns, norms whole).
tp_g_rank = layout.gen_coords(rank).tp_g
cols = ("o_proj.weight", "down_proj.weight")
want = {n: t if "norm" in n else t.chunk(layout.tp_g, 1 if n.endswith(cols) else 0)[tp_g_rank]
        for n, t in hf.items()}
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
    print(f"reshard_megatron: {len(gen)} tensors {verdict}, received "
          f"{stats.received_bytes / 2**20:.2f} MiB/rank (minimum {minimum / 2**20:.2f} MiB)")
transition.to_training()
dist.destroy_process_group()
sys.stdout.flush()  # exit without interpreter teardown: it can abort in gloo's threads
os._exit(1 if failures.item() else 0)
