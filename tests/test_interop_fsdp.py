"""FSDP2 / ZeRO-3 source layouts -> generation layouts.

Pure tier: the plan, simulated in one process for every small mesh, placement and generation
layout, rebuilds every generation shard bit-exactly from the FSDP shards (each element written
once) while receiving exactly the brute-force minimum.  Multi-rank tier (4 gloo ranks, started
once): real ``fully_shard`` (1-D and over TP) and ``distribute_tensor`` state dicts, bit-exact
Hugging Face tensors, measured bytes == formula == brute force, FSDP shards untouched, and every
bad input raising ValueError on every rank before any collective (rank jobs: tests/fsdp_jobs.py).
"""

import itertools

import pytest
import torch

from hybridflow_comm.interop.fsdp_plan import (ConcatFusion, GenPlacement, GenTensor, MeshSpec,
                                               SourcePlacement, min_received_bytes, plan_blocks,
                                               plan_rounds)
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion
from tests import fsdp_jobs

# Pure tier ------------------------------------------------------------------------------------
SHAPES = {  # name -> (shape, generation dim, fusion)
    "col": ((8, 6), 0, None), "row": ((4, 8), 1, None), "rep": ((8,), None, None),
    "qkv": ((16, 2), 0, QKVFusion(4, 4, 1)), "gu": ((8, 3), 0, GateUpFusion()),
    "cat": ((16, 2), 0, ConcatFusion.qkv(4, 2, 2)), "gucat": ((8, 2), 0, ConcatFusion.gate_up(4)),
    "bias": ((12,), 0, None),
}
MESHES = [  # (shape, dp_axis, tp_axis)
    ((1,), 0, None), ((2,), 0, None), ((3,), 0, None), ((4,), 0, None),
    ((2, 2), 0, 1), ((2, 2), 1, None), ((1, 4), 0, 1), ((4, 1), 0, 1), ((2, 1), 0, 1),
]


def _source_choices(shape, mesh):
    """Every placement of a tensor of ``shape`` that the mesh can hold with even shards."""
    out = [SourcePlacement(False)]
    cands = [SourcePlacement(True)]
    if mesh.tp_axis is not None:
        cands += [SourcePlacement(True, d) for d in range(len(shape))]
        cands += [SourcePlacement(True, 0, True), SourcePlacement(False, len(shape) - 1)]
    for c in cands:
        if all(shape[d] % c.parts(mesh, d) == 0 for d in range(len(shape))):
            out.append(c)
    return out


def _ref_local(full, src, mesh, rank):
    """DTensor's semantics by torch.chunk (the multi-rank tier checks it against DTensor)."""
    i, j = mesh.dp_tp(rank)
    t = full
    if src.dp_sharded and src.tp_dim == 0 and src.tp_outer:
        return t.chunk(mesh.tp, 0)[j].chunk(mesh.dp, 0)[i]
    if src.dp_sharded:
        t = t.chunk(mesh.dp, 0)[i]
    if src.tp_dim is not None:
        t = t.chunk(mesh.tp, src.tp_dim)[j]
    return t


def _ref_gen(full, g, tp_g, t):
    if g.dim is None:
        return full
    if isinstance(g.fusion, ConcatFusion):
        return torch.cat([p.chunk(tp_g, 0)[t] for p in full.split(list(g.fusion.part_rows))])
    return full.chunk(tp_g, g.dim)[t]


