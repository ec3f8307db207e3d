"""Every message between the controller (rank 0) and the workers: one frozen dataclass each.

Control plane (one command socket and one abort socket per rank; rank 0's own worker talks
over a socket pair and needs no handshake)::

    controller (rank 0)                                  rank r, on each of its two sockets
        Challenge(nonce) ------------------------------>    (handshake: fixed-size frames,
        <------------------- Hello(rank, channel, ...)       never pickled, see
        Welcome(mac) ---------------------------------->     rlhf.controller.handshake)
        Create | Call | SendOnly | GetOutput ---------->    run one at a time, in order
        <------------------------ Done | Value | Failed    one reply per command
        Shutdown -------------------------------------->    stop the command loop
        <----------------------------------------- Bye
        Abort(reason) --------------------------------->    (abort socket) exit 1 now
        <---------------------- Heartbeat(rank, pid, host)  (abort socket) every interval

Data plane plans ride inside commands: a :class:`Fetch` stands in for a call argument whose rows
the consumer rank receives from producer ranks, a :class:`Send` is one producer's order to send
rows to one consumer (see :mod:`rlhf.controller.worker`).

Messages hold plain values (numbers, strings, tuples, dicts, tensors) and other messages; what a
program passes to a worker method (``args``/``kwargs``) travels as given.  Every class is made by
:func:`message`, which registers it in :data:`MESSAGES`: the complete list of message types, for
a decoder that accepts nothing else.  :mod:`rlhf.controller.wire` sends a message as its
registry index and its field values (:func:`astuple`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Callable, TypeVar, dataclass_transform

T = TypeVar("T")

MESSAGES: list[type] = []
"""Every message class, in definition order (filled by :func:`message`)."""
_VALUES: dict[type, Callable[[Any], tuple]] = {}


@dataclass_transform(frozen_default=True)
def message(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen, slotted dataclass, registered in :data:`MESSAGES`.

    Where a message is pickled inside another object (a :class:`Fetch` among a call's
    arguments) it pickles as (class, field values): one constructor call on load, about half
    the cost of the default state protocol of slotted dataclasses.
    """
    cls = dataclass(frozen=True, slots=True)(cls)
    names = tuple(f.name for f in fields(cls))
    values: Callable[[Any], tuple] = (attrgetter(*names) if len(names) > 1
                                      else lambda m: tuple(getattr(m, n) for n in names))
    cls.__reduce__ = lambda self: (cls, values(self))
    _VALUES[cls] = values
    MESSAGES.append(cls)
    return cls


def astuple(msg: Any) -> tuple:
    """Field values of a message, in field order (no copies, unlike ``dataclasses.astuple``)."""
    return _VALUES[type(msg)](msg)


# Data plane plans --------------------------------------------------------------------------
@message
class Fetch:
    """Placeholder for a call argument whose rows come from producer ranks (a future's output)."""

    oid: int
    """Id of the stored output on the producers (the producing call's id)."""
    segments: tuple[tuple[int, int, int], ...]
    """``(producer global rank, start, end)`` row ranges, concatenated in this order."""
    tags: tuple[tuple[int, int], ...]
    """``(producer global rank, gloo tag)`` of each producer's one message to this rank."""


@message
class Send:
    """Rows of a stored output that this rank sends to one consumer rank in one message."""

    dst: int
    """Global rank of the consumer."""
    oid: int
    """Id of the stored output (the producing call's id)."""
    ranges: tuple[tuple[int, int], ...]
    """``(start, end)`` row ranges of the output, sent in this order."""
    tag: int
    """Gloo tag of the size message; the payload goes with ``tag + 1``."""


# Handshake and abort -----------------------------------------------------------------------
# The three handshake messages travel as fixed-size byte strings (rlhf.controller.handshake),
# not pickles: they come before the peer has proved that it belongs to the job.
@message
class Challenge:
    """Controller -> a new connection: prove that you know the job's secret."""

    nonce: bytes
    """32 random bytes, fresh for every connection (an answer recorded on another connection
    does not fit this one)."""


@message
class Hello:
    """Rank -> controller: the answer to :class:`Challenge` on each of its two connections."""

    rank: int
    """Global rank of the sender."""
    channel: str
    """``"cmd"`` (commands and replies) or ``"ctl"`` (aborts; heartbeats the other way)."""
    nonce: bytes
    """32 random bytes of the rank, which :class:`Welcome` must cover."""
    mac: bytes
    """HMAC-SHA256 under the job's secret of the challenge, rank, channel and ``nonce``."""


@message
class Welcome:
    """Controller -> rank: the controller knows the secret too (the rank checks it)."""

    mac: bytes
    """HMAC-SHA256 under the job's secret of the rank's nonce, the challenge, rank, channel."""


@message
class Abort:
    """Controller -> rank on the abort socket: exit non-zero now (the job failed)."""

    reason: str
    """One line the rank prints before it exits."""


