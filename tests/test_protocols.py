"""Protocol rank plans (C++) against a brute-force enumeration of the ranks written here.

The reference never calls the layout maths (hybridflow_comm.layout wraps the same C++ code):
it counts the ranks in p-t-d order and groups them by their coordinates. Exhaustive over every
layout of 1..8 ranks with tp_g | tp and pp_g | pp.
"""

import itertools

import pytest
import torch  # noqa: F401  (loads libtorch, which hybridflow_comm._C links against)

from hybridflow_comm import _C
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.controller.protocols import (CONCAT, LIST, PER_RANK, SINGLE, SPLIT, WHOLE, Plan,
                                       get_protocol, protocol, protocol_of, register_protocol)


def _layouts(max_world=8):
    for pp, tp, dp in itertools.product(range(1, max_world + 1), repeat=3):
        if pp * tp * dp > max_world:
            continue
        for pp_g in [d for d in range(1, pp + 1) if pp % d == 0]:
            for tp_g in [d for d in range(1, tp + 1) if tp % d == 0]:
                yield HybridLayout(ParallelLayout(pp, tp, dp), pp_g=pp_g, tp_g=tp_g)


LAYOUTS = list(_layouts())


def _reference(name, layout):
    """(distribute, chunk per rank, collect ranks, collect kind) by enumeration."""
    pp, tp, dp = layout.train.pp, layout.train.tp, layout.train.dp
    micro_tp, micro_pp = tp // layout.tp_g, pp // layout.pp_g
    # Rank r has training coordinates coords[r]: count the ranks tp fastest, then pp, then dp.
    coords = [(s, t, d) for d in range(dp) for s in range(pp) for t in range(tp)]
    w = len(coords)
    ranks = list(range(w))
    if name in ("ONE_TO_ALL", "ALL_TO_ALL"):
        return WHOLE, [0] * w, ranks, LIST
    if name == "3D_PROTO":
        collect = [coords.index((pp - 1, 0, d)) for d in range(dp)]
        return SPLIT, [d for _, _, d in coords], collect, CONCAT
    if name == "3D_ALL_MICRO_DP":
        # A micro-DP group: the ranks of one dp replica in the same generation stage and the
        # same generation TP shard. Dicts keep insertion order, so groups come by first rank.
        groups = {}
        for r, (s, t, d) in enumerate(coords):
            groups.setdefault((d, s // micro_pp, t // micro_tp), []).append(r)
        order = list(groups.values())
        chunk = [next(i for i, g in enumerate(order) if r in g) for r in ranks]
        return SPLIT, chunk, [g[0] for g in order], CONCAT
    if name == "3D_PP_ONLY":
        return WHOLE, [0] * w, [coords.index((s, 0, 0)) for s in range(pp)], LIST
    if name in ("DP_PROTO", "DP_COMPUTE_METRIC"):
        return SPLIT, ranks, ranks, CONCAT if name == "DP_PROTO" else LIST
    if name == "DP_COMPUTE":
        return PER_RANK, ranks, ranks, LIST
    if name == "RANK_ZERO":
        return WHOLE, [0] + [-1] * (w - 1), [0], SINGLE
    raise AssertionError(name)


@pytest.mark.parametrize("name", _C.builtin_protocols())
def test_builtin_plans_match_layout_maths(name):
    assert len(LAYOUTS) > 50
    for layout in LAYOUTS:
        plan = get_protocol(name).plan(layout)
        dist_kind, chunks, collect, kind = _reference(name, layout)
        assert (plan.distribute, list(plan.chunk_of_rank), list(plan.collect_ranks),
                plan.collect) == (dist_kind, chunks, collect, kind), (name, layout)
        if plan.distribute == SPLIT:
            assert plan.num_chunks == max(chunks) + 1
            # every chunk goes to at least one rank and is collected exactly once (concat)
            assert sorted(set(chunks)) == list(range(plan.num_chunks))
            if plan.collect == CONCAT:
                assert [plan.chunk_of_rank[r] for r in plan.collect_ranks] == list(
                    range(plan.num_chunks))


def test_bad_layout_and_name():
    with pytest.raises(ValueError, match="unknown protocol 'NOPE'"):
        _C.protocol_plan("NOPE", 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="tp_g=3"):
        _C.protocol_plan("3D_PROTO", 1, 4, 1, 1, 3)
    with pytest.raises(ValueError, match="unknown protocol 'NOPE'"):
        get_protocol("NOPE")


def _chunks_loop(n, k):
    c = -(-n // k)
    return [i * c for i in range(k + 1)]


def test_chunk_offsets_and_segments_against_loops():
    for n in range(0, 13):
        for k in range(1, 6):
            assert _C.chunk_offsets(n, k) == _chunks_loop(n, k)
    for counts in [[3], [2, 4], [1, 0, 3], [4, 4, 1], [0, 5]]:
        total = sum(counts)
        for n_valid in range(1, total + 1):
            owner = [(s, i) for s, c in enumerate(counts) for i in range(c)]  # row -> (src, off)
            for start in range(0, 2 * n_valid + 1):
                for end in range(start, 2 * n_valid + 2):
                    segs = _C.transfer_segments(counts, n_valid, start, end)
                    rows = [(s, i) for s, a, b in segs for i in range(a, b)]
                    assert rows == [owner[r % n_valid] for r in range(start, end)]
                    # adjacent pieces of one source are merged
                    assert all(not (x[0] == y[0] and x[2] == y[1]) for x, y in zip(segs, segs[1:]))
    with pytest.raises(ValueError, match="n_valid=5"):
        _C.transfer_segments([2, 2], 5, 0, 1)
    with pytest.raises(ValueError, match="n=-1"):
        _C.chunk_offsets(-1, 2)


def test_user_protocol_and_decorator():
    def plan_fn(layout):
        w = layout.world_size
        return Plan(SPLIT, w, tuple(reversed(range(w))), tuple(reversed(range(w))), CONCAT)

    proto = register_protocol("TEST_REVERSED", plan_fn)
    layout = HybridLayout(ParallelLayout(1, 1, 3), 1, 1)
    assert proto.plan(layout).chunk_of_rank == (2, 1, 0)
    with pytest.raises(ValueError, match="already registered"):
        register_protocol("TEST_REVERSED", plan_fn)

    class W:
        @protocol("TEST_REVERSED")
        def m(self):
            return 1

    assert protocol_of(W.m) is proto and W().m() == 1
    with pytest.raises(ValueError, match=r"collect_ranks=\[5\]"):
        Plan(SPLIT, 2, (0, 1), (5,), CONCAT)
    with pytest.raises(ValueError, match="distribute='bogus'"):
        Plan("bogus", 1, (0,), (0,), CONCAT)
