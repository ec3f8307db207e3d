"""Where a mixture of experts' experts live on the training and the generation side, as pure
arithmetic over a :class:`~hybridflow_comm.layout.HybridLayout` (no process is touched).

Training side, expert parallelism ``ep`` folded over the ``tp x dp`` ranks of each pipeline
stage (attention and the other dense weights keep their ``p-t-d`` layout)::

    j = dp_rank * tp + tp_rank                   # the rank's index inside its stage
    j = edp_rank * (ep * etp) + ep_rank * etp + etp_rank
    etp = tp when ep == 1 (every expert split like the dense MLP), else 1 (experts whole)

A rank holds experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of every layer of its stage
(piece ``etp_rank`` of ``etp`` along each tensor's partition dim).  EP groups (the all-to-all
of tokens) are the ``ep`` ranks of a stage with one ``edp_rank``; expert-DP groups (the
experts' gradient reduction) are those with one ``ep_rank`` and ``etp_rank``.

Generation side: each generation TP group (``tp_g`` ranks with every token of their
replica) splits the experts ``gen_ep`` ways (``gen_ep | tp_g``, ``gen_ep | ep``) and each
expert ``gen_etp = tp_g / gen_ep`` ways, so every rank computes its own experts' pieces for
all tokens and the layer's TP all-reduce sums them (no all-to-all, no lockstep between
generation replicas)::

    the members' training EP blocks packed into gen_ep disjoint classes, each of gen_etp
        members and at most ep / gen_ep blocks (_pack_blocks: members sharing a block
        share a class)
    class c needs the experts of its members' blocks, filled up with blocks no member
        holds to E/gen_ep experts; its i-th member by tp_g_rank needs piece i of gen_etp
    gen_ep = 1: one class, piece tp_g_rank of every expert (experts under gen TP)

so a rank's training experts lie in its own generation set.  A layout with no such packing
(e.g. ``tp=4 -> tp_g=2, ep=2, gen_ep=2``, whose generation TP groups each hold one block
twice) is refused: choose another ``gen_ep``.  Example, ``tp=2, dp=2, ep=4 -> tp_g=2, gen_ep=2`` (4 ranks, 8
experts)::

    training EP group      [0 1 2 3]        experts 0-1 | 2-3 | 4-5 | 6-7
    generation TP groups   [0 1] [2 3]
    generation sets        rank 0: 0-1 4-5   rank 1: 2-3 6-7     (its own block, then
                           rank 2: 0-1 4-5   rank 3: 2-3 6-7      one nobody in the group has)
    rank 0 receives experts 4-5 from rank 2: a quarter of the experts' bytes

A generation rank receives exactly the pieces it needs and does not hold: with ``M_e`` the
bytes of every expert of every layer (layers spread evenly over the stages),

    received = (pp * ep - pp_g * gen_ep) / (pp * ep * pp_g * gen_ep * gen_etp) * M_e

the paper's ``(t p - t_g p_g) / (t_g p_g t p) M`` with the expert dimension in place of
tensor parallelism.  Each missing piece comes from the holder with the receiver's own
``edp_rank`` (:meth:`ExpertLayout.source`), so on one stage the traffic stays inside the
training EP groups.

Run ``python -m hybridflow_comm.expert_layout --train PP,TP,DP --gen PP_G,TP_G --experts E
--ep EP --gen-ep GEN_EP`` to print the groups.
"""

from __future__ import annotations

import argparse
import json
import sys
import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from hybridflow_comm.layout import (Groups, HybridLayout, add_layout_arguments,
                                    layout_from_arguments, sorted_groups)
from hybridflow_comm.sizes import check_sizes, divisors


class ExpertCoords(NamedTuple):
    """Expert coordinates of one rank: training ``ep``, ``etp`` and ``edp`` ranks, and its
    generation EP rank (its class in its generation TP group)."""

    ep: int
    etp: int
    edp: int
    gen_ep: int


class Piece(NamedTuple):
    """Piece ``index`` of ``count`` equal pieces along a tensor's partition dim."""

    index: int
    count: int


WHOLE = Piece(0, 1)


