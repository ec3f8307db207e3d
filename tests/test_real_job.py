"""The real-checkpoint main job (rlhf/real_job.py, ``make run``): its rows, its reward and its
configuration, without the 10-minute run itself.

- the held-out rows share no pair of numbers with the training rows (in either order), and
  every ground truth is the sum of the two numbers in the prompt's text;
- the reward file scores the responses the instruct model writes by the last number;
- the main job's overrides pass every check of ``rlhf.train --check`` on its world size,
  against the converted checkpoint and the written rows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from rlhf import real_job
from rlhf.user_files import import_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def numbers(row: dict) -> tuple[int, int]:
    a, b = map(int, re.findall(r"\d+", row["prompt"][-1]["content"]))
    return a, b


def test_rows_are_sums_and_held_out_pairs_never_train(tmp_path):
    train, val = (read_rows(p) for p in real_job.write_rows(str(tmp_path)))
    assert (len(train), len(val)) == (2000, 128)
    for r in train + val:
        a, b = numbers(r)
        assert 1 <= a <= 99 and 1 <= b <= 99 and r["ground_truth"] == str(a + b)
        assert r["prompt"][-1]["role"] == "user" and len(r["prompt"]) == 1
    seen = {frozenset(numbers(r)) for r in train}
    assert not seen & {frozenset(numbers(r)) for r in val}
    assert len({r["prompt"][0]["content"] for r in train}) == len(train)
    again = real_job.write_rows(str(tmp_path / "again"))
    assert read_rows(again[1]) == val  # seeded: every run holds out the same rows


def test_reward_is_the_last_number():
    reward = import_file(os.path.join(real_job.EXAMPLE, "reward.py"), "test_real_", "reward")
    cases = {"54 + 6 = 60": 1.0, "60": 1.0, "The answer is 60.": 1.0, "60 is 54 + 6": 0.0,
             "To add 54 and 6, we need to combine": 0.0, "54 + 6 = 61.": 0.0, "": 0.0,
             "1,060": 0.0, "-60": 0.0, "6.0": 0.0, "60.5": 0.0, "x60": 0.0}
    for text, want in cases.items():
        assert reward.compute_score("sums", text, "60") == want, text
    assert reward.compute_score("sums", "1,060", "1060") == 1.0


def test_main_job_configuration_passes_its_checks(tmp_path, real_checkpoint):
    model, rows = real_job.prepare(str(tmp_path / "data"), real_checkpoint)
    assert model == real_checkpoint
    env = dict(os.environ, WORLD_SIZE=str(real_job.NPROC))
    out = subprocess.run([sys.executable, "-m", "rlhf.train", "--check", *real_job.RL_OVERRIDES,
                          f"actor.model.init_from={model}", *rows, f"log.runs_dir={tmp_path}"],
                         cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"actor pp=1 tp=1 dp={real_job.NPROC}" in out.stdout, out.stdout
