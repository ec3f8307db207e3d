"""Asynchronous GRPO on a disaggregated rollout pool against the colocated synchronous run.

    python bench/e2e.py --placement disaggregated --max-staleness 1 [--nproc 4] [--steps 30]
                        [--rounds 1] [--budget-s S] [--json PATH]

Both contenders are our runtime on the same ``--nproc`` ranks with the main job's GRPO
settings (:data:`rlhf.main_job.RL_OVERRIDES`: its 4-layer model from its SFT warm start, built
and cached by :func:`rlhf.main_job.warm_start`, 32 prompts x 4 samples), so that the reward
means something; evaluation and checkpoints are off in both:

    colocated      every role on all ranks, generation and training in turn (max_staleness 0)
    disaggregated  placement.pool_sizes = {actor: N/2, rollout: N/2}; the rollout pool
                   generates up to ``--max-staleness`` iterations ahead of the actor, weights
                   pushed by WeightSync after each update, decoupled-PPO correction with
                   algo.tis_cap = 2

Per contender: iterations/s and tokens/s (medians over the iterations after the first), and
the reward after a fixed wall-clock budget: the mean ``reward/mean`` of the last 3 iterations
that finished within ``--budget-s`` seconds of the first iteration's start (default: the
shorter of the two runs' total time, so both are judged at the same time).  Rounds alternate
the contenders; medians of the rounds are compared.  JSON: ``{"colocated": {...},
"disaggregated": {...}, "ratio_iterations_per_s", "ratio_tokens_per_s", "budget_s", ...}``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIS_CAP = 2.0
NPROC = 4
"""Default ranks: two pools of 2, each holding the main job's actor (training tp 2)."""
LAST = 3  # iterations averaged for the reward at the budget


def overrides(placement: str, nproc: int, staleness: int, steps: int, work: str,
              name: str) -> list[str]:
    from rlhf.main_job import RL_OVERRIDES

    args = [*RL_OVERRIDES, f"iterations={steps}", "eval_every=0", "eval_pass_k=0",
            "checkpoint.save_every=0", f"log.runs_dir={work}", f"log.run_name={name}",
            "log.progress=false", "log.tensorboard=false", "log.plot=false"]
    if placement == "disaggregated":
        half = nproc // 2
        args += ["placement.mode=disaggregated",
                 f"placement.pool_sizes={{actor: {half}, rollout: {nproc - half}}}",
                 f"algo.max_staleness={staleness}"]
        if staleness:
            args.append(f"algo.tis_cap={TIS_CAP}")
    return args


def one_run(placement: str, nproc: int, staleness: int, steps: int, work: str) -> list[dict]:
    """The metrics records of one run."""
    from rlhf.metrics import read_metrics

    name = f"{placement}_{len(os.listdir(work))}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rlhf.train",
           *overrides(placement, nproc, staleness, steps, work, name)]
    subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True,
                   stdout=subprocess.DEVNULL)
    return read_metrics(os.path.join(work, name, "metrics.jsonl"))


def summarize(recs: list[dict], budget_s: float) -> dict:
    """iterations/s, tokens/s and the reward at ``budget_s`` of one run's records."""
    steps = [r["timing_s/step"] for r in recs]
    ends = [sum(steps[:i + 1]) for i in range(len(steps))]
    within = [r["reward/mean"] for r, end in zip(recs, ends) if end <= budget_s]
    return {"iterations_per_s": 1.0 / statistics.median(steps[1:]),
            "tokens_per_s": statistics.median(r["perf/throughput_tokens_per_s"]
                                              for r in recs[1:]),
            "iterations_in_budget": len(within),
            "reward_at_budget": statistics.fmean(within[-LAST:]) if within else None,
            "reward_first": recs[0]["reward/mean"], "total_s": ends[-1],
            "staleness_max": max(r.get("rollout/staleness_max", 0) for r in recs)}


def run(nproc: int, staleness: int, steps: int, rounds: int, budget_s: float | None) -> dict:
    if nproc < 2 or nproc % 2:
        raise ValueError(f"nproc={nproc} must be even (two equal pools)")
    if steps < LAST + 1:
        raise ValueError(f"steps={steps} must be >= {LAST + 1}")
    if staleness < 0 or rounds < 1:
        raise ValueError(f"max_staleness={staleness} must be >= 0 and rounds={rounds} >= 1")
    from rlhf.main_job import warm_start

    warm_start()
    runs: dict[str, list[list[dict]]] = {"colocated": [], "disaggregated": []}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(rounds):
            for placement in runs:
                runs[placement].append(one_run(placement, nproc, staleness, steps, work))
    budget = budget_s or min(sum(r["timing_s/step"] for r in recs)
                             for v in runs.values() for recs in v)
    out: dict = {}
    for placement, recs_list in runs.items():
        rows = [summarize(recs, budget) for recs in recs_list]
        out[placement] = {k: statistics.median(r[k] for r in rows)
                          if all(r[k] is not None for r in rows) else None for k in rows[0]}
        out[placement]["rounds"] = rows
    c, d = out["colocated"], out["disaggregated"]
    return out | {"ratio_iterations_per_s": d["iterations_per_s"] / c["iterations_per_s"],
                  "ratio_tokens_per_s": d["tokens_per_s"] / c["tokens_per_s"],
                  "budget_s": budget, "max_staleness": staleness, "nproc": nproc,
                  "steps": steps, "settings": overrides("disaggregated", nproc, staleness,
                                                        steps, "WORK", "NAME")}