def _placements(mesh, ranks):
    w = len(ranks)
    for pp_g, tp_g in itertools.product(range(1, w + 1), repeat=2):
        if w % (pp_g * tp_g):
            continue
        yield GenPlacement.in_order(mesh.locality_order(), pp_g, tp_g)
        yield GenPlacement.from_layout(ParallelLayout(pp_g, tp_g, w // (pp_g * tp_g)), ranks)


def _cases():
    for shape, dp_axis, tp_axis in MESHES:
        w = int(torch.Size(shape).numel())
        ranks = tuple(range(w))[::-1] if w == 4 and len(shape) == 1 else tuple(range(w))
        mesh = MeshSpec(shape, ranks, dp_axis, tp_axis)
        for place in _placements(mesh, sorted(ranks)):
            tensors = []
            for k, (name, (sh, dim, fusion)) in enumerate(SHAPES.items()):
                g = GenTensor(name, sh, 4 if k % 2 else 2, dim, k % place.pp_g, fusion)
                try:
                    g.check(place.tp_g)
                except ValueError:
                    continue
                choices = _source_choices(sh, mesh)
                tensors.append((g, choices[(k + len(place.ranks)) % len(choices)]))
                tensors += [(GenTensor(f"{name}.{i}", sh, 4, dim, 0, fusion), c)
                            for i, c in enumerate(choices)]
            yield mesh, place, tensors


def test_plan_rebuilds_every_generation_shard_with_minimum_bytes():
    cases = 0
    for mesh, place, tensors in _cases():
        blocks = plan_blocks(tensors, mesh, place)
        ids, start = [], 0
        for g, _ in tensors:
            n = torch.Size(g.shape).numel()
            ids.append(torch.arange(start, start + n, dtype=torch.float64).view(g.shape))
            start += n
        for r in place.ranks:
            s, t = place.coord(r)
            got = {i: torch.full(g.shard_shape(place.tp_g), -1.0, dtype=torch.float64)
                   for i, (g, _) in enumerate(tensors) if g.stage == s}
            received = 0
            for b in (b for b in blocks if b.dst == r):
                src_local = _ref_local(ids[b.tensor], tensors[b.tensor][1], mesh, b.src)
                view = got[b.tensor][tuple(slice(*x) for x in b.dst_box)]
                assert bool((view == -1).all()), "an element written twice"
                view.copy_(src_local[tuple(slice(*x) for x in b.src_box)])
                received += b.nbytes if b.src != r else 0
            brute = 0
            for i, (g, src) in enumerate(tensors):
                if g.stage != s:
                    continue
                want = _ref_gen(ids[i], g, place.tp_g, t)
                assert torch.equal(got[i], want), (mesh, place, g, src, r)
                held = _ref_local(ids[i], src, mesh, r).reshape(-1)
                brute += int((~torch.isin(want.reshape(-1), held)).sum()) * g.itemsize
            assert received == brute == min_received_bytes(tensors, mesh, place, r)
        cases += 1
    assert cases > 60


def test_rounds_bound_every_pair_and_keep_every_byte():
    mesh = MeshSpec((4,), (0, 1, 2, 3), 0)
    tensors = [(GenTensor(f"w{i}", (64, 48), 4, i % 2), SourcePlacement(True)) for i in range(6)]
    blocks = plan_blocks(tensors, mesh, GenPlacement.in_order(mesh.ranks, 1, 2))
    remote = sum(b.nbytes for b in blocks if b.src != b.dst)
    for cap in (1000, 4096, 1 << 20):
        rounds = plan_rounds(blocks, cap)
        assert sum(b.nbytes for r in rounds for b in r) == remote
        for r in rounds:
            for pair in {(b.src, b.dst) for b in r}:
                assert sum(b.nbytes for b in r if (b.src, b.dst) == pair) <= max(cap, 48 * 4)
        assert (len(rounds) == 1) == (cap == 1 << 20)


def test_one_d_formula_and_locality_first_placement():
    """recv = (W - t_g)/(t_g W) M_col + (W - 1)/(t_g W) M_row + (W - 1)/W M_rep."""
    w = 4
    mesh = MeshSpec((w,), tuple(range(w)), 0)
    tensors = [(GenTensor("c", (16, 8), 2, 0), SourcePlacement(True)),
               (GenTensor("r", (8, 16), 2, 1), SourcePlacement(True)),
               (GenTensor("n", (8,), 2, None), SourcePlacement(True))]
    m_col, m_row, m_rep = 256, 256, 16
    for tp_g in (1, 2, 4):
        place = GenPlacement.in_order(mesh.locality_order(), 1, tp_g)
        assert [place.coord(r)[1] for r in range(w)] == [r // (w // tp_g) for r in range(w)]
        formula = ((w - tp_g) * m_col + (w - 1) * m_row) / (tp_g * w) + (w - 1) * m_rep / w
        assert all(min_received_bytes(tensors, mesh, place, r) == formula for r in range(w))


def test_placements_from_layouts():
    ranks = list(range(4))
    p = GenPlacement.from_layout(ParallelLayout(1, 2, 2), ranks)
    assert p.tp_groups() == [[0, 1], [2, 3]]
    h = HybridLayout(ParallelLayout(1, 4, 1), 1, 2)
    assert GenPlacement.from_layout(h, ranks).tp_groups() == h.gen_tp_groups()
    assert GenPlacement.in_order(ranks, 1, 2).tp_groups() == [[0, 2], [1, 3]]
    assert GenPlacement.in_order(ranks, 2, 2).coords == ((0, 0), (1, 0), (0, 1), (1, 1))
    with pytest.raises(ValueError, match="pp_g=1 x tp_g=3 must divide the 4 ranks"):
        GenPlacement.in_order(ranks, 1, 3)
    mesh = MeshSpec((2, 2), (0, 1, 2, 3), 0, 1)  # (dp, tp): chunk order tp outer
    assert mesh.locality_order() == [0, 2, 1, 3]


def test_generation_checks_name_the_tensor_and_the_choices():
    g = GenTensor("l0.qkv", (12, 2), 4, 0, 0, QKVFusion(8, 2, 1))
    with pytest.raises(ValueError, match=r"l0.qkv: generation tp_g=4 does not divide its 2 KV "
                                         r"heads.*choose tp_g from \[1, 2\]"):
        g.check(4)
    with pytest.raises(ValueError, match="do not add up"):
        GenTensor("c", (10, 2), 4, 0, 0, ConcatFusion.gate_up(4)).check(1)
    with pytest.raises(ValueError, match="whole part_units"):
        ConcatFusion((5, 4), (2, 2))


def test_single_process_plain_tensors():
    """One code path for one rank: no process group, plain tensors, local copies only."""
    from hybridflow_comm.interop import from_fsdp

    full = fsdp_jobs.toy_full(seed=3)
    tr = from_fsdp(full, (1, 1), tp_dims=fsdp_jobs.TP_DIMS, fusions=fsdp_jobs.FUSIONS,
                   hf_names=fsdp_jobs.HF)
    stats = tr.to_generation()
    got = dict(tr.named_generation_weights())
    want = fsdp_jobs.ref_hf(full, 1, 0)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], w) for k, w in want.items())
    assert stats.received_bytes == stats.sent_bytes == tr.minimum_received_bytes() == 0
    assert tr.to_training() > 0 and tr.mode == "training"
    with pytest.raises(RuntimeError, match="needs generation mode"):
        next(tr.named_generation_weights())


