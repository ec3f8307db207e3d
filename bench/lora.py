"""LoRA against full fine-tuning of the same model, side by side: training state and peak
memory per rank, training step time, bytes synced to the generation side per iteration, and
(``--iteration``) a whole GRPO iteration.

    python -m bench.lora [--shape small|qwen2.5-0.5b] [--rank 32] [--alpha 64]
                         [--sequences N] [--micro-batch M] [--repeat R]
                         [--iteration [--response-len N]] [--json PATH]
    python -m bench.lora --learning [--rank 32 --alpha 32 --lr-factor 10] [--png PATH]

- ``state_bytes``: what one rank holds for training, counted from its tensors after a step:
  parameters, gradient buffer, float32 masters (16-bit runs) and Adam moments.  LoRA trains
  the adapters only (``engine.lora``): the base has no gradient, master or moment.
- ``peak_rss``: the peak resident memory of a fresh process that builds the model and engine
  and takes one step, per side (``ru_maxrss``; the interpreter and torch included on both).
- ``step_s``: the median training step (``TrainEngine.train_step`` on ``--sequences``
  sequences of the shape's prompt + response length, ``--micro-batch`` per micro-batch), the
  two sides alternating in one process.
- ``sync_bytes``: what must reach the generation side after an update: every parameter for a
  full fine-tune, the adapters for LoRA (the frozen base moved once, then kept:
  ``engine.hybrid_engine``); the goal is >= 20x fewer at rank 32 on ``qwen2.5-0.5b``.
- ``--iteration``: ``rlhf.train`` GRPO on 2 ranks (trained tp=2, generating unsplit) at the
  shape, full and LoRA (``bench/e2e.py``'s setup): median iteration seconds after the first,
  the measured ``reshard/bytes`` of the later iterations and the peak RSS per rank.

``--learning``: the main job's GRPO (``rlhf.main_job``'s settings, its cached SFT warm start)
trained in full and with LoRA at ``--lr-factor`` times the full learning rate; the held-out
greedy accuracy curves of both (``--png``) and the final gap (goal: within 0.05).

Runs on the CPU in float32 (``--shape small``: seconds; ``qwen2.5-0.5b``: minutes, its full
side holding about 8 GB of training state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.report import write_json  # noqa: E402
from bench.shapes import BenchShape, add_shape_argument, get_shape  # noqa: E402
from bench.timing import interleaved_median_times  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("full", "lora")


def config_of(shape: BenchShape):
    """The shape's engine config in float32 (the CPU's training precision)."""
    return shape.llama_config(dtype=torch.float32)


def build(shape: BenchShape, lora, seed: int = 0):
    """One rank's model (random base, fresh adapters when ``lora``) and its TrainEngine."""
    from engine.llama_spec import init_full_state_dict
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.train import OptimConfig, TrainEngine
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    cfg = config_of(shape)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups, lora=lora)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=seed))
    return model, TrainEngine(model, OptimConfig(lr=1e-4, max_grad_norm=1.0))


