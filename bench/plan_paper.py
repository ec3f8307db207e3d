"""Planner on the paper's setting: PPO with Llama 7B / 13B on 16-128 A100-80GB, as markdown.

For every (model, device count): the planner's best mapping, and the best of each placement
kind (colocated, split = actor+reference | critic+reward, standalone) with predicted seconds.

    python -m bench.plan_paper --profile a100-80gb > table.md
"""

from __future__ import annotations

import argparse
import sys
import time

from rlhf.planner import Planner, Workload, build_dataflow, load_profile, model_shape
from rlhf.planner.report import placement_kind

KINDS = ("colocated", "split", "standalone")


def _strategies(m) -> str:
    return ", ".join(f"{r} {st.short()}" for s in m.sets for r, st in s.strategies.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="a100-80gb")
    p.add_argument("--models", default="7b,13b")
    p.add_argument("--devices", default="16,32,64,96,128")
    p.add_argument("--mini-batch", type=int, default=256)
    a = p.parse_args(argv)
    prof = load_profile(a.profile)
    work = Workload(mini_batch=a.mini_batch)
    print(f"Profile {prof.name}; workload: {work.prompts} prompts, {work.prompt_len}+"
          f"{work.response_len} tokens, mini-batch {work.mini_batch}, micro-batch "
          f"{work.micro_batch}.\n")
    print("| model | N | best (kind) | sets:devices | gen / prep / train s | total s | "
          + " | ".join(f"best {k} s" for k in KINDS) + " | search s | strategies |")
    print("|---" * (8 + len(KINDS)) + "|")
    for size in a.models.split(","):
        flow = build_dataflow("ppo", model_shape(size))
        for n in (int(x) for x in a.devices.split(",")):
            t0 = time.perf_counter()
            best = Planner(flow, work, n, prof).search(top=1)
            dt = time.perf_counter() - t0
            per_kind = {}
            for kind in KINDS:
                r = Planner(flow, work, n, prof, placement_filter=lambda part, _a, k=kind:
                            placement_kind(part) == k).search(top=1)
                per_kind[kind] = f"{r[0].total:.1f}" if r else "-"
            if not best:
                print(f"| {size} | {n} | no fit |")
                continue
            m = best[0]
            st = " / ".join(f"{m.stages[s]:.1f}" for s in ("generation", "preparation",
                                                            "training"))
            print(f"| {size} | {n} | {placement_kind(m.placement)} | {m.label()} | {st} | "
                  f"{m.total:.1f} | " + " | ".join(per_kind[k] for k in KINDS)
                  + f" | {dt:.2f} | {_strategies(m)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
