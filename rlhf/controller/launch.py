"""Start the single controller and the workers on every rank of a torchrun job.

Every rank calls :func:`run` with the same program::

    def main(ctl: Controller) -> None:          # the controller program, rank 0 only
        actor = ctl.group(Actor, layout)
        ...

    if __name__ == "__main__":
        sys.exit(run(main))                      # torchrun --nproc_per_node 4 script.py

Where the controller lives: on global rank 0, in the main thread, with rank 0's worker in a
second thread of the same process.  No extra rank: the controller holds only metadata and runs
a sequential program, so it needs no device or cores of its own, the job keeps exactly the
ranks that torchrun starts (``--nproc_per_node`` = number of workers), and resource pools are
plain ranks ``0..W-1``.  The cost is that rank 0's worker shares a process (and the GIL) with
the controller; the controller mostly waits on sockets, which releases the GIL.

Failures.  A worker exception reaches the program as :class:`WorkerError`; a rank whose
connection closes (killed, crashed) as :class:`RankLostError`.  Either way, if the program does
not handle it, rank 0 prints it, tells every other rank to exit (on a second, abort-only
connection watched by a daemon thread, because their main thread may be stuck in a collective
with the lost rank), and exits non-zero; torchrun then reports the job as failed.  If rank 0
disappears, the other ranks see their connections close and exit non-zero too.  A rank whose
process stops (SIGSTOP, frozen, swapped out) is caught by its heartbeats: every other rank
sends one on its abort connection every ``min(1 s, stall_timeout_s / 4)`` from a thread of its
own, and after ``stall_timeout_s`` (60 s; ``run(stall_timeout_s=...)`` or the environment
variable ``HYBRIDFLOW_STALL_TIMEOUT_S``, the same on every node; 0 turns it off) without one
the program gets a ControllerError naming the rank and the job ends as above, instead of
waiting for the collective timeout.  A stalled rank on rank 0's host is sent SIGCONT after the
abort so that it can read it; one on another host is stopped by its own torchrun.  When a
rank dies, torchrun sends SIGTERM to the others, possibly before rank 0 has read the closed
connection: rank 0 takes that SIGTERM as the program's failure and reports what it knows
(:meth:`Controller.stopped_error`: the lost rank and its calls in flight) before it exits.
``HYBRIDFLOW_TRACE_CALLS=<file>`` appends a line per call the controller issues to that file.

Devices.  ``run(device=...)`` names the device of this rank (None: cpu).  The job's default
group is created by :func:`hybridflow_comm.devices.init_process_group`: gloo on CPU;
``cpu:gloo,cuda:nccl`` on CUDA, its NCCL communicator created eagerly on the device, with
:data:`NCCL_ENV_DEFAULTS` set first so that a collective that times out fails the rank with an
error instead of hanging it.  The runtime's data plane carries host bytes only and is a gloo
group by name (:func:`_data_group`); the roles' groups inherit the default backend.  Every
thread that issues device work makes the device current first (CUDA keeps one per thread): the
worker loop does, rank 0's worker thread included.

Test modes, read here only (:func:`hooks_of_test_modes`), for tests and never for a run:
``HYBRIDFLOW_TEST_META_DEFAULT=1`` makes ``meta`` the default device of every worker thread
(``torch.set_default_device``, which is per thread), so a tensor created without an explicit
device fails the call that made it; ``HYBRIDFLOW_TEST_NCCL_RULES=1`` calls
``hybridflow_comm.nccl_rules.install()`` at rank start, before any process group, so every collective
is checked against NCCL's rules on gloo.

Start-up (see :mod:`.rendezvous` and :mod:`.handshake`): rank 0 listens on loopback or on
MASTER_ADDR's interface and publishes the address and the job's secret in the job's store; every
other rank opens its two connections and proves, by an HMAC of a fresh challenge, that it knows
the secret.  Connections that fail are closed and logged; the start-up waits for the real ranks.
The listening socket closes as soon as every rank is in, so nothing can connect during the job.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from hybridflow_comm import devices
from rlhf.controller import handshake, rendezvous, wire
from rlhf.controller.controller import Controller, heartbeat_interval
from rlhf.controller.errors import ControllerError
from rlhf.controller.worker import WorkerRuntime, send_heartbeats, watch_controller

MAX_MESSAGE_ENV = "HYBRIDFLOW_MAX_MESSAGE_BYTES"
TRACE_CALLS_ENV = "HYBRIDFLOW_TRACE_CALLS"
STALL_TIMEOUT_ENV = "HYBRIDFLOW_STALL_TIMEOUT_S"
STALL_TIMEOUT_S = 60.0
"""Default silence after which a rank counts as stalled (far above any GIL or scheduling
hiccup of a heartbeat thread, far below the 300 s collective timeout)."""
TEST_META_DEFAULT_ENV = "HYBRIDFLOW_TEST_META_DEFAULT"
TEST_NCCL_RULES_ENV = "HYBRIDFLOW_TEST_NCCL_RULES"
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
"""Environment defaults of a CUDA job's NCCL, set before its first group unless the user set
them (or their deprecated ``NCCL_*`` names).  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: when a
collective fails or outlives the group's timeout, the rank's NCCL watchdog aborts the
communicator (its peers' collectives fail instead of hanging) and ends the process after
printing the cause (``[PG ... Rank r] Watchdog caught collective operation timeout: ...``);
the controller reports the rank as lost during its call (:class:`RankLostError`).  Users who
want the cause as the call's own error (:class:`WorkerError`) set
``TORCH_NCCL_BLOCKING_WAIT=1``: collectives then block the calling thread until they finish
or time out, which costs the overlap of host and device, so it is not a default."""


def nccl_env_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The :data:`NCCL_ENV_DEFAULTS` that ``env`` lacks (under their names or the deprecated
    names without ``TORCH_``)."""
    return {k: v for k, v in NCCL_ENV_DEFAULTS.items()
            if k not in env and k.removeprefix("TORCH_") not in env}


def check_device(device: torch.device, env: Mapping[str, str], device_count: int) -> None:
    """Refuse a rank that would share a GPU or drive another rank's (before any group).

    One rank drives one GPU, the rank ``LOCAL_RANK`` of its node on ``cuda:<LOCAL_RANK>``; two
    ranks of a node on one GPU would be found by NCCL only at its first collective.

    Raises:
        ValueError naming the rank, its device and the node's GPUs.
    """
    if device.type != "cuda":
        return
    rank = env.get("RANK", "0")
    local = devices.local_rank(env)
    if device.index is None:
        raise ValueError(f"rank {rank}: device={device} names no GPU index; pass "
                         f"cuda:{local} (LOCAL_RANK) or resolve_device()")
    if device.index >= device_count:
        raise ValueError(f"rank {rank}: {device} does not exist: this node has {device_count} "
                         f"GPUs")
    if device.index != local:
        raise ValueError(f"rank {rank} (LOCAL_RANK={local}) is on {device}, the GPU of local "
                         f"rank {device.index}: every rank drives cuda:<LOCAL_RANK>, one GPU "
                         f"each")
    ranks_here = int(env.get("LOCAL_WORLD_SIZE", local + 1))
    if ranks_here > device_count:
        raise ValueError(f"rank {rank}: {ranks_here} ranks on this node share {device_count} "
                         f"GPUs (start at most {device_count}: torchrun "
                         f"--nproc_per_node={device_count})")


def hooks_of_test_modes(env: Mapping[str, str], device: torch.device
                        ) -> Callable[[], None] | None:
    """The worker-thread start hook of the test modes set in ``env`` (None: no test mode);
    the NCCL-rule mode is installed here, at once, for ``device`` (it must precede every
    process group)."""
    if env.get(TEST_NCCL_RULES_ENV) == "1":
        from hybridflow_comm import nccl_rules

        nccl_rules.install(device)
    if env.get(TEST_META_DEFAULT_ENV) == "1":
        return lambda: torch.set_default_device("meta")
    return None


def _init_dist(device: torch.device, timeout_s: float) -> None:
    if device.type == "cuda":
        check_device(device, os.environ, torch.cuda.device_count())
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise ValueError("run() needs torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are "
                         "not set) or an initialized process group")
    if device.type == "cuda":
        os.environ.update(nccl_env_defaults(os.environ))
    devices.init_process_group(device, timeout_s)


def message_limit(max_message_bytes: int | None, env: Mapping[str, str]) -> int:
    """``max_message_bytes``, else ``HYBRIDFLOW_MAX_MESSAGE_BYTES``, else 1 GiB."""
    value: Any = max_message_bytes
    if value is None:
        value = env.get(MAX_MESSAGE_ENV, wire.MAX_MESSAGE_BYTES)
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"{MAX_MESSAGE_ENV}={value!r} is not a number of bytes") from None
    if limit < 1 << 16:
        raise ValueError(f"max_message_bytes={limit} must be at least 65536 (64 KiB)")
    return limit


