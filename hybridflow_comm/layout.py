"""Parallel layouts of the training and generation sides, as pure arithmetic.

Nothing here touches torch.distributed: every function maps sizes and a rank to ranks or
coordinates, so the whole module is testable without a process and two layouts can live side
by side in one process (one per role).

The coordinate formulas below exist once, in C++ (``hybridflow_comm._C.Layout`` in
``csrc/protocol_plans.cpp``), because the transfer protocols' rank plans are built from them
there; :meth:`ParallelLayout.coords`/:meth:`~ParallelLayout.rank` and
:meth:`HybridLayout.gen_coords`/:meth:`~HybridLayout.gen_rank` call it, and this module keeps
the validation messages and the group enumeration.

Training side, ``ParallelLayout(pp, tp, dp)`` (the paper's ``p-t-d``)::

    rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank        # tp fastest, then pp, then dp

Generation side, ``HybridLayout(train, pp_g, tp_g)`` (the paper's ``p_g-t_g-d_g-d``) on the
same ranks.  With ``micro_tp = tp / tp_g`` and ``micro_pp = pp / pp_g`` every training
coordinate splits in two::

    tp_rank = tp_g_rank * micro_tp + micro_tp_rank
    pp_rank = pp_g_rank * micro_pp + micro_pp_rank
    micro_dp_rank = micro_pp_rank * micro_tp + micro_tp_rank     # in [0, micro_dp_size)

Example, training 1-4-2 -> generation 1-2 (8 ranks, micro_dp_size 2)::

    training TP groups   [0 1 2 3] [4 5 6 7]
    generation TP groups [0 . 2 .] [. 1 . 3] [4 . 6 .] [. 5 . 7]     stride micro_tp = 2
    micro-DP groups      [0 1] [2 3] [4 5] [6 7]                      consecutive ranks

Shards.  Split every tensor along its partition dim into ``tp`` equal pieces and the layers into
``pp`` equal stages; a *piece* is ``(pp_rank, tp_rank)``:

* the training shard of a rank is the single piece ``(pp_rank, tp_rank)``;
* the generation shard of a rank is every piece ``(s, t)`` with ``s // micro_pp == pp_g_rank``
  and ``t // micro_tp == tp_g_rank``: the layers of generation stage ``pp_g_rank`` cut ``tp_g``
  ways, i.e. ``micro_dp_size`` pieces, ordered by ``micro_dp_rank``.

The rank with micro-DP rank ``k`` holds exactly piece ``k`` of its own generation shard (its
training shard is one *slot* of its generation shard), and the ranks of one micro-DP group hold
all ``micro_dp_size`` slots between them, each once.  So one all-gather inside each micro-DP
group builds every generation shard with zero redundant weights.

Run ``python -m hybridflow_comm.layout --train PP,TP,DP --gen PP_G,TP_G`` to print all groups.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch  # noqa: F401  (loads libtorch, which hybridflow_comm._C links against)

from hybridflow_comm import _C
from hybridflow_comm.sizes import check_sizes, divisors

Groups = list[list[int]]

# Every group family, in the fixed order in which process groups are created.
FAMILIES = ("train_tp", "train_pp", "train_dp", "gen_tp", "gen_pp", "gen_dp", "micro_dp",
            "micro_tp", "micro_pp", "train_mp", "world")


class TrainCoords(NamedTuple):
    pp: int
    tp: int
    dp: int


class GenCoords(NamedTuple):
    """Generation-side coordinates of one rank.

    ``dp_g`` numbers the generation replicas: ``dp * micro_dp_size + micro_dp``.
    """

    pp_g: int
    tp_g: int
    micro_dp: int
    dp: int
    dp_g: int


@dataclass(frozen=True)
class ParallelLayout:
    """Training layout ``pp x tp x dp``; ranks ordered tp fastest, then pp, then dp."""

    pp: int
    tp: int
    dp: int

    def __post_init__(self) -> None:
        check_sizes(pp=self.pp, tp=self.tp, dp=self.dp)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless this layout covers exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise ValueError(
                f"layout pp={self.pp} x tp={self.tp} x dp={self.dp} covers {self.world_size} "
                f"ranks but the job has world_size={world_size}"
            )

    def coords(self, rank: int) -> TrainCoords:
        """Training coordinates ``(pp, tp, dp)`` of ``rank``; ValueError outside the world."""
        return TrainCoords(*_maths(self.pp, self.tp, self.dp).train_coords(rank))

    def rank(self, *, pp: int, tp: int, dp: int) -> int:
        """Rank at training coordinates ``(pp, tp, dp)``; ValueError for one out of range."""
        return _maths(self.pp, self.tp, self.dp).train_rank(pp, tp, dp)

    def tp_groups(self) -> Groups:
        return [[self.rank(pp=s, tp=t, dp=d) for t in range(self.tp)]
                for d in range(self.dp) for s in range(self.pp)]

    def pp_groups(self) -> Groups:
        return sorted_groups([[self.rank(pp=s, tp=t, dp=d) for s in range(self.pp)]
                        for d in range(self.dp) for t in range(self.tp)])

    def dp_groups(self) -> Groups:
        return sorted_groups([[self.rank(pp=s, tp=t, dp=d) for d in range(self.dp)]
                        for s in range(self.pp) for t in range(self.tp)])


@dataclass(frozen=True)
class HybridLayout:
    """Generation layout ``pp_g x tp_g`` on the ranks of the training layout ``train``.

    Requires ``tp_g | tp`` and ``pp_g | pp``; each training replica becomes
    ``micro_dp_size = (pp * tp) / (pp_g * tp_g)`` generation replicas.
    """

    train: ParallelLayout
    pp_g: int
    tp_g: int

    def __post_init__(self) -> None:
        if not isinstance(self.train, ParallelLayout):
            raise TypeError(f"train must be a ParallelLayout, got {self.train!r}")
        check_sizes(pp_g=self.pp_g, tp_g=self.tp_g)
        if self.train.tp % self.tp_g:
            raise ValueError(
                f"tp_g={self.tp_g} must divide the training tp={self.train.tp} "
                f"(choose tp_g from {divisors(self.train.tp)})"
            )
        if self.train.pp % self.pp_g:
            raise ValueError(
                f"pp_g={self.pp_g} must divide the training pp={self.train.pp} "
                f"(choose pp_g from {divisors(self.train.pp)})"
            )

    # Derived sizes -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.train.world_size

    @property
    def micro_tp(self) -> int:
        """Training TP shards per generation TP shard (``tp / tp_g``)."""
        return self.train.tp // self.tp_g

    @property
    def micro_pp(self) -> int:
        """Training stages per generation stage (``pp / pp_g``)."""
        return self.train.pp // self.pp_g

    @property
    def micro_dp_size(self) -> int:
        return self.micro_tp * self.micro_pp

    @property
    def dp_g(self) -> int:
        """Number of generation replicas over the whole world (``dp * micro_dp_size``)."""
        return self.train.dp * self.micro_dp_size

    def check_world_size(self, world_size: int) -> None:
        self.train.check_world_size(world_size)

    # Coordinates ---------------------------------------------------------------------------
    def gen_coords(self, rank: int) -> GenCoords:
        """Generation coordinates of ``rank`` (see the module docstring)."""
        t = self.train
        return GenCoords(*_maths(t.pp, t.tp, t.dp, self.pp_g, self.tp_g).gen_coords(rank))

    def gen_rank(self, *, pp_g: int, tp_g: int, micro_dp: int, dp: int) -> int:
        """Rank at generation coordinates (inverse of :meth:`gen_coords`)."""
        t = self.train
        return _maths(t.pp, t.tp, t.dp, self.pp_g, self.tp_g).gen_rank(pp_g, tp_g, micro_dp, dp)

    # Groups ---------------------------------------------------------------------------------
    def _gen_groups(self, vary: str) -> Groups:
        sizes = {"pp_g": self.pp_g, "tp_g": self.tp_g, "micro_dp": self.micro_dp_size,
                 "dp": self.train.dp}
        varied = vary.split("+")
        fixed = [k for k in sizes if k not in varied]
        groups = []
        for fixed_idx in itertools.product(*(range(sizes[k]) for k in fixed)):
            group = []
            for var_idx in itertools.product(*(range(sizes[k]) for k in varied)):
                kw = dict(zip(fixed, fixed_idx)) | dict(zip(varied, var_idx))
                group.append(self.gen_rank(**kw))
            groups.append(sorted(group))
        return sorted_groups(groups)

    def gen_tp_groups(self) -> Groups:
        """Ranks that hold one generation replica's TP shards of one stage (stride micro_tp)."""
        return self._gen_groups("tp_g")

    def gen_pp_groups(self) -> Groups:
        """Ranks that hold one generation replica's stages (stride micro_pp * tp)."""
        return self._gen_groups("pp_g")

    def micro_dp_groups(self) -> Groups:
        """Ranks whose training shards together make one generation shard."""
        return self._gen_groups("micro_dp")

    def micro_tp_groups(self) -> Groups:
        """Ranks of one micro-DP group on the same training stage (consecutive TP ranks)."""
        out = []
        for g in self.micro_dp_groups():
            for j in range(self.micro_pp):
                out.append(g[j * self.micro_tp:(j + 1) * self.micro_tp])
        return sorted_groups(out)

    def micro_pp_groups(self) -> Groups:
        """Ranks of one micro-DP group with the same micro-TP rank (one per training stage)."""
        out = []
        for g in self.micro_dp_groups():
            for i in range(self.micro_tp):
                out.append(g[i::self.micro_tp])
        return sorted_groups(out)

    def model_parallel_groups(self) -> Groups:
        """Ranks of one training replica (all pp x tp ranks with the same dp rank)."""
        t = self.train
        return [[t.rank(pp=s, tp=x, dp=d) for s in range(t.pp) for x in range(t.tp)]
                for d in range(t.dp)]

    def gen_dp_groups(self) -> Groups:
        """Ranks that hold the same generation shard (one per generation replica)."""
        return self._gen_groups("micro_dp+dp")

    def family_groups(self, family: str) -> Groups:
        """The groups of one family by name (see :data:`FAMILIES`), sorted by first rank."""
        t = self.train
        table = {
            "train_tp": t.tp_groups, "train_pp": t.pp_groups, "train_dp": t.dp_groups,
            "gen_tp": self.gen_tp_groups, "gen_pp": self.gen_pp_groups,
            "gen_dp": self.gen_dp_groups, "micro_dp": self.micro_dp_groups,
            "micro_tp": self.micro_tp_groups, "micro_pp": self.micro_pp_groups,
            "train_mp": self.model_parallel_groups,
            "world": lambda: [list(range(self.world_size))],
        }
        if family not in table:
            raise ValueError(f"family={family!r} is not one of {FAMILIES}")
        return sorted_groups(table[family]())

    def describe(self) -> dict:
        """The training and generation group families as plain lists (what the CLI prints)."""
        families = ("train_tp", "train_pp", "train_dp", "gen_tp", "gen_pp", "gen_dp", "micro_dp")
        return {"world_size": self.world_size, "micro_dp_size": self.micro_dp_size,
                **{f"{f}_groups": self.family_groups(f) for f in families}}


