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
disappears, the other ranks see their connections close and exit non-zero too.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import traceback
from typing import Any, Callable

import torch.distributed as dist

from rlhf.controller import wire
from rlhf.controller.controller import Controller
from rlhf.controller.errors import ControllerError
from rlhf.controller.messages import Hello
from rlhf.controller.worker import WorkerRuntime, watch_controller


def _init_dist(timeout_s: float) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise ValueError("run() needs torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are "
                         "not set) or an initialized process group")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _connect(addr: tuple[str, int], rank: int, channel: str) -> socket.socket:
    s = socket.create_connection(addr)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    wire.send_msg(s, Hello(rank, channel))
    return s


def _accept_all(server: socket.socket, world_size: int, timeout_s: float
                ) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    server.settimeout(timeout_s)
    cmd: dict[int, socket.socket] = {}
    ctl: dict[int, socket.socket] = {}
    for _ in range(2 * (world_size - 1)):
        s, _ = server.accept()
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello, _, _ = wire.recv_msg(s)
        if not isinstance(hello, Hello):
            raise ControllerError(f"a rank connected with {type(hello).__name__}, not Hello")
        (cmd if hello.channel == "cmd" else ctl)[hello.rank] = s
    return cmd, ctl


def run(program: Callable[[Controller], Any], *, collective_timeout_s: float = 300.0,
        call_timeout_s: float | None = None, hard_exit: bool = True) -> int:
    """Run ``program`` as the single controller on rank 0 and the worker loop on every rank.

    Args:
        program: ``program(controller)``, called on rank 0 only.
        collective_timeout_s: timeout of every gloo collective (job group and role groups).
        call_timeout_s: limit on one wait of the controller for replies (None: no limit).
        hard_exit: on failure, exit the process at once with code 1 (threads may be stuck in a
            collective). False returns 1 instead (for embedding in a harness).

    Returns:
        The exit code: 0 on success, 1 on failure.
    """
    if collective_timeout_s <= 0:
        raise ValueError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
    _init_dist(collective_timeout_s)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data_pg = dist.new_group(list(range(world_size)),
                             timeout=datetime.timedelta(seconds=collective_timeout_s))
    if rank == 0:
        server = socket.create_server(("0.0.0.0", 0))
        server.listen(2 * world_size)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        addr = [(host, server.getsockname()[1])]
    else:
        addr = [None]
    dist.broadcast_object_list(addr, src=0)
    if rank != 0:
        return _serve_worker(rank, addr[0], data_pg, collective_timeout_s)
    cmd, ctl_socks = _accept_all(server, world_size, collective_timeout_s)
    server.close()
    local_ctl, local_worker = socket.socketpair()
    cmd[0] = local_ctl
    runtime = WorkerRuntime(0, local_worker, data_pg, collective_timeout_s)
    thread = threading.Thread(target=_serve_local, args=(runtime,), daemon=True,
                              name="hybridflow-worker-0")
    thread.start()
    controller = Controller(dict(sorted(cmd.items())), ctl_socks, call_timeout_s)
    try:
        program(controller)
        controller.shutdown()
    except BaseException as exc:  # noqa: BLE001 - report, stop every rank, exit non-zero
        print(f"[hybridflow] controller failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if not hasattr(exc, "remote_traceback"):
            traceback.print_exc()
        sys.stderr.flush()
        controller.abort(f"the controller failed: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}")
        if hard_exit:
            sys.stdout.flush()
            os._exit(1)
        return 1
    thread.join(timeout=30)
    return 0


def _serve_local(runtime: WorkerRuntime) -> None:
    try:
        runtime.serve()
    except (ConnectionError, OSError):
        pass  # the controller closed the socket pair (shutdown or abort)


def _serve_worker(rank: int, addr: tuple[str, int], data_pg: Any, timeout_s: float) -> int:
    cmd = _connect(addr, rank, "cmd")
    ctl = _connect(addr, rank, "ctl")
    runtime = WorkerRuntime(rank, cmd, data_pg, timeout_s)
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
    return 0
