"""Layout maths, exhaustively for every world size up to 16 (pure, no processes).

The coordinates are computed in C++ (hybridflow_comm._C.Layout); the references here are
brute-force loops over the coordinates and properties of the groups, never calls of that code.
"""

import json
import subprocess
import sys

import pytest

from hybridflow_comm.layout import HybridLayout, ParallelLayout, main
from hybridflow_comm.sizes import divisors


def divisors_by_trial(n):
    """The reference: every candidate tried."""
    return [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_match_trial_division():
    for n in range(0, 400):
        assert divisors(n) == divisors_by_trial(n), n


def all_hybrid_layouts(max_world=16):
    for world in range(1, max_world + 1):
        for pp in divisors_by_trial(world):
            for tp in divisors_by_trial(world // pp):
                dp = world // (pp * tp)
                for pp_g in divisors_by_trial(pp):
                    for tp_g in divisors_by_trial(tp):
                        yield HybridLayout(ParallelLayout(pp=pp, tp=tp, dp=dp), pp_g=pp_g, tp_g=tp_g)


LAYOUTS = list(all_hybrid_layouts())


def _assert_partition(groups, world, size):
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world))
    assert all(len(g) == size for g in groups)
    assert all(g == sorted(g) for g in groups)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)


def _group_of(groups, rank):
    (g,) = [g for g in groups if rank in g]
    return g


def test_enumeration_is_large():
    assert len(LAYOUTS) > 300


@pytest.mark.parametrize("hl", LAYOUTS, ids=lambda h: f"{h.train.pp}-{h.train.tp}-{h.train.dp}_{h.pp_g}-{h.tp_g}")
def test_groups_partition_and_zero_redundancy(hl):
    t = hl.train
    world = t.pp * t.tp * t.dp
    m_t, m_p = t.tp // hl.tp_g, t.pp // hl.pp_g
    d = hl.describe()
    assert d["world_size"] == world and d["micro_dp_size"] == m_t * m_p
    _assert_partition(d["train_tp_groups"], world, t.tp)
    _assert_partition(d["train_pp_groups"], world, t.pp)
    _assert_partition(d["train_dp_groups"], world, t.dp)
    _assert_partition(d["gen_tp_groups"], world, hl.tp_g)
    _assert_partition(d["gen_pp_groups"], world, hl.pp_g)
    _assert_partition(d["gen_dp_groups"], world, t.dp * m_t * m_p)
    _assert_partition(d["micro_dp_groups"], world, m_t * m_p)
    _assert_partition(hl.micro_tp_groups(), world, m_t)
    _assert_partition(hl.micro_pp_groups(), world, m_p)
    _assert_partition(hl.model_parallel_groups(), world, t.pp * t.tp)
    for g in hl.micro_dp_groups():  # micro-TP x micro-PP factor every micro-DP group
        assert sorted(q for p_ in g for q in _group_of(hl.micro_tp_groups(), p_)) == sorted(g * m_t)
        assert sorted(q for p_ in g for q in _group_of(hl.micro_pp_groups(), p_)) == sorted(g * m_p)
    # Strides stated in the paper: training TP consecutive, DP strided by p*t,
    # generation TP strided by tp/tp_g, generation PP by (pp/pp_g)*tp.
    for g in d["train_tp_groups"]:
        assert g == list(range(g[0], g[0] + t.tp))
    for g in d["train_dp_groups"]:
        assert all(b - a == t.pp * t.tp for a, b in zip(g, g[1:]))
    for g in d["gen_tp_groups"]:
        assert all(b - a == m_t for a, b in zip(g, g[1:]))
    for g in d["gen_pp_groups"]:
        assert all(b - a == m_p * t.tp for a, b in zip(g, g[1:]))

    # Independent element-level check. A tensor of pp*L layers x tp*K columns; a rank's
    # training shard and generation shard are read off its positions in the groups.
    L, K = 2, 3
    layers, cols = t.pp * L, t.tp * K

    def train_shard(r):
        s = _group_of(d["train_pp_groups"], r).index(r)
        tt = _group_of(d["train_tp_groups"], r).index(r)
        return {(l, c) for l in range(s * L, (s + 1) * L) for c in range(tt * K, (tt + 1) * K)}

    def gen_shard(r):
        pg = _group_of(d["gen_pp_groups"], r).index(r)
        tg = _group_of(d["gen_tp_groups"], r).index(r)
        lp, cp = layers // hl.pp_g, cols // hl.tp_g
        return {(l, c) for l in range(pg * lp, (pg + 1) * lp) for c in range(tg * cp, (tg + 1) * cp)}

    for r in range(world):
        assert train_shard(r) <= gen_shard(r)
    for g in d["micro_dp_groups"]:
        shards = [train_shard(r) for r in g]
        union = set().union(*shards)
        assert sum(len(s) for s in shards) == len(union)  # disjoint: zero redundancy
        for r in g:
            assert gen_shard(r) == union  # one all-gather builds every member's gen shard
        # Slot order: member k holds the k-th piece of the shard, pieces ordered by
        # (first layer, first column).
        pieces = sorted(shards, key=lambda s: (min(s)[0], min(c for _, c in s)))
        assert pieces == shards
    # One generation replica (closure of gen TP and PP groups) covers the whole tensor.
    for r in range(world):
        replica = {q for p in _group_of(d["gen_pp_groups"], r)
                   for q in _group_of(d["gen_tp_groups"], p)}
        assert len(replica) == hl.pp_g * hl.tp_g
        assert set().union(*(gen_shard(q) for q in replica)) == {(l, c) for l in range(layers) for c in range(cols)}
    # Coordinates agree with the groups and invert.
    for r in range(world):
        c = hl.gen_coords(r)
        assert _group_of(d["gen_tp_groups"], r).index(r) == c.tp_g
        assert _group_of(d["micro_dp_groups"], r).index(r) == c.micro_dp
        assert hl.gen_rank(pp_g=c.pp_g, tp_g=c.tp_g, micro_dp=c.micro_dp, dp=c.dp) == r
        assert t.rank(**t.coords(r)._asdict()) == r


