"""Multi-turn GRPO with a tool against single-turn GRPO generating as many tokens, in one run.

    python bench/e2e.py --multi-turn [--nproc 2] [--steps 8] [--rounds 3] [--json PATH]
                        [--tool-latency-s S]

Both contenders are our runtime on the same ``--nproc`` ranks with the tool-use example's
model (examples/tool_use: made, then SFT-warm-started with ``rlhf.sft --tools``, and cached in
``runs/cache/``), its prompts and its tool rendered into every prompt, GRPO with
``--prompts`` x ``--samples`` rows, evaluation and checkpoints off:

    multi_turn   rollout.tools=examples/tool_use/tools.py, rollout.max_turns=3: a turn that
                 calls the tool, the call run, the whole context prefilled again, the answer
    single_turn  the same prompts with rollout.max_turns=1 (no call is run), every response
                 exactly as many tokens as the multi-turn run's model tokens per sample
                 (data.min_new_tokens = data.max_response_len = their median, rounded)

``--tool-latency-s S`` makes every tool call take S seconds longer (the example's tool behind
a sleep) and adds a third contender, ``multi_turn_overlap``: the multi-turn run with
``rollout.overlap_tools=true`` (two halves whose turns alternate, one half's calls running
while the other half generates); ``overlap_ratio`` is its generated tokens/s over the plain
multi-turn run's.

What the ratio measures is the cost of the turns: re-prefilling the context of every turn
(no KV cache is kept across turns), the tool calls (run at once, after each turn's batched
generation, not overlapped with it), and training over the tool results' ids, which the
multi-turn sequences hold and the single-turn ones do not.  Generated tokens/s = the model's
tokens of an iteration (``response_mask``) / its wall time, median over the iterations after
the first; rounds alternate the contenders and the medians of the rounds are compared.  JSON:
``{"multi_turn": {...}, "single_turn": {...}, "ratio", "multi_turn_tokens_per_s",
"single_turn_tokens_per_s", "tokens_per_sample", ...}`` with per-phase seconds
(``timing_s/*``) of each.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tool_use")
NPROC = 2
COUNTS = {"train": 512, "val": 16, "sft": 2000}
SFT = ["--steps", "1500", "--batch", "32", "--lr", "3e-3"]
"""The example README's warm start (the model calls its tool on about half the prompts)."""


def warm_start(cache: str = os.path.join(ROOT, "runs", "cache")) -> str:
    """The example's data and SFT'd model in a cached folder (made once per settings)."""
    key = hashlib.sha256(repr((COUNTS, SFT)).encode()).hexdigest()[:12]
    folder = os.path.join(cache, f"tool_use_bench_{key}")
    if os.path.isfile(os.path.join(folder, "sft", "config.json")):
        return folder
    counts = [a for k, v in COUNTS.items() for a in (f"--{k}", str(v))]
    subprocess.run([sys.executable, os.path.join(EXAMPLE, "make_example.py"), folder, *counts],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "rlhf.sft", "--model", os.path.join(folder, "base"),
                    "--data", os.path.join(folder, "sft.jsonl"), "--tools",
                    os.path.join(EXAMPLE, "tools.py"), "--out", os.path.join(folder, "sft"),
                    *SFT], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return folder


SLOW_TOOLS = '''import os
import sys
import time

import rlhf.tools

sys.path.insert(0, {example!r})
from tools import lookup as _lookup  # the example's tool


@rlhf.tools.tool
def lookup(name: str, extra_info: dict) -> str:
    """Look up the secret code of a name.

    Args:
        name: the name, as written in the question
    """
    time.sleep({latency!r})
    return _lookup(name, extra_info)
'''


def slow_tools(work: str, latency_s: float) -> str:
    """A tools file whose ``lookup`` is the example's, ``latency_s`` seconds slower."""
    path = os.path.join(work, "slow_tools.py")
    with open(path, "w") as f:
        f.write(SLOW_TOOLS.format(example=EXAMPLE, latency=latency_s))
    return path


