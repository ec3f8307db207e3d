"""Expert layouts and their transfer plans, for every layout of up to 16 ranks (pure, no
processes).

References are brute force: which rank holds and needs which piece comes from loops over the
coordinates written here, and the bytes received from the formula of the module docstring.
"""

import json
from fractions import Fraction

import pytest
import torch

from hybridflow_comm.expert_layout import ExpertLayout, Piece, main
from hybridflow_comm.expert_reshard import check_expert_specs, plan_expert_transfers
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import GateUpFusion, ShardSpec
from tests.test_layout import all_hybrid_layouts, divisors_by_trial

NUM_EXPERTS = 16


def all_expert_sizes(max_world=16):
    """``(hybrid layout, ep, gen_ep)`` for every hybrid layout of tests/test_layout.py, every
    ep > 1 and every gen_ep dividing both ep and tp_g."""
    for hl in all_hybrid_layouts(max_world):
        for ep in divisors_by_trial(hl.train.tp * hl.train.dp)[1:]:
            for gen_ep in divisors_by_trial(ep):
                if hl.tp_g % gen_ep == 0:
                    yield hl, ep, gen_ep


def _build(sizes):
    """The accepted ExpertLayouts (2 experts per EP rank) and the refused sizes."""
    accepted, refused = [], []
    for hl, ep, gen_ep in sizes:
        try:
            accepted.append(ExpertLayout(hl, 2 * ep, ep=ep, gen_ep=gen_ep))
        except ValueError as exc:
            assert "choose another gen_ep" in str(exc), exc
            refused.append((hl, ep, gen_ep))
    return accepted, refused


LAYOUTS, REFUSED = _build(all_expert_sizes())
PLAN_LAYOUTS = [el for el in LAYOUTS if el.hybrid.world_size <= 8] + LAYOUTS[::16]
"""Every layout of up to 8 ranks, and a sample of the larger ones, for the plan's checks."""


def _id(el):
    t, h = el.hybrid.train, el.hybrid
    return f"{t.pp}-{t.tp}-{t.dp}_{h.pp_g}-{h.tp_g}_ep{el.ep}-{el.gen_ep}"


