"""The single controller: one plain Python program that drives every worker group.

It lives on global rank 0, beside rank 0's own worker (a thread of the same process): see
:mod:`rlhf.controller.launch` for why.  Control plane = one TCP connection per rank (rank 0's
worker: a socketpair) carrying small pickled commands and replies (the dataclasses of
:mod:`rlhf.controller.messages`); data plane = gloo point-to-point between worker ranks (see
:mod:`rlhf.controller.worker`).

The controller never blocks on a call it issued unless the program needs something from it:
the metadata of a future passed to the next call, or a value (:meth:`Future.get`).  Replies are
read by :meth:`Controller.pump` from whichever ranks have answered.  Any error reply or lost
connection is raised at the next interaction with the workers, so a failure stops the program
promptly instead of waiting for the failing call's future.
"""

from __future__ import annotations

import itertools
import selectors
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hybridflow_comm.layout import HybridLayout
from rlhf.controller import wire
from rlhf.controller.calls import CallState
from rlhf.controller.errors import ControllerError, RankLostError, WorkerError
from rlhf.controller.messages import (Abort, Bye, Command, Done, Failed, GetOutput, Shutdown,
                                      Value)
from rlhf.controller.worker_group import WorkerGroup


@dataclass
class TransferStats:
    """Bytes through the controller's connections (both directions, all ranks).

    ``payload_*`` counts tensor bytes (sent as raw buffers); ``total_*`` counts everything.
    """

    total_out: int = 0
    total_in: int = 0
    payload_out: int = 0
    payload_in: int = 0
    messages: int = 0

    def snapshot(self) -> TransferStats:
        return TransferStats(self.total_out, self.total_in, self.payload_out, self.payload_in,
                             self.messages)

    def since(self, before: TransferStats) -> TransferStats:
        return TransferStats(self.total_out - before.total_out, self.total_in - before.total_in,
                             self.payload_out - before.payload_out,
                             self.payload_in - before.payload_in, self.messages - before.messages)


