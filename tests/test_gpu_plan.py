"""The GPU check's time plan (bench/gpu_plan.py): the recorded step times come from the last GPU
run, the committed steps fit the budget whatever each takes, and the skip rule."""

import glob
import json
import os
import random

import pytest

from bench import gpu_check, gpu_plan
from bench.gpu_plan import BUDGET_S, SLACK_S, STEP_TIMES, StepTime

CORE = ["env", "install_wheels", "build", "pytest_gpu", "main_job", "bench_generation"]
"""The most informative steps, which the plan commits to."""
LAST_RUN = os.path.join(gpu_check.ROOT, "bench", "results", "gpu",
                        "2026-11-28-nvidia-h100-80gb-hbm3")


def test_the_measured_times_are_the_last_gpu_runs():
    recorded = {}
    for path in glob.glob(os.path.join(LAST_RUN, "[0-9][0-9]_*.json")):
        with open(path) as f:
            r = json.load(f)
        recorded[r["name"]] = r["seconds"]
    measured = {n: t.measured_s for n, t in STEP_TIMES.items() if t.measured_s is not None}
    assert measured == {n: recorded[n] for n in measured}
    assert set(recorded) <= set(STEP_TIMES)  # every step that ran then is planned now


def test_the_most_informative_steps_are_committed_and_fit_the_budget():
    names = list(STEP_TIMES)
    assert BUDGET_S <= 480  # 15 minutes of device time, the machine's start included
    assert names[:len(CORE)] == CORE
    assert gpu_plan.committed(names) == CORE
    assert sum(STEP_TIMES[n].limit_s for n in CORE) <= BUDGET_S - SLACK_S
    for t in STEP_TIMES.values():
        assert 0 < t.min_s <= t.expected_s <= t.limit_s and t.basis


def test_the_gpu_plan_takes_its_order_limits_and_minimums_from_the_table(tmp_path):
    steps = gpu_check.plan("cuda", False, str(tmp_path))
    assert [s.name for s in steps] == list(STEP_TIMES)
    for s in steps:
        assert (s.timeout_s, s.min_s) == (STEP_TIMES[s.name].limit_s, STEP_TIMES[s.name].min_s)


def test_the_check_stays_inside_its_budget_however_long_each_step_takes():
    names, committed = list(STEP_TIMES), gpu_plan.committed(list(STEP_TIMES))
    # every step to its limit: the committed ones still run whole, the rest are skipped
    ran, total = gpu_plan.simulate(names, {n: t.limit_s for n, t in STEP_TIMES.items()})
    assert total <= BUDGET_S
    assert all(ran[n] == STEP_TIMES[n].limit_s for n in committed)
    # the expected times: the time the committed steps leave runs the next benches
    ran, total = gpu_plan.simulate(names, {n: t.expected_s for n, t in STEP_TIMES.items()})
    assert total <= BUDGET_S
    assert [n for n in names if ran[n] is not None] == [*CORE, "bench_roofline"]
    rng = random.Random(0)
    for _ in range(200):
        seconds = {n: rng.uniform(0, 1.5) * t.limit_s for n, t in STEP_TIMES.items()}
        ran, total = gpu_plan.simulate(names, seconds)
        assert total <= BUDGET_S
        assert all(ran[n] is not None for n in committed)


def test_a_step_runs_on_what_is_left_and_is_skipped_under_its_minimum():
    assert gpu_plan.admit(100, 30, 10) == (30, None)
    assert gpu_plan.admit(20, 30, 10) == (20, None)
    limit, why = gpu_plan.admit(9.6, 30, 10)
    assert limit is None and "10 s" in why and "minimum" in why


def test_a_row_whose_minimum_exceeds_its_limit_is_refused():
    with pytest.raises(ValueError, match="min_s <= expected_s <= limit_s"):
        StepTime(None, 10, 20, 30, "a minimum over the limit")