# Multi-rank tier ------------------------------------------------------------------------------
RESHARD_CASES = [
    ((4,), ("dp",), "fsdp", (1, 1), None, False),
    ((4,), ("dp",), "fsdp", (1, 2), None, False),
    ((4,), ("dp",), "fsdp", (1, 4), None, False),
    ((4,), ("dp",), "fsdp", ParallelLayout(1, 2, 2), None, False),
    ((4,), ("dp",), "fsdp", (2, 2), None, True),
    ((2, 2), ("dp", "tp"), "fsdp_tp", (1, 1), "tp", False),
    ((2, 2), ("dp", "tp"), "fsdp_tp", (1, 2), "tp", False),
    ((2, 2), ("dp", "tp"), "fsdp_tp", (1, 4), "tp", False),
    ((2, 2), ("dp", "tp"), "dtensor", (1, 2), "tp", False),
    ((2, 2), ("rep", "dp"), "hsdp", (1, 2), None, False),
]


def test_fsdp_state_dicts_reshard_bit_exact_with_minimum_bytes(pool4):
    reports = pool4.run(fsdp_jobs.check_reshard, RESHARD_CASES, timeout_s=600)
    full_gather = []
    for c in range(len(RESHARD_CASES)):
        per_rank = [r[c] for r in reports]
        for rep in per_rank:
            assert rep["received"] == rep["minimum"] == rep["brute"], rep
            assert rep["version"] == 2, rep
            assert rep["released"] > 0 or rep["coord"][0] == 1, rep  # stage 1: no "big"
        assert sum(r["sent"] for r in per_rank) == sum(r["received"] for r in per_rank)
        full_gather.append(max(r["received"] for r in per_rank))
    one_d = {str(RESHARD_CASES[c][3]): full_gather[c] for c in range(3)}
    assert one_d["(1, 2)"] < one_d["(1, 1)"]  # t_g = 1 is the full gather
    assert reports[0][1]["tp_groups"] == [[0, 2], [1, 3]]  # local-first, 1-D, t_g = 2
    assert reports[0][3]["tp_groups"] == [[0, 1], [2, 3]]  # a ParallelLayout: tp fastest
    assert reports[0][6]["tp_groups"] == [[0, 1], [2, 3]]  # FSDP over TP: the TP groups


def test_bad_inputs_raise_value_error_on_every_rank(pool4):
    expected = [
        "uneven_w: dim 0 of global shape (6, 4) is not divisible by the 4 shards",
        "partial_w: placement P",
        "half_w: the device mesh covers ranks [0, 1] but the transition's group has ranks "
        "[0, 1, 2, 3]",
        "qkv_w: generation tp_g=4 does not divide its 2 KV heads",
        "generation pp_g=1 x tp_g=3 must divide the 4 ranks",
        "dim1_w: placement S(1) on the dp (FSDP) mesh axis 0",
        "other_mesh_w: its device mesh",
        "ok_w: generation stage None is not in [0, pp_g=2); pass gen_stages=",
        "nodim_w: no generation partition dim",
        "fusions given for tensors not in the state dict: ['missing']",
        "ranks [1, 2, 3] describe the state dict differently from rank 0",
    ]
    for msgs in pool4.run(fsdp_jobs.check_bad_inputs, timeout_s=300):
        assert len(msgs) == len(expected)
        for got, want in zip(msgs, expected):
            assert want in got, (want, got)
