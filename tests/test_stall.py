"""Stalled ranks: the controller's heartbeat monitor names a rank whose process stops, within
the stall timeout, instead of the job waiting for the collective timeout.

In-process: a Controller over socket pairs, one fake rank that beats and one that does not.
Under torchrun: a worker rank SIGSTOPped in the middle of a call.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from rlhf.controller import Controller, ControllerError, wire
from rlhf.controller.launch import STALL_TIMEOUT_ENV, stall_timeout
from rlhf.controller.messages import Heartbeat
from rlhf.controller.worker import send_heartbeats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALL_S = 5.0


def _controller(stall_s: float, beating: set[int]) -> tuple[Controller, list[socket.socket]]:
    """A controller of ranks 0..2 over socket pairs; the ranks in ``beating`` send heartbeats
    from a thread (as a worker does), the others stay silent."""
    socks, ctl_socks, keep = {}, {}, []
    for rank in range(3):
        ours, theirs = socket.socketpair()
        socks[rank] = ours
        keep.append(theirs)
        if rank == 0:
            continue  # rank 0's worker lives in the controller's process: no heartbeat
        ours, theirs = socket.socketpair()
        ctl_socks[rank] = ours
        keep.append(theirs)
        if rank in beating:
            threading.Thread(target=send_heartbeats, args=(theirs, rank, stall_s / 10),
                             daemon=True).start()
    return Controller(socks, ctl_socks, stall_timeout_s=stall_s), keep


def test_a_silent_rank_is_named_within_the_stall_timeout():
    t0 = time.monotonic()  # before the controller: its monitor counts silence from its start
    ctl, keep = _controller(0.6, beating={1})
    with pytest.raises(ControllerError, match=r"^rank 2 stalled: no heartbeat for [\d.]+ s "
                                              r"while idle \(stall_timeout_s=0.6"):
        ctl.pump(lambda: False, timeout_s=20)
    assert 0.6 <= time.monotonic() - t0 < 3
    ctl.close()
    for s in keep:
        s.close()


def test_beating_ranks_are_never_stalled_and_no_thread_without_a_timeout():
    ctl, keep = _controller(1.0, beating={1, 2})
    with pytest.raises(ControllerError, match=r"no reply within 3\.0 s"):  # not a stall
        ctl.pump(lambda: False, timeout_s=3.0)
    ctl.close()
    threads = threading.active_count()
    ours, theirs = socket.socketpair()
    ctl = Controller({0: ours}, {})  # as the unit tests build one: no monitor
    assert ctl._heartbeats is None and threading.active_count() == threads
    ctl.close()
    for s in [*keep, theirs]:
        s.close()


def test_heartbeats_stop_when_the_connection_closes():
    ours, theirs = socket.socketpair()
    thread = threading.Thread(target=send_heartbeats, args=(theirs, 3, 0.01), daemon=True)
    thread.start()
    msg, _, _ = wire.recv_msg(ours)
    assert msg == Heartbeat(3, os.getpid(), socket.gethostname())
    ours.close()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_stall_timeout_setting():
    assert stall_timeout(None, {}) == 60.0
    assert stall_timeout(None, {STALL_TIMEOUT_ENV: "2.5"}) == 2.5
    assert stall_timeout(0, {STALL_TIMEOUT_ENV: "2.5"}) == 0.0  # the argument wins; 0 = off
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match=STALL_TIMEOUT_ENV):
            stall_timeout(None, {STALL_TIMEOUT_ENV: bad})


def test_sigstop_of_a_worker_rank_mid_call_ends_the_job_naming_it(tmp_path):
    """Rank 1 of 2, stopped while it runs a call: the job exits non-zero within the stall
    timeout plus a few seconds (not the 60 s collective timeout), naming rank 1."""
    pid_file = tmp_path / "pid"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "tests.controller_jobs", "stall", str(pid_file), "1"]
    env = os.environ | {STALL_TIMEOUT_ENV: str(STALL_S)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "rank 1 never started its call"
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid is not None:  # never leave a stopped process behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    assert proc.returncode != 0
    assert "rank 1 stalled: no heartbeat for" in out and "during actor.sleep_on_rank" in out, \
        out[-3000:]
    assert "rank 1: stopping: the controller failed: ControllerError: rank 1 stalled" in out, \
        out[-3000:]
    assert elapsed < STALL_S + 10, (elapsed, out[-3000:])
