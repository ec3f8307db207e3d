"""Resharding on gloo ranks: bit-exact, zero-copy, and the paper's byte counts (ranks started
once for the module; layouts of world size 1-4 run on sub-pools of 4 ranks)."""

import subprocess
import sys

import pytest
import torch

from hybridflow_comm.baselines import TRANSITIONS, make_transition
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec, slot_specs, stacked_to_logical
from hybridflow_comm.transition import Transition
from tests.test_layout import all_hybrid_layouts

LAYOUTS = [h for h in all_hybrid_layouts(4)]
METHODS = tuple(TRANSITIONS)


def rich_specs(pp):
    """Every tensor kind, spread over the stages (balanced is not required here)."""
    specs = [ShardSpec("embed", (48, 8), partition_dim=0, stage=0, hf_names=("model.embed_tokens.weight",))]
    for layer in range(pp):
        p = f"layers.{layer}."
        specs += [
            ShardSpec(p + "qkv", ((48 + 2 * 24) * 1, 8), partition_dim=0, stage=layer,
                      fusion=QKVFusion(num_heads=48, num_kv_heads=24, head_dim=1),
                      hf_names=(p + "q", p + "k", p + "v")),
            ShardSpec(p + "o", (8, 48), partition_dim=1, stage=layer),
            ShardSpec(p + "gate_up", (2 * 24, 8), partition_dim=0, stage=layer, fusion=GateUpFusion()),
            ShardSpec(p + "down", (8, 24), partition_dim=1, stage=layer, dtype=torch.bfloat16),
            ShardSpec(p + "norm", (8,), stage=layer),
            ShardSpec(p + "bias", (24,), partition_dim=0, stage=layer, dtype=torch.float64),
        ]
    specs += [ShardSpec("final_norm", (8,), stage=pp - 1),
              ShardSpec("head", (48, 8), partition_dim=0, stage=pp - 1)]
    return specs


def balanced_specs(pp):
    """Partitioned tensors only, identical per stage: the paper's formulas hold exactly."""
    out = []
    for layer in range(pp):
        out += [ShardSpec(f"l{layer}.col", (24, 24), partition_dim=0, stage=layer),
                ShardSpec(f"l{layer}.row", (24, 24), partition_dim=1, stage=layer)]
    return out


def full_tensors(specs, seed):
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}


def expected_gen(full, spec, hl, rank):
    """Independent reference: cut the full tensor by the generation coordinates read off the
    generation groups."""
    gpp = next(g for g in hl.gen_pp_groups() if rank in g).index(rank)
    gtp = next(g for g in hl.gen_tp_groups() if rank in g).index(rank)
    stages_per_gen = hl.train.pp // hl.pp_g
    if spec.stage // stages_per_gen != gpp:
        return None
    if spec.partition_dim is None:
        return full
    return full.chunk(hl.tp_g, dim=spec.partition_dim)[gtp]


