"""The training -> generation transition of a mixture of experts' expert weights under expert
parallelism (``ep > 1``; see :mod:`hybridflow_comm.expert_layout` for who holds and needs what).

:func:`plan_expert_transfers` is pure: from the expert specs, an :class:`ExpertLayout` and a
rank it lists the pieces the rank needs and holds (generation views of its training tensors,
no copy), the pieces it receives and from whom, and the pieces it sends and to whom.  Every
needed piece is held or received exactly once, so the bytes received are the layout's
minimum.  :class:`ExpertResharder` runs that plan with point-to-point messages, one batch per
bucket of consecutive specs (all ranks cut the same buckets, so messages match in order),
inside one :class:`~hybridflow_comm.flat_buffer.FlatParamBuffer` of
:func:`expert_slot_specs` (rank 1 of the module docstring's example)::

    FlatParamBuffer   | e0 (gen only) | e1 (gen only) | e2 (own) | e3 (own) |
    training          |                               |  e2 e3 whole        |
    generation        | e0 e1 received, released by to_training() | views   |

Every piece is a contiguous part of a training tensor and is sent straight from it: whole
experts, rows of a dim-0 split (``gate_up``), and, for a tensor split along another dim under
generation TP (``down_proj``'s columns, ``g = tp_g`` pieces), a held expert is stored stacked
``[g, H, F / g]`` (:func:`stacked_pieces`; the training forward takes the stacked form, as the
dense generation weights do), so piece ``i`` is slot ``i``.  Nothing is staged
(``redundant_bytes`` 0).  Received pieces land in place, each a contiguous tensor of its
piece's shape.  :func:`to_train_layout` / :func:`from_train_layout` convert a whole expert
tensor between its logical (Hugging Face) shape and the stored one.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from hybridflow_comm import comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.expert_layout import WHOLE, ExpertLayout, Piece
from hybridflow_comm.flat_buffer import FlatParamBuffer, SlotSpec
from hybridflow_comm.groups import Group, HybridGroups
from hybridflow_comm.reshard import Resharder
from hybridflow_comm.shard_spec import ShardSpec, hf_named
from hybridflow_comm.strided import logical_from_stacked, stacked_from_logical
from hybridflow_comm.transition import (BUCKET_BYTES, LABEL, TransitionStats, agree_on_specs,
                                        check_bucket_bytes, measured_transition)

__all__ = ["ExpertPlan", "ExpertResharder", "MoeResharder", "expert_slot_specs",
           "from_train_layout", "plan_expert_transfers", "piece_of", "stacked_pieces",
           "to_train_layout"]


class ExpertPlan(NamedTuple):
    """One rank's part of an expert transition, every list in spec order.

    Attributes:
        views: ``(name, piece)`` needed and held: views of the training tensor.
        recvs: ``(name, piece, source rank)`` needed and not held.
        sends: ``(name, piece, destination rank)`` held and needed elsewhere.
    """

    views: list[tuple[str, Piece]]
    recvs: list[tuple[str, Piece, int]]
    sends: list[tuple[str, Piece, int]]


def stacked_pieces(spec: ShardSpec, layout: ExpertLayout) -> int:
    """How many generation pieces a held expert tensor of ``spec`` is stored as, stacked along
    a new leading dim: ``tp_g`` for a tensor split along a non-leading dim under generation TP
    (``down_proj``), else 1 (stored in its logical shape)."""
    if layout.gen_etp > 1 and spec.partition_dim not in (None, 0):
        return layout.gen_etp
    return 1


def to_train_layout(logical: torch.Tensor, spec: ShardSpec, layout: ExpertLayout
                    ) -> torch.Tensor:
    """A whole expert tensor of ``spec`` in its stored form (a new tensor when stacked)."""
    g = stacked_pieces(spec, layout)
    return logical if g == 1 else stacked_from_logical(logical, spec.partition_dim, g)


def from_train_layout(stored: torch.Tensor, spec: ShardSpec, layout: ExpertLayout
                      ) -> torch.Tensor:
    """A stored whole expert tensor of ``spec`` in its logical shape (a new tensor when
    stacked)."""
    if stored.dim() == len(spec.shape):
        return stored
    return logical_from_stacked(stored, spec.partition_dim)


def piece_of(tensor: torch.Tensor, spec: ShardSpec, piece: Piece) -> torch.Tensor:
    """``piece`` of a whole expert tensor along its partition dim (a view): of a stacked one
    (:func:`stacked_pieces`) its slot, contiguous."""
    if piece.count == 1:
        return tensor
    if tensor.dim() == len(spec.shape) + 1:
        if tensor.shape[0] != piece.count:
            raise ValueError(f"{spec.name}: stored as {tensor.shape[0]} pieces, asked for "
                             f"piece {piece.index} of {piece.count}")
        return tensor[piece.index]
    size = spec.shape[spec.partition_dim] // piece.count
    return tensor.narrow(spec.partition_dim, piece.index * size, size)


def piece_shape(spec: ShardSpec, piece: Piece) -> tuple[int, ...]:
    if piece.count == 1:
        return spec.shape
    return spec.shard_shape(piece.count)


def check_expert_specs(specs: list[ShardSpec], layout: ExpertLayout) -> None:
    """ValueError for a spec ``layout`` cannot place (before any collective)."""
    if layout.ep == 1:
        raise ValueError("ep=1: the experts are split over tp like the dense MLP and move with "
                         "it (hybridflow_comm.reshard)")
    train = layout.hybrid.train
    for s in specs:
        if s.expert is None:
            raise ValueError(f"{s.name}: not an expert tensor (ShardSpec.expert is None)")
        if s.expert >= layout.num_experts:
            raise ValueError(f"{s.name}: expert={s.expert} but the layout has "
                             f"num_experts={layout.num_experts}")
        if s.stage >= train.pp:
            raise ValueError(f"{s.name}: stage={s.stage} but the layout has pp={train.pp}")
        if layout.gen_etp > 1 and s.partition_dim is not None and s.units % layout.gen_etp:
            raise ValueError(f"{s.name}: {s.units} units along dim {s.partition_dim} cannot be "
                             f"split over tp_g={layout.gen_etp}")


def plan_expert_transfers(specs: list[ShardSpec], layout: ExpertLayout, rank: int) -> ExpertPlan:
    """``rank``'s views, receives and sends (pure; see :class:`ExpertPlan`)."""
    check_expert_specs(specs, layout)
    h = layout.hybrid
    world = range(h.world_size)
    stage = [h.train.coords(r).pp for r in world]
    gen_stage = [h.gen_coords(r).pp_g for r in world]
    held = [layout.train_experts(r) for r in world]
    needed = [layout.gen_experts(r) for r in world]
    pieces = [layout.gen_piece(r) for r in world]
    views, recvs, sends = [], [], []
    for s in specs:
        for r in world:
            if s.stage // h.micro_pp != gen_stage[r] or s.expert not in needed[r]:
                continue
            piece = pieces[r] if s.partition_dim is not None else WHOLE
            if stage[r] == s.stage and s.expert in held[r]:
                if r == rank:
                    views.append((s.name, piece))
                continue
            src = layout.source(r, s.stage, s.expert)
            if r == rank:
                recvs.append((s.name, piece, src))
            elif src == rank:
                sends.append((s.name, piece, r))
    return ExpertPlan(views, recvs, sends)


