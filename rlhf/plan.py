"""Auto-mapping CLI: print the best placement and parallelism of an RLHF dataflow.

::

    python -m rlhf.plan --algo ppo --model 7b --devices 64 --profile a100-80gb
    python -m rlhf.plan --model tiny --devices 4 --profile cpu --prompts 16 --prompt-len 8 \\
        --response-len 6 --json plan.json
    python -m rlhf.plan --calibrate my_cpu.json --devices 4 --model tiny   # measure, then plan
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rlhf.planner import DATAFLOWS, Planner, Workload, build_dataflow, load_profile, model_shape
from rlhf.planner.profile import save_profile, shipped_profiles
from rlhf.planner.report import format_best, format_table, mapping_to_dict


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlhf.plan", description=__doc__.split("\n")[0])
    p.add_argument("--algo", default="ppo", choices=DATAFLOWS)
    p.add_argument("--model", default="7b",
                   help="actor preset: 7b, 13b, 34b, 70b, tiny, tiny-4l, qwen3-30b-a3b")
    p.add_argument("--critic", default=None, help="critic preset (default: the actor's)")
    p.add_argument("--reward", default=None, help="reward/cost preset (default: the critic's)")
    p.add_argument("--devices", type=int, required=True, help="number of devices N")
    p.add_argument("--memory-gb", type=float, default=None, help="override the profile's memory")
    p.add_argument("--profile", default="a100-80gb",
                   help=f"shipped {shipped_profiles()} or a JSON path")
    p.add_argument("--calibrate", metavar="PATH", default=None,
                   help="measure this machine, write the profile to PATH and plan with it")
    p.add_argument("--prompts", type=int, default=1024, help="prompts per iteration")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--samples", type=int, default=1, help="responses per prompt")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--mini-batch", type=int, default=256, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per device pass")
    p.add_argument("--top", type=int, default=10, help="rows of the candidates table")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the plan as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.calibrate:
            from rlhf.planner.calibrate import calibrate

            prof = calibrate(world=a.devices, memory_gb=a.memory_gb)
            save_profile(prof, a.calibrate)
            print(f"calibrated profile written to {a.calibrate}")
        else:
            prof = load_profile(a.profile)
        if a.memory_gb is not None:
            prof = prof.with_memory(a.memory_gb)
        actor = model_shape(a.model)
        critic = model_shape(a.critic) if a.critic else None
        reward = model_shape(a.reward) if a.reward else None
        flow = build_dataflow(a.algo, actor, critic, reward)
        work = Workload(prompts=a.prompts, prompt_len=a.prompt_len, response_len=a.response_len,
                        samples_per_prompt=a.samples, epochs=a.epochs,
                        mini_batch=min(a.mini_batch, a.prompts * a.samples),
                        micro_batch=a.micro_batch)
        if a.top < 1:
            raise ValueError(f"--top={a.top} must be >= 1")
        t0 = time.perf_counter()
        planner = Planner(flow, work, a.devices, prof)
        top = planner.search(top=a.top)
        seconds = time.perf_counter() - t0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.algo} {actor.name} on {a.devices} x {prof.name} ({prof.memory_gb:g} GiB); "
          f"{work.prompts} prompts x {work.samples_per_prompt}, {work.prompt_len}+"
          f"{work.response_len} tokens; searched in {seconds:.2f} s")
    if not top:
        print(f"no mapping fits: {a.devices} devices of {prof.memory_gb:g} GiB are too few for "
              f"{flow.names} at this size", file=sys.stderr)
        return 1
    print(format_best(top[0]))
    print()
    print(format_table(top))
    if a.json:
        out = {"algo": a.algo, "model": actor.name, "devices": a.devices,
               "profile": prof.to_dict(), "workload": vars(work), "search_s": seconds,
               "best": mapping_to_dict(top[0]), "top": [mapping_to_dict(m) for m in top]}
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