def micro_batches(shape: BenchShape, sequences: int, micro: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    seq = shape.prompt_len + shape.response_len
    vocab = shape.tokenizer_vocab or shape.vocab
    return [{"input_ids": torch.randint(0, vocab, (micro, seq), generator=g)}
            for _ in range(sequences // micro)]


def nll(outputs: dict, mb: dict) -> torch.Tensor:
    return -outputs["log_probs"].mean()


def state_bytes(model, engine) -> dict[str, int]:
    """The training state of one rank by kind (bytes), after a step."""
    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    params = list(model.params.values()) + list(model.adapter_params.values())
    moments = [v for st in engine.optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    out = {"params": size(params), "grads": size(engine.grads.flat.values()),
           "masters": size(engine.masters.flat.values()) if engine.masters else 0,
           "optimizer": size(moments)}
    return out | {"total": sum(out.values()),
                  "trained_params": sum(p.numel() for p in engine.train_params.values())}


def lora_config(rank: int, alpha: float):
    from engine.lora import LoraConfig

    return LoraConfig(rank=rank, alpha=alpha)


def sync_bytes(shape: BenchShape, lora) -> dict[str, int]:
    """Bytes the generation side needs after an update: the whole model, or the adapters."""
    from engine.llama_spec import llama_shard_specs
    from engine.lora import lora_shard_specs

    cfg = config_of(shape)

    def size(specs) -> int:
        return sum(torch.Size(s.shape).numel() for s in specs) * 4

    return {"full": size(llama_shard_specs(cfg, 1)), "lora": size(lora_shard_specs(cfg, 1, lora))}


def one_side(shape: BenchShape, side: str, rank: int, alpha: float, sequences: int,
             micro: int) -> dict:
    """Build one side and take a step in this (fresh) process: its state and peak RSS."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model, engine = build(shape, lora_config(rank, alpha) if side == "lora" else None)
    engine.train_step(micro_batches(shape, sequences, micro), nll, temperature=1.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"state_bytes": state_bytes(model, engine), "peak_rss": peak,
            "rss_before_build": before}


def measure_memory(args: argparse.Namespace) -> dict:
    """:func:`one_side` of each side in its own process."""
    out = {}
    for side in SIDES:
        cmd = [sys.executable, "-m", "bench.lora", "--one", side, "--shape", args.shape,
               "--rank", str(args.rank), "--alpha", str(args.alpha), "--sequences",
               str(args.sequences), "--micro-batch", str(args.micro_batch)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        out[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def measure_steps(shape: BenchShape, lora, sequences: int, micro: int, repeat: int) -> dict:
    """Median training step of both sides, alternating in this process."""
    mbs = micro_batches(shape, sequences, micro)
    engines = {side: build(shape, lora if side == "lora" else None)[1] for side in SIDES}
    fns = {side: (lambda e=e: e.train_step(mbs, nll, temperature=1.0))
           for side, e in engines.items()}
    times, _ = interleaved_median_times(fns, repeat)
    return times


def measure_iteration(shape_name: str, rank: int, alpha: float, steps: int = 3,
                      response_len: int | None = None) -> dict:
    """GRPO on 2 ranks (tp=2 -> gen 1), full and LoRA, from the same files (responses of
    ``response_len`` tokens, default the shape's)."""
    from bench.e2e import contest, our_overrides, prepare
    from rlhf.metrics import read_metrics

    out = {"response_len": response_len}
    with tempfile.TemporaryDirectory() as work:
        c = contest(shape_name, work)
        if response_len is not None:
            c = dataclasses.replace(c, response_len=response_len)
        prompts, samples = 4, 2
        prepare(c, prompts, steps)
        for side in SIDES:
            runs = os.path.join(work, side)
            args = our_overrides(c, 2, steps, runs, 2, prompts, samples)
            args += ["actor.layout.gen_tp=1", "data.val_size=0"]
            if side == "lora":
                args += [f"actor.lora.rank={rank}", f"actor.lora.alpha={alpha}"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", "-m", "rlhf.train", *args]
            subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           check=True, stdout=subprocess.DEVNULL)
            recs = read_metrics(os.path.join(runs, "ours", "metrics.jsonl"))
            out[side] = {
                "iteration_s": statistics.median(r["timing_s/step"] for r in recs[1:]),
                "reshard_bytes_first": recs[0]["reshard/bytes"],
                "reshard_bytes_later": statistics.median(r["reshard/bytes"] for r in recs[1:]),
                "peak_rss_gb": max(r.get("memory/peak_rss_gb", 0.0) for r in recs)}
    out["iteration_ratio"] = out["full"]["iteration_s"] / out["lora"]["iteration_s"]
    out["reshard_bytes_ratio"] = (out["full"]["reshard_bytes_later"]
                                  / out["lora"]["reshard_bytes_later"])
    return out


def measure_learning(rank: int, alpha: float, lr_factor: float, png: str | None) -> dict:
    """The main job's GRPO (4 ranks, from its cached SFT warm start) trained in full and with
    LoRA at ``lr_factor`` x the full learning rate: held-out greedy accuracy per evaluation
    and its final value on each side (the goal: LoRA within 0.05 of the full run)."""
    from rlhf import main_job
    from rlhf.metrics import read_metrics

    main_job.warm_start()
    full_lr = next(float(o.split("=")[1]) for o in main_job.RL_OVERRIDES
                   if o.startswith("actor.optim.lr="))
    out = {}
    with tempfile.TemporaryDirectory() as work:
        for side in SIDES:
            extra = [f"log.run_name={side}", f"log.runs_dir={work}", "checkpoint.save_every=0",
                     "log.progress=false", "log.tensorboard=false", "log.plot=false"]
            if side == "lora":
                extra += [f"actor.lora.rank={rank}", f"actor.lora.alpha={alpha}",
                          f"actor.optim.lr={full_lr * lr_factor:g}"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=4", "-m", "rlhf.train", *main_job.RL_OVERRIDES, *extra]
            subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           check=True, stdout=subprocess.DEVNULL)
            recs = read_metrics(os.path.join(work, side, "metrics.jsonl"))
            evals = [r for r in recs if "val/accuracy" in r]
            out[side] = {"step": [r["step"] for r in evals],
                         "accuracy": [r["val/accuracy"] for r in evals],
                         "iteration_s": statistics.median(r["timing_s/step"] for r in recs[1:])}
    out["final_gap"] = out["full"]["accuracy"][-1] - out["lora"]["accuracy"][-1]
    out["lr"] = {"full": full_lr, "lora": full_lr * lr_factor}
    if png:
        plot_learning(out, rank, alpha, png)
    return out


def plot_learning(result: dict, rank: int, alpha: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"full": f"full fine-tune (lr {result['lr']['full']:g})",
              "lora": f"LoRA r={rank}, alpha={alpha:g} (lr {result['lr']['lora']:g})"}
    for side in SIDES:
        ax.plot(result[side]["step"], result[side]["accuracy"], "o-", label=labels[side])
    ax.set_xlabel("GRPO iteration")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("main job: LoRA against full fine-tuning")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(p, default="small", rl=True)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64.0)
    p.add_argument("--sequences", type=int, default=4, help="sequences of the timed step")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--iteration", action="store_true", help="also time GRPO iterations")
    p.add_argument("--response-len", type=int, default=None,
                   help="--iteration: tokens per response (default the shape's)")
    p.add_argument("--iteration-only", action="store_true",
                   help="only the GRPO iterations (not the state, memory and step parts)")
    p.add_argument("--learning", action="store_true",
                   help="only the main job's learning curves, full against LoRA")
    p.add_argument("--lr-factor", type=float, default=10.0,
                   help="--learning: LoRA's learning rate over the full one")
    p.add_argument("--png", default=None, help="--learning: the plot")
    p.add_argument("--one", choices=SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.sequences < 1 or a.micro_batch < 1 or a.sequences % a.micro_batch or a.repeat < 1:
        p.error(f"--sequences={a.sequences} must be a multiple of --micro-batch="
                f"{a.micro_batch} (both >= 1) and --repeat={a.repeat} >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    shape = get_shape(a.shape, rl=True)
    if a.one is not None:
        print(json.dumps(one_side(shape, a.one, a.rank, a.alpha, a.sequences, a.micro_batch)))
        return 0
    if a.learning:
        result = measure_learning(a.rank, a.alpha, a.lr_factor, a.png)
        print(json.dumps({"final_gap": result["final_gap"],
                          "final": {s: result[s]["accuracy"][-1] for s in SIDES}}))
        write_json(result, a.json)
        return 0
    if a.iteration_only:
        result = {"iteration": measure_iteration(a.shape, a.rank, a.alpha,
                                                 response_len=a.response_len),
                  "rank": a.rank, "alpha": a.alpha, "shape": shape.describe(),
                  "device": "cpu", "precision": "fp32",
                  "argv": sys.argv if argv is None else argv}
        print(json.dumps(result["iteration"]))
        write_json(result, a.json)
        return 0
    lora = lora_config(a.rank, a.alpha)
    memory = measure_memory(a)
    steps = measure_steps(shape, lora, a.sequences, a.micro_batch, a.repeat)
    sync = sync_bytes(shape, lora)
    result = {
        "state_bytes": {s: memory[s]["state_bytes"] for s in SIDES},
        "state_ratio": (memory["full"]["state_bytes"]["total"]
                        / memory["lora"]["state_bytes"]["total"]),
        "peak_rss": {s: memory[s]["peak_rss"] for s in SIDES},
        "peak_rss_saved_bytes": memory["full"]["peak_rss"] - memory["lora"]["peak_rss"],
        "step_s": steps, "step_ratio": steps["full"] / steps["lora"],
        "sync_bytes": sync, "sync_ratio": sync["full"] / sync["lora"],
        "goals": {"sync_ratio": ">= 20 at rank 32 on qwen2.5-0.5b"},
        "rank": a.rank, "alpha": a.alpha, "sequences": a.sequences,
        "micro_batch": a.micro_batch, "repeat": a.repeat,
        "shape": shape.describe(), "device": "cpu", "precision": "fp32",
        "argv": sys.argv if argv is None else argv}
    if a.iteration:
        result["iteration"] = measure_iteration(a.shape, a.rank, a.alpha,
                                                response_len=a.response_len)
    print(json.dumps({k: result[k] for k in ("state_ratio", "step_ratio", "sync_ratio",
                                             "peak_rss_saved_bytes")}))
    print(f"LoRA rank {a.rank} vs full at {a.shape}: training state {result['state_ratio']:.1f}x"
          f" smaller, step {result['step_ratio']:.2f}x faster, {result['sync_ratio']:.1f}x fewer"
          f" bytes to sync, peak RSS {result['peak_rss_saved_bytes'] / 2**30:.2f} GiB lower")
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
