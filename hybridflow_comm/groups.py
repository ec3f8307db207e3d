"""Process groups for a HybridLayout, built in one place and one fixed order on every rank.

``build_hybrid_groups`` is the only function in the project that calls ``dist.new_group`` for
layouts. Every process of the job must call it with the same arguments in the same order (it
creates every group of every family, as torch.distributed requires) and gets back a frozen
:class:`HybridGroups` with the groups this process belongs to, for the training and the
generation side.  Several HybridLayouts (one per role) coexist: each call makes its own groups.

A layout can run on a subset of the job's ranks (a resource pool): layout rank ``r`` is global
rank ``pool[r]``.  A group of one rank has no ProcessGroup (``pg is None``); collectives on it
are skipped, so the same code runs on one process or many.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.layout import FAMILIES, HybridLayout

# FAMILIES fixes the creation order: changing it changes which ProcessGroup every rank gets.


@dataclass(frozen=True)
class Group:
    """The group of one family that this process belongs to.

    Attributes:
        ranks: global ranks of the members in layout-rank order; the group rank of a member is
            its index (so slot ``k`` of a micro-DP gather comes from ``ranks[k]``).
        rank: this process's group rank (its index in ``ranks``).
        pg: the ProcessGroup, or None for a single-rank group.
    """

    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class HybridGroups:
    """This process's groups for one HybridLayout (training and generation side)."""

    layout: HybridLayout
    pool: tuple[int, ...]
    rank: int  # layout rank of this process
    train_tp: Group
    train_pp: Group
    train_dp: Group
    gen_tp: Group
    gen_pp: Group
    gen_dp: Group
    micro_dp: Group
    micro_tp: Group  # micro-DP members on this rank's training stage
    micro_pp: Group  # micro-DP members with this rank's micro-TP rank, one per stage
    train_mp: Group  # the whole training replica (pp x tp ranks of this dp rank)
    world: Group  # every rank of the layout (the pool)



def check_pool(layout: HybridLayout, pool: list[int] | tuple[int, ...] | None,
               world_size: int) -> tuple[int, ...]:
    """Validate a resource pool for ``layout`` on a job of ``world_size`` ranks."""
    if pool is None:
        layout.check_world_size(world_size)
        return tuple(range(world_size))
    pool = tuple(int(r) for r in pool)
    if list(pool) != sorted(set(pool)):
        # torch.distributed numbers group members by ascending global rank; an ascending pool
        # keeps that order equal to the layout's.
        raise ValueError(f"resource pool {list(pool)} must list distinct ranks in ascending order")
    bad = [r for r in pool if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"resource pool ranks {bad} are outside the job's world_size={world_size}")
    if len(pool) != layout.world_size:
        raise ValueError(f"layout {layout.train} (world {layout.world_size}) does not fit the "
                         f"resource pool of {len(pool)} ranks {list(pool)}")
    return pool


def build_hybrid_groups(layout: HybridLayout, pool: list[int] | None = None,
                        timeout_s: float | None = None) -> HybridGroups | None:
    """Create every group of ``layout`` and return this process's (None if not in the pool).

    Args:
        layout: training and generation layout.
        pool: global ranks the layout runs on (default: all ranks of the job, in order).
        timeout_s: collective timeout of the new groups (default: the job's).

    Must be called by every process of the job, in the same order.
    """
    pool, my_global, mine = _new_groups(
        layout, [(f, layout.family_groups(f)) for f in FAMILIES], pool, timeout_s)
    if my_global not in pool:
        return None
    return HybridGroups(layout=layout, pool=pool, rank=pool.index(my_global), **mine)


@dataclass(frozen=True)
class ExpertGroups:
    """This process's groups for one :class:`~hybridflow_comm.expert_layout.ExpertLayout`."""

    layout: ExpertLayout
    ep: Group  # training EP group: the all-to-all of tokens (member k holds expert block k)
    edp: Group  # training expert-DP group: the ranks holding the same experts
    gen_ep: Group  # generation EP group


EXPERT_FAMILIES = ("ep", "edp", "gen_ep")
"""The expert group families, in the fixed order in which their groups are created."""


def build_expert_groups(layout: ExpertLayout, pool: list[int] | None = None,
                        timeout_s: float | None = None) -> ExpertGroups | None:
    """Create every expert group of ``layout`` and return this process's (None if not in the
    pool); called like :func:`build_hybrid_groups`, by every process, in one order."""
    families = {"ep": layout.ep_groups, "edp": layout.expert_dp_groups,
                "gen_ep": layout.gen_ep_groups}
    pool, my_global, mine = _new_groups(
        layout.hybrid, [(f, families[f]()) for f in EXPERT_FAMILIES], pool, timeout_s)
    if my_global not in pool:
        return None
    return ExpertGroups(layout=layout, **mine)


def _new_groups(layout: HybridLayout, families: list[tuple[str, list[list[int]]]],
                pool: list[int] | None, timeout_s: float | None
                ) -> tuple[tuple[int, ...], int, dict[str, Group]]:
    """Every group of every family (``dist.new_group`` on every process, in the given order):
    the checked pool, this process's global rank and its group of each family."""
    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    my_global = dist.get_rank() if initialized else 0
    pool = check_pool(layout, pool, world_size)
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    mine: dict[str, Group] = {}
    for family, groups in families:
        for group in groups:
            ranks = tuple(pool[r] for r in sorted(group))
            pg = dist.new_group(list(ranks), **kwargs) if len(ranks) > 1 else None
            if my_global in ranks:
                mine[family] = Group(ranks=ranks, rank=ranks.index(my_global), pg=pg)
    return pool, my_global, mine
