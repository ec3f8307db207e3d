"""Training -> generation transition: hybridflow against its baselines, measured in one run.

    python bench/transition.py --nproc 4 --train 1,4,1 --gen 1,2 --size-mb 128 [--repeat 5]
                               [--bucket-mb 32] [--json PATH] [--source specs|fsdp]

Starts its own gloo ranks, builds a synthetic Llama-shaped parameter set of about ``size-mb``
MiB (bf16), and runs every method ``repeat`` times after one warm-up.  A method's time is the
slowest rank's, median over repeats.  ``raw_allgather_time_s`` is one single-bucket
``all_gather_into_tensor`` of the same bytes in the same micro-DP groups: the practical limit.

``--source fsdp`` benchmarks the FSDP2 source instead (``--train`` is ignored: the model is
``fully_shard`` ed over all ``--nproc`` ranks); see :mod:`bench.transition_fsdp`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import transition_fsdp  # noqa: E402
from bench.ranks import launch, max_over_ranks  # noqa: E402
from hybridflow_comm.baselines import TRANSITIONS, make_transition
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout, parse_sizes
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 1024, 16, 8, 2816, 8192


def llama_like_specs(size_mb: float, pp: int, dtype=torch.bfloat16) -> list[ShardSpec]:
    """A Llama-shaped parameter set of about ``size_mb`` MiB whose layers split over ``pp``."""
    hd = HIDDEN // HEADS
    item = dtype.itemsize
    layer_numel = ((HEADS + 2 * KV_HEADS) * hd * HIDDEN + HIDDEN * HIDDEN + 3 * FFN * HIDDEN
                   + 2 * HIDDEN)
    edge_numel = 2 * VOCAB * HIDDEN + HIDDEN
    layers = max(1, round((size_mb * 2**20 / item - edge_numel) / layer_numel))
    layers = max(pp, layers // pp * pp)
    per_stage = layers // pp
    specs = [ShardSpec("embed", (VOCAB, HIDDEN), dtype=dtype, partition_dim=0, stage=0,
                       hf_names=("model.embed_tokens.weight",))]
    for i in range(layers):
        st = i // per_stage
        p = f"model.layers.{i}."
        specs += [
            ShardSpec(p + "qkv", ((HEADS + 2 * KV_HEADS) * hd, HIDDEN), dtype=dtype,
                      partition_dim=0, stage=st, fusion=QKVFusion(HEADS, KV_HEADS, hd)),
            ShardSpec(p + "o_proj", (HIDDEN, HIDDEN), dtype=dtype, partition_dim=1, stage=st),
            ShardSpec(p + "gate_up", (2 * FFN, HIDDEN), dtype=dtype, partition_dim=0, stage=st,
                      fusion=GateUpFusion()),
            ShardSpec(p + "down_proj", (HIDDEN, FFN), dtype=dtype, partition_dim=1, stage=st),
            ShardSpec(p + "input_norm", (HIDDEN,), dtype=dtype, partition_dim=None, stage=st),
            ShardSpec(p + "post_norm", (HIDDEN,), dtype=dtype, partition_dim=None, stage=st),
        ]
    specs += [ShardSpec("final_norm", (HIDDEN,), dtype=dtype, partition_dim=None, stage=pp - 1),
              ShardSpec("lm_head", (VOCAB, HIDDEN), dtype=dtype, partition_dim=0, stage=pp - 1)]
    return specs


def formula_bytes(method: str, hl: HybridLayout, model_bytes: int) -> float:
    """Paper, Table 2: communication volume per rank."""
    t, p, d = hl.train.tp, hl.train.pp, hl.train.dp
    tg, pg = hl.tp_g, hl.pp_g
    return {"ds_chat": (t * p * d - 1) / (t * p * d),
            "hybridflow_v": (t * p - 1) / (t * p),
            "hybridflow": (t * p - tg * pg) / (tg * pg * t * p)}[method] * model_bytes


def _rank_main(rank: int, world: int, cfg: dict):
    hl = HybridLayout(ParallelLayout(*cfg["train"]), pp_g=cfg["gen"][0], tp_g=cfg["gen"][1])
    groups = build_hybrid_groups(hl)
    specs = llama_like_specs(cfg["size_mb"], hl.train.pp)
    out = {"methods": {}}
    for method in TRANSITIONS:
        rs = make_transition(method, specs, groups, bucket_bytes=cfg["bucket_mb"] << 20)
        buf = rs.weights.buffer
        tp_rank = hl.train.coords(groups.rank).tp
        for slot in buf.specs:  # DP replicas (and TP ranks, for replicated) must agree
            if slot.own_slot is not None:
                piece = tp_rank if slot.num_slots > 1 else 0
                seed = zlib.crc32(f"{slot.name}:{piece}".encode())
                view = buf.train_view(slot.name)
                view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(seed)))
        times = []
        for it in range(cfg["repeat"] + 1):
            dist.barrier()
            stats = rs.to_generation()
            times.append(max_over_ranks(stats.time_s))
            if it == 0:
                rs.weights.verify()
            rs.to_training(release=not cfg["keep_pages"])
        out["methods"][method] = {
            "comm_bytes_per_rank": max_over_ranks(stats.received_bytes),
            "peak_weight_bytes": max_over_ranks(stats.peak_weight_bytes),
            "redundant_bytes": max_over_ranks(stats.redundant_bytes),
            "collective_calls": stats.calls,
            "time_s": statistics.median(times[1:]),
        }
        del rs, buf
    # The practical limit: one all_gather_into_tensor of the training shard bytes in the same
    # micro-DP groups (stages differ slightly in size: every rank sends the largest).
    t = hl.train
    stage_bytes = [sum(s.nbytes // (t.tp if s.partition_dim is not None else 1)
                       for s in specs if s.stage == stage) for stage in range(t.pp)]
    train_bytes = max(stage_bytes)
    inp = torch.ones(train_bytes, dtype=torch.uint8)
    outbuf = torch.empty(groups.micro_dp.size * train_bytes, dtype=torch.uint8)
    raw = []
    for _ in range(cfg["repeat"] + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if groups.micro_dp.pg is not None:
            dist.all_gather_into_tensor(outbuf, inp, group=groups.micro_dp.pg)
        raw.append(max_over_ranks(time.perf_counter() - t0))
    out["raw_allgather_time_s"] = statistics.median(raw[1:])
    out["model_bytes"] = sum(s.nbytes for s in specs)
    return out




def run(nproc: int, train: tuple[int, int, int], gen: tuple[int, int], size_mb: float,
        repeat: int = 5, bucket_mb: int = 32, keep_pages: bool = False) -> dict:
    """Run the benchmark on ``nproc`` fresh ranks; returns the JSON-ready result."""
    hl = HybridLayout(ParallelLayout(*train), pp_g=gen[0], tp_g=gen[1])
    hl.check_world_size(nproc)
    cfg = {"train": train, "gen": gen, "size_mb": size_mb, "repeat": repeat,
           "bucket_mb": bucket_mb, "keep_pages": keep_pages}
    out = launch(_rank_main, nproc, cfg)
    ds = out["methods"]["ds_chat"]["time_s"]
    for name, m in out["methods"].items():
        m["formula_bytes_per_rank"] = formula_bytes(name, hl, out["model_bytes"])
        m["ratio_vs_ds_chat"] = m["time_s"] / ds
    out["config"] = {"nproc": nproc, "train": list(train), "gen": list(gen), "size_mb": size_mb,
                     "model_bytes": out.pop("model_bytes"), "repeat": repeat,
                     "bucket_mb": bucket_mb, "micro_dp_size": hl.micro_dp_size,
                     "keep_pages": keep_pages}
    return {"config": out["config"], "methods": out["methods"],
            "raw_allgather_time_s": out["raw_allgather_time_s"]}


def print_table(result: dict) -> None:
    c = result["config"]
    print(f"train {c['train']} -> gen {c['gen']} on {c['nproc']} ranks, model "
          f"{c['model_bytes'] / 2**20:.1f} MiB, micro-DP {c['micro_dp_size']}")
    print(f"{'method':<14}{'time_s':>9}{'vs ds_chat':>12}{'recv MiB':>10}{'formula':>10}"
          f"{'peak MiB':>10}{'redund MiB':>12}{'calls':>7}")
    for name, m in result["methods"].items():
        print(f"{name:<14}{m['time_s']:>9.4f}{m['ratio_vs_ds_chat']:>12.3f}"
              f"{m['comm_bytes_per_rank'] / 2**20:>10.2f}{m['formula_bytes_per_rank'] / 2**20:>10.2f}"
              f"{m['peak_weight_bytes'] / 2**20:>10.1f}{m['redundant_bytes'] / 2**20:>12.1f}"
              f"{m['collective_calls']:>7}")
    raw = result["raw_allgather_time_s"]
    hf = result["methods"]["hybridflow"]["time_s"]
    print(f"raw single-bucket all-gather {raw:.4f} s; hybridflow / raw = "
          f"{hf / raw if raw > 0 else float('nan'):.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--train", default="1,4,1", help="PP,TP,DP")
    p.add_argument("--gen", default="1,2", help="PP_G,TP_G")
    p.add_argument("--size-mb", type=float, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=32)
    p.add_argument("--keep-pages", action="store_true",
                   help="keep generation-only pages between transitions (no release)")
    p.add_argument("--json", default=None)
    p.add_argument("--source", choices=("specs", "fsdp"), default="specs",
                   help="specs: training layout --train from shard specs; fsdp: an FSDP2 model")
    a = p.parse_args(argv)
    try:
        gen = parse_sizes(a.gen, ("pp_g", "tp_g"))
        if a.source == "fsdp":
            result = transition_fsdp.run(a.nproc, gen, llama_like_specs(a.size_mb, gen[0]),
                                         a.size_mb, a.repeat, a.bucket_mb, a.keep_pages)
        else:
            train = parse_sizes(a.train, ("pp", "tp", "dp"))
            result = run(a.nproc, train, gen, a.size_mb, a.repeat, a.bucket_mb, a.keep_pages)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (transition_fsdp.print_table if a.source == "fsdp" else print_table)(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