def expert_slot_specs(specs: list[ShardSpec], layout: ExpertLayout, rank: int,
                      plan: ExpertPlan | None = None) -> list[SlotSpec]:
    """The flat-buffer regions of ``rank``'s experts: each expert it holds in training (whole,
    its own slot), then each piece it receives for generation (no training slot); ``plan``:
    ``plan_expert_transfers(specs, layout, rank)`` when the caller has it."""
    plan = plan or plan_expert_transfers(specs, layout, rank)
    by_name = {s.name: s for s in specs}
    c = layout.hybrid.train.coords(rank)

    def stored(s: ShardSpec) -> tuple[int, ...]:
        g = stacked_pieces(s, layout)
        return s.shape if g == 1 else (g, *s.shard_shape(g))
    own = [SlotSpec(s.name, s.dtype, stored(s)) for s in specs
           if s.stage == c.pp and s.expert in layout.train_experts(rank)]
    received = [SlotSpec(n, by_name[n].dtype, piece_shape(by_name[n], p), 1, None)
                for n, p, _ in plan.recvs]
    return own + received


class ExpertResharder:
    """Moves the expert weights between their training and generation layouts.

    Args:
        specs: every expert tensor of the model (``ShardSpec.expert`` set), the same list on
            every rank.
        layout: the experts' layout (``ep > 1``).
        world: the group of every rank of the layout (group rank = layout rank).
        buffer: this rank's experts, built from ``expert_slot_specs(specs, layout, rank)``
            (a new one, zeroed, on ``device`` by default); the training views are the whole
            experts the rank trains, never copied.
        device: where a new buffer lives (default cpu).
        bucket_bytes: the bytes of consecutive specs whose messages go out as one batch.
        ledger: where bytes are recorded (a new one by default).

    Construction is collective over ``world``: the ranks agree on the specs and layout, and
    raise ValueError on every rank when one differs.
    """

    method = "hybridflow"

    def __init__(self, specs: list[ShardSpec], layout: ExpertLayout, world: Group, *,
                 buffer: FlatParamBuffer | None = None,
                 device: torch.device | str | None = None, bucket_bytes: int = BUCKET_BYTES,
                 ledger: CommLedger | None = None) -> None:
        check_bucket_bytes(bucket_bytes)
        if world.size != layout.hybrid.world_size:
            raise ValueError(f"world group of {world.size} ranks for a layout of "
                             f"{layout.hybrid.world_size}")
        self.specs = list(specs)
        self.layout = layout
        self.world = world
        self.ledger = ledger if ledger is not None else CommLedger()
        self.plan = plan_expert_transfers(self.specs, layout, world.rank)
        self._spec = {s.name: s for s in self.specs}
        mine = expert_slot_specs(self.specs, layout, world.rank, self.plan)
        if buffer is None:
            buffer = FlatParamBuffer(mine, device=device or "cpu")
        elif buffer.specs != mine:
            raise ValueError(f"rank {world.rank}: the expert buffer was not built from "
                             f"expert_slot_specs(specs, layout, rank)")
        self.buffer = buffer
        self.device = buffer.device
        self._buckets = self._cut_buckets(bucket_bytes)
        self.version, self.mode = 0, "training"
        self._pieces_kept = False
        self._last: TransitionStats | None = None
        t, h = layout.hybrid.train, layout.hybrid
        head = ("experts", t.pp, t.tp, t.dp, h.pp_g, h.tp_g, layout.num_experts, layout.ep,
                layout.gen_ep, bucket_bytes)  # (equal buckets: messages match in order)
        agree_on_specs([head] + [(s.name, s.shape, str(s.dtype), s.partition_dim, s.stage,
                                  repr(s.fusion), s.expert) for s in self.specs], world,
                       self.ledger, self.device)

    # Set-up (no collective) ------------------------------------------------------------------
    def _cut_buckets(self, bucket_bytes: int) -> list[tuple[list, list]]:
        """Sends and receives per bucket of consecutive specs (the same cuts on every rank)."""
        index = {s.name: i for i, s in enumerate(self.specs)}
        cuts, total = [], 0
        for i, s in enumerate(self.specs):
            if total and total + s.nbytes > bucket_bytes:
                cuts.append(i)
                total = 0
            total += s.nbytes
        buckets = [([], []) for _ in range(len(cuts) + 1)]
        for item in self.plan.sends:
            buckets[bisect.bisect_right(cuts, index[item[0]])][0].append(item)
        for item in self.plan.recvs:
            buckets[bisect.bisect_right(cuts, index[item[0]])][1].append(item)
        return [b for b in buckets if b[0] or b[1]]

    # Transition --------------------------------------------------------------------------------
    def to_generation(self, refill: bool = True) -> TransitionStats:
        """Receive every missing expert piece; returns this rank's stats.

        ``refill=False`` moves nothing: the received pieces are still those of the last
        transition (kept by ``to_training(release=False)``, the experts unchanged since: a
        frozen base under LoRA).  RuntimeError when they were released or never received.
        """
        if self.mode != "training":
            raise RuntimeError(f"to_generation() called in {self.mode} mode")
        if not refill and not self._pieces_kept:
            raise RuntimeError("to_generation(refill=False) but the received expert pieces "
                               "were released or never received")
        self._last = measured_transition(self.ledger, self.method, self.version + 1,
                                         self.gen_nbytes(),
                                         self._exchange_pieces if refill else lambda: 0)
        self.version += 1
        self.mode = "generation"
        return self._last

    def _exchange_pieces(self) -> int:
        """Every bucket's messages, each sent from its training tensor; returns 0 (nothing is
        staged)."""
        for sends, recvs in self._buckets:
            out = [(piece_of(self.buffer.train_view(name), self._spec[name], piece), dst)
                   for name, piece, dst in sends]
            into = [(self.buffer.slot_view(name, 0), src) for name, _, src in recvs]
            for work in comm.exchange_(out, into, self.world, self.ledger, LABEL):
                work.wait()
        return 0

    def to_training(self, release: bool = True) -> int:
        """Back to training; returns the bytes of the received pieces' pages released
        (``release=False`` keeps them, for a later ``to_generation(refill=False)``)."""
        if self.mode != "generation":
            raise RuntimeError(f"to_training() called in {self.mode} mode")
        self.mode = "training"
        self._pieces_kept = not release
        return self.buffer.release_generation_slots() if release else 0

    def accounting(self) -> TransitionStats | None:
        """Stats of the last :meth:`to_generation` (None before the first)."""
        return self._last

    def minimum_received_bytes(self) -> int:
        """This rank's generation experts minus the part it holds from training."""
        return sum(math.prod(piece_shape(self._spec[n], p)) * self._spec[n].dtype.itemsize
                   for n, p, _ in self.plan.recvs)

    def gen_nbytes(self) -> int:
        """Bytes of this rank's generation experts (views of training tensors included)."""
        return self.minimum_received_bytes() + sum(
            math.prod(piece_shape(self._spec[n], p)) * self._spec[n].dtype.itemsize
            for n, p in self.plan.views)

    def generation_experts(self) -> dict[str, torch.Tensor]:
        """This rank's generation expert tensors by name: views of its training tensors
        (slots of a stacked one) and the received pieces, all contiguous."""
        if self.mode != "generation":
            raise RuntimeError("generation_experts() needs generation mode")
        out = {n: piece_of(self.buffer.train_view(n), self._spec[n], p) for n, p in self.plan.views}
        out.update((n, self.buffer.slot_view(n, 0)) for n, _, _ in self.plan.recvs)
        return {s.name: out[s.name] for s in self.specs if s.name in out}


