"""Transfer protocols: (distribute, collect) pairs whose rank plans come from the C++ layer.

A worker method carries its protocol through the :func:`protocol` decorator; the method stays
an ordinary method of the worker class::

    class Critic(Worker):
        @protocol(DP_PROTO)
        def compute_values(self, batch: Batch) -> Batch: ...

Plans (see ``csrc/protocol_plans.h``) for a layout of W ranks:

=================  =======================================  ==================================
protocol           distribute                               collect
=================  =======================================  ==================================
ONE_TO_ALL         whole arguments to every rank            list of all W outputs
3D_PROTO           split over dp, same chunk to a dp        concat of (pp = last, tp = 0) of
                   replica's whole TP x PP block            every dp replica
3D_ALL_MICRO_DP    split over micro-DP groups, same chunk   concat of micro-DP rank 0 of every
                   to every member                          micro-DP group
3D_PP_ONLY         whole arguments to every rank            list, one per pp stage, from
                                                            (tp = 0, dp = 0)
DP_PROTO           split over all W ranks                   concat of all W outputs
ALL_TO_ALL         no-op: arguments as given to every rank  list of all W outputs
DP_COMPUTE         caller passes a list of W items          list of all W outputs
DP_COMPUTE_METRIC  split over all W ranks                   list of all W outputs (no concat)
RANK_ZERO          whole arguments to layout rank 0 only    its output
=================  =======================================  ==================================

Split: every :class:`Batch` argument (or future of one) is padded to a multiple of the chunk
count by repeating rows from its start, cut into equal chunks, and after a concat collect the
padding rows are removed again (never dropped silently: the pad count travels with the call).
Other arguments go whole to every called rank.

A built-in plan is computed by ``_C.protocol_plan`` from the layout's five sizes alone: the C++
planner and the coordinate formulas it uses (which :mod:`hybridflow_comm.layout` also calls)
are the one implementation, and this module only converts and caches its answer per
(protocol, layout), so a dispatch never recomputes a plan.

User protocols: :func:`register_protocol` with a Python plan function ``layout -> Plan``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from hybridflow_comm import _C
from hybridflow_comm.layout import HybridLayout

WHOLE, SPLIT, PER_RANK = "whole", "split", "per_rank"
CONCAT, LIST, SINGLE = "concat", "list", "single"
_DISTRIBUTE = {0: WHOLE, 1: SPLIT, 2: PER_RANK}
_COLLECT = {0: CONCAT, 1: LIST, 2: SINGLE}

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Plan:
    """Rank plan of one protocol on one layout (layout ranks, not global ranks).

    Attributes:
        distribute: ``"whole"``, ``"split"`` or ``"per_rank"``.
        num_chunks: chunks of a split (W for per_rank).
        chunk_of_rank: chunk (or item) index per layout rank; -1 = the rank is not called.
        collect_ranks: layout ranks whose outputs are collected, in output order.
        collect: ``"concat"``, ``"list"`` or ``"single"``.
    """

    distribute: str
    num_chunks: int
    chunk_of_rank: tuple[int, ...]
    collect_ranks: tuple[int, ...]
    collect: str

    def __post_init__(self) -> None:
        if self.distribute not in (WHOLE, SPLIT, PER_RANK):
            raise ValueError(f"distribute={self.distribute!r} is not one of whole/split/per_rank")
        if self.collect not in (CONCAT, LIST, SINGLE):
            raise ValueError(f"collect={self.collect!r} is not one of concat/list/single")
        w = len(self.chunk_of_rank)
        bad = [c for c in self.chunk_of_rank if not -1 <= c < max(self.num_chunks, 1)]
        if bad:
            raise ValueError(f"chunk indices {bad} are outside [-1, {self.num_chunks})")
        if not self.collect_ranks or any(not 0 <= r < w or self.chunk_of_rank[r] < 0
                                         for r in self.collect_ranks):
            raise ValueError(f"collect_ranks={list(self.collect_ranks)} must be called ranks "
                             f"of a {w}-rank layout")
        if self.collect == SINGLE and len(self.collect_ranks) != 1:
            raise ValueError("collect='single' needs exactly one collect rank")

    @property
    def called_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, c in enumerate(self.chunk_of_rank) if c >= 0)


@dataclass(frozen=True)
class Protocol:
    """A named transfer protocol; ``plan(layout)`` gives its rank plan."""

    name: str
    plan_fn: Callable[[HybridLayout], Plan]

    def plan(self, layout: HybridLayout) -> Plan:
        return _cached_plan(self, layout)

    def __repr__(self) -> str:
        return f"Protocol({self.name})"


@functools.lru_cache(maxsize=1024)
def _cached_plan(proto: Protocol, layout: HybridLayout) -> Plan:
    plan = proto.plan_fn(layout)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan function of protocol {proto.name} returned {type(plan).__name__}, "
                        "not a Plan")
    if len(plan.chunk_of_rank) != layout.world_size:
        raise ValueError(f"protocol {proto.name} planned {len(plan.chunk_of_rank)} ranks for a "
                         f"layout of {layout.world_size}")
    return plan


def _builtin_plan(name: str, layout: HybridLayout) -> Plan:
    t = layout.train
    p = _C.protocol_plan(name, t.pp, t.tp, t.dp, layout.pp_g, layout.tp_g)
    return Plan(_DISTRIBUTE[p.distribute], p.num_chunks, tuple(p.chunk_of_rank),
                tuple(p.collect_ranks), _COLLECT[p.collect])


_REGISTRY: dict[str, Protocol] = {}


def register_protocol(name: str, plan_fn: Callable[[HybridLayout], Plan]) -> Protocol:
    """Register a user protocol. ValueError if the name is taken.

    Args:
        name: unique protocol name.
        plan_fn: ``layout -> Plan`` (pure; cached per layout).
    Returns:
        The protocol, to pass to :func:`protocol`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"protocol name must be a non-empty str, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"protocol {name!r} is already registered")
    if not callable(plan_fn):
        raise TypeError(f"plan_fn of protocol {name!r} must be callable, got {plan_fn!r}")
    proto = Protocol(name, plan_fn)
    _REGISTRY[name] = proto
    return proto


