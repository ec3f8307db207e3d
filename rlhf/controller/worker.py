"""Worker side of the single controller: the Worker base class and the per-rank command loop.

Every rank runs one :class:`WorkerRuntime`.  It reads commands from its control socket in
order, runs them one at a time and answers each with a small reply (metadata, not payload)::

    controller --("create" | "call" | "send" | "fetch" | "shutdown")--> rank r
    controller <--("done", meta) | ("error", traceback) | ("value", v)-- rank r

Data plane.  Outputs of a call stay on the ranks that the protocol collects from, in a local
store keyed by call id.  When a later call consumes that output (a future passed as argument),
each consumer rank receives its own rows straight from the producer ranks over gloo
point-to-point messages (``isend``/``recv`` on a dedicated group), never through the
controller.  Per (producer, consumer) pair one message carries all rows the consumer needs from
that producer; sends are posted before receives, so ranks that are both never wait on each
other.  Since every rank runs its commands in the controller's issue order, a receive in
command k only waits for sends posted in commands <= k on other ranks: no cycle, no deadlock.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow_comm.groups import HybridGroups, build_hybrid_groups
from hybridflow_comm.layout import HybridLayout
from rlhf.controller import wire
from rlhf.controller.batch import Batch


class Worker:
    """Base class of the workers of one role (actor, critic, ...).

    The runtime sets these attributes before ``__init__`` runs, so a subclass can use them there:

    Attributes:
        role: name of the worker group.
        layout: the role's HybridLayout.
        pool: global ranks of the role's resource pool (layout rank i = ``pool[i]``).
        rank: this worker's layout rank.
        groups: this worker's process groups for ``layout`` (training and generation side).
    """

    role: str
    layout: HybridLayout
    pool: tuple[int, ...]
    rank: int
    groups: HybridGroups

    @property
    def global_rank(self) -> int:
        return self.pool[self.rank]


@dataclass(frozen=True)
class Fetch:
    """Placeholder for an argument whose rows come from producer ranks (a future's output).

    Attributes:
        oid: id of the stored output on the producers (the producing call's id).
        segments: ``(producer global rank, start, end)`` row ranges, concatenated in order.
        tags: producer global rank -> gloo tag of its message to this rank.
    """

    oid: int
    segments: tuple[tuple[int, int, int], ...]
    tags: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Send:
    """Rows of a stored output that this rank sends to one consumer rank in one message."""

    dst: int
    oid: int
    ranges: tuple[tuple[int, int], ...]
    tag: int


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
    """

    def __init__(self, rank: int, sock: socket.socket, data_pg: dist.ProcessGroup | None,
                 collective_timeout_s: float) -> None:
        self.rank = rank
        self.sock = sock
        self.data_pg = data_pg
        self.collective_timeout_s = collective_timeout_s
        self.workers: dict[int, Worker] = {}
        self.store: dict[int, Any] = {}
        self.stopping = threading.Event()

    def serve(self) -> None:
        """Run commands until "shutdown". ConnectionError if the controller goes away."""
        while True:
            msg, _, _ = wire.recv_msg(self.sock)
            op = msg[0]
            if op == "shutdown":
                self.stopping.set()
                wire.send_msg(self.sock, ("bye", None, self.rank))
                return
            cid = msg[1]
            try:
                reply = getattr(self, "_op_" + op)(*msg[1:])
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the controller
                reply = ("error", cid, self.rank, f"{type(exc).__name__}: {exc}",
                         traceback.format_exc())
            wire.send_msg(self.sock, reply)

    # Commands ---------------------------------------------------------------------------------
    def _op_create(self, cid: int, gid: int, cls: type, layout: HybridLayout,
                   pool: tuple[int, ...], role: str, args: tuple, kwargs: dict,
                   timeout_s: float | None) -> tuple:
        groups = build_hybrid_groups(layout, list(pool),
                                     timeout_s=timeout_s or self.collective_timeout_s)
        if groups is not None:
            worker = cls.__new__(cls)
            worker.role, worker.layout, worker.pool = role, layout, tuple(pool)
            worker.rank, worker.groups = groups.rank, groups
            worker.__init__(*args, **kwargs)
            self.workers[gid] = worker
        return ("done", cid, self.rank, None, None)

    def _op_call(self, cid: int, gid: int, method: str, args: tuple, kwargs: dict, keep: bool,
                 inline: bool, sends: tuple[Send, ...], frees: tuple[int, ...]) -> tuple:
        self._free(frees)
        works = self._post_sends(sends)
        args = tuple(self._resolve(a) for a in args)
        kwargs = {k: self._resolve(v) for k, v in kwargs.items()}
        for w in works:
            w.wait()
        out = getattr(self.workers[gid], method)(*args, **kwargs)
        if keep:
            self.store[cid] = out
        return ("done", cid, self.rank, describe(out), (out,) if inline and keep else None)

    def _op_send(self, cid: int, sends: tuple[Send, ...], frees: tuple[int, ...]) -> tuple:
        self._free(frees)
        for w in self._post_sends(sends):
            w.wait()
        return ("done", cid, self.rank, None, None)

    def _op_fetch(self, cid: int, oid: int, frees: tuple[int, ...]) -> tuple:
        value = self.store[oid]
        self._free(frees)
        return ("value", cid, self.rank, value, None)

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
            size = torch.tensor([data.numel()], dtype=torch.int64)
            works.append(dist.isend(size, s.dst, group=self.data_pg, tag=s.tag))
            works.append(dist.isend(data, s.dst, group=self.data_pg, tag=s.tag + 1))
        return works

    def _recv_pieces(self, src: int, tag: int) -> list[Batch]:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self.data_pg, tag=tag)
        data = torch.empty(int(size), dtype=torch.uint8)
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
        msg, _, _ = wire.recv_msg(ctl_sock)
        reason = msg[1] if msg and msg[0] == "abort" else f"unexpected message {msg!r}"
    except (ConnectionError, OSError):
        if runtime.stopping.is_set():
            return
        reason = "lost the controller (rank 0): its connection closed"
    print(f"[hybridflow] rank {rank}: stopping: {reason}", file=sys.stderr, flush=True)
    os._exit(1)
