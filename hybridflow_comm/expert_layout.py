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

Generation side, ``gen_ep`` (``gen_ep | ep``; ``micro_ep = ep / gen_ep``)::

    gen_ep > 1:  gen_ep_rank = ep_rank // micro_ep
                 needs experts [gen_ep_rank * E/gen_ep, ...) whole, every layer of its
                 generation stage: its training experts are one block of them
    gen_ep = 1:  needs every expert, piece tp_g_rank of tp_g (experts under gen TP)

Example, ``tp=1, dp=4, ep=4 -> gen_ep=2`` (4 ranks, 8 experts)::

    training EP group     [0 1 2 3]      experts 0-1 | 2-3 | 4-5 | 6-7
    generation EP groups  [0 . 2 .] [. 1 . 3]            stride micro_ep = 2
    rank 1 holds 2-3 and needs 0-3: it receives 0-1 from rank 0, nothing else

A generation rank receives exactly the pieces it needs and does not hold: with ``M_e`` the
bytes of every expert of every layer (layers spread evenly over the stages),

    received = (pp * ep - pp_g * gen_ep) / (pp * ep * pp_g * gen_ep * gen_etp) * M_e
    gen_etp  = tp_g when gen_ep == 1, else 1

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
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from hybridflow_comm.layout import (Groups, HybridLayout, _check_sizes, _divisors, _sorted,
                                    add_layout_arguments, layout_from_arguments)


class ExpertCoords(NamedTuple):
    """Expert coordinates of one rank: training ``ep``, ``etp`` and ``edp`` ranks, and its
    generation EP rank."""

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
        _check_sizes(num_experts=self.num_experts, ep=self.ep, gen_ep=self.gen_ep)
        t = self.hybrid.train
        if (t.tp * t.dp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide the tp x dp = {t.tp * t.dp} ranks of a "
                             f"training stage (choose ep from {_divisors(t.tp * t.dp)})")
        for name, size in (("ep", self.ep), ("gen_ep", self.gen_ep)):
            if self.num_experts % size:
                raise ValueError(f"{name}={size} must divide num_experts={self.num_experts}")
        if self.gen_ep > 1 and (self.ep == 1 or self.ep % self.gen_ep):
            raise ValueError(f"gen_ep={self.gen_ep} needs a training ep it divides, got "
                             f"ep={self.ep} (with ep=1 the experts are split over tp)")

    # Derived sizes ---------------------------------------------------------------------------
    @property
    def etp(self) -> int:
        """Training ranks one expert is split over: ``tp`` when ``ep == 1``, else 1."""
        return self.hybrid.train.tp if self.ep == 1 else 1

    @property
    def gen_etp(self) -> int:
        """Generation ranks one expert is split over: ``tp_g`` when ``gen_ep == 1``, else 1."""
        return self.hybrid.tp_g if self.gen_ep == 1 else 1

    @property
    def micro_ep(self) -> int:
        """Training EP ranks per generation EP rank (``ep / gen_ep``)."""
        return self.ep // self.gen_ep

    @property
    def edp(self) -> int:
        """Replicas of each expert piece per training stage (``tp * dp / (ep * etp)``)."""
        t = self.hybrid.train
        return t.tp * t.dp // (self.ep * self.etp)

    # Coordinates -----------------------------------------------------------------------------
    def coords(self, rank: int) -> ExpertCoords:
        """Expert coordinates of ``rank``; ValueError outside the world."""
        c = self.hybrid.train.coords(rank)
        j = c.dp * self.hybrid.train.tp + c.tp
        etp_rank, rest = j % self.etp, j // self.etp
        ep_rank, edp_rank = rest % self.ep, rest // self.ep
        gen_ep_rank = ep_rank // self.micro_ep if self.gen_ep > 1 else 0
        return ExpertCoords(ep=ep_rank, etp=etp_rank, edp=edp_rank, gen_ep=gen_ep_rank)

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

    def gen_experts(self, rank: int) -> range:
        """The experts ``rank`` needs in generation (of every layer of its generation stage)."""
        per = self.num_experts // self.gen_ep
        g = self.coords(rank).gen_ep
        return range(g * per, (g + 1) * per)

    def gen_piece(self, rank: int) -> Piece:
        """The piece of each of those experts that ``rank`` needs in generation."""
        return Piece(self.hybrid.gen_coords(rank).tp_g, self.gen_etp) if self.gen_ep == 1 \
            else WHOLE

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
        return _sorted(list(groups.values()))

    def ep_groups(self) -> Groups:
        """Training EP groups: the ranks of a stage with one ``(edp, etp)`` (token all-to-all)."""
        return self._stage_groups(lambda c: (c.edp, c.etp))

    def expert_dp_groups(self) -> Groups:
        """Training expert-DP groups: the ranks of a stage holding the same expert piece."""
        return self._stage_groups(lambda c: (c.ep, c.etp))

    def gen_ep_groups(self) -> Groups:
        """Generation EP groups: one ``gen_ep`` rank each, inside a training EP group (stride
        ``micro_ep``); every rank alone when ``gen_ep == 1``."""
        if self.gen_ep == 1:
            return [[r] for r in range(self.hybrid.world_size)]
        return self._stage_groups(lambda c: (c.edp, c.etp, c.ep % self.micro_ep))

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
