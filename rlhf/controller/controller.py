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

Stalls.  Every other rank sends a :class:`~rlhf.controller.messages.Heartbeat` on its abort
connection from a thread of its own; a :class:`HeartbeatMonitor` thread on rank 0 reads them.
A rank silent for ``stall_timeout_s`` (its process stopped, frozen or swapped out: a rank busy
in a long call or blocked in a collective still beats) is raised as a ControllerError naming
it at the controller's next wait, which it wakes for that, instead of the program waiting for
the 300 s collective timeout.  Nothing of this is on the path of a call.
"""

from __future__ import annotations

import itertools
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.layout import HybridLayout
from rlhf.controller import wire
from rlhf.controller.calls import CallState
from rlhf.controller.errors import ControllerError, RankLostError, WorkerError
from rlhf.controller.messages import (Abort, Bye, Command, Done, Failed, GetOutput, Heartbeat,
                                      Shutdown, Value)
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


def heartbeat_interval(stall_timeout_s: float) -> float:
    """Seconds between two heartbeats of a rank: a quarter of the stall timeout, at most 1 s."""
    return min(1.0, stall_timeout_s / 4)


class HeartbeatMonitor:
    """Watches the heartbeats of ranks 1..W-1 on their abort connections (a daemon thread).

    A rank is stalled once ``stall_timeout_s`` passed since its last heartbeat (or since the
    start); then the monitor records it, writes one byte to ``wake`` (registered in the
    controller's selector) and stops.  A rank whose connection closes is no longer watched:
    its command connection reports it as lost.

    Args:
        ctl_socks: global rank -> abort socket (read here; the controller writes aborts).
        stall_timeout_s: silence after which a rank counts as stalled.
        wake: socket written once when a rank stalls.
    """

    MAX_BYTES = 1 << 16  # a heartbeat is under 100 bytes

    def __init__(self, ctl_socks: Mapping[int, socket.socket], stall_timeout_s: float,
                 wake: socket.socket) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.stalled: dict[int, float] = {}
        """Stalled rank -> seconds since its last heartbeat (set once, by the thread)."""
        self.beats: dict[int, Heartbeat] = {}
        """Rank -> its latest heartbeat (pid and host)."""
        self.seen: dict[int, float] = {}
        """Rank -> ``time.monotonic()`` of its latest heartbeat."""
        self._socks = dict(ctl_socks)
        self._wake = wake
        self._stop = threading.Event()
        for s in self._socks.values():
            s.settimeout(stall_timeout_s)  # a frame cut short counts as silence
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="hybridflow-heartbeats")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        tick = heartbeat_interval(self.stall_timeout_s)
        selector = selectors.DefaultSelector()
        for rank, s in self._socks.items():
            selector.register(s, selectors.EVENT_READ, rank)
        last = dict.fromkeys(self._socks, time.monotonic())
        try:
            while not self._stop.is_set():
                events = selector.select(tick)
                now = time.monotonic()  # after the wait: a late thread reads what queued up
                for key, _ in events:
                    if not self._beat(key.data, now, last):
                        selector.unregister(key.fileobj)
                        last.pop(key.data)
                stalled = {r: now - t for r, t in last.items() if now - t > self.stall_timeout_s}
                if stalled and not self._stop.is_set():
                    self.stalled = stalled
                    self._wake.send(b"!")
                    return
        except (OSError, ValueError):
            if not self._stop.is_set():
                raise
        finally:
            selector.close()

    def _beat(self, rank: int, now: float, last: dict[int, float]) -> bool:
        """Read one heartbeat of ``rank``; False once its connection is no longer watched."""
        try:
            msg, _, _ = wire.recv_msg(self._socks[rank], self.MAX_BYTES)
        except socket.timeout:
            return True  # a frame cut short: the rank's silence decides
        except (ConnectionError, OSError):
            return False  # gone: the command connection reports it
        except wire.MessageError as exc:
            print(f"[hybridflow] controller: stopped watching rank {rank}'s heartbeats: {exc}",
                  file=sys.stderr, flush=True)
            return False
        if not (isinstance(msg, Heartbeat) and msg.rank == rank):
            print(f"[hybridflow] controller: stopped watching rank {rank}'s heartbeats: it sent "
                  f"{type(msg).__name__} on its abort connection", file=sys.stderr, flush=True)
            return False
        self.beats[rank] = msg
        self.seen[rank] = last[rank] = now
        return True

    def resume_stalled(self) -> None:
        """SIGCONT to every stalled rank that runs on this host, so that a stopped one reads
        its abort (and takes torchrun's SIGTERM) instead of holding the job until torchrun's
        30 s shutdown grace ends; a rank on another host is left to its own torchrun."""
        host = socket.gethostname()
        for rank in self.stalled:
            beat = self.beats.get(rank)
            if beat is not None and beat.host == host and beat.pid > 1:
                try:
                    os.kill(beat.pid, signal.SIGCONT)
                except OSError:
                    pass


class Controller:
    """Handle of the single controller (exists on global rank 0 only).

    It is the :class:`~rlhf.controller.calls.CallIssuer` of the groups it makes.

    Args:
        socks: global rank -> command socket (every rank, rank 0's local worker included).
        ctl_socks: global rank -> abort socket (ranks other than 0).
        call_timeout_s: limit on any single wait for replies (None: wait; collective timeouts
            on the workers still bound every collective).
        max_message_bytes: largest command the controller sends and largest reply it accepts.
        stall_timeout_s: a rank whose heartbeats stop for this long is raised as stalled (0:
            no heartbeat monitor; see :class:`HeartbeatMonitor`).
        trace_path: a file to which every issued call is appended as a line
            ``<monotonic s> issue <what> ranks=<r,...>`` (None: no trace).
    """

    def __init__(self, socks: dict[int, socket.socket], ctl_socks: dict[int, socket.socket],
                 call_timeout_s: float | None = None, *,
                 max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
                 stall_timeout_s: float = 0.0, trace_path: str | None = None) -> None:
        self.world_size = len(socks)
        self._socks = socks
        self._ctl_socks = ctl_socks
        self._selector = selectors.DefaultSelector()
        for r, s in socks.items():
            self._selector.register(s, selectors.EVENT_READ, r)  # key.data: the rank
        self._heartbeats: HeartbeatMonitor | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        if stall_timeout_s > 0 and ctl_socks:
            self._wake = socket.socketpair()
            self._selector.register(self._wake[0], selectors.EVENT_READ, None)
            self._heartbeats = HeartbeatMonitor(ctl_socks, stall_timeout_s, self._wake[1])
        self.call_timeout_s = call_timeout_s
        self.max_message_bytes = max_message_bytes
        self._trace = open(trace_path, "a", buffering=1) if trace_path else None
        self.stats = TransferStats()
        self._ids = itertools.count(1)
        self._tags = itertools.count(0, 2)
        self._calls: dict[int, CallState] = {}
        self._pending_frees: dict[int, list[int]] = {r: [] for r in socks}
        self._lost: set[int] = set()
        self._closed = False
        self._memory: dict[str, dict[str, int]] = {}

    # Worker groups ------------------------------------------------------------------------
    def group(self, worker_cls: type, layout: HybridLayout, pool: list[int] | None = None,
              name: str | None = None, args: tuple = (), kwargs: dict | None = None,
              collective_timeout_s: float | None = None,
              values_in_replies: bool = False, experts: ExpertLayout | None = None
              ) -> WorkerGroup:
        """Create a worker group (see :class:`rlhf.controller.worker_group.WorkerGroup`)."""
        return WorkerGroup(self, worker_cls, layout, pool=pool, name=name, args=args,
                           kwargs=kwargs or {}, collective_timeout_s=collective_timeout_s,
                           values_in_replies=values_in_replies, experts=experts)

    # Memory -------------------------------------------------------------------------------
    def take_memory(self) -> dict[str, dict[str, int]]:
        """Memory per phase since the last call: phase -> reading -> bytes, the largest over
        every rank and call of that phase (:attr:`Done.memory`); then starts over."""
        memory, self._memory = self._memory, {}
        return memory

    def _note_memory(self, sample: dict) -> None:
        readings = self._memory.setdefault(sample["phase"], {})
        for key, value in sample.items():
            if key != "phase":
                readings[key] = max(readings.get(key, 0), int(value))

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
        if self._trace is not None:
            self._trace.write(f"{time.monotonic():.3f} issue {what} "
                              f"ranks={','.join(map(str, sorted(messages)))}\n")
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
                if key.data is None:
                    raise self._stall_error()
                self._read(key.data)
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
            self._selector.unregister(self._socks[rank])
            bye = self._calls.get(0)
            if bye is not None and rank in bye.replies:
                # it acknowledged the shutdown and closed: a clean exit, while the others'
                # acknowledgements may still be on their way
                return
            self._lost.add(rank)
            raise RankLostError(rank, self._busy(rank)) from None
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
                if isinstance(msg, Done) and msg.memory is not None:
                    self._note_memory(msg.memory)
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

    def _stall_error(self) -> ControllerError:
        assert self._heartbeats is not None
        parts = []
        for rank, silent_s in sorted(self._heartbeats.stalled.items()):
            parts.append(f"rank {rank} stalled: no heartbeat for {silent_s:.1f} s "
                         f"{self._busy(rank)}")
        return ControllerError(
            f"{'; '.join(parts)} (stall_timeout_s={self._heartbeats.stall_timeout_s:g}: its "
            f"process is stopped, frozen or swapped out)")

    def stopped_error(self, signal_name: str) -> ControllerError:
        """What the controller knows when the job is stopped from outside (torchrun's SIGTERM
        after a rank died, which can come before the closed connection was read): a
        :class:`RankLostError` for a rank whose command connection has closed (of several,
        the one whose heartbeats stopped first: the first to go), else the calls in flight."""
        closed = sorted(r for r, s in self._socks.items() if r in self._lost or _closed(s))
        if closed:
            seen = self._heartbeats.seen if self._heartbeats is not None else {}
            first = min(closed, key=lambda r: (seen.get(r, float("-inf")), r))
            others = [r for r in closed if r != first]
            return RankLostError(first, f"{self._busy(first)} (found when the job was stopped "
                                 f"by {signal_name}"
                                 + (f"; ranks {others} had closed too)" if others else ")"))
        flight = sorted({c.what for c in self._calls.values() if not c.done})
        return ControllerError(f"the job was stopped by {signal_name} with no rank lost; "
                               f"calls in flight: {', '.join(flight) or 'none'}")

    def _busy(self, rank: int) -> str:
        busy = [c.what for c in self._calls.values() if rank in c.ranks and rank not in c.replies]
        return f"during {', '.join(busy)}" if busy else "while idle"

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
        listens on its abort connection (a dead one just fails the send).  A stalled rank on
        this host is resumed to read it (:meth:`HeartbeatMonitor.resume_stalled`).
        """
        for s in self._ctl_socks.values():
            try:
                wire.send_msg(s, Abort(reason), self.max_message_bytes)
            except (ConnectionError, OSError):
                pass
        if self._heartbeats is not None:
            self._heartbeats.stop()
            self._heartbeats.resume_stalled()
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._trace is not None:
            self._trace.close()
        if self._heartbeats is not None:
            self._heartbeats.stop()  # before its sockets close under it
        self._selector.close()
        for s in [*self._socks.values(), *self._ctl_socks.values(), *(self._wake or ())]:
            s.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has closed it (end of stream or reset), without reading."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