class MoeResharder:
    """A mixture of experts' whole transition (a :class:`~hybridflow_comm.transition.Transition`):
    the :class:`~hybridflow_comm.reshard.Resharder` for every weight but the experts, the
    :class:`ExpertResharder` for the experts, one ledger and one set of stats.  ``weights``
    are the dense transition's (:class:`~hybridflow_comm.transition.HybridWeights`, without
    the experts); :meth:`named_generation_weights` yields both.

    Args:
        specs: every parameter of the model, experts included (``ShardSpec.expert`` set).
        groups: this rank's groups for ``experts.hybrid``.
        experts: the experts' layout (``ep > 1``).
        bucket_bytes / ledger / device: as for both transitions.
        buffer: the dense weights' flat buffer (e.g. the training model's; default a new one).
        expert_buffer: the experts' (built from :func:`expert_slot_specs`; default a new one).
        verify_every: checksum-verify the dense generation weights after every transition
            (:class:`~hybridflow_comm.reshard.Resharder`).

    Collective over the layout's ranks (both transitions agree on their specs).
    """

    method = "hybridflow"

    def __init__(self, specs: list[ShardSpec], groups: HybridGroups, experts: ExpertLayout, *,
                 bucket_bytes: int = BUCKET_BYTES, ledger: CommLedger | None = None,
                 device: torch.device | str | None = None,
                 buffer: FlatParamBuffer | None = None,
                 expert_buffer: FlatParamBuffer | None = None,
                 verify_every: bool = False) -> None:
        if experts.hybrid != groups.layout:
            raise ValueError(f"expert layout over {experts.hybrid}, groups over {groups.layout}")
        check_expert_specs([s for s in specs if s.expert is not None], experts)  # local first
        self.dense = Resharder([s for s in specs if s.expert is None], groups,
                               bucket_bytes=bucket_bytes, ledger=ledger, device=device,
                               buffer=buffer, verify_every=verify_every)
        self.weights = self.dense.weights
        expert_specs = [s for s in specs if s.expert is not None]
        self.experts = ExpertResharder(expert_specs, experts, groups.world, buffer=expert_buffer,
                                       device=self.dense.buffer.device,
                                       bucket_bytes=bucket_bytes, ledger=self.weights.ledger)
        self.specs = list(specs)
        self._spec = {s.name: s for s in expert_specs}
        self._last: TransitionStats | None = None

    @property
    def version(self) -> int:
        return self.dense.version

    @property
    def mode(self) -> str:
        return self.dense.mode

    def train_view(self, name: str) -> torch.Tensor:
        """This rank's training tensor ``name`` (a whole expert in its stored form,
        :func:`stacked_pieces`, or a dense training shard)."""
        home = self.experts.buffer if name in self._spec else self.dense.buffer
        return home.train_view(name)

    def copy_train_(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (a whole expert in its logical shape, or a dense training shard)
        into this rank's training tensor ``name``."""
        spec = self._spec.get(name)
        want = spec.shape if spec is not None else tuple(self.train_view(name).shape)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name}: tensor of shape {tuple(tensor.shape)}, the training "
                             f"tensor is {want}")
        if spec is not None:
            tensor = to_train_layout(tensor, spec, self.experts.layout)
        self.train_view(name).copy_(tensor)

    def to_generation(self, refill: bool = True) -> TransitionStats:
        """Both transitions; the stats add up (time: the whole call's).  ``refill=False``:
        neither moves anything (both kept their generation pieces, see
        :meth:`Resharder.to_generation`)."""
        t0 = time.perf_counter()
        a, b = self.dense.to_generation(refill), self.experts.to_generation(refill)
        self._last = TransitionStats(
            method=self.method, version=a.version, sent_bytes=a.sent_bytes + b.sent_bytes,
            received_bytes=a.received_bytes + b.received_bytes, calls=a.calls + b.calls,
            peak_weight_bytes=a.peak_weight_bytes + b.peak_weight_bytes,
            redundant_bytes=a.redundant_bytes + b.redundant_bytes,
            time_s=time.perf_counter() - t0)
        return self._last

    def to_training(self, release: bool = True) -> int:
        return self.dense.to_training(release) + self.experts.to_training(release)

    def accounting(self) -> TransitionStats | None:
        return self._last

    def minimum_received_bytes(self) -> int:
        return self.dense.minimum_received_bytes() + self.experts.minimum_received_bytes()

    def generation_params(self) -> dict[str, torch.Tensor]:
        """This rank's generation tensors by spec name: the dense ones' (views of the
        generation layout, :meth:`HybridWeights.generation_params`) and its experts'."""
        return {**self.dense.generation_params(), **self.experts.generation_experts()}

    def named_generation_weights(self, hf_names: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's generation weights, the dense ones' then its experts' (fused experts
        split into their Hugging Face parts, as :meth:`HybridWeights.named_generation_weights`)."""
        yield from self.dense.named_generation_weights(hf_names)
        for name, t in self.experts.generation_experts().items():
            spec = self._spec[name]
            yield from hf_named(name, t, spec.hf_names if hf_names else (), spec.fusion)

