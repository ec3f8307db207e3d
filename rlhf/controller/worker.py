"""Worker side of the single controller: the Worker base class and the per-rank command loop.

Every rank runs one :class:`WorkerRuntime`.  It reads commands from its control socket in
order, runs them one at a time and answers each with a small reply (metadata, not payload); the
messages are the dataclasses of :mod:`rlhf.controller.messages`::

    controller --(Create | Call | SendOnly | GetOutput | Shutdown)--> rank r
    controller <--(Done(meta) | Failed(traceback) | Value(v) | Bye)-- rank r

Data plane.  Outputs of a call stay on the ranks that the protocol collects from, in a local
store keyed by call id.  When a later call consumes that output (a future passed as argument),
each consumer rank receives its own rows straight from the producer ranks over gloo
point-to-point messages (``isend``/``recv`` on a dedicated group), never through the
controller.  Per (producer, consumer) pair one message carries all rows the consumer needs from
that producer; sends are posted before receives, so ranks that are both never wait on each
other.  Since every rank runs its commands in the controller's issue order, a receive in
command k only waits for sends posted in commands <= k on other ranks: no cycle, no deadlock.

Devices.  Each rank computes on one device (:attr:`Worker.device`).  Everything on the wire
is host bytes, so a call's arguments are moved to the device once, here, before the method
runs (the tensors of a :class:`Batch` or a bare tensor argument); outputs kept in the store
for later calls stay where the method left them (on the device), and what leaves the rank (a
reply's value, rows for another rank) is copied to the host where :mod:`.wire` encodes it.
The data-plane group is gloo: it moves those encoded host bytes.

Memory.  A call to a method with a phase (``@protocol(..., phase=...)``) reports the memory of
its device in :attr:`Done.memory` (:func:`rlhf.metrics.memory_sample`, the peak reset before
the call), which the controller keeps per phase (:meth:`Controller.take_memory`).
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridflow_comm.devices import use_device
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.groups import (ExpertGroups, HybridGroups, build_expert_groups,
                                    build_hybrid_groups)
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.controller import wire
from rlhf.controller.batch import Batch
from rlhf.controller.messages import (Abort, Bye, Call, Create, Done, Failed, Fetch, GetOutput,
                                      Heartbeat, Reply, Send, SendOnly, Shutdown, Value)
from rlhf.controller.protocols import phase_of
from rlhf.metrics import memory_sample, reset_peak_memory


class Worker:
    """Base class of the workers of one role (actor, critic, ...).

    The runtime sets these attributes before ``__init__`` runs, so a subclass can use them there:

    Attributes:
        role: name of the worker group.
        layout: the role's HybridLayout.
        pool: global ranks of the role's resource pool (layout rank i = ``pool[i]``).
        rank: this worker's layout rank.
        groups: this worker's process groups for ``layout`` (training and generation side).
        experts: its expert groups when the role splits a mixture's experts over EP ranks
            (``ep > 1``), else None.
        device: the device this rank computes on (``run(device=...)``): build models and
            create tensors on it; the call arguments arrive on it.  A worker built outside
            the runtime (a test, a script) computes on the CPU.
    """

    role: str
    layout: HybridLayout
    pool: tuple[int, ...]
    rank: int
    groups: HybridGroups
    experts: ExpertGroups | None = None
    device: torch.device = torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return self.pool[self.rank]


def worker_path(cls: type) -> str:
    """``"module:qualname"`` of a worker class, as :class:`Create` carries it.

    Raises:
        TypeError: ``cls`` is not a Worker subclass defined at module level.
    """
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"worker_cls must be a Worker subclass, got {cls!r}")
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"worker class {cls.__qualname__} must be importable by module path "
                        f"(defined at module level, not inside a function)")
    return f"{cls.__module__}:{cls.__qualname__}"


def import_worker(path: str) -> type[Worker]:
    """The worker class named by :func:`worker_path` (imports its module if needed)."""
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    if not (isinstance(obj, type) and issubclass(obj, Worker)):
        raise TypeError(f"{path} is not a Worker subclass: {obj!r}")
    return obj


def describe(value: Any) -> dict:
    """Metadata of an output: what the controller learns about it (never the payload)."""
    if isinstance(value, Batch):
        return {"kind": "batch"} | value.describe()
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "size": int(value.shape[0]) if value.dim() else None,
                "shape": tuple(value.shape), "dtype": str(value.dtype)}
    return {"kind": type(value).__name__}


class WorkerRuntime:
    """The command loop of one rank.

    Args:
        rank: global rank.
        sock: the command socket (to the controller).
        data_pg: process group of all ranks used for point-to-point data transfers.
        collective_timeout_s: timeout of the process groups that roles create.
        max_message_bytes: largest command this rank accepts and largest reply it sends.
        device: the device of this rank's workers (None: cpu).
        on_start: called first in the thread that serves (a test mode's hook), or None.
    """

    def __init__(self, rank: int, sock: socket.socket, data_pg: dist.ProcessGroup | None,
                 collective_timeout_s: float, *,
                 max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
                 device: torch.device | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.on_start = on_start
        self.sock = sock
        self.data_pg = data_pg
        self.collective_timeout_s = collective_timeout_s
        self.max_message_bytes = max_message_bytes
        self.workers: dict[int, Worker] = {}
        self.store: dict[int, Any] = {}
        self.stopping = threading.Event()

    def serve(self) -> None:
        """Run commands until :class:`Shutdown`.

        Raises:
            ConnectionError: the controller went away.
            wire.MessageError: the controller sent a frame this rank refuses (too large, or
                naming a class outside the allow-list); the caller drops the connection.
        """
        use_device(self.device)  # CUDA's current device is per thread: this one runs the calls
        if self.on_start is not None:
            self.on_start()
        while True:
            msg, _, _ = wire.recv_msg(self.sock, self.max_message_bytes)
            if isinstance(msg, Shutdown):
                self.stopping.set()
                wire.send_msg(self.sock, Bye(self.rank), self.max_message_bytes)
                return
            try:
                reply: Reply
                match msg:
                    case Call():
                        reply = self._call(msg)
                    case SendOnly():
                        reply = self._send_only(msg)
                    case GetOutput():
                        reply = self._get_output(msg)
                    case Create():
                        reply = self._create(msg)
                    case _:
                        raise TypeError(f"rank {self.rank}: not a command: {msg!r}")
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the controller
                reply = Failed(msg.cid, self.rank, f"{type(exc).__name__}: {exc}",
                               traceback.format_exc())
            wire.send_frame(self.sock, self._frame(reply))

    def _frame(self, reply: Reply) -> wire.Frame:
        """The reply's frame; a Failed naming the reason if the output cannot travel (too
        large, a type the wire refuses, a tensor whose copy to the host fails)."""
        try:
            return wire.frame(reply, self.max_message_bytes)
        except Exception as exc:  # noqa: BLE001 - the controller must hear of it, not wait
            return wire.frame(Failed(reply.cid, self.rank, f"{type(exc).__name__}: {exc}",
                                     traceback.format_exc()), self.max_message_bytes)

    # Commands ---------------------------------------------------------------------------------
    def _create(self, msg: Create) -> Done:
        layout = HybridLayout(ParallelLayout(*msg.train), *msg.gen)
        timeout_s = msg.collective_timeout_s or self.collective_timeout_s
        groups = build_hybrid_groups(layout, list(msg.pool), timeout_s=timeout_s)
        experts = None if msg.experts is None else build_expert_groups(
            ExpertLayout(layout, *msg.experts), list(msg.pool), timeout_s=timeout_s)
        if groups is not None:
            cls = import_worker(msg.worker)
            worker = cls.__new__(cls)
            worker.role, worker.layout, worker.pool = msg.role, layout, tuple(msg.pool)
            worker.rank, worker.groups, worker.device = groups.rank, groups, self.device
            worker.experts = experts
            worker.__init__(*msg.args, **msg.kwargs)
            self.workers[msg.gid] = worker
        return Done(msg.cid, self.rank, None, False, None)

    def _call(self, msg: Call) -> Done:
        self._free(msg.frees)
        works = self._post_sends(msg.sends)
        args = tuple(self._on_device(self._resolve(a)) for a in msg.args)
        kwargs = {k: self._on_device(self._resolve(v)) for k, v in msg.kwargs.items()}
        for w in works:
            w.wait()
        method = getattr(self.workers[msg.gid], msg.method)
        phase = phase_of(method)
        if phase is not None:
            reset_peak_memory(self.device)
        out = method(*args, **kwargs)
        memory = None if phase is None else {"phase": phase, **memory_sample(self.device)}
        if msg.keep:
            self.store[msg.cid] = out
        inline = msg.inline and msg.keep
        return Done(msg.cid, self.rank, describe(out), inline, out if inline else None, memory)

    def _on_device(self, arg: Any) -> Any:
        """A call argument on this rank's device (Batch tensors, a bare tensor; the rest as
        is): the one host-to-device move of the data a call receives."""
        if isinstance(arg, (Batch, torch.Tensor)):
            return arg.to(self.device)
        return arg

    def _send_only(self, msg: SendOnly) -> Done:
        self._free(msg.frees)
        for w in self._post_sends(msg.sends):
            w.wait()
        return Done(msg.cid, self.rank, None, False, None)

    def _get_output(self, msg: GetOutput) -> Value:
        value = self.store[msg.oid]
        self._free(msg.frees)
        return Value(msg.cid, self.rank, value)

    # Data plane -------------------------------------------------------------------------------
    def _free(self, oids: tuple[int, ...]) -> None:
        for oid in oids:
            self.store.pop(oid, None)

    def _post_sends(self, sends: tuple[Send, ...]) -> list:
        works = []
        for s in sends:
            if s.dst == self.rank:
                continue  # the consumer reads its own store
            out = self.store[s.oid]
            payload = wire.dumps([out.rows(slice(a, b)) for a, b in s.ranges])
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64, device="cpu")
            works.append(dist.isend(size, s.dst, group=self.data_pg, tag=s.tag))
            works.append(dist.isend(data, s.dst, group=self.data_pg, tag=s.tag + 1))
        return works

    def _recv_pieces(self, src: int, tag: int) -> list[Batch]:
        size = torch.zeros(1, dtype=torch.int64, device="cpu")  # host bytes: a gloo group
        dist.recv(size, src, group=self.data_pg, tag=tag)
        data = torch.empty(int(size), dtype=torch.uint8, device="cpu")
        dist.recv(data, src, group=self.data_pg, tag=tag + 1)
        return wire.loads(data.numpy())

    def _resolve(self, arg: Any) -> Any:
        if not isinstance(arg, Fetch):
            return arg
        received = {src: self._recv_pieces(src, tag) for src, tag in arg.tags if src != self.rank}
        pieces = []
        for src, start, end in arg.segments:
            if src == self.rank:
                pieces.append(self.store[arg.oid].rows(slice(start, end)))
            else:
                pieces.append(received[src].pop(0))
        out = Batch.concat(pieces) if len(pieces) > 1 else pieces[0]
        out.meta.pop("_pad", None)
        return out


def watch_controller(ctl_sock: socket.socket, rank: int, runtime: WorkerRuntime) -> None:
    """Kill this rank when the controller aborts the job or disappears (daemon thread).

    The main thread may be blocked inside a collective whose peer is gone, so only a hard exit
    is sure to stop it; the exit code is non-zero so that torchrun reports the job as failed.
    """
    try:
        msg, _, _ = wire.recv_msg(ctl_sock, runtime.max_message_bytes)
        reason = msg.reason if isinstance(msg, Abort) else f"unexpected message {msg!r}"
    except (ConnectionError, OSError):
        if runtime.stopping.is_set():
            return
        reason = "lost the controller (rank 0): its connection closed"
    except wire.MessageError as exc:
        reason = f"refused a message on the abort connection: {exc}"
    print(f"[hybridflow] rank {rank}: stopping: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


def send_heartbeats(ctl_sock: socket.socket, rank: int, interval_s: float) -> None:
    """Tell the controller every ``interval_s`` that this process runs (daemon thread, on the
    abort connection, which only this thread writes).  It needs nothing but the GIL, so a main
    thread busy in a call or blocked in a collective does not silence it; a stopped process
    does.  Ends when the connection closes (the job ended)."""
    frame = wire.frame(Heartbeat(rank, os.getpid(), socket.gethostname()))
    while True:
        try:
            wire.send_frame(ctl_sock, frame)
        except (ConnectionError, OSError):
            return
        time.sleep(interval_s)
