"""Smoke case of the time-to-reward comparison (``make bench``; not part of ``make test``).

A few seconds per side from a barely trained SFT checkpoint: checks that both sides run, save
and are scored by the same evaluator, not the learning itself (``bench/learning.py`` does).
"""

import subprocess
import sys

import pytest

pytest.importorskip("trl")

from bench.learning import ROOT, run  # noqa: E402


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "model"
    subprocess.run([sys.executable, "-m", "rlhf.sft", "--out", str(out), "--steps", "20"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return str(out)


def test_learning_smoke(benchmark, sft_dir):
    result = benchmark.pedantic(run, kwargs=dict(budget_s=3.0, points=2, sft_dir=sft_dir,
                                                 overrides=["data.val_size=16"]),
                                rounds=1, iterations=1)
    for side in ("ours", "trl"):
        curve = result[side]
        assert curve["time_s"][0] == 0.0 and curve["time_s"][-1] >= 3.0
        assert len(curve["accuracy"]) == len(curve["time_s"]) >= 2
        assert curve["hyperparameters"]
        benchmark.extra_info[f"{side}_final_accuracy"] = curve["accuracy"][-1]
    assert result["evaluator_check"]["agree"], result["evaluator_check"]
    assert "speedup" in result
    benchmark.extra_info["speedup"] = result["speedup"]
