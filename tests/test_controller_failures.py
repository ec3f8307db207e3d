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


def test_stopped_error_names_the_closed_rank_and_its_calls():
    """What rank 0 reports when torchrun's SIGTERM comes before it read a closed connection:
    the rank whose command connection closed (found without reading it) and the calls it had
    in flight; of several, the one whose heartbeats stopped first; with none closed, the calls
    in flight."""
    import socket

    from rlhf.controller.calls import CallState
    from rlhf.controller.controller import Controller, HeartbeatMonitor
    from rlhf.controller.errors import ControllerError, RankLostError

    pairs = {r: socket.socketpair() for r in range(4)}
    ctl = Controller({r: a for r, (a, _) in pairs.items()}, {})
    try:
        ctl._calls[7] = CallState(7, "rollout.generate_sequences", frozenset({2, 3}))
        ctl._calls[8] = CallState(8, "actor.update", frozenset({0, 1}))
        pairs[1][0].sendall(b"unread reply bytes")  # data waiting is not a closed connection
        err = ctl.stopped_error("SIGTERM")
        assert type(err) is ControllerError
        assert "no rank lost" in str(err) and "actor.update, rollout.generate_sequences" in str(err)
        pairs[3][1].close()
        err = ctl.stopped_error("SIGTERM")
        assert isinstance(err, RankLostError) and err.rank == 3
        assert str(err).startswith("lost rank 3: its connection to the controller closed "
                                   "during rollout.generate_sequences (found when the job was "
                                   "stopped by SIGTERM)")
        pairs[1][1].close()  # rank 1 closed too, but its heartbeats went on longer
        ctl._heartbeats = HeartbeatMonitor.__new__(HeartbeatMonitor)
        ctl._heartbeats.seen = {1: 50.0, 2: 60.0, 3: 40.0}
        err = ctl.stopped_error("SIGTERM")
        assert err.rank == 3 and "ranks [1] had closed too" in str(err)
        ctl._heartbeats.seen = {1: 30.0, 3: 40.0}
        assert ctl.stopped_error("SIGTERM").rank == 1
    finally:
        ctl._heartbeats = None
        ctl.close()
        for _, b in pairs.values():
            b.close()
