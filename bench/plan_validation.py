"""Planner validation: measured vs predicted iteration time of several mappings on CPU ranks.

For each mapping (placement + layouts of the PPO recipe's tiny models) this runs
``torchrun --nproc_per_node W -m rlhf.train`` for a few iterations, takes the median
``timing_s/step`` after the warm-up iterations, and compares with
:func:`rlhf.planner.config_bridge.predict_config` under a profile (default: measured now with
``--calibrate``).  Reports the Spearman rank correlation and whether the planner's choice
(:func:`plan_for_config`, restricted to the measured mappings) is among the two fastest.

    python -m bench.plan_validation --world 4 --iterations 6 --json /tmp/plan_val.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from rlhf.config import load_config
from rlhf.planner.calibrate import calibrate
from rlhf.planner.config_bridge import apply_overrides, predict_config
from rlhf.planner.profile import load_profile, save_profile

# name -> overrides of the ppo recipe (roles actor, critic, reference; rule reward)
MAPPINGS = {
    "colocated a1-2-2>1-1 c1-1-4": {"placement.mode": "colocated", "actor.layout.tp": 2,
                                     "actor.layout.gen_tp": 1},
    "colocated a1-1-4 c1-1-4": {"placement.mode": "colocated", "actor.layout.tp": 1,
                                "actor.layout.gen_tp": 0},
    "colocated all 1-2-2": {"placement.mode": "colocated", "actor.layout.tp": 2,
                            "actor.layout.gen_tp": 2, "critic.layout.tp": 2,
                            "reference.layout.tp": 2},
    "colocated a2-1-2>1-1": {"placement.mode": "colocated", "actor.layout.pp": 2,
                             "actor.layout.tp": 1, "actor.layout.gen_pp": 1,
                             "actor.layout.gen_tp": 1},
    "split 2|2 all dp": {"placement.mode": "split",
                         "placement.pool_sizes": {"actor": 2, "critic": 2},
                         "actor.layout.tp": 1, "actor.layout.gen_tp": 0},
    "split 2|2 a1-2-1>1-1": {"placement.mode": "split",
                             "placement.pool_sizes": {"actor": 2, "critic": 2},
                             "actor.layout.tp": 2, "actor.layout.gen_tp": 1},
    "standalone 2|1|1": {"placement.mode": "standalone",
                         "placement.pool_sizes": {"actor": 2, "critic": 1, "reference": 1},
                         "actor.layout.tp": 1, "actor.layout.gen_tp": 0},
}


def _args_of(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        if isinstance(v, dict):
            v = "{" + ", ".join(f"{a}: {b}" for a, b in v.items()) + "}"
        out.append(f"{k}={v}")
    return out


def measure(overrides: dict, world: int, iterations: int, warmup: int, runs_dir: str,
            name: str) -> list[float]:
    """Step times of one run (after ``warmup`` iterations)."""
    run = name.replace(" ", "_").replace("|", "-").replace(">", "to")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           "-m", "rlhf.train", "algo=ppo", f"iterations={iterations}", f"log.runs_dir={runs_dir}",
           f"log.run_name={run}", "log.tensorboard=false", "log.progress=false",
           "log.plot=false", "checkpoint.save_every=0", "checkpoint.resume=never",
           *_args_of(overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{name}: rlhf.train failed\n{proc.stderr[-3000:]}")
    with open(os.path.join(runs_dir, run, "metrics.jsonl"), encoding="utf-8") as f:
        steps = [json.loads(line)["timing_s/step"] for line in f]
    return steps[warmup:]


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):                          # average ranks of ties
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", default=None, help="profile name/path (default: calibrate now)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.profile:
        prof = load_profile(a.profile)
    else:
        prof = calibrate(world=a.world)
        save_profile(prof, os.path.join(tempfile.gettempdir(), "plan_validation_profile.json"))
    base = load_config(["algo=ppo"])
    rows = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for name, ov in MAPPINGS.items():
            cfg = apply_overrides(base, ov)
            pred = {c: predict_config(cfg, a.world, prof, concurrent=c).total
                    for c in (False, True)}
            steps = measure(ov, a.world, a.iterations, a.warmup, runs_dir, name)
            rows.append({"mapping": name, "measured_s": statistics.median(steps),
                         "steps_s": steps, "pred_sequential_s": pred[False],
                         "pred_concurrent_s": pred[True]})
            print(f"{name:<30} measured {rows[-1]['measured_s']:.3f} s  predicted "
                  f"{pred[False]:.3f} s (sequential) {pred[True]:.3f} s (concurrent)", flush=True)
    measured = [r["measured_s"] for r in rows]
    by_measured = sorted(rows, key=lambda r: r["measured_s"])
    report = {"profile": prof.to_dict(), "rows": rows}
    for mode in ("sequential", "concurrent"):
        pred = [r[f"pred_{mode}_s"] for r in rows]
        top = min(rows, key=lambda r: r[f"pred_{mode}_s"])["mapping"]
        ok = top in [r["mapping"] for r in by_measured[:2]]
        report[mode] = {"spearman": spearman(pred, measured), "planner_top": top,
                        "top_among_two_fastest": ok}
        print(f"{mode}: Spearman rho = {report[mode]['spearman']:.3f}; planner's top choice "
              f"{top!r} among the two fastest measured: {ok}")
    print("fastest measured:", [r["mapping"] for r in by_measured[:2]])
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
