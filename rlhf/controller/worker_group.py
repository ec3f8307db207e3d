"""Worker groups: the controller's handle on the workers of one role.

A group is made from a worker class, a resource pool (ascending global ranks) and the role's
HybridLayout.  Roles may share ranks (colocated: each keeps its own worker object, layout and
process groups on those ranks) or sit on disjoint pools::

    actor  = ctl.group(Actor,  HybridLayout(ParallelLayout(1, 2, 2), 1, 1), pool=[0, 1, 2, 3])
    critic = ctl.group(Critic, HybridLayout(ParallelLayout(1, 1, 2), 1, 1), pool=[2, 3])
    out = actor.generate_sequences(prompts)           # Future, returned at once
    values = critic.compute_values(out)               # ranks 2, 3 pull rows from the actor ranks

``group.m(...)`` is short for ``group.call(WorkerCls.m, ...)``: attribute access resolves only
to methods of the worker class that carry a protocol (the decorator), so what a group can do is
exactly what a reader sees on the worker class.

Distribution (controller side, before anything is sent, so bad input raises ValueError and
never reaches a collective): split arguments are padded and cut by the protocol plan; a future
argument becomes per-rank :class:`~rlhf.controller.messages.Fetch` row plans plus
:class:`~rlhf.controller.messages.Send` orders to its producer ranks, from
``_C.transfer_segments``.

A group talks to the controller through :class:`~rlhf.controller.calls.CallIssuer` only, so
this module does not import the controller (which imports it to make groups).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Callable, Generic, TypeVar

from hybridflow_comm import _C
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.groups import check_pool
from hybridflow_comm.layout import HybridLayout
from rlhf.controller.batch import PAD_KEY, Batch
from rlhf.controller.calls import CallIssuer
from rlhf.controller.futures import Future
from rlhf.controller.messages import Call, Command, Create, Fetch, Send, SendOnly
from rlhf.controller.protocols import PER_RANK, SPLIT, Plan, protocol_of
from rlhf.controller.worker import Worker, worker_path

W = TypeVar("W", bound=Worker)


class WorkerGroup(Generic[W]):
    """Handle on the workers of one role.

    Args:
        controller: the controller (what :class:`CallIssuer` names of it).
        worker_cls: a :class:`Worker` subclass importable by module path.
        layout: the role's layout (its world size = the pool size).
        pool: ascending global ranks (default: every rank of the job).
        name: role name used in messages (default: the class name).
        args, kwargs: passed to ``worker_cls.__init__`` on every rank of the pool.
        collective_timeout_s: timeout of the role's process groups (default: the job's).
        values_in_replies: the collect ranks send every call's output with their reply (and
            still keep it for later calls), so :meth:`Future.get` needs no fetch round trip;
            for programs that read every output (the RLHF programs).  Default: outputs stay
            on the workers until asked for.
        experts: a mixture's expert layout over ``layout`` when the role splits its experts
            over EP ranks: every rank also builds its expert groups (``Worker.experts``).
    """

    def __init__(self, controller: CallIssuer, worker_cls: type[W], layout: HybridLayout,
                 pool: list[int] | None = None, name: str | None = None, args: tuple = (),
                 kwargs: dict | None = None, collective_timeout_s: float | None = None,
                 values_in_replies: bool = False, experts: ExpertLayout | None = None) -> None:
        if collective_timeout_s is not None and not collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
        path = worker_path(worker_cls)  # TypeError unless an importable Worker subclass
        if not isinstance(layout, HybridLayout):
            raise TypeError(f"layout must be a HybridLayout, got {layout!r}")
        if experts is not None and experts.hybrid != layout:
            raise ValueError(f"expert layout over {experts.hybrid}, role layout {layout}")
        self.pool = check_pool(layout, pool, controller.world_size)
        self._ctl = controller
        self.worker_cls = worker_cls
        self.layout = layout
        self.name = name or worker_cls.__name__
        self.values_in_replies = values_in_replies
        self.gid = controller.next_id()
        cid = controller.next_id()
        # Every rank builds the role's process groups (new_group is collective over the job).
        create = Create(cid=cid, gid=self.gid, worker=path, role=self.name, pool=self.pool,
                        train=(layout.train.pp, layout.train.tp, layout.train.dp),
                        gen=(layout.pp_g, layout.tp_g), args=tuple(args), kwargs=dict(kwargs or {}),
                        collective_timeout_s=collective_timeout_s,
                        experts=None if experts is None else
                        (experts.num_experts, experts.ep, experts.gen_ep))
        msgs = dict.fromkeys(range(controller.world_size), create)
        controller.wait(controller.issue(f"{self.name}.__init__", msgs))

    def __getattr__(self, name: str) -> Callable[..., Future]:
        if name.startswith("__"):
            raise AttributeError(name)
        method = getattr(self.worker_cls, name, None)
        if method is None or protocol_of(method) is None:
            raise AttributeError(
                f"{self.worker_cls.__name__}.{name} is not a worker method with a transfer "
                f"protocol (decorate it with @protocol(...))")
        return functools.partial(self.call, method)

    def call(self, method: Callable, *args: Any, **kwargs: Any) -> Future:
        """Run ``method`` on the group's workers by its protocol; returns a Future at once."""
        return self._issue(method, args, kwargs, inline=self.values_in_replies)

    def execute(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` and return its collected value (blocking, one round trip).

        The program asks for the value up front, so the collect ranks send their outputs with
        their replies instead of waiting for a fetch (what :meth:`Future.get` would do).
        """
        return self._issue(method, args, kwargs, inline=True).get()

    def _issue(self, method: Callable, args: tuple, kwargs: dict, inline: bool) -> Future:
        proto = protocol_of(method)
        name = getattr(method, "__name__", repr(method))
        if proto is None or getattr(self.worker_cls, name, None) is not method:
            raise ValueError(f"{name} is not a protocol-decorated method of "
                             f"{self.worker_cls.__name__}")
        plan = proto.plan(self.layout)
        what = f"{self.name}.{name}"
        per_rank, sends, rows_in, padded_in = _distribute(self._ctl, plan, self.pool, args,
                                                          kwargs, what)
        cid = self._ctl.next_id()
        collect = tuple(self.pool[r] for r in plan.collect_ranks)
        msgs: dict[int, Command] = {}
        for r, (a, kw) in per_rank.items():
            msgs[r] = Call(cid=cid, gid=self.gid, method=name, args=a, kwargs=kw, keep=r in collect,
                           inline=inline, sends=tuple(sends.pop(r, ())),
                           frees=self._ctl.take_frees(r))
        for r, s in sends.items():  # producers outside this group's called ranks
            msgs[r] = SendOnly(cid, tuple(s), self._ctl.take_frees(r))
        state = self._ctl.issue(what, msgs)
        return Future(self._ctl, state, plan, collect, rows_in, padded_in)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name}, pool={list(self.pool)}, layout={self.layout})"


def _distribute(ctl: CallIssuer, plan: Plan, pool: tuple[int, ...], args: tuple, kwargs: dict,
                what: str) -> tuple[dict[int, tuple[tuple, dict]], dict[int, list[Send]],
                                    int | None, int | None]:
    """Per called global rank its (args, kwargs); producer sends; rows before/after padding."""
    called = [(pool[r], c) for r, c in enumerate(plan.chunk_of_rank) if c >= 0]
    sends: dict[int, list[Send]] = defaultdict(list)
    keys = list(range(len(args))) + list(kwargs)
    values = list(args) + list(kwargs.values())
    if plan.distribute == PER_RANK:
        for k, v in zip(keys, values):
            if not isinstance(v, (list, tuple)) or len(v) != plan.num_chunks:
                raise ValueError(f"{what}: argument {k!r} must be a list of {plan.num_chunks} "
                                 f"items (one per rank), got {_short(v)}")
        per = {g: [v[c] for v in values] for g, c in called}
        return {g: _split_back(keys, vals) for g, vals in per.items()}, {}, None, None
    _check_futures(keys, values, what)
    sized = [(k, v) for k, v in zip(keys, values) if isinstance(v, (Batch, Future))]
    rows_in = padded_in = None
    offsets = [0, 0]
    if plan.distribute == SPLIT and sized:
        sizes = {k: len(v) for k, v in sized}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"{what}: split arguments have different sizes {sizes}")
        rows_in = next(iter(sizes.values()))
        if rows_in == 0:
            raise ValueError(f"{what}: cannot split an empty batch over {plan.num_chunks} ranks")
        offsets = _C.chunk_offsets(rows_in, plan.num_chunks)
        padded_in = offsets[-1]
    per_chunk: dict[int, list] = {}
    chunks = sorted({c for _, c in called})
    for c in chunks:
        per_chunk[c] = []
    for k, v in zip(keys, values):
        for c in chunks:
            if plan.distribute == SPLIT and isinstance(v, Batch) and padded_in is not None:
                piece = _batch_rows(v, offsets[c], offsets[c + 1])
            elif isinstance(v, Future):
                start, end = (offsets[c], offsets[c + 1]) if padded_in is not None else (0, len(v))
                piece = (v, start, end)  # resolved per consumer rank below
            else:
                piece = v
            per_chunk[c].append(piece)
    out: dict[int, tuple[tuple, dict]] = {}
    for g, c in called:
        vals = [_fetch_for(ctl, p, g, sends) if isinstance(p, tuple) and len(p) == 3
                and isinstance(p[0], Future) else p for p in per_chunk[c]]
        out[g] = _split_back(keys, vals)
    return out, sends, rows_in, padded_in


def _check_futures(keys: list, values: list, what: str) -> None:
    for k, v in zip(keys, values):
        if isinstance(v, Future):
            try:
                v.counts()  # waits for the producer; ValueError unless concatenated Batches
            except ValueError as exc:
                raise ValueError(f"{what}: argument {k!r} is a future that cannot be split: "
                                 f"{exc}") from None


def _batch_rows(b: Batch, start: int, end: int) -> Batch:
    """Rows [start, end) of ``b`` padded cyclically from its start (views when no padding)."""
    n = len(b)
    out = b.rows(slice(start, end)) if end <= n else b.rows([i % n for i in range(start, end)])
    out.meta.pop(PAD_KEY, None)
    return out


def _fetch_for(ctl: CallIssuer, piece: tuple, consumer: int,
               sends: dict[int, list[Send]]) -> Fetch:
    """Row plan of one consumer rank for rows [start, end) of a future; adds producer sends."""
    fut, start, end = piece
    counts = fut.counts()
    segs = _C.transfer_segments(counts, len(fut), start, end)
    by_src: dict[int, list[tuple[int, int]]] = defaultdict(list)
    segments = []
    for src_idx, a, b in segs:
        src = fut.collect_ranks[src_idx]
        by_src[src].append((a, b))
        segments.append((src, a, b))
    tags = []
    for src, ranges in by_src.items():
        tag = ctl.next_tag()
        tags.append((src, tag))
        if src != consumer:
            sends[src].append(Send(consumer, fut.oid, tuple(ranges), tag))
    return Fetch(fut.oid, tuple(segments), tuple(tags))


def _split_back(keys: list, vals: list) -> tuple[tuple, dict]:
    args = tuple(v for k, v in zip(keys, vals) if isinstance(k, int))
    kwargs = {k: v for k, v in zip(keys, vals) if not isinstance(k, int)}
    return args, kwargs


def _short(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return f"a {type(v).__name__} of {len(v)} items"
    return f"{type(v).__name__}"