@functools.lru_cache(maxsize=256)
def _maths(pp: int, tp: int, dp: int, pp_g: int = 1, tp_g: int = 1) -> _C.Layout:
    """The C++ coordinate maths of a layout (arguments in the order of ``_C.Layout``); one
    object per set of sizes, kept here rather than on the frozen layouts, which stay plain
    picklable values."""
    return _C.Layout(pp, tp, dp, pp_g, tp_g)


def sorted_groups(groups: Groups) -> Groups:
    """Every group sorted, and the groups by their first rank (how group lists are compared
    and printed)."""
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def parse_sizes(text: str, names: tuple[str, ...]) -> tuple[int, ...]:
    """Parse ``"1,4,2"`` into ints, naming the expected fields on error."""
    parts = text.split(",")
    if len(parts) != len(names):
        raise ValueError(f"expected {','.join(names).upper()} ({len(names)} ints), got {text!r}")
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected {','.join(names).upper()} as ints, got {text!r}") from None


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """``--train PP,TP,DP`` and ``--gen PP_G,TP_G`` (read by :func:`layout_from_arguments`)."""
    parser.add_argument("--train", required=True, help="PP,TP,DP of the training layout")
    parser.add_argument("--gen", required=True, help="PP_G,TP_G of the generation layout")


def layout_from_arguments(args: argparse.Namespace) -> HybridLayout:
    """The HybridLayout of ``--train`` and ``--gen``; ValueError/TypeError naming a bad size."""
    pp, tp, dp = parse_sizes(args.train, ("pp", "tp", "dp"))
    pp_g, tp_g = parse_sizes(args.gen, ("pp_g", "tp_g"))
    return HybridLayout(ParallelLayout(pp=pp, tp=tp, dp=dp), pp_g=pp_g, tp_g=tp_g)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow_comm.layout",
                                     description="Print the training and generation groups.")
    add_layout_arguments(parser)
    args = parser.parse_args(argv)
    try:
        layout = layout_from_arguments(args)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(layout.describe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
