"""Failure handling of the controller under torchrun: an uncaught worker error, a SIGKILL."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_controller_multirank import ROOT, torchrun


def test_uncaught_worker_error_stops_job_non_zero():
    proc = torchrun("raise", timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "worker rank 2 (role 'critic') failed in critic.fail_on_rank_2" in out
    assert "RuntimeError: deliberate failure on rank 2" in out
    assert "--- remote traceback (rank 2) ---" in out


@pytest.mark.parametrize("target", [2, 0])
def test_sigkill_mid_call_exits_non_zero_naming_lost_rank(tmp_path, target):
    """SIGKILL of a worker rank (2) or of rank 0 (the controller's process) during a call:
    the job ends non-zero within the time limit, naming the lost rank."""
    pid_file = tmp_path / "pid"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", "-m", "tests.controller_jobs", "kill", str(pid_file), str(target)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, f"rank {target} never started its call"
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        killed_at = time.monotonic()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert elapsed < 60
    lost = "lost rank 2" if target == 2 else "lost the controller (rank 0)"
    assert lost in out, out[-3000:]
