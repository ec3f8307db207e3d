"""Tokens/s of one training step of the native engine for several layouts on 4 gloo ranks,
against the single-process step on the same global batch, measured in one run.

    python bench/train_step.py [--hidden 256] [--layers 4] [--seq 128] [--micro 8] [--json PATH]
    python bench/train_step.py --dynamic [--shape small] [--rows 32] [--micro-rows 4]

``--dynamic``: one process, a batch of ``--rows`` sequences of 16..256 real tokens (seeded,
right-padded to 256) at a ``bench/shapes.py`` shape: real tokens/s of a training step with
fixed padded micro-batches of ``--micro-rows`` rows against dynamic batching by the same
padded token budget (``micro-rows x 256`` real tokens per micro-batch) with the padding
removed (engine/micro_batches.py); steps alternate between the two, medians, and both
print their loss (the same up to float32 rounding).

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
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, ROOT)

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


DYNAMIC_SEQ, DYNAMIC_MIN = 256, 16  # the batch's width and shortest sequence


def _dynamic_batch(rows: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(DYNAMIC_MIN, DYNAMIC_SEQ + 1, (rows,), generator=g)
    mask = (torch.arange(DYNAMIC_SEQ) < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (rows, DYNAMIC_SEQ), generator=g) * mask
    return ids, mask


def _masked_nll(n_micro: int, total: int):
    """Token-mean NLL over the whole batch (every real next token), whatever the split."""
    def loss(outputs, mb):
        m = (mb["attention_mask"][:, :-1] * mb["attention_mask"][:, 1:]).bool()
        lp = outputs["log_probs"].masked_fill(~m, 0.0)
        return -lp.sum() * n_micro / total
    return loss


def run_dynamic(args) -> dict:
    """Padded fixed micro-batches vs token budget + padding removal, alternating steps."""
    import torch

    from bench.shapes import get_shape
    from engine.llama_spec import init_full_state_dict
    from engine.micro_batches import partition_by_tokens
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.train import OptimConfig, TrainEngine
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    shape = get_shape(args.shape, rl=True)
    config = shape.llama_config(max_positions=DYNAMIC_SEQ, dtype=torch.float32)
    model = ParallelLlama(config, build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1,
                                                                   1)))
    full = init_full_state_dict(config, seed=0)
    load_full_state_dict(model, full)
    eng = TrainEngine(model, OptimConfig(lr=1e-9))  # steps barely move the weights
    ids, mask = _dynamic_batch(args.rows, shape.vocab)
    lengths = mask.sum(1).tolist()
    total = int((mask[:, :-1] * mask[:, 1:]).sum())
    budget = args.micro_rows * DYNAMIC_SEQ
    step = args.micro_rows
    fixed = [{"input_ids": ids[i:i + step], "attention_mask": mask[i:i + step]}
             for i in range(0, args.rows, step)]
    parts = partition_by_tokens(lengths, budget)
    dynamic = [{"input_ids": ids[p], "attention_mask": mask[p]} for p in parts]
    paths = {"padded": (fixed, False), "dynamic": (dynamic, True)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    losses = {}
    for r in range(args.warmup + args.repeat):
        for name, (mbs, packed) in paths.items():
            load_full_state_dict(model, full)  # every step from the same weights
            t0 = time.perf_counter()
            out = eng.train_step(mbs, _masked_nll(len(mbs), total), temperature=1.0,
                                 remove_padding=packed)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name] = out["loss"]
    real = sum(lengths)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": shape.describe(), "rows": args.rows, "real_tokens": real,
            "padded_tokens": args.rows * DYNAMIC_SEQ, "budget": budget,
            "micro_batches": {"padded": len(fixed), "dynamic": len(dynamic)},
            "step_s": med, "times_s": times, "loss": losses,
            "padded_tokens_per_s": real / med["padded"],
            "dynamic_tokens_per_s": real / med["dynamic"],
            "ratio": med["padded"] / med["dynamic"], "threads": torch.get_num_threads(),
            "command": " ".join(sys.argv)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("vocab", 4096), ("hidden", 256), ("layers", 4), ("heads", 8),
                          ("kv-heads", 4), ("seq", 128), ("batch", 2), ("micro", 8),
                          ("warmup", 1), ("repeat", 3), ("rows", 32), ("micro-rows", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dynamic", action="store_true",
                   help="padded fixed micro-batches vs token budget + padding removal")
    from bench.shapes import add_shape_argument
    add_shape_argument(p, default="small", rl=True)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    if args.dynamic:
        res = run_dynamic(args)
        counts = res["micro_batches"]
        print(f"shape={args.shape} rows={res['rows']} real tokens={res['real_tokens']} of "
              f"{res['padded_tokens']} padded, micro-batches padded={counts['padded']} "
              f"dynamic={counts['dynamic']} (budget {res['budget']} tokens), "
              f"threads={res['threads']}")
        for k in ("padded", "dynamic"):
            print(f"{k:<8} step {res['step_s'][k]:.3f} s  {res[k + '_tokens_per_s']:.0f} real "
                  f"tokens/s  loss {res['loss'][k]:.6f}")
        print(f"ratio dynamic/padded tokens/s = {res['ratio']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
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