def get_protocol(name: str) -> Protocol:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; registered: {sorted(_REGISTRY)}") from None


for _name in _C.builtin_protocols():
    register_protocol(_name, functools.partial(_builtin_plan, _name))

ONE_TO_ALL = get_protocol("ONE_TO_ALL")
THREE_D_PROTO = get_protocol("3D_PROTO")
THREE_D_ALL_MICRO_DP = get_protocol("3D_ALL_MICRO_DP")
THREE_D_PP_ONLY = get_protocol("3D_PP_ONLY")
DP_PROTO = get_protocol("DP_PROTO")
ALL_TO_ALL = get_protocol("ALL_TO_ALL")
DP_COMPUTE = get_protocol("DP_COMPUTE")
DP_COMPUTE_METRIC = get_protocol("DP_COMPUTE_METRIC")
RANK_ZERO = get_protocol("RANK_ZERO")

PROTOCOL_ATTR = "__hybridflow_protocol__"
PHASE_ATTR = "__hybridflow_phase__"
PHASES = ("generation", "log_probs", "update")
"""Phases of an iteration whose memory the workers report: generation, the forward-only
passes over the rollouts (log-probs, values, scores) and the training update."""


def protocol(proto: Protocol | str, phase: str | None = None) -> Callable[[F], F]:
    """Decorator: attach a transfer protocol to a worker method (the method is unchanged).

    Args:
        proto: the protocol or its registered name.
        phase: one of :data:`PHASES` when the method is that phase of an iteration: each call
            then reports its rank's device memory (``memory/<phase>/*`` metrics).
    """
    proto = get_protocol(proto) if isinstance(proto, str) else proto
    if not isinstance(proto, Protocol):
        raise TypeError(f"protocol() needs a Protocol or a name, got {proto!r}")
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase={phase!r} must be one of {PHASES} or None")

    def attach(fn: F) -> F:
        setattr(fn, PROTOCOL_ATTR, proto)
        if phase is not None:
            setattr(fn, PHASE_ATTR, phase)
        return fn

    return attach


def phase_of(method: Callable) -> str | None:
    """The phase a worker method was declared with (:func:`protocol`), or None."""
    return getattr(method, PHASE_ATTR, None)


def protocol_of(method: Callable) -> Protocol | None:
    """The protocol attached to a worker method, or None."""
    return getattr(method, PROTOCOL_ATTR, None)
