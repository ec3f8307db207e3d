"""The main job (``make run``): GRPO on the real checkpoint SmolLM2-135M-Instruct
(:mod:`rlhf.real_job`, the default), or ``--model tiny``: a tiny Llama warm-started by SFT
(cached), then GRPO on 4 ranks; each judged on held-out problems.

    python -m rlhf.main_job [--nproc 2] [key=value ...]                 # overrides go to rlhf.train
    python -m rlhf.main_job --model tiny [--nproc 4] [--moe] [key=value ...]

The rest of this docstring is the tiny job's:

1. The warm start, two ``rlhf.sft`` phases (cached in ``runs/cache``; later runs with the
   same settings reuse them): a 4-layer Llama learns addition from correct demonstrations
   (``sft-base``), then a short second phase on sloppy ones, where 65% of the answers to
   problems that carry drop the carry (``--carry-errors``; ``sft-main``).  That systematic
   mistake makes the greedy answer to most carrying problems wrong while sampling still finds
   the right one: what RL on a verifiable reward corrects.
2. ``torchrun --nproc_per_node 4 -m rlhf.train algo=grpo ...``: actor (train 1-2-2,
   generation tp 1: micro-DP 2) and the rule-based exact-match reward on all 4 ranks.  Every
   ``eval_every`` iterations the policy answers the built-in task's held-out problems (a
   fixed tenth of all problems, never in the SFT or RL data) greedily, and samples
   ``eval_pass_k`` answers each: ``val/accuracy``, ``val/pass@k``.  Output in
   ``runs/main_grpo/`` (metrics.jsonl, TensorBoard, metrics.png, checkpoints, the HF export);
   the folder is replaced by each run unless a ``checkpoint.resume=...`` override is given.
   ``device=`` and ``precision=`` among the overrides apply to the SFT phases too.
3. Prints the held-out greedy accuracy of the SFT policy and of the final one, and the times.

``--moe``: the same job on a mixture of experts (every layer's MLP 4 experts of the dense
width, 2 per token: a Mixtral), its own warm start (``runs/cache/sft-*-moe``) and run
(``runs/main_grpo_moe``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from rlhf import real_job, sft
from rlhf.config import load_config
from rlhf.metrics import read_metrics
from rlhf.real_model import NAME as REAL_MODEL

SFT_BASE_DIR = os.path.join("runs", "cache", "sft-base")
SFT_DIR = os.path.join("runs", "cache", "sft-main")
RUN_NAME = "main_grpo"
RUN_DIR = os.path.join("runs", RUN_NAME)
MODEL = ["actor.model.num_layers=4"]
"""The policy: the built-in tiny Llama (hidden 64, 4/2 heads, 24-token vocabulary), 4 layers."""
SFT_BASE_ARGS = ["--out", SFT_BASE_DIR, "--steps", "6000", *MODEL]
"""``rlhf.sft`` arguments of the first phase (correct demonstrations)."""
SFT_ARGS = ["--out", SFT_DIR, "--steps", "600", "--lr", "1e-3", "--carry-errors", "0.65",
            *MODEL, f"actor.model.init_from={SFT_BASE_DIR}"]
"""``rlhf.sft`` arguments of the second phase (carries dropped), from the first."""
RL_OVERRIDES = [
    "algo=grpo", "iterations=60", f"log.run_name={RUN_NAME}", "checkpoint.resume=never",
    "checkpoint.save_every=30", "eval_every=5", "data.prompts_per_iter=32",
    "data.samples_per_prompt=4", "data.mini_batch_size=64", "data.micro_batch_size=16",
    "actor.optim.lr=3e-4", f"actor.model.init_from={SFT_DIR}"]
"""``rlhf.train`` overrides of the RL run (on top of the grpo recipe)."""


MOE_MODEL = ["actor.model.num_experts=4", "actor.model.num_experts_per_tok=2"]
"""``--moe``: the policy's MLPs as 4 experts, 2 per token."""


