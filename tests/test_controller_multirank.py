"""The single controller under torchrun on 4 ranks: every protocol, futures, errors.

One torchrun job (started once for the module) runs all checks of tests/controller_jobs.py;
each test here asserts one family of them.  Expectations come from direct loops over
hybridflow_comm.layout inside that job, not from the C++ plans.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOLS = ["ONE_TO_ALL", "3D_PROTO", "3D_ALL_MICRO_DP", "3D_PP_ONLY", "DP_PROTO",
             "ALL_TO_ALL", "DP_COMPUTE_METRIC", "RANK_ZERO", "JOBS_REVERSED"]


def torchrun(*args, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", "-m", "tests.controller_jobs", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    path = tmp_path_factory.mktemp("controller") / "checks.json"
    proc = torchrun("checks", str(path), timeout=300)  # 69 s beside other modules here
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(path) as f:
        return json.load(f)


def _same(entry):
    return json.dumps(entry["got"], sort_keys=True) == json.dumps(entry["expected"],
                                                                   sort_keys=True)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_protocol_distribute_and_collect(checks, proto):
    names = [k for k in checks if k.startswith((f"seen/{proto}/", f"result/{proto}/"))]
    assert len(names) == 8  # 4 layouts x (what each rank received, collected result)
    for name in names:
        assert _same(checks[name]), (name, checks[name])


def test_future_handoff_moves_no_payload_through_controller(checks):
    assert checks["handoff/controller_payload_bytes"]["got"] == 0
    for name in ("handoff/controller_total_bytes_small", "handoff/consumer_rows",
                 "handoff/get_counts_payload", "handoff/values_exact", "handoff/by_rank"):
        assert _same(checks[name]), (name, checks[name])


def test_future_chains_and_other_consumers(checks):
    for name in ("chain/values_exact", "chain/idx", "future_to_one_to_all",
                 "future_to_micro_dp"):
        assert _same(checks[name]), (name, checks[name])


def test_dp_compute_and_bad_input(checks):
    assert _same(checks["dp_compute"])
    msgs = checks["bad_input_messages"]["got"]
    assert "list of 4 items" in msgs["dp_compute_len"] and "3 items" in msgs["dp_compute_len"]
    assert "not_a_worker_method" in msgs["undecorated"]
    assert "[7]" in msgs["pool"]
    assert "[0, 1, 2]" in msgs["pool_size"]
    assert "{0: 3, 1: 4}" in msgs["sizes"]
    assert "echo_dp_proto" in msgs["list_future"] and "list" in msgs["list_future"]
    assert "not_a_worker_method" in msgs["getattr"]
    assert _same(checks["still_alive"])  # nothing hung after the bad input


def test_worker_error_names_rank_role_method_and_traceback(checks):
    rank, role, method, tb = checks["worker_error"]["got"]
    assert (rank, role, method) == (2, "probe", "fail_on_rank_2")
    assert "deliberate failure on rank 2" in tb and "controller_jobs.py" in tb


def test_collective_timeout_is_configurable_per_role(checks):
    rank, method, error, elapsed = checks["collective_timeout"]["got"]
    assert (rank, method) == (1, "unmatched_all_reduce")
    assert "timed out" in error.lower() or "timeout" in error.lower(), error
    assert 1.5 < elapsed < 30  # the role's 2 s timeout, not the job's 60 s