@message
class Heartbeat:
    """Rank -> controller on the abort socket, from a thread of its own, every heartbeat
    interval: the rank's process runs (a busy or blocked main thread still beats; a stopped
    process does not)."""

    rank: int
    """Global rank of the sender."""
    pid: int
    """Process id of the sender (the controller resumes a stopped rank on its own host, so
    that the rank can read the abort)."""
    host: str
    """Host name of the sender (``socket.gethostname()``)."""


# Commands (controller -> rank) -------------------------------------------------------------
@message
class Create:
    """Build a role's process groups on every rank; make its worker on the role's pool."""

    cid: int
    """Call id (the reply carries it back)."""
    gid: int
    """Worker-group id under which the ranks keep the worker."""
    worker: str
    """Worker class as ``"module:qualname"`` (see :func:`rlhf.controller.worker.worker_path`)."""
    role: str
    """Name of the worker group."""
    pool: tuple[int, ...]
    """Ascending global ranks of the role; layout rank i is ``pool[i]``."""
    train: tuple[int, int, int]
    """``(pp, tp, dp)`` of the role's training layout."""
    gen: tuple[int, int]
    """``(pp_g, tp_g)`` of the role's generation layout."""
    args: tuple
    """Positional arguments of the worker's ``__init__``."""
    kwargs: dict[str, Any]
    """Keyword arguments of the worker's ``__init__``."""
    collective_timeout_s: float | None
    """Timeout of the role's process groups (None: the job's)."""
    experts: tuple[int, int, int] | None = None
    """``(num_experts, ep, gen_ep)`` of a role that splits a mixture's experts over EP ranks
    (:class:`hybridflow_comm.expert_layout.ExpertLayout`); None: no expert groups."""


@message
class Call:
    """Run one worker method on this rank (producer sends first, then the method)."""

    cid: int
    """Call id; also the id under which ``keep`` stores the output."""
    gid: int
    """Worker-group id of the worker to run on."""
    method: str
    """Name of the protocol-decorated worker method."""
    args: tuple
    """This rank's positional arguments (:class:`Fetch` where rows come from producers)."""
    kwargs: dict[str, Any]
    """This rank's keyword arguments (:class:`Fetch` where rows come from producers)."""
    keep: bool
    """This rank is a collect rank: store the output under ``cid`` and describe it."""
    inline: bool
    """Send a kept output with the reply (:attr:`Done.value`)."""
    sends: tuple[Send, ...]
    """Rows of earlier outputs this rank sends to consumer ranks before the method runs."""
    frees: tuple[int, ...]
    """Ids of stored outputs to forget first (futures the program dropped)."""


@message
class SendOnly:
    """A call's sends on a producer rank that the call does not run on."""

    cid: int
    """Call id (the reply carries it back)."""
    sends: tuple[Send, ...]
    """Rows of earlier outputs to send to the call's consumer ranks."""
    frees: tuple[int, ...]
    """Ids of stored outputs to forget first."""


@message
class GetOutput:
    """Send one stored output to the controller (:meth:`Future.get` without inline values)."""

    cid: int
    """Call id (the reply carries it back)."""
    oid: int
    """Id of the stored output."""
    frees: tuple[int, ...]
    """Ids of stored outputs to forget after reading ``oid``."""


@message
class Shutdown:
    """Stop the rank's command loop (it answers :class:`Bye`)."""


# Replies (rank -> controller) --------------------------------------------------------------
@message
class Done:
    """A command finished on one rank."""

    cid: int
    """Id of the command."""
    rank: int
    """Global rank of the sender."""
    meta: dict[str, Any] | None
    """Description of a kept output (:func:`rlhf.controller.worker.describe`), else None."""
    has_value: bool
    """``value`` carries the output (a call with ``inline`` on a collect rank)."""
    value: Any
    """The output when ``has_value`` (it may itself be None), else None."""
    memory: dict[str, Any] | None = None
    """A phase's call: ``{"phase": name, <reading>: bytes, ...}`` of this rank's device
    (:func:`rlhf.metrics.memory_sample`); else None."""


@message
class Value:
    """A stored output, in answer to :class:`GetOutput`."""

    cid: int
    """Id of the GetOutput command."""
    rank: int
    """Global rank of the sender."""
    value: Any
    """The stored output."""


@message
class Failed:
    """A command raised on one rank."""

    cid: int
    """Id of the command."""
    rank: int
    """Global rank of the sender."""
    error: str
    """``"ExceptionType: message"``."""
    traceback: str
    """The formatted traceback on the rank."""


@message
class Bye:
    """The rank stopped its command loop (answer to :class:`Shutdown`)."""

    rank: int
    """Global rank of the sender."""


Command = Create | Call | SendOnly | GetOutput
"""Commands that carry a call id and get one :data:`Reply` each."""
Reply = Done | Value | Failed
"""Answers to a :data:`Command`."""
