"""What a rejected configuration costs: the CPU time of ``python -m rlhf.train`` ending with exit
code 2, beside a bare interpreter and ``import torch`` measured in the same run.

    python -m bench.config_check [--repeat 3] [--json PATH]

CPU time is user + system time of the child and its descendants
(``resource.getrusage(RUSAGE_CHILDREN)`` before and after each process, median over
``--repeat`` processes), not wall time: on a shared machine the wall clock of a short process
measures its neighbours.  Cases, each one bad thing:

    bad_key     ``bad.key=1``: an unknown key, rejected while the overrides are applied
    bad_type    ``actor.optim.lr=abc``: a value of the wrong type, likewise
    bad_value   ``algo.kl_mode=x``: rejected by a section's check, which reads the registries
                (algorithms, losses: torch)
    bad_world   ``algo=grpo``: the recipe's ``actor.layout.tp=2`` on one rank, rejected by the
                world plan after the engines, the controller and the C++ extension are loaded

Also the project modules (``rlhf``, ``engine``, ``hybridflow_comm``) that ``import rlhf.config``
loads, and whether torch is among its imports.  Goal: ``bad_key`` under 3 s of CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import emit_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCES = {"python": ["-c", "pass"], "import_torch": ["-c", "import torch"]}
CASES = {"bad_key": ["bad.key=1"], "bad_type": ["actor.optim.lr=abc"],
         "bad_value": ["algo.kl_mode=x"], "bad_world": ["algo=grpo"]}
PROJECT = ("rlhf", "engine", "hybridflow_comm")
GOAL_CPU_S = 3.0
IMPORTS = ("import sys, json, rlhf.config; print(json.dumps({'modules': sorted(m for m in "
           f"sys.modules if m.split('.')[0] in {PROJECT!r}), 'torch': 'torch' in sys.modules}}))")


def cpu_time(argv: list[str], cwd: str, expect: int) -> float:
    """User + system CPU seconds of the process ``argv`` (and its descendants); ValueError
    unless it exits with ``expect``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(argv, cwd=cwd, env=env | {"PYTHONPATH": ROOT}, capture_output=True,
                         text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != expect:
        raise ValueError(f"{argv} exited {res.returncode}, expected {expect}: "
                         f"{res.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def config_imports(cwd: str) -> dict:
    """``{"modules": [...], "torch": bool}``: the project modules that ``import rlhf.config``
    loads in a fresh interpreter, and whether torch is among its imports."""
    res = subprocess.run([sys.executable, "-c", IMPORTS], cwd=cwd, capture_output=True,
                         text=True, env=os.environ | {"PYTHONPATH": ROOT}, check=True)
    return json.loads(res.stdout)


def run(repeat: int = 3) -> dict:
    with tempfile.TemporaryDirectory() as cwd:  # nothing of a run lands in the repository
        times: dict[str, list[float]] = {name: [] for name in (*REFERENCES, *CASES)}
        for _ in range(repeat):  # interleaved: a slower minute costs every case alike
            for name, args in REFERENCES.items():
                times[name].append(cpu_time([sys.executable, *args], cwd, 0))
            for name, args in CASES.items():
                times[name].append(cpu_time([sys.executable, "-m", "rlhf.train", *args], cwd, 2))
        imports = config_imports(cwd)
    cpu = {name: statistics.median(t) for name, t in times.items()}
    return {
        "repeat": repeat,
        "cpu_s": cpu,
        "over_import_torch": {name: cpu[name] / cpu["import_torch"] for name in CASES},
        "bad_key_within_goal": cpu["bad_key"] < GOAL_CPU_S,
        "config_modules": len(imports["modules"]),
        "config_module_names": imports["modules"],
        "config_imports_torch": imports["torch"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="processes per case (median)")
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    emit_json(run(a.repeat), a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