def expert_specs(pp, layers_per_stage=2, hidden=8, ffn=16, num_experts=NUM_EXPERTS):
    """Two tensors per expert and layer: gate_up split on dim 0, down_proj on dim 1."""
    specs = []
    for layer in range(pp * layers_per_stage):
        for e in range(num_experts):
            p = f"layers.{layer}.experts.{e}."
            specs += [ShardSpec(p + "gate_up", (2 * ffn, hidden), dtype=torch.bfloat16,
                                partition_dim=0, stage=layer // layers_per_stage,
                                fusion=GateUpFusion(), expert=e),
                      ShardSpec(p + "down_proj", (hidden, ffn), dtype=torch.bfloat16,
                                partition_dim=1, stage=layer // layers_per_stage, expert=e)]
    return specs


def test_enumeration_is_large():
    assert len(LAYOUTS) > 900 and len(PLAN_LAYOUTS) > 250
    assert sum(el.gen_ep > 1 for el in LAYOUTS) > 100 and len(REFUSED) < len(LAYOUTS) / 10


def _feasible(blocks, gen_ep, per):
    """Brute force: can members holding training ``blocks`` be cut into ``gen_ep`` classes of
    equal size whose block sets are disjoint, each of at most ``per`` blocks?"""
    size = len(blocks) // gen_ep

    def place(rest, classes):
        if not rest:
            sets = [{blocks[i] for i in c} for c in classes]
            return (all(len(x) <= per for x in sets)
                    and sum(len(x) for x in sets) == len(set().union(*sets)))
        i = rest[0]
        return any(place(rest[1:], classes[:k] + [c + [i]] + classes[k + 1:])
                   for k, c in enumerate(classes) if len(c) < size)
    return place(list(range(len(blocks))), [[] for _ in range(gen_ep)])


def test_refused_exactly_where_no_assignment_keeps_the_blocks():
    """A layout is refused only when no class assignment of some generation TP group keeps
    every member's training block in its own set (brute force over the assignments)."""
    for hl, ep, gen_ep in REFUSED:
        one = ExpertLayout(hl, 2 * ep, ep=ep)  # gen_ep=1 is always accepted
        verdicts = [_feasible([one.coords(r).ep for r in g], gen_ep, ep // gen_ep)
                    for g in hl.family_groups("gen_tp")]
        assert not all(verdicts), (hl.train, hl.pp_g, hl.tp_g, ep, gen_ep)
    for el in [el for el in LAYOUTS if el.gen_ep > 1][::9]:
        for g in el.hybrid.family_groups("gen_tp"):
            assert _feasible([el.coords(r).ep for r in g], el.gen_ep, el.micro_ep)


@pytest.mark.parametrize("el", LAYOUTS, ids=_id)
def test_coordinates_and_groups(el):
    t, h = el.hybrid.train, el.hybrid
    world = h.world_size
    for r in range(world):
        c, tc = el.coords(r), t.coords(r)
        assert el.rank(stage=tc.pp, ep=c.ep, etp=c.etp, edp=c.edp) == r
        j = tc.dp * t.tp + tc.tp  # the rank's index in its stage, ep consecutive per group
        assert (c.ep, c.edp) == (j % el.ep, j // el.ep)
    # Every expert of a stage is held whole by exactly edp = tp * dp / ep ranks of it.
    for stage in range(t.pp):
        for e in range(el.num_experts):
            holders = [r for r in range(world) if t.coords(r).pp == stage
                       and e in el.train_experts(r)]
            assert len(holders) == t.tp * t.dp // el.ep
    for groups, size in ((el.ep_groups(), el.ep), (el.expert_dp_groups(), el.edp),
                         (el.gen_ep_groups(), el.gen_ep)):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for g in el.ep_groups():  # one stage, every expert once
        assert len({t.coords(r).pp for r in g}) == 1
        assert sorted(e for r in g for e in el.train_experts(r)) == list(range(el.num_experts))
    for g in el.gen_ep_groups():  # together one generation copy of every expert
        assert sorted(e for r in g for e in el.gen_experts(r)) == list(range(el.num_experts))
    for g in h.family_groups("gen_tp"):  # each (expert, piece) once in a generation TP group
        have = sorted((e, el.gen_piece(r)) for r in g for e in el.gen_experts(r))
        assert have == sorted((e, Piece(i, el.gen_etp)) for e in range(el.num_experts)
                              for i in range(el.gen_etp))
    for r in range(world):  # a rank's training experts lie in its generation set
        assert set(el.train_experts(r)) <= set(el.gen_experts(r))
        assert len(el.gen_experts(r)) == el.num_experts // el.gen_ep
        if el.gen_ep == 1:  # experts under generation TP: the dense MLP's piece
            assert el.gen_piece(r) == Piece(h.gen_coords(r).tp_g, h.tp_g)


def _needs(el, specs, r):
    """``{name: piece}`` rank ``r`` needs in generation: its generation set's experts (checked
    in test_coordinates_and_groups) on every layer of its generation stage."""
    h = el.hybrid
    g = h.gen_coords(r)
    return {s.name: el.gen_piece(r) for s in specs
            if s.stage // h.micro_pp == g.pp_g and s.expert in el.gen_experts(r)}


def _bytes(spec, piece):
    return spec.nbytes // piece.count


@pytest.mark.parametrize("el", PLAN_LAYOUTS, ids=_id)
def test_plan_covers_every_need_once_at_the_formula(el):
    t = el.hybrid.train
    specs = expert_specs(t.pp, ffn=4 * t.tp, num_experts=el.num_experts)  # any tp_g | tp
    by_name = {s.name: s for s in specs}
    plans = [plan_expert_transfers(specs, el, r) for r in range(el.hybrid.world_size)]
    expert_bytes = sum(s.nbytes for s in specs)
    for r, plan in enumerate(plans):
        got = [(n, p) for n, p in plan.views] + [(n, p) for n, p, _ in plan.recvs]
        assert sorted(got) == sorted(_needs(el, specs, r).items())  # each need once
        for name, _ in plan.views:  # a view is of a tensor this rank holds
            assert by_name[name].stage == t.coords(r).pp
            assert by_name[name].expert in el.train_experts(r)
        for name, piece, src in plan.recvs:  # the source holds it, and sends it, in order
            s = by_name[name]
            assert src != r and t.coords(src).pp == s.stage and s.expert in el.train_experts(src)
            assert el.coords(src).edp == el.coords(r).edp
        received = sum(_bytes(by_name[n], p) for n, p, _ in plan.recvs)
        assert Fraction(received, expert_bytes) == el.received_fraction()
    for src, plan in enumerate(plans):  # sends mirror receives, message order included
        for dst in range(el.hybrid.world_size):
            sent = [(n, p) for n, p, d in plan.sends if d == dst]
            wanted = [(n, p) for n, p, s in plans[dst].recvs if s == src]
            assert sent == wanted


def test_volume_of_ep4_to_gen_ep2_and_to_gen_tp2():
    hl = HybridLayout(ParallelLayout(pp=1, tp=2, dp=2), pp_g=1, tp_g=2)
    # EP 4 (over tp 2 x dp 2) -> gen EP 2 inside gen TP 2: half the experts whole, a quarter
    # held, so a quarter of every expert's bytes received.
    assert ExpertLayout(hl, 8, ep=4, gen_ep=2).received_fraction() == Fraction(1, 4)
    # -> gen TP 2 (gen_ep 1): half of every expert, an eighth already held.
    assert ExpertLayout(hl, 8, ep=4, gen_ep=1).received_fraction() == Fraction(3, 8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(train=(1, 2, 2), ep=3), "ep=3 must divide the tp x dp = 4"),
    (dict(train=(1, 1, 4), ep=4, num_experts=6), "ep=4 must divide num_experts=6"),
    (dict(train=(1, 1, 4), ep=1, gen_ep=2), "gen_ep=2 needs a training ep"),
    (dict(train=(1, 1, 4), ep=4, gen_ep=3), "gen_ep=3 must divide num_experts=8"),
    (dict(train=(1, 1, 4), ep=0), "ep must be a positive int"),
    (dict(train=(1, 1, 4), ep=4, gen_ep=2), "gen_ep=2 must divide tp_g=1"),
    # tp 4 -> tp_g 2: the generation TP groups [0 2] [1 3] hold blocks 0, 0 and 1, 1.
    (dict(train=(1, 4, 1), tp_g=2, ep=2, gen_ep=2),
     r"group \[0, 2\] holds the training expert blocks \[0, 0\].*choose another gen_ep"),
])
def test_bad_sizes(kwargs, match):
    hl = HybridLayout(ParallelLayout(*kwargs.pop("train")), pp_g=1, tp_g=kwargs.pop("tp_g", 1))
    with pytest.raises(ValueError, match=match):
        ExpertLayout(hl, kwargs.pop("num_experts", 8), **kwargs)


def test_bad_specs():
    hl = HybridLayout(ParallelLayout(pp=1, tp=2, dp=2), pp_g=1, tp_g=2)
    el = ExpertLayout(hl, NUM_EXPERTS, ep=4)
    dense = ShardSpec("layers.0.qkv", (8, 8), partition_dim=0)
    with pytest.raises(ValueError, match="not an expert tensor"):
        check_expert_specs([dense], el)
    odd = ShardSpec("layers.0.experts.0.down_proj", (8, 3), partition_dim=1, expert=0)
    with pytest.raises(ValueError, match="3 units along dim 1 cannot be split over tp_g=2"):
        check_expert_specs([odd], el)
    with pytest.raises(ValueError, match="expert=99"):
        check_expert_specs([ShardSpec("x", (4, 4), partition_dim=0, expert=99)], el)
    with pytest.raises(ValueError, match="ep=1: the experts are split over tp"):
        check_expert_specs(expert_specs(1), ExpertLayout(hl, NUM_EXPERTS, ep=1))
    with pytest.raises(ValueError, match="expert=-1 must be >= 0"):
        ShardSpec("x", (4, 4), expert=-1)


def test_cli(capsys):
    assert main(["--train", "1,2,2", "--gen", "1,2", "--experts", "8", "--ep", "4",
                 "--gen-ep", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gen_ep_groups"] == [[0, 1], [2, 3]]
    assert out["gen_experts"] == [[0, 1, 4, 5], [2, 3, 6, 7]] * 2
    assert main(["--train", "1,1,4", "--gen", "1,1", "--experts", "8", "--ep", "3"]) == 2
    assert "ep=3 must divide" in capsys.readouterr().err


def test_formula_matches_brute_force_overlap():
    """received_fraction against gen shard minus held overlap, counted element by element."""
    for el in LAYOUTS[::7]:
        h, t = el.hybrid, el.hybrid.train
        layers, units = 2 * t.pp, 4 * t.tp  # an expert as 4 tp units along its partition dim
        total = layers * el.num_experts * units
        for r in range(h.world_size):
            g, c = h.gen_coords(r), t.coords(r)
            piece = el.gen_piece(r)
            need = {(layer, e, u) for layer in range(layers) for e in el.gen_experts(r)
                    for u in range(units) if (layer // 2) // h.micro_pp == g.pp_g
                    and u // (units // piece.count) == piece.index}
            held = {(layer, e, u) for layer in range(layers) for e in el.train_experts(r)
                    for u in range(units) if layer // 2 == c.pp}
            assert Fraction(len(need - held), total) == el.received_fraction(), _id(el)