@dataclass(frozen=True)
class ExpertLayout:
    """The experts of ``hybrid``'s model: ``num_experts`` per layer, ``ep`` and ``gen_ep``
    ways (see the module docstring)."""

    hybrid: HybridLayout
    num_experts: int
    ep: int = 1
    gen_ep: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.hybrid, HybridLayout):
            raise TypeError(f"hybrid must be a HybridLayout, got {self.hybrid!r}")
        check_sizes(num_experts=self.num_experts, ep=self.ep, gen_ep=self.gen_ep)
        t = self.hybrid.train
        if (t.tp * t.dp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide the tp x dp = {t.tp * t.dp} ranks of a "
                             f"training stage (choose ep from {divisors(t.tp * t.dp)})")
        for name, size in (("ep", self.ep), ("gen_ep", self.gen_ep)):
            if self.num_experts % size:
                raise ValueError(f"{name}={size} must divide num_experts={self.num_experts}")
        if self.gen_ep > 1 and (self.ep == 1 or self.ep % self.gen_ep):
            raise ValueError(f"gen_ep={self.gen_ep} needs a training ep it divides, got "
                             f"ep={self.ep} (with ep=1 the experts are split over tp)")
        if self.hybrid.tp_g % self.gen_ep:
            raise ValueError(f"gen_ep={self.gen_ep} must divide tp_g={self.hybrid.tp_g}: the "
                             f"experts are split over the ranks of each generation TP group")
        self._gen_plan  # noqa: B018 - refuses a layout whose classes would share a block

    # Derived sizes ---------------------------------------------------------------------------
    @property
    def etp(self) -> int:
        """Training ranks one expert is split over: ``tp`` when ``ep == 1``, else 1."""
        return self.hybrid.train.tp if self.ep == 1 else 1

    @property
    def gen_etp(self) -> int:
        """Generation ranks one expert is split over: ``tp_g / gen_ep``."""
        return self.hybrid.tp_g // self.gen_ep

    @property
    def micro_ep(self) -> int:
        """Training EP blocks per generation set (``ep / gen_ep``)."""
        return self.ep // self.gen_ep

    @property
    def edp(self) -> int:
        """Replicas of each expert piece per training stage (``tp * dp / (ep * etp)``)."""
        t = self.hybrid.train
        return t.tp * t.dp // (self.ep * self.etp)

    # Coordinates -----------------------------------------------------------------------------
    def coords(self, rank: int) -> ExpertCoords:
        """Expert coordinates of ``rank``; ValueError outside the world."""
        ep_rank, etp_rank, edp_rank = self._train_coords(rank)
        return ExpertCoords(ep=ep_rank, etp=etp_rank, edp=edp_rank,
                            gen_ep=self._gen_plan[rank][0])

    def _train_coords(self, rank: int) -> tuple[int, int, int]:
        """``(ep, etp, edp)`` of ``rank`` (the training side alone, which the generation
        assignment is built from)."""
        c = self.hybrid.train.coords(rank)
        j = c.dp * self.hybrid.train.tp + c.tp
        etp_rank, rest = j % self.etp, j // self.etp
        return rest % self.ep, etp_rank, rest // self.ep

    def rank(self, *, stage: int, ep: int, etp: int, edp: int) -> int:
        """Rank of training stage ``stage`` at expert coordinates ``(ep, etp, edp)``."""
        t = self.hybrid.train
        for name, value, size in (("stage", stage, t.pp), ("ep", ep, self.ep),
                                  ("etp", etp, self.etp), ("edp", edp, self.edp)):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside [0, {size})")
        j = (edp * self.ep + ep) * self.etp + etp
        return t.rank(pp=stage, tp=j % t.tp, dp=j // t.tp)

    def train_experts(self, rank: int) -> range:
        """The experts ``rank`` holds in training (of every layer of its stage)."""
        per = self.num_experts // self.ep
        return range(self.coords(rank).ep * per, (self.coords(rank).ep + 1) * per)

    def train_piece(self, rank: int) -> Piece:
        """The piece of each of its experts that ``rank`` holds in training."""
        return Piece(self.coords(rank).etp, self.etp)

    def gen_experts(self, rank: int) -> tuple[int, ...]:
        """The experts ``rank`` needs in generation (of every layer of its generation stage),
        ascending."""
        self.hybrid.gen_coords(rank)  # ValueError outside the world
        return self._gen_plan[rank][1]

    def gen_piece(self, rank: int) -> Piece:
        """The piece of each of those experts that ``rank`` needs in generation."""
        self.hybrid.gen_coords(rank)
        return self._gen_plan[rank][2]

    @functools.cached_property
    def _gen_plan(self) -> tuple[tuple[int, tuple[int, ...], Piece], ...]:
        """``(class, experts, piece)`` of every rank (the module docstring's assignment)."""
        h, per_block = self.hybrid, self.num_experts // self.ep
        plan: dict[int, tuple[int, tuple[int, ...], Piece]] = {}
        for group in h.family_groups("gen_tp"):
            by_tp_g = sorted(group, key=lambda r: h.gen_coords(r).tp_g)
            if self.gen_ep == 1:
                for i, r in enumerate(by_tp_g):
                    plan[r] = (0, tuple(range(self.num_experts)), Piece(i, self.gen_etp))
                continue
            block = {r: self._train_coords(r)[0] for r in group}
            held = _pack_blocks([block[r] for r in by_tp_g], self.gen_ep, self.gen_etp,
                                self.micro_ep)
            if held is None:
                raise ValueError(
                    f"gen_ep={self.gen_ep}: the generation TP group {sorted(group)} holds the "
                    f"training expert blocks {[block[r] for r in by_tp_g]}, which cannot be "
                    f"split into {self.gen_ep} sets of {self.micro_ep} blocks each keeping its "
                    f"holders' blocks (layout {h.train} -> ({h.pp_g}, {h.tp_g}), ep={self.ep});"
                    f" choose another gen_ep")
            classes = [[r for r in by_tp_g if block[r] in blocks] for blocks in held]
            taken = [b for blocks in held for b in blocks]
            free = iter(b for b in range(self.ep) if b not in taken)
            for c, members in enumerate(classes):
                blocks = held[c] + [next(free) for _ in range(self.micro_ep - len(held[c]))]
                experts = tuple(sorted(e for b in blocks
                                       for e in range(b * per_block, (b + 1) * per_block)))
                for i, r in enumerate(members):
                    plan[r] = (c, experts, Piece(i, self.gen_etp))
        return tuple(plan[r] for r in range(h.world_size))

    def source(self, rank: int, stage: int, expert: int) -> int:
        """The training rank ``rank`` receives expert ``expert`` of stage ``stage`` from: the
        holder with ``rank``'s own ``edp`` rank (for ``ep > 1``, where experts are whole)."""
        if self.ep == 1:
            raise ValueError("ep=1: the experts are split over tp like the dense MLP and move "
                             "with it (hybridflow_comm.reshard)")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert={expert} is outside [0, {self.num_experts})")
        return self.rank(stage=stage, ep=expert // (self.num_experts // self.ep), etp=0,
                         edp=self.coords(rank).edp)

    # Groups ----------------------------------------------------------------------------------
    def _stage_groups(self, key) -> Groups:
        groups: dict[tuple, list[int]] = {}
        for r in range(self.hybrid.world_size):
            groups.setdefault((self.hybrid.train.coords(r).pp, *key(self.coords(r))), []).append(r)
        return sorted_groups(list(groups.values()))

    def ep_groups(self) -> Groups:
        """Training EP groups: the ranks of a stage with one ``(edp, etp)`` (token all-to-all)."""
        return self._stage_groups(lambda c: (c.edp, c.etp))

    def expert_dp_groups(self) -> Groups:
        """Training expert-DP groups: the ranks of a stage holding the same expert piece."""
        return self._stage_groups(lambda c: (c.ep, c.etp))

    def gen_ep_groups(self) -> Groups:
        """Generation EP groups: the ranks of a generation TP group with one piece index,
        which hold every expert's piece once between them; every rank alone when
        ``gen_ep == 1``."""
        h, groups = self.hybrid, []
        for group in h.family_groups("gen_tp"):
            for i in range(self.gen_etp):
                groups.append([r for r in group if self.gen_piece(r).index == i])
        return sorted_groups(groups)

    # Volume ----------------------------------------------------------------------------------
    def received_fraction(self) -> Fraction:
        """Bytes each rank receives in a transition over the bytes of every expert of every
        layer (the module docstring's formula; ValueError for ``ep == 1``, whose experts
        move with the dense weights)."""
        if self.ep == 1:
            raise ValueError("ep=1: the experts are split over tp like the dense MLP and move "
                             "with it (hybridflow_comm.reshard)")
        t, h = self.hybrid.train, self.hybrid
        return Fraction(t.pp * self.ep - h.pp_g * self.gen_ep,
                        t.pp * self.ep * h.pp_g * self.gen_ep * self.gen_etp)

    def describe(self) -> dict:
        """The expert group families as plain lists (what the CLI prints)."""
        return {"etp": self.etp, "gen_etp": self.gen_etp, "micro_ep": self.micro_ep,
                "ep_groups": self.ep_groups(), "expert_dp_groups": self.expert_dp_groups(),
                "gen_ep_groups": self.gen_ep_groups(),
                "train_experts": [list(self.train_experts(r)) for r in range(self.hybrid.world_size)],
                "gen_experts": [list(self.gen_experts(r)) for r in range(self.hybrid.world_size)]}


def _pack_blocks(blocks: list[int], classes: int, size: int, most: int
                 ) -> list[list[int]] | None:
    """The distinct ``blocks`` (one per member, repeated where members share one) cut into
    ``classes`` disjoint sets, each of at most ``most`` blocks held by exactly ``size``
    members (a depth-first search, most-held blocks first; None when there is no such cut)."""
    held = {b: blocks.count(b) for b in sorted(set(blocks))}
    order = sorted(held, key=lambda b: (-held[b], b))
    sets: list[list[int]] = [[] for _ in range(classes)]
    fill = [0] * classes

    def place(i: int) -> bool:
        if i == len(order):
            return all(f == size for f in fill)
        b, seen = order[i], set()
        for c in range(classes):
            state = (fill[c], len(sets[c]))  # classes in one state are interchangeable
            if state in seen or fill[c] + held[b] > size or len(sets[c]) == most:
                continue
            seen.add(state)
            sets[c].append(b)
            fill[c] += held[b]
            if place(i + 1):
                return True
            sets[c].pop()
            fill[c] -= held[b]
        return False
    return [sorted(x) for x in sets] if place(0) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow_comm.expert_layout",
                                     description="Print the expert groups of a layout.")
    add_layout_arguments(parser)
    parser.add_argument("--experts", type=int, required=True, help="experts per layer")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--gen-ep", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        layout = ExpertLayout(layout_from_arguments(args), args.experts, ep=args.ep,
                              gen_ep=args.gen_ep)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(layout.describe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