def stall_timeout(stall_timeout_s: float | None, env: Mapping[str, str]) -> float:
    """``stall_timeout_s``, else ``HYBRIDFLOW_STALL_TIMEOUT_S``, else 60 s (0: no heartbeat
    check); ValueError for anything but a finite number >= 0."""
    value: Any = stall_timeout_s
    name = "stall_timeout_s"
    if value is None:
        value = env.get(STALL_TIMEOUT_ENV, STALL_TIMEOUT_S)
        name = STALL_TIMEOUT_ENV
    try:
        timeout = float(value)
    except (TypeError, ValueError):
        timeout = float("nan")
    if not 0 <= timeout < float("inf"):
        raise ValueError(f"{name}={value!r} must be a finite number of seconds >= 0 (0 turns "
                         f"the heartbeat check off)")
    return timeout


def run(program: Callable[[Controller], Any], *, collective_timeout_s: float = 300.0,
        call_timeout_s: float | None = None, hard_exit: bool = True,
        handshake_timeout_s: float = 10.0, max_message_bytes: int | None = None,
        stall_timeout_s: float | None = None, device: torch.device | None = None) -> int:
    """Run ``program`` as the single controller on rank 0 and the worker loop on every rank.

    Args:
        program: ``program(controller)``, called on rank 0 only.
        collective_timeout_s: timeout of every gloo collective (job group and role groups), and
            of the start-up (every rank connected to the controller).
        call_timeout_s: limit on one wait of the controller for replies (None: no limit).
        hard_exit: on failure, exit the process at once with code 1 (threads may be stuck in a
            collective). False returns 1 instead (for embedding in a harness).
        handshake_timeout_s: limit on one connection's handshake with the controller.
        max_message_bytes: largest control-plane frame either side sends or accepts (None:
            ``HYBRIDFLOW_MAX_MESSAGE_BYTES``, else 1 GiB); the same on every rank.
        stall_timeout_s: a rank without a heartbeat for this long fails the job naming it
            (None: ``HYBRIDFLOW_STALL_TIMEOUT_S``, else 60 s; 0: off); the same on every rank.
        device: this rank's device (None: cpu), from
            :func:`hybridflow_comm.devices.resolve_device`; the workers compute on it.

    Returns:
        The exit code: 0 on success, 1 on failure.
    """
    if collective_timeout_s <= 0:
        raise ValueError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
    if handshake_timeout_s <= 0:
        raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
    limit = message_limit(max_message_bytes, os.environ)
    stall_s = stall_timeout(stall_timeout_s, os.environ)
    device = torch.device("cpu") if device is None else torch.device(device)
    on_start = hooks_of_test_modes(os.environ, device)
    _init_dist(device, collective_timeout_s)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = rendezvous.default_store()
    options = dict(max_message_bytes=limit, device=device, on_start=on_start)
    if rank != 0:
        return _serve_worker(rank, rendezvous.lookup(store, os.environ, rank),
                             collective_timeout_s, handshake_timeout_s, stall_s, options)
    server, endpoint = rendezvous.open_controller(store, os.environ, world_size)
    try:
        cmd, ctl_socks = handshake.accept_ranks(server, world_size, endpoint.secret,
                                                collective_timeout_s, handshake_timeout_s)
    finally:
        server.close()  # nothing can connect during the job
        rendezvous.retract(store)
    data_pg = _data_group(world_size, collective_timeout_s)
    local_ctl, local_worker = socket.socketpair()
    cmd[0] = local_ctl
    runtime = WorkerRuntime(0, local_worker, data_pg, collective_timeout_s, **options)
    thread = threading.Thread(target=_serve_local, args=(runtime,), daemon=True,
                              name="hybridflow-worker-0")
    thread.start()
    controller = Controller(dict(sorted(cmd.items())), ctl_socks, call_timeout_s,
                            max_message_bytes=limit, stall_timeout_s=stall_s,
                            trace_path=os.environ.get(TRACE_CALLS_ENV) or None)
    previous = _raise_on_sigterm(controller)
    try:
        program(controller)
        controller.shutdown()
    except BaseException as exc:  # noqa: BLE001 - report, stop every rank, exit non-zero
        _restore_sigterm(previous, ignore=True)  # the report is not cut short
        print(f"[hybridflow] controller failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if not hasattr(exc, "remote_traceback"):
            traceback.print_exc()
        sys.stderr.flush()
        controller.abort(f"the controller failed: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}")
        if hard_exit:
            sys.stdout.flush()
            os._exit(1)
        _restore_sigterm(previous)
        return 1
    _restore_sigterm(previous)
    thread.join(timeout=30)
    return 0


def _raise_on_sigterm(controller: Controller) -> Any:
    """Make SIGTERM raise :meth:`Controller.stopped_error` in the controller program (in the
    main thread only, where Python runs signal handlers); returns the handler it replaced, or
    None where it installed nothing."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stopped(signum: int, frame: Any) -> None:
        raise controller.stopped_error(signal.Signals(signum).name)
    return signal.signal(signal.SIGTERM, stopped)


def _restore_sigterm(previous: Any, ignore: bool = False) -> None:
    """Put back the SIGTERM handler :func:`_raise_on_sigterm` replaced (``ignore``: ignore
    SIGTERM instead, while the failure is reported before the exit)."""
    if previous is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else previous)


def _serve_local(runtime: WorkerRuntime) -> None:
    try:
        runtime.serve()
    except (ConnectionError, OSError):
        pass  # the controller closed the socket pair (shutdown or abort)
    except wire.MessageError as exc:
        print(f"[hybridflow] rank 0: refused a message from the controller: {exc}",
              file=sys.stderr, flush=True)
        runtime.sock.close()  # the controller sees rank 0's worker gone instead of waiting


def _data_group(world_size: int, timeout_s: float) -> Any:
    """Process group of every rank for the data plane (collective: after the start-up): gloo
    on every device, since it carries serialized host bytes only."""
    return dist.new_group(list(range(world_size)), backend="gloo",
                          timeout=datetime.timedelta(seconds=timeout_s))


def _serve_worker(rank: int, endpoint: rendezvous.Endpoint, timeout_s: float,
                  handshake_timeout_s: float, stall_s: float, options: dict) -> int:
    """Rank ``rank``'s worker loop; ``options``: the WorkerRuntime's keyword arguments."""
    wait_s = max(timeout_s, handshake_timeout_s)  # rank 0 may still be busy with other ranks
    try:
        cmd = handshake.connect(endpoint.host, endpoint.port, rank, "cmd", endpoint.secret,
                                wait_s)
        ctl = handshake.connect(endpoint.host, endpoint.port, rank, "ctl", endpoint.secret,
                                wait_s)
    except ControllerError as exc:
        print(f"[hybridflow] rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    if stall_s > 0:
        threading.Thread(target=send_heartbeats, args=(ctl, rank, heartbeat_interval(stall_s)),
                         daemon=True, name="hybridflow-heartbeat").start()
    data_pg = _data_group(dist.get_world_size(), timeout_s)
    runtime = WorkerRuntime(rank, cmd, data_pg, timeout_s, **options)
    threading.Thread(target=watch_controller, args=(ctl, rank, runtime), daemon=True,
                     name="hybridflow-watchdog").start()
    try:
        runtime.serve()
    except (ConnectionError, OSError):
        if runtime.stopping.is_set():
            return 0
        print(f"[hybridflow] rank {rank}: lost the controller (rank 0)", file=sys.stderr,
              flush=True)
        return 1
    except wire.MessageError as exc:
        print(f"[hybridflow] rank {rank}: refused a message from the controller, dropping the "
              f"connection: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
