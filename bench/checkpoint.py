"""Seconds and peak RSS per rank of a checkpoint save and load: sharded DCP (every rank writes
and reads its own blocks) against gathering everything to rank 0, measured in one run, for a
tiny and a larger model at 1, 2 and 4 gloo ranks; and the HF export, gathered vs streamed.

    python -m bench.checkpoint [--models tiny,large] [--worlds 1,2,4] [--json PATH]

For each world size and method, fresh ranks build a model (layout 1-1-1, 1-2-1, 1-2-2),
take one AdamW step (so the moments exist), then save (weights + both Adam moments + step)
and load into the same model, ``--repeat`` times (fastest time, highest peak).  Methods:

* ``gather_rank0`` (the baseline): the DP-rank-0 replica gathers every global tensor to
  rank 0, which writes them (safetensors, fsynced, atomic folder); on load every rank reads the
  whole state and cuts its shards.  Sending the state to the ranks through the controller's
  socket is left out, so this baseline is a lower bound of a single-writer checkpoint's cost.
* ``sharded``: :class:`rlhf.workers.common.ShardCheckpoint` (DCP, every rank its own file,
  written in a background thread; ``save_blocking_s`` is the part training waits for).
* ``hf_gathered`` / ``hf_streamed``: the HF export, :func:`engine.hf_interop.save_hf_checkpoint`
  (whole model on rank 0) / :func:`engine.hf_interop.stream_hf_checkpoint` (one tensor).

``peak_rss_mb`` is each rank's VmHWM during the phase (reset through /proc/self/clear_refs,
after ``malloc_trim``, before it), ``extra_rss_mb`` the peak minus the RSS at its start.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import multiprocessing as mp
import os
import tempfile
import time

MODELS = {"tiny": dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2),
          "large": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                        num_layers=8, num_heads=8, num_kv_heads=4)}
LAYOUTS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (1, 2, 2)}
METHODS = ("gather_rank0", "sharded", "hf_gathered", "hf_streamed")


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_peak() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back first
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


class _Phase:
    """Seconds, peak RSS and extra RSS of one phase on this rank (barriers around it)."""

    def __init__(self, barrier) -> None:
        self.barrier = barrier

    def __enter__(self):
        self.barrier()
        _reset_peak()
        self.rss0 = _status_mb("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.barrier()
        self.s = time.perf_counter() - self.t0
        self.peak = _status_mb("VmHWM")
        self.extra = self.peak - self.rss0


def _gather_save(model, engine, folder: str) -> None:
    """The old path: global tensors to rank 0, which writes them."""
    from engine.hf_interop import gather_full_state_dict
    from rlhf.checkpoint import MOMENTS, save_checkpoint

    weights = gather_full_state_dict(model)
    moments = {m: gather_full_state_dict(model, {n: engine.optimizer.state[p][m]
                                                 for n, p in model.params.items()})
               for m in MOMENTS}
    if weights is not None:
        save_checkpoint(folder, 1, {"model": weights} | {f"model.{m}": moments[m]
                                                         for m in MOMENTS},
                        {"optim_step": engine.step_count})


def _gather_load(model, engine, folder: str) -> None:
    """The old path: every rank holds the whole state and cuts its shards."""
    import torch

    from engine.model import load_full_state_dict
    from hybridflow_comm.shard_spec import train_shard
    from rlhf.checkpoint import MOMENTS, load_checkpoint, step_dir

    _, tensors, state = load_checkpoint(step_dir(folder, 1))
    load_full_state_dict(model, tensors["model"])
    for spec in model.local_specs:
        p = model.params[spec.name]
        engine.optimizer.state[p] = {"step": torch.tensor(float(state["optim_step"])), **{
            m: train_shard(tensors[f"model.{m}"][spec.name], spec, model.layout,
                           model.groups.rank).clone() for m in MOMENTS}}


def _trained_model(name: str, world: int):
    import torch

    from engine.llama_spec import LlamaConfig, init_full_state_dict
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.train import OptimConfig, TrainEngine
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    config = LlamaConfig(**MODELS[name], tie_word_embeddings=False)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(*LAYOUTS[world]), 1, 1))
    model = ParallelLlama(config, groups)
    load_full_state_dict(model, init_full_state_dict(config, seed=0))
    engine = TrainEngine(model, OptimConfig(lr=1e-4))
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    engine.train_step([{"input_ids": ids}], lambda out, mb: -out["log_probs"].mean(),
                      temperature=1.0)
    return model, engine


def _bench_once(method: str, model, engine, folder: str, barrier) -> dict:
    from engine.hf_interop import save_hf_checkpoint, stream_hf_checkpoint
    from rlhf.workers.common import ShardCheckpoint

    out = {}
    if method.startswith("hf_"):
        export = save_hf_checkpoint if method == "hf_gathered" else stream_hf_checkpoint
        with _Phase(barrier) as save:
            export(model, folder)
        return {"save_s": save.s, "peak_rss_mb": save.peak, "extra_rss_mb": save.extra}
    if method == "gather_rank0":
        with _Phase(barrier) as save:
            _gather_save(model, engine, folder)
        with _Phase(barrier) as load:
            _gather_load(model, engine, folder)
    else:
        ckpt = ShardCheckpoint(model, engine)
        with _Phase(barrier) as save:
            t0 = time.perf_counter()
            ckpt.start_save(folder)
            out["save_blocking_s"] = time.perf_counter() - t0
            ckpt.finish_save()
        with _Phase(barrier) as load:
            out["read_mb"] = ckpt.load(folder) / 2**20
    return out | {"save_s": save.s, "load_s": load.s, "peak_rss_mb": max(save.peak, load.peak),
                  "save_peak_rss_mb": save.peak, "load_peak_rss_mb": load.peak,
                  "save_extra_rss_mb": save.extra, "load_extra_rss_mb": load.extra}


def _bench(method: str, name: str, world: int, tmp: str, repeat: int) -> dict:
    """Fastest seconds and highest RSS of ``repeat`` runs of ``method`` on this rank."""
    import torch.distributed as dist

    def barrier():
        if dist.is_initialized():
            dist.barrier()

    model, engine = _trained_model(name, world)
    runs = [_bench_once(method, model, engine, os.path.join(tmp, f"{name}-{method}-{i}"),
                        barrier) for i in range(repeat)]
    return {k: (min if k.endswith("_s") else max)(r[k] for r in runs) for k in runs[0]}


def _rank_main(rank: int, world: int, store: str, tmp: str, method: str, models: list[str],
               repeat: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import transformers  # noqa: F401  (the HF export's config imports it: not timed)

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=1200))
    try:
        queue.put((rank, {name: _bench(method, name, world, tmp, repeat) for name in models}))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _merge(per_rank: list[dict]) -> dict:
    """Seconds: the slowest rank; RSS and bytes read: one value per rank."""
    return {k: (max(r[k] for r in per_rank) if k.endswith("_s")
                else [round(r[k], 1) for r in per_rank]) for k in per_rank[0]}


def run(models: list[str], worlds: list[int], repeat: int = 1) -> dict:
    """``{model: {world: {method: {save_s, load_s, peak_rss_mb, ...}}}}``; every (world,
    method) in fresh rank processes, so no method inherits another's freed memory."""
    ctx = mp.get_context("spawn")
    result: dict = {name: {str(w): {} for w in worlds} for name in models}
    for world in worlds:
        for method in METHODS:
            queue = ctx.Queue()
            with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
                store = os.path.join(tmp, "store")
                procs = [ctx.Process(target=_rank_main, args=(r, world, store, tmp, method,
                                                              models, repeat, queue))
                         for r in range(world)]
                for p in procs:
                    p.start()
                per_rank = dict(queue.get(timeout=3600) for _ in procs)
                for p in procs:
                    p.join()
            for name in models:
                result[name][str(world)][method] = _merge([per_rank[r][name]
                                                           for r in range(world)])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,large", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--worlds", default="1,2,4", help="comma list of world sizes (1, 2, 4)")
    p.add_argument("--repeat", type=int, default=1, help="runs per method (fastest is kept)")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    models, worlds = args.models.split(","), [int(w) for w in args.worlds.split(",")]
    bad = [m for m in models if m not in MODELS] + [w for w in worlds if w not in LAYOUTS]
    if bad:
        raise SystemExit(f"unknown models/world sizes {bad}: models {sorted(MODELS)}, "
                         f"worlds {sorted(LAYOUTS)}")
    result = run(models, worlds, args.repeat)
    print(f"cores={os.cpu_count()}  layouts (pp, tp, dp) {LAYOUTS}")
    print(f"{'model':<7}{'W':>3} {'method':<14}{'save s':>9}{'blocking':>10}{'load s':>9}"
          f"   peak (+extra) RSS MB per rank, save / load")
    for name, worlds_out in result.items():
        for world, methods in worlds_out.items():
            for method, r in methods.items():
                if "load_s" in r:
                    peaks = "  ".join(f"{a:.0f}(+{c:.0f})/{b:.0f}(+{d:.0f})" for a, b, c, d in zip(
                        r["save_peak_rss_mb"], r["load_peak_rss_mb"], r["save_extra_rss_mb"],
                        r["load_extra_rss_mb"]))
                else:
                    peaks = "  ".join(f"{a:.0f}(+{c:.0f})" for a, c in zip(r["peak_rss_mb"],
                                                                          r["extra_rss_mb"]))
                print(f"{name:<7}{world:>3} {method:<14}{r['save_s']:>9.3f}"
                      f"{r.get('save_blocking_s', float('nan')):>10.3f}"
                      f"{r.get('load_s', float('nan')):>9.3f}   {peaks}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
