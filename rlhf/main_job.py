"""The main job (``make run``): warm start by SFT (cached), then PPO on 4 ranks.

    python -m rlhf.main_job [--nproc 4] [key=value ...]     # extra overrides go to rlhf.train

1. ``rlhf.sft`` trains the policy on addition demonstrations of which 30% are wrong (noisy
   demonstrations: the warm start samples the right answer only part of the time) and saves
   it to ``runs/cache/sft-main`` -- reused on later runs with the same settings.
2. ``torchrun --nproc_per_node 4 -m rlhf.train algo=ppo ...``: actor (train 1-2-2, generation
   tp 1: micro-DP 2), critic, reference and the rule-based exact-match reward, colocated on
   all 4 ranks.  Output in ``runs/main_ppo/`` (metrics.jsonl, TensorBoard, metrics.png,
   checkpoints every 50 iterations); the folder is replaced by each run unless a
   ``checkpoint.resume=...`` override is given.
3. Prints the mean reward of the first and last 10 iterations and the wall time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from rlhf import sft
from rlhf.metrics import read_metrics

SFT_DIR = os.path.join("runs", "cache", "sft-main")
RUN_DIR = os.path.join("runs", "main_ppo")
SFT_ARGS = ["--steps", "1500", "--noise", "0.3"]
PPO_OVERRIDES = [
    "algo=ppo", "iterations=250", "log.run_name=main_ppo", "checkpoint.resume=never",
    "checkpoint.save_every=50", "data.prompts_per_iter=128", "data.mini_batch_size=64",
    "data.micro_batch_size=16", "algo.lam=1.0", "actor.optim.lr=3e-4", "critic.optim.lr=5e-4",
    f"actor.model.init_from={SFT_DIR}"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks of the PPO job")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for rlhf.train")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if sft.main(["--out", SFT_DIR, *SFT_ARGS]) != 0:
        return 1
    t_sft = time.perf_counter() - t0
    if not any(o.startswith("checkpoint.resume=") for o in a.overrides):
        shutil.rmtree(RUN_DIR, ignore_errors=True)  # a fresh run: no stale event files
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.nproc}", "-m", "rlhf.train", *PPO_OVERRIDES, *a.overrides]
    print("[main_job]", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = subprocess.run(cmd, env=env).returncode
    if code != 0:
        print(f"[main_job] PPO job failed with exit code {code}", file=sys.stderr)
        return code
    records = read_metrics(os.path.join(RUN_DIR, "metrics.jsonl"))
    first = [r["reward/mean"] for r in records[:10]]
    last = [r["reward/mean"] for r in records[-10:]]
    head, tail = sum(first) / len(first), sum(last) / len(last)
    print(f"[main_job] reward/mean first 10 iterations {head:.3f} -> last 10 {tail:.3f} "
          f"({tail - head:+.3f}); SFT {t_sft:.0f} s, total {time.perf_counter() - t0:.0f} s; "
          f"plot runs/main_ppo/metrics.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
