"""Process groups on 4 gloo ranks, and the multi-rank harness itself (ranks started once)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from hybridflow_comm.groups import FAMILIES, build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests.multirank import RankError, RankPool

LAYOUTS_4 = [((1, 4, 1), (1, 2)), ((1, 2, 2), (1, 1)), ((2, 2, 1), (1, 1)), ((2, 1, 2), (1, 1)),
             ((4, 1, 1), (2, 1)), ((1, 1, 4), (1, 1)), ((2, 2, 1), (2, 1))]


def _layout(train, gen):
    return HybridLayout(ParallelLayout(*train), pp_g=gen[0], tp_g=gen[1])


def _members_by_allgather(group):
    """Independent check: every member reports its global rank over the group's own pg."""
    if group.pg is None:
        return [dist.get_rank()]
    mine = torch.tensor([dist.get_rank()])
    out = [torch.zeros(1, dtype=torch.long) for _ in range(group.size)]
    dist.all_gather(out, mine, group=group.pg)
    return [int(t) for t in out]


def check_groups(rank, world, layouts):
    report = []
    for train, gen in layouts:  # every layout's groups coexist in this process
        hg = build_hybrid_groups(_layout(train, gen))
        for family in FAMILIES:
            g = getattr(hg, family)
            report.append((train, gen, family, list(g.ranks), g.rank, _members_by_allgather(g)))
    return report


def test_groups_match_layout_maths(pool4):
    results = pool4.run(check_groups, LAYOUTS_4)
    for rank, report in enumerate(results):
        for train, gen, family, ranks, grank, members in report:
            hl = _layout(train, gen)
            expected = [g for g in hl.family_groups(family) if rank in g]
            assert ranks == expected[0], (train, gen, family)
            assert members == ranks  # collective order == layout order
            assert ranks[grank] == rank


def check_pool_subset(rank, world):
    # Two roles on disjoint pools: ranks [2, 3] and [0, 1].
    a = build_hybrid_groups(_layout((1, 2, 1), (1, 1)), pool=[2, 3])
    b = build_hybrid_groups(_layout((1, 2, 1), (1, 1)), pool=[0, 1])
    mine = a if rank in (2, 3) else b
    other = b if mine is a else a
    return other is None, mine.rank, list(mine.micro_dp.ranks), _members_by_allgather(mine.micro_dp)


def test_disjoint_pools(pool4):
    results = pool4.run(check_pool_subset)
    assert [r[0] for r in results] == [True] * 4
    assert [r[1] for r in results] == [0, 1, 0, 1]
    assert results[3][2] == [2, 3] and results[3][3] == [2, 3]
    assert results[0][2] == [0, 1] and results[0][3] == [0, 1]


def check_bad_pool(rank, world):
    out = []
    for pool, layout in (([0, 0, 1, 2], (1, 4, 1)), ([3, 2], (1, 2, 1)), ([0, 1, 2, 9], (1, 4, 1)), (None, (1, 2, 1))):
        try:
            build_hybrid_groups(_layout(layout, (1, 1)), pool=pool)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_bad_pools_raise_before_any_collective(pool4):
    msgs = pool4.run(check_bad_pool)[0]
    assert "[0, 0, 1, 2] must list distinct ranks in ascending order" in msgs[0]
    assert "[3, 2] must list distinct" in msgs[1]
    assert "[9]" in msgs[2]
    assert "world_size=4" in msgs[3]


def test_world_size_one_without_dist():
    hg = build_hybrid_groups(_layout((1, 1, 1), (1, 1)))
    assert all(getattr(hg, f).pg is None and getattr(hg, f).ranks == (0,) for f in FAMILIES)
    with pytest.raises(ValueError, match="world_size=1"):
        build_hybrid_groups(_layout((1, 2, 1), (1, 1)))


def fail_on_rank(rank, world, bad):
    if rank == bad:
        raise KeyError(f"boom on {rank}")
    dist.barrier()  # the others wait in a collective: the harness must not hang
    return rank


def sleep_forever(rank, world):
    time.sleep(3600)


def die_on_rank(rank, world, bad):
    if rank == bad:
        os._exit(7)
    return rank


def add(rank, world, x, y=0):
    return rank * x + y


def test_harness_results_and_errors(pool4):
    assert pool4.run(add, 10, y=1) == [1, 11, 21, 31]
    with pytest.raises(RankError, match="rank 2 raised KeyError: 'boom on 2'") as exc:
        pool4.run(fail_on_rank, 2)
    assert exc.value.rank == 2 and "remote traceback (rank 2)" in str(exc.value)
    assert pool4.run(add, 1) == [0, 1, 2, 3]  # the pool restarts after a failure
    with pytest.raises(RankError, match="timed out"):
        pool4.run(sleep_forever, timeout_s=3)
    with pytest.raises(RankError, match="rank 1 died \\(exit code 7\\)"):
        pool4.run(die_on_rank, 1)
    assert pool4.run(add, 2) == [0, 2, 4, 6]


def test_harness_start_up_has_its_own_time_limit():
    """Spawning and importing torch takes far longer than 10 ms: the start-up limit fires,
    naming it, and the pool starts again on the next call once it has room."""
    pool = RankPool(2, start_timeout_s=0.01)
    try:
        with pytest.raises(RankError, match="start-up timed out on ranks"):
            pool.run(add, 1)
        pool.start_timeout_s = 300.0
        assert pool.run(add, 3) == [0, 3]
    finally:
        pool.close()
