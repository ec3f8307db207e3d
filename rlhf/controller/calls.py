"""What worker groups and futures need from the controller: issued calls and their replies.

:class:`CallState` collects the replies of one issued command; :class:`CallIssuer` is the part
of :class:`rlhf.controller.controller.Controller` that :class:`~rlhf.controller.worker_group.
WorkerGroup` and :class:`~rlhf.controller.futures.Future` use.  They depend on this module, not
on the controller, so the imports run one way::

    messages, calls  <-  futures  <-  worker_group  <-  controller  <-  launch
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from rlhf.controller.messages import Bye, Command, Done, Value


@dataclass
class CallState:
    """Replies of one issued command, filled in by the controller as they arrive."""

    cid: int
    """Call id of the command (0: shutdown)."""
    what: str
    """``"role.method"``, for messages."""
    ranks: frozenset[int]
    """Global ranks the command went to."""
    replies: dict[int, Done | Value | Bye] = field(default_factory=dict)
    """Global rank -> its reply, as they arrive."""
    error: Exception | None = None
    """The first failure of the command (set before it is raised)."""

    @property
    def done(self) -> bool:
        return len(self.replies) == len(self.ranks)


class CallIssuer(Protocol):
    """The controller as worker groups and futures see it (rank 0 only)."""

    world_size: int
    """Number of ranks of the job."""

    def next_id(self) -> int:
        """A fresh call (or worker-group) id."""

    def next_tag(self) -> int:
        """A fresh pair of gloo tags (tag, tag + 1) for one point-to-point message."""

    def take_frees(self, rank: int) -> tuple[int, ...]:
        """Stored outputs to forget on ``rank``, for the next command sent to it."""

    def release(self, oid: int, ranks: tuple[int, ...]) -> None:
        """Forget a stored output on ``ranks`` (piggybacked on the next command to each)."""

    def issue(self, what: str, messages: Mapping[int, Command]) -> CallState:
        """Send one command per rank (all with the same call id); returns its state."""

    def poll(self) -> None:
        """Read every reply that has already arrived (raises on errors); never blocks."""

    def wait(self, state: CallState) -> CallState:
        """Block until every rank of ``state`` answered; raise the first error."""

    def fetch(self, oid: int, ranks: Sequence[int], what: str) -> CallState:
        """Ask ``ranks`` for their stored output ``oid``; wait for the :class:`Value` replies."""
