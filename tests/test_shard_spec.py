"""Shard specs, fused layouts and per-rank slot specs (pure)."""

import pytest
import torch

from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import (GateUpFusion, QKVFusion, ShardSpec, gen_shard, slot_specs,
                                        stacked_to_logical, train_shard)
from tests.test_layout import all_hybrid_layouts


def _heads_of(x, per, n):
    return [x[i * per:(i + 1) * per] for i in range(n)]


@pytest.mark.parametrize("heads, kv, tp", [(8, 4, 4), (8, 2, 2), (4, 4, 2), (6, 3, 3), (8, 8, 8)])
def test_qkv_shards_are_valid_smaller_tp_shards(heads, kv, tp):
    hd, hidden = 3, 5
    fusion = QKVFusion(heads, kv, hd)
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    w = fusion.fuse(q, k, v)
    assert w.shape == ((heads + 2 * kv) * hd, hidden)
    for tp_small in [d for d in range(1, tp + 1) if tp % d == 0]:
        m = tp // tp_small
        shards = w.chunk(tp, 0)
        for j in range(tp_small):
            merged = torch.cat(shards[j * m:(j + 1) * m])  # a micro-DP gather of m shards
            mq, mk, mv = fusion.split(merged)
            # Reference: the standard head split for tp_small, written with loops over heads.
            qh = _heads_of(q, hd, heads)
            kh = _heads_of(k, hd, kv)
            vh = _heads_of(v, hd, kv)
            kv_per = kv // tp_small
            q_per = heads // tp_small
            assert torch.equal(mq, torch.cat(qh[j * q_per:(j + 1) * q_per]))
            assert torch.equal(mk, torch.cat(kh[j * kv_per:(j + 1) * kv_per]))
            assert torch.equal(mv, torch.cat(vh[j * kv_per:(j + 1) * kv_per]))


def test_gate_up_shards():
    gate, up = torch.randn(12, 4), torch.randn(12, 4)
    f = GateUpFusion()
    w = f.fuse(gate, up)
    for tp in (1, 2, 3, 4, 6, 12):
        for j, shard in enumerate(w.chunk(tp, 0)):
            g, u = f.split(shard)
            n = 12 // tp
            assert torch.equal(g, gate[j * n:(j + 1) * n]) and torch.equal(u, up[j * n:(j + 1) * n])


def test_spec_validation():
    with pytest.raises(ValueError, match="partition_dim=2"):
        ShardSpec("w", (4, 4), partition_dim=2)
    with pytest.raises(ValueError, match="units along dim 1 cannot be split over tp=3"):
        ShardSpec("w", (4, 4), partition_dim=1).check_layout(ParallelLayout(1, 3, 1))
    with pytest.raises(ValueError, match="stage=2 but the layout has pp=2"):
        ShardSpec("w", (4, 4), stage=2).check_layout(ParallelLayout(2, 1, 1))
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        QKVFusion(6, 4, 2)
    with pytest.raises(ValueError, match="fused tensor must be partitioned on dim 0"):
        ShardSpec("w", (4, 4), partition_dim=1, fusion=GateUpFusion())


SPECS = [ShardSpec("col", (8, 3), partition_dim=0, stage=0), ShardSpec("row", (3, 8), partition_dim=1, stage=1),
         ShardSpec("norm", (3,), stage=1), ShardSpec("emb", (16, 3), partition_dim=0, stage=0),
         ShardSpec("head", (16, 3), partition_dim=0, stage=3)]


@pytest.mark.parametrize("hl", [h for h in all_hybrid_layouts(16) if h.train.pp in (1, 2, 4)
                                and h.train.tp in (1, 2, 4, 8)],
                         ids=lambda h: f"{h.train.pp}-{h.train.tp}-{h.train.dp}_{h.pp_g}-{h.tp_g}")
def test_slots_rebuild_generation_shards(hl):
    """Filling each slot from the owner rank's training shard gives the generation shard."""
    specs = [ShardSpec(s.name, s.shape, dtype=s.dtype, partition_dim=s.partition_dim,
                       stage=s.stage % hl.train.pp) for s in SPECS]
    full = {s.name: torch.randn(s.shape) for s in specs}
    for rank in range(hl.world_size):
        mine = {ss.name: ss for ss in slot_specs(specs, hl, rank)}
        g = hl.gen_coords(rank)
        for s in specs:
            expected = gen_shard(full[s.name], s, hl, rank)
            if expected is None:
                assert s.name not in mine
                continue
            ss = mine[s.name]
            slots = []
            for k in range(ss.num_slots):
                # The owner of slot k: the micro-DP peer on the parameter's own stage.
                micro_pp = s.stage % hl.micro_pp
                owner = hl.gen_rank(pp_g=g.pp_g, tp_g=g.tp_g, dp=g.dp,
                                    micro_dp=micro_pp * hl.micro_tp + (k if s.partition_dim is not None else 0))
                piece = train_shard(full[s.name], s, hl.train, owner)
                assert piece is not None and piece.shape == ss.slot_shape
                slots.append(piece)
            stacked = torch.stack(slots)
            assert torch.equal(stacked_to_logical(stacked, s), expected)
            own = train_shard(full[s.name], s, hl.train, rank)
            if own is None:
                assert ss.own_slot is None
            else:
                assert torch.equal(slots[ss.own_slot], own)
