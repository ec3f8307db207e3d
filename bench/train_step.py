"""Tokens/s of one training step of the native engine for several layouts on 4 gloo ranks,
against the single-process step on the same global batch, measured in one run.

    python bench/train_step.py [--hidden 256] [--layers 4] [--seq 128] [--micro 8] [--json PATH]

Every layout runs the same global batch (``--micro`` micro-batches of ``--batch`` x ``--seq``
tokens) with the same weights; the ratio column is layout tokens/s over the faster of the single-process runs
(1 thread and all cores: on a loaded machine a multi-threaded step can be much slower than a
single-threaded one).  Each of the 4 ranks gets ``cores / 4`` intra-op threads (at least 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

LAYOUTS = [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]


def _loss(outputs, mb):
    return -outputs["log_probs"].mean()


def _time_steps(layout, config, args, micro_batches) -> float:
    """Median seconds of a train step on this rank's layout (collective over the layout)."""
    import torch.distributed as dist

    from engine.llama_spec import init_full_state_dict
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.train import OptimConfig, TrainEngine
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    groups = build_hybrid_groups(HybridLayout(ParallelLayout(*layout), 1, 1))
    model = ParallelLlama(config, groups)
    load_full_state_dict(model, init_full_state_dict(config, seed=0))
    eng = TrainEngine(model, OptimConfig(lr=1e-4))
    per_dp = len(micro_batches) // layout[2]
    mine = micro_batches[model.coords.dp * per_dp:(model.coords.dp + 1) * per_dp]
    times = []
    for _ in range(args.warmup + args.repeat):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        eng.train_step(mine, _loss, temperature=1.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[args.warmup:])


def _config(args):
    from engine.llama_spec import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.hidden * 8 // 3 // 4 * 4, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads, tie_word_embeddings=False)


def _batches(args):
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)}
            for _ in range(args.micro)]


def _rank_main(rank: int, world: int, store_path: str, args, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    config, mbs = _config(args), _batches(args)
    for layout in LAYOUTS:
        t = _time_steps(layout, config, args, mbs)
        if rank == 0:
            queue.put((layout, t))
    dist.destroy_process_group()


def run(args) -> list[dict]:
    import torch

    tokens = args.micro * args.batch * args.seq
    singles = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        singles[threads] = _time_steps((1, 1, 1), _config(args), args, _batches(args))
    t_single = min(singles.values())  # the baseline is the faster thread count
    rows = [{"layout": f"1-1-1 (1 proc, {n} thr)", "step_s": t, "tokens_s": tokens / t,
             "ratio": t_single / t} for n, t in singles.items()]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, 4, os.path.join(tmp, "store"), args,
                                                      queue)) for r in range(4)]
        for p in procs:
            p.start()
        for _ in LAYOUTS:
            layout, t = queue.get(timeout=1800)
            rows.append({"layout": "-".join(map(str, layout)), "step_s": t,
                         "tokens_s": tokens / t, "ratio": t_single / t})
        for p in procs:
            p.join()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("vocab", 4096), ("hidden", 256), ("layers", 4), ("heads", 8),
                          ("kv-heads", 4), ("seq", 128), ("batch", 2), ("micro", 8),
                          ("warmup", 1), ("repeat", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = run(args)
    print(f"cores={os.cpu_count()} hidden={args.hidden} layers={args.layers} "
          f"tokens/step={args.micro * args.batch * args.seq}")
    print(f"{'layout p-t-d':<24}{'step s':>10}{'tokens/s':>12}{'vs 1 proc':>11}")
    for r in rows:
        print(f"{r['layout']:<24}{r['step_s']:>10.3f}{r['tokens_s']:>12.0f}{r['ratio']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