def test_paper_example_cli():
    out = subprocess.run([sys.executable, "-m", "hybridflow_comm.layout", "--train", "1,4,2",
                          "--gen", "1,2"], capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["gen_tp_groups"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d["micro_dp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d["train_tp_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d["train_dp_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert set(d) == {"world_size", "micro_dp_size", "train_tp_groups", "train_pp_groups",
                      "train_dp_groups", "gen_tp_groups", "gen_pp_groups", "gen_dp_groups",
                      "micro_dp_groups"}


def test_coords_against_enumeration():
    """The coordinate maths (C++) against counting the ranks in nested loops: dp slowest, then
    the generation stage, the stage inside it, the generation TP shard, the TP rank inside it."""
    for hl in LAYOUTS:
        t = hl.train
        m_t, m_p = t.tp // hl.tp_g, t.pp // hl.pp_g
        rank = 0
        for d in range(t.dp):
            for pg in range(hl.pp_g):
                for mp in range(m_p):
                    for tg in range(hl.tp_g):
                        for mt in range(m_t):
                            s, x, micro = pg * m_p + mp, tg * m_t + mt, mp * m_t + mt
                            assert t.coords(rank) == (s, x, d)
                            assert t.rank(pp=s, tp=x, dp=d) == rank
                            assert hl.gen_coords(rank) == (pg, tg, micro, d, d * m_t * m_p + micro)
                            assert hl.gen_rank(pp_g=pg, tp_g=tg, micro_dp=micro, dp=d) == rank
                            rank += 1
        assert rank == t.world_size


def test_coordinates_out_of_range():
    t = ParallelLayout(pp=2, tp=2, dp=1)
    hl = HybridLayout(t, pp_g=1, tp_g=1)
    with pytest.raises(ValueError, match=r"rank=4 is outside \[0, 4\)"):
        t.coords(4)
    with pytest.raises(ValueError, match=r"rank=-1 is outside \[0, 4\)"):
        hl.gen_coords(-1)
    with pytest.raises(ValueError, match=r"tp=2 is outside \[0, 2\)"):
        t.rank(pp=0, tp=2, dp=0)
    with pytest.raises(ValueError, match=r"micro_dp=4 is outside \[0, 4\)"):
        hl.gen_rank(pp_g=0, tp_g=0, micro_dp=4, dp=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp=0, tp=1, dp=1), "pp=0"),
    (dict(pp=1, tp=-2, dp=1), "tp=-2"),
    (dict(pp=1, tp=1, dp=0), "dp=0"),
])
def test_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_bad_generation_sizes():
    with pytest.raises(ValueError, match="tp_g=3 must divide the training tp=4"):
        HybridLayout(ParallelLayout(1, 4, 1), pp_g=1, tp_g=3)
    with pytest.raises(ValueError, match="pp_g=2 must divide the training pp=3"):
        HybridLayout(ParallelLayout(3, 1, 1), pp_g=2, tp_g=1)
    with pytest.raises(ValueError, match="tp_g=0"):
        HybridLayout(ParallelLayout(1, 4, 1), pp_g=1, tp_g=0)
    with pytest.raises(TypeError):
        ParallelLayout(1.5, 1, 1)


def test_world_size_mismatch():
    with pytest.raises(ValueError, match="covers 8 ranks but the job has world_size=4"):
        ParallelLayout(1, 4, 2).check_world_size(4)


def test_cli_error(capsys):
    assert main(["--train", "1,4", "--gen", "1,1"]) == 2
    assert "PP,TP,DP" in capsys.readouterr().err