def variant(args: list[str], moe: bool) -> list[str]:
    """``args`` of the dense job, or of the ``--moe`` one: its own cache folders and run
    name, the experts added to every model argument list."""
    if not moe:
        return list(args)
    renamed = {SFT_BASE_DIR: SFT_BASE_DIR + "-moe", SFT_DIR: SFT_DIR + "-moe",
               RUN_NAME: RUN_NAME + "_moe"}
    out = []
    for a in args:
        for old, new in renamed.items():
            if a == old or a.endswith("=" + old):
                a = a[:len(a) - len(old)] + new
        out.append(a)
    return out + (MOE_MODEL if MODEL[0] in args else [])


def sft_device(overrides: list[str], moe: bool = False) -> list[str]:
    """The SFT phases' ``device=`` and ``precision=``: the RL run's, as its config reads the
    user's ``overrides`` (ValueError for a bad one, before any SFT step).  Each process
    resolves ``auto`` for itself (:func:`rlhf.config.resolve_devices`)."""
    cfg = load_config([*variant(RL_OVERRIDES, moe), *overrides])
    return [f"device={cfg.device}", f"precision={cfg.precision}"]


def warm_start(overrides: list[str] = (), moe: bool = False) -> str:
    """Both SFT phases (each reused when cached with the same settings), with the device and
    precision of the RL run (:func:`sft_device`); the folder of the warm-start policy
    (:data:`SFT_DIR`, or its ``-moe`` sibling)."""
    device = sft_device(list(overrides), moe)
    for args in (SFT_BASE_ARGS, SFT_ARGS):
        args = [*variant(args, moe), *device]
        if sft.main(args) != 0:
            raise RuntimeError(f"rlhf.sft {' '.join(args)} failed")
    return variant([SFT_DIR], moe)[0]


def held_out_accuracy(records: list[dict]) -> tuple[float, float]:
    """``(first, last)`` ``val/accuracy`` of a run's records: the starting (SFT) policy's and
    the final policy's."""
    acc = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    if not acc:
        raise ValueError("the run logged no val/accuracy (data.val_size=0?)")
    return acc[0], acc[-1]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[REAL_MODEL, "tiny"], default=None,
                   help="the real checkpoint (the default; about 10 minutes on 2 cores) or the "
                        "tiny model trained from scratch (the default with --moe)")
    p.add_argument("--nproc", type=int, default=None,
                   help=f"ranks of the RL job (default {real_job.NPROC} for the real "
                        f"checkpoint, 4 for tiny)")
    p.add_argument("--moe", action="store_true", help="tiny: the policy as a mixture of experts")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for rlhf.train")
    a = p.parse_args(argv)
    a.model = a.model or ("tiny" if a.moe else REAL_MODEL)
    if a.model == REAL_MODEL:
        if a.moe:
            p.error("--moe is an option of --model tiny")
        return real_job.main(a.nproc or real_job.NPROC, a.overrides)
    a.nproc = a.nproc or 4
    t0 = time.perf_counter()
    try:
        warm_start(a.overrides, a.moe)
    except ValueError as e:  # a bad override, named by the run config
        print(f"[main_job] invalid configuration: {e}", file=sys.stderr, flush=True)
        return 2
    t_sft = time.perf_counter() - t0
    run_dir = os.path.join("runs", variant([RUN_NAME], a.moe)[0])
    if not any(o.startswith("checkpoint.resume=") for o in a.overrides):
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no stale event files
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.nproc}", "-m", "rlhf.train", *variant(RL_OVERRIDES, a.moe),
           *a.overrides]
    print("[main_job]", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = subprocess.run(cmd, env=env).returncode
    if code != 0:
        print(f"[main_job] RL job failed with exit code {code}", file=sys.stderr)
        return code
    start, end = held_out_accuracy(read_metrics(os.path.join(run_dir, "metrics.jsonl")))
    print(f"[main_job] held-out greedy accuracy: SFT {start:.3f} -> final {end:.3f} "
          f"({end - start:+.3f}); SFT {t_sft:.0f} s, total {time.perf_counter() - t0:.0f} s; "
          f"plot {run_dir}/metrics.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