def expected_train(full, spec, train, rank):
    tp_rank = rank % train.tp
    pp_rank = (rank // train.tp) % train.pp
    if spec.stage != pp_rank:
        return None
    return full if spec.partition_dim is None else full.chunk(train.tp, dim=spec.partition_dim)[tp_rank]


def _hl(key):
    (pp, tp, dp), (pp_g, tp_g) = key
    return HybridLayout(ParallelLayout(pp, tp, dp), pp_g=pp_g, tp_g=tp_g)


def _key(hl):
    return ((hl.train.pp, hl.train.tp, hl.train.dp), (hl.pp_g, hl.tp_g))


def check_reshard_all(rank, world, keys, methods):
    """Every layout x method on a sub-pool; returns per-case observations for the parent."""
    report = []
    for key in keys:
        hl = _hl(key)
        pool = list(range(hl.world_size))
        groups = build_hybrid_groups(hl, pool=pool)
        for method in methods:
            for kind in ("rich", "balanced"):
                if groups is None:
                    continue
                specs = (rich_specs if kind == "rich" else balanced_specs)(hl.train.pp)
                full = full_tensors(specs, seed=1)
                rs = make_transition(method, specs, groups, bucket_bytes=1024)
                assert isinstance(rs, Transition) and rs.accounting() is None
                buf = rs.weights.buffer
                for s in specs:
                    shard = expected_train(full[s.name], s, hl.train, rank)
                    if shard is not None:
                        buf.train_view(s.name).copy_(shard)
                ptrs = {n: t.data_ptr() for n, t in buf.train_views().items()}
                storage = {d: buf.storage(d).untyped_storage().data_ptr() for d in buf.dtypes}
                for cycle in range(2):
                    stats = rs.to_generation()
                    assert rs.accounting() is stats and stats.method == method
                    gen = rs.weights.generation_params()
                    for s in specs:
                        want = expected_gen(full[s.name], s, hl, rank)
                        if want is None:
                            assert s.name not in gen, (key, s.name)
                            continue
                        got = stacked_to_logical(buf.gen_view(s.name), s)
                        assert torch.equal(got, want), (key, method, s.name, cycle)
                        assert gen[s.name].untyped_storage().data_ptr() == storage[s.dtype]
                    for n, t in buf.train_views().items():
                        assert t.data_ptr() == ptrs[n]  # training shard never moved
                    rs.weights.verify()
                    rs.to_training()
                    # Simulate an optimizer step on the training shards, then go again.
                    for s in specs:
                        full[s.name] = full[s.name] + 1
                        shard = expected_train(full[s.name], s, hl.train, rank)
                        if shard is not None:
                            buf.train_view(s.name).copy_(shard)
                report.append((key, method, kind, stats.received_bytes, stats.sent_bytes,
                               stats.redundant_bytes, stats.peak_weight_bytes, stats.version,
                               buf.gen_nbytes, buf.train_nbytes))
    return report


def _partitioned_bytes(specs):
    return sum(s.nbytes for s in specs)


def test_reshard_bit_exact_and_paper_bytes(pool4):
    keys = [_key(h) for h in LAYOUTS]
    reports = pool4.run(check_reshard_all, keys, METHODS, timeout_s=600)
    seen = 0
    for rank, report in enumerate(reports):
        for key, method, kind, recv, sent, redundant, peak, version, gen_b, train_b in report:
            seen += 1
            assert version == 2
            hl = _hl(key)
            if method == "hybridflow":
                assert redundant == 0
                assert recv == gen_b - train_b or kind == "rich"
            if kind != "balanced":
                continue
            m = _partitioned_bytes(balanced_specs(hl.train.pp))
            t, p, d = hl.train.tp, hl.train.pp, hl.train.dp
            formula = {"ds_chat": (t * p * d - 1) * m / (t * p * d),
                       "hybridflow_v": (t * p - 1) * m / (t * p),
                       "hybridflow": (t * p - hl.tp_g * hl.pp_g) * m / (hl.tp_g * hl.pp_g * t * p)}[method]
            assert recv == formula, (key, method, rank, recv, formula)
            if method != "hybridflow":
                assert peak >= m  # a whole-model copy at the peak
    assert seen == sum(h.world_size for h in LAYOUTS) * len(METHODS) * 2


def check_mismatch(rank, world):
    hl = _hl(((1, 2, 2), (1, 1)))
    groups = build_hybrid_groups(hl)
    specs = rich_specs(1)
    if rank == 2:
        specs[1] = ShardSpec(specs[1].name, (specs[1].shape[0], 10), partition_dim=0, stage=0)
    try:
        Resharder(specs, groups)
    except ValueError as exc:
        return str(exc)
    return "no error"


def check_corruption(rank, world):
    hl = _hl(((1, 4, 1), (1, 2)))
    groups = build_hybrid_groups(hl)
    specs = balanced_specs(1)
    rs = Resharder(specs, groups)
    for s in specs:
        rs.buffer.train_view(s.name).normal_()
    rs.to_generation()
    rs.verify()
    if rank == 1:
        rs.buffer.slot_view("l0.row", 0).view(-1)[3] += 1.0  # a silent partial update
    try:
        rs.verify()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def check_all_gather_views(rank, world):
    """comm.all_gather_views on the world group: row-contiguous strided views (point-to-point,
    in place) and column-strided ones (the staged fallback), against a direct reference."""
    from hybridflow_comm import comm
    group = build_hybrid_groups(_hl(((1, 4, 1), (1, 1)))).world
    count, numel, gap = 3, 5, 2
    stride = world * numel + gap  # [slot 0 | slot 1 | ... | gap] per region, like a flat buffer
    storage = torch.full((count * stride,), -1.0)

    def value(k):  # what member k holds in its slot
        return (100 * k + torch.arange(count * numel, dtype=torch.float32)).view(count, numel)

    views = [storage.as_strided((count, numel), (stride, 1), k * numel) for k in range(world)]
    views[rank].copy_(value(rank))
    ledger = comm.CommLedger()
    comm.all_gather_views(views, group, ledger, "t")
    rows_ok = all(torch.equal(v, value(k)) for k, v in enumerate(views))
    gaps = storage.view(count, stride)[:, world * numel:]
    gaps_ok = bool((gaps == -1).all())  # nothing outside the views was written
    # Column-strided views (rows not contiguous) take the staged path, same result.
    cols = torch.zeros(numel, world * count)
    tviews = [cols[:, k * count:(k + 1) * count] for k in range(world)]  # [numel, count] each
    tviews[rank].copy_(value(rank).t())
    comm.all_gather_views(tviews, group, ledger, "t")
    cols_ok = all(torch.equal(v, value(k).t()) for k, v in enumerate(tviews))
    return rows_ok, gaps_ok, cols_ok, ledger.snapshot("t")


def test_all_gather_views_in_place(pool4):
    for rows_ok, gaps_ok, cols_ok, (sent, received, calls) in pool4.run(check_all_gather_views,
                                                                         timeout_s=60):
        assert rows_ok and gaps_ok and cols_ok
        assert sent == received == 2 * 3 * 3 * 5 * 4 and calls == 2  # 2 calls x (n-1) x 15 f32


def test_all_gather_views_rejects_mismatched_views():
    from hybridflow_comm import comm
    from hybridflow_comm.groups import Group
    group = Group(ranks=(0,), rank=0, pg=None)
    with pytest.raises(ValueError, match=r"outputs for a group of 1"):
        comm.all_gather_views([torch.zeros(2), torch.zeros(2)], group, comm.CommLedger(), "t")
    pair = Group(ranks=(0, 1), rank=0, pg=None)
    with pytest.raises(ValueError, match=r"\(1, \(3,\), torch.float32\)"):
        comm.all_gather_views([torch.zeros(2), torch.zeros(3)], pair, comm.CommLedger(), "t")


def test_spec_mismatch_raises_everywhere(pool4):
    msgs = pool4.run(check_mismatch, timeout_s=60)
    for m in msgs:
        assert "shard specs differ" in m and "layers.0.qkv" in m and "rank 2" in m


def test_verify_names_corrupted_parameter_everywhere(pool4):
    msgs = pool4.run(check_corruption, timeout_s=60)
    for m in msgs:
        assert "rank 1: parameter 'l0.row' slot 0" in m


def test_single_process_world_one():
    hl = _hl(((1, 1, 1), (1, 1)))
    specs = rich_specs(1)
    rs = Resharder(specs, build_hybrid_groups(hl))
    full = full_tensors(specs, 3)
    for s in specs:
        rs.buffer.train_view(s.name).copy_(full[s.name])
    stats = rs.to_generation()
    assert stats.received_bytes == 0 and stats.calls == 0
    named = dict(rs.named_generation_weights())
    q, k, v = specs[1].fusion.split(full["layers.0.qkv"])
    assert torch.equal(named["layers.0.q"], q) and torch.equal(named["layers.0.v"], v)
    assert torch.equal(named["model.embed_tokens.weight"], full["embed"])
    with pytest.raises(RuntimeError, match="to_generation\\(\\) called in generation mode"):
        rs.to_generation()


def test_bad_arguments():
    hl = _hl(((1, 1, 1), (1, 1)))
    groups = build_hybrid_groups(hl)
    with pytest.raises(ValueError, match="method='nccl_magic'"):
        make_transition("nccl_magic", rich_specs(1), groups)
    with pytest.raises(ValueError, match="bucket_bytes=10"):
        Resharder(rich_specs(1), groups, bucket_bytes=10)
    with pytest.raises(ValueError, match="cannot be split over tp=64"):
        rich_specs(1)[0].check_layout(ParallelLayout(1, 64, 1))
    other = FlatParamBuffer(slot_specs(balanced_specs(1), hl, 0))
    with pytest.raises(ValueError, match="not built from slot_specs"):
        Resharder(rich_specs(1), groups, buffer=other)


def test_registry_builds_every_transition():
    """Every registered name builds its class, which satisfies the Transition protocol."""
    hl = _hl(((1, 1, 1), (1, 1)))
    groups = build_hybrid_groups(hl)
    assert METHODS == ("hybridflow", "hybridflow_v", "ds_chat")
    assert TRANSITIONS["hybridflow"] is Resharder
    for method, cls in TRANSITIONS.items():
        rs = make_transition(method, rich_specs(1), groups, bucket_bytes=1024)
        assert type(rs) is cls and cls.method == method
        assert isinstance(rs, Transition), method
        for name in ("to_generation", "to_training", "accounting"):
            assert callable(getattr(rs, name)), (method, name)
        assert rs.accounting() is None
        stats = rs.to_generation()
        assert rs.accounting() is stats and stats.version == rs.weights.version == 1
        assert rs.weights.mode == "generation"
        rs.to_training()
        assert rs.weights.mode == "training"
    assert not isinstance(object(), Transition)


def test_reshard_does_not_import_baselines():
    """The baselines import the resharder, never the other way round (no import circle)."""
    code = ("import sys, hybridflow_comm.reshard, hybridflow_comm.transition; "
            "sys.exit('hybridflow_comm.baselines' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow
def test_reshard_world_8_slow():
    """Every layout of 8 ranks (run with ``pytest -m slow``; CI keeps world sizes <= 4)."""
    from tests.multirank import RankPool

    layouts = [h for h in all_hybrid_layouts(8) if h.world_size == 8]
    pool = RankPool(8, timeout_s=1800)
    try:
        reports = pool.run(check_reshard_all, [_key(h) for h in layouts], METHODS, timeout_s=1800)
    finally:
        pool.close()
    for rank, report in enumerate(reports):
        for key, method, kind, recv, sent, redundant, peak, version, gen_b, train_b in report:
            hl = _hl(key)
            assert version == 2
            if method == "hybridflow":
                assert redundant == 0
            if kind == "balanced":
                m = _partitioned_bytes(balanced_specs(hl.train.pp))
                t, p = hl.train.tp, hl.train.pp
                if method == "hybridflow":
                    assert recv == (t * p - hl.tp_g * hl.pp_g) * m / (hl.tp_g * hl.pp_g * t * p)