def overrides(folder: str, steps: int, prompts: int, samples: int, work: str, name: str,
              response_tokens: int | None, tools: str = os.path.join(EXAMPLE, "tools.py"),
              overlap: bool = False) -> list[str]:
    """``response_tokens`` None: a multi-turn contender (``overlap``: with
    ``rollout.overlap_tools``); else the single-turn one."""
    args = [f"actor.model.init_from={os.path.join(folder, 'sft')}", "algo=grpo",
            f"iterations={steps}", f"data.train_files={os.path.join(folder, 'train.jsonl')}",
            f"data.prompts_per_iter={prompts}", f"data.samples_per_prompt={samples}",
            f"data.mini_batch_size={prompts * samples}", "data.max_prompt_len=256",
            "reward.kind=function",
            f"reward.function={os.path.join(EXAMPLE, 'reward.py')}:compute_score",
            f"rollout.tools={tools}", f"rollout.overlap_tools={overlap}", "eval_every=0",
            "eval_pass_k=0", "checkpoint.save_every=0", "checkpoint.resume=never",
            f"log.runs_dir={work}", f"log.run_name={name}", "log.progress=false",
            "log.tensorboard=false", "log.plot=false"]
    if response_tokens is None:
        return args + ["rollout.max_turns=3", "data.max_response_len=96"]
    return args + ["rollout.max_turns=1", f"data.max_response_len={response_tokens}",
                   f"data.min_new_tokens={response_tokens}"]


def one_run(nproc: int, args: list[str], work: str) -> list[dict]:
    from rlhf.metrics import read_metrics

    name = next(a for a in args if a.startswith("log.run_name=")).split("=", 1)[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rlhf.train", *args]
    subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True,
                   stdout=subprocess.DEVNULL)
    return read_metrics(os.path.join(work, name, "metrics.jsonl"))


def summarize(recs: list[dict], rows: int) -> dict:
    """Medians over the iterations after the first (warm-up)."""
    timed = recs[1:]
    per_iter = [r["response/length_mean"] * rows / r["timing_s/step"] for r in timed]
    phases = sorted({k for r in timed for k in r if k.startswith("timing_s/")})
    return {"generated_tokens_per_s": statistics.median(per_iter),
            "tokens_per_sample": statistics.median(r["response/length_mean"] for r in timed),
            "step_s": statistics.median(r["timing_s/step"] for r in timed),
            "turns_mean": statistics.median(r.get("rollout/turns_mean", 1.0) for r in timed),
            "tool_calls_mean": statistics.median(r.get("rollout/tool_calls_mean", 0.0)
                                                 for r in timed),
            "phases_s": {k.removeprefix("timing_s/"): statistics.median(r.get(k, 0.0)
                                                                        for r in timed)
                         for k in phases}}


def run(nproc: int = NPROC, steps: int = 8, rounds: int = 3, prompts: int = 16,
        samples: int = 4, tool_latency_s: float = 0.0) -> dict:
    if steps < 2 or rounds < 1 or tool_latency_s < 0:
        raise ValueError(f"steps={steps} must be >= 2 (the first is warm-up), rounds={rounds} "
                         f">= 1 and tool_latency_s={tool_latency_s} >= 0")
    folder = warm_start()
    rows = prompts * samples
    out: dict[str, list[dict]] = {"multi_turn": [], "single_turn": []}
    if tool_latency_s:
        out["multi_turn_overlap"] = []
    tokens = None
    with tempfile.TemporaryDirectory() as work:
        tools = slow_tools(work, tool_latency_s) if tool_latency_s \
            else os.path.join(EXAMPLE, "tools.py")

        def contender(name: str, r: int, response_tokens: int | None, overlap: bool = False):
            args = overrides(folder, steps, prompts, samples, work, f"{name}_{r}",
                             response_tokens, tools, overlap)
            out[name].append(summarize(one_run(nproc, args, work), rows))

        for r in range(rounds):
            contender("multi_turn", r, None)
            tokens = tokens or max(1, round(out["multi_turn"][0]["tokens_per_sample"]))
            contender("single_turn", r, tokens)
            if tool_latency_s:
                contender("multi_turn_overlap", r, None, overlap=True)
    med = {k: statistics.median(v["generated_tokens_per_s"] for v in runs)
           for k, runs in out.items()}
    result = out | {f"{k}_tokens_per_s": v for k, v in med.items()} | {
        "ratio": med["multi_turn"] / med["single_turn"], "tokens_per_sample": tokens,
        "tool_latency_s": tool_latency_s, "nproc": nproc, "steps": steps, "rounds": rounds,
        "prompts": prompts, "samples": samples, "device": "cpu",
        "settings": overrides("FOLDER", steps, prompts, samples, "WORK", "NAME", None)}
    if tool_latency_s:
        result["overlap_ratio"] = med["multi_turn_overlap"] / med["multi_turn"]
    return result