class Controller:
    """Handle of the single controller (exists on global rank 0 only).

    It is the :class:`~rlhf.controller.calls.CallIssuer` of the groups it makes.

    Args:
        socks: global rank -> command socket (every rank, rank 0's local worker included).
        ctl_socks: global rank -> abort socket (ranks other than 0).
        call_timeout_s: limit on any single wait for replies (None: wait; collective timeouts
            on the workers still bound every collective).
        max_message_bytes: largest command the controller sends and largest reply it accepts.
    """

    def __init__(self, socks: dict[int, socket.socket], ctl_socks: dict[int, socket.socket],
                 call_timeout_s: float | None = None, *,
                 max_message_bytes: int = wire.MAX_MESSAGE_BYTES) -> None:
        self.world_size = len(socks)
        self._socks = socks
        self._ctl_socks = ctl_socks
        self._rank_of = {s.fileno(): r for r, s in socks.items()}
        self._selector = selectors.DefaultSelector()
        for s in socks.values():
            self._selector.register(s, selectors.EVENT_READ)
        self.call_timeout_s = call_timeout_s
        self.max_message_bytes = max_message_bytes
        self.stats = TransferStats()
        self._ids = itertools.count(1)
        self._tags = itertools.count(0, 2)
        self._calls: dict[int, CallState] = {}
        self._pending_frees: dict[int, list[int]] = {r: [] for r in socks}
        self._lost: set[int] = set()
        self._closed = False

    # Worker groups ------------------------------------------------------------------------
    def group(self, worker_cls: type, layout: HybridLayout, pool: list[int] | None = None,
              name: str | None = None, args: tuple = (), kwargs: dict | None = None,
              collective_timeout_s: float | None = None,
              values_in_replies: bool = False) -> WorkerGroup:
        """Create a worker group (see :class:`rlhf.controller.worker_group.WorkerGroup`)."""
        return WorkerGroup(self, worker_cls, layout, pool=pool, name=name, args=args,
                           kwargs=kwargs or {}, collective_timeout_s=collective_timeout_s,
                           values_in_replies=values_in_replies)

    # Issuing ------------------------------------------------------------------------------
    def next_id(self) -> int:
        return next(self._ids)

    def next_tag(self) -> int:
        """A fresh pair of gloo tags (tag, tag + 1) for one point-to-point message."""
        return next(self._tags) % (1 << 30)

    def take_frees(self, rank: int) -> tuple[int, ...]:
        frees, self._pending_frees[rank] = self._pending_frees[rank], []
        return tuple(frees)

    def release(self, oid: int, ranks: tuple[int, ...]) -> None:
        """Forget a stored output on ``ranks`` (piggybacked on the next command to each)."""
        if self._closed:
            return
        for r in ranks:
            self._pending_frees[r].append(oid)

    def issue(self, what: str, messages: Mapping[int, Command]) -> CallState:
        """Send one command per rank; returns the state that collects their replies.

        Raises:
            wire.MessageError: a command cannot travel (a value outside the allow-list, or
                too large); then no rank got any part of the call.
        """
        self.poll()
        # Every rank's frame first: a refused value fails the call before any rank runs it.
        # Rank 0's worker last: it is a thread of this process and, once woken, holds the GIL
        # while it works, so a send after it could wait a whole GIL switch interval
        frames = [(rank, wire.frame(msg, self.max_message_bytes))
                  for rank, msg in sorted(messages.items(), key=lambda item: item[0] == 0)]
        cid = next(iter(messages.values())).cid
        state = CallState(cid, what, frozenset(messages))
        self._calls[cid] = state
        for rank, frame in frames:
            self._send(rank, frame, what)
        return state

    def _send(self, rank: int, frame: wire.Frame, what: str) -> None:
        if rank in self._lost:
            raise RankLostError(rank, f"before {what} could be sent to it")
        try:
            n, payload = wire.send_frame(self._socks[rank], frame)
        except (ConnectionError, OSError):
            self._lost.add(rank)
            raise RankLostError(rank, f"while sending {what}") from None
        self.stats.total_out += n
        self.stats.payload_out += payload
        self.stats.messages += 1

    # Waiting ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every reply that has already arrived (raises on errors); never blocks."""
        self.pump(lambda: True, timeout_s=0.0)

    def wait(self, state: CallState) -> CallState:
        """Block until every rank of ``state`` answered; raise the first error."""
        self.pump(lambda: state.done or state.error is not None)
        if state.error is not None:
            raise state.error
        return state

    def pump(self, until: Callable[[], bool], timeout_s: float | None = None) -> None:
        """Read replies until ``until()`` holds (``timeout_s=0``: one non-blocking pass)."""
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            if timeout_s != 0.0 and until():
                return
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = self._selector.select(wait_s)
            for key, _ in events:
                self._read(self._rank_of[key.fd])
            if until() and (timeout_s != 0.0 or not events):
                return
            if deadline is not None and time.monotonic() >= deadline:
                if timeout_s == 0.0:
                    return
                pending = sorted({r for c in self._calls.values() if not c.done
                                  for r in c.ranks - c.replies.keys()})
                raise ControllerError(f"no reply within {limit} s from ranks {pending}")

    def _read(self, rank: int) -> None:
        try:
            msg, n, payload = wire.recv_msg(self._socks[rank], self.max_message_bytes)
        except (ConnectionError, OSError):
            self._lost.add(rank)
            self._selector.unregister(self._socks[rank])
            busy = [c.what for c in self._calls.values() if rank in c.ranks and rank not in
                    c.replies]
            raise RankLostError(rank, f"during {', '.join(busy)}" if busy else "while idle"
                                ) from None
        except wire.MessageError as exc:  # nothing of it was run; the stream is not trusted
            self._lost.add(rank)
            self._selector.unregister(self._socks[rank])
            self._socks[rank].close()
            print(f"[hybridflow] controller: dropped the connection of rank {rank}: {exc}",
                  file=sys.stderr, flush=True)
            raise ControllerError(f"rank {rank} sent a message that the control plane refuses "
                                  f"({exc}); its connection was dropped") from None
        self.stats.total_in += n
        self.stats.payload_in += payload
        match msg:
            case Done() | Value():
                state = self._calls.get(msg.cid)
                if state is None:
                    return  # a late reply to a call that already failed on another rank
                state.replies[msg.rank] = msg
                if state.done:
                    self._calls.pop(msg.cid, None)
            case Failed():
                state = self._calls.pop(msg.cid, None)
                if state is None:
                    return
                role, _, method = state.what.partition(".")
                state.error = WorkerError(msg.rank, role, method, msg.error, msg.traceback)
                raise state.error
            case Bye():
                self._calls[0].replies[msg.rank] = msg
            case _:
                raise ControllerError(f"rank {rank} sent {type(msg).__name__}, not a reply")

    def fetch(self, oid: int, ranks: Sequence[int], what: str) -> CallState:
        """Ask ``ranks`` for their stored output ``oid``; wait for the values."""
        cid = self.next_id()
        state = self.issue(f"{what}.get", {r: GetOutput(cid, oid, self.take_frees(r))
                                           for r in ranks})
        return self.wait(state)

    # Lifecycle ----------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Wait for every issued command, then stop every rank's command loop."""
        for state in list(self._calls.values()):
            self.wait(state)
        bye = CallState(0, "shutdown", frozenset(self._socks))
        self._calls[0] = bye
        for rank in self._socks:
            self._send(rank, wire.frame(Shutdown()), "shutdown")
        self.pump(lambda: bye.done, timeout_s=timeout_s)
        self.close()

    def abort(self, reason: str) -> None:
        """Tell every rank to exit non-zero now (they may be stuck in a collective).

        Lost ranks too: one whose command connection was dropped for a refused message still
        listens on its abort connection (a dead one just fails the send).
        """
        for s in self._ctl_socks.values():
            try:
                wire.send_msg(s, Abort(reason), self.max_message_bytes)
            except (ConnectionError, OSError):
                pass
        self.close()

    def close(self) -> None:
        self._closed = True
        self._selector.close()
        for s in list(self._socks.values()) + list(self._ctl_socks.values()):
            s.close()

