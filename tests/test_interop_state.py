"""DTensor and plain state dicts -> shard specs -> reshard: bit-exact generation shards and
Hugging Face (name, tensor) pairs against independent references; bad inputs raise ValueError
locally (4 gloo ranks, started once; layouts of world 2-4 on sub-pools)."""

import torch

from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.interop import from_state_dict, load_local_tensors
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder
from hybridflow_comm.shard_spec import QKVFusion, ShardSpec

HEADS, KV, HD, HID = 8, 4, 2, 8
QKV = QKVFusion(HEADS, KV, HD)


def _parts(seed, layers):
    """Independent full tensors, unfused (q, k, v kept apart)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        out |= {f"l{i}.q": torch.randn(HEADS * HD, HID, generator=g),
                f"l{i}.k": torch.randn(KV * HD, HID, generator=g),
                f"l{i}.v": torch.randn(KV * HD, HID, generator=g),
                f"l{i}.o": torch.randn(HID, HEADS * HD, generator=g),
                f"l{i}.norm": torch.randn(HID, generator=g),
                f"l{i}.bias": torch.randn(12, generator=g).double()}
    return out


def _hf(i):
    p = f"model.layers.{i}."
    return {f"l{i}.qkv": tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
            f"l{i}.o": (p + "self_attn.o_proj.weight",),
            f"l{i}.norm": (p + "input_layernorm.weight",), f"l{i}.bias": (p + "bias",)}


def _fused_full(parts, i):
    p = f"l{i}."
    return {p + "qkv": QKV.fuse(parts[p + "q"], parts[p + "k"], parts[p + "v"]),
            p + "o": parts[p + "o"], p + "norm": parts[p + "norm"], p + "bias": parts[p + "bias"]}


DIMS = {"qkv": 0, "o": 1, "norm": None, "bias": 0}


def _expected_hf(parts, hl, rank, layers):
    """HF name -> the generation shard, cut from the *unfused* tensors by the gen groups."""
    gtp = next(g for g in hl.gen_tp_groups() if rank in g).index(rank)
    gpp = next(g for g in hl.gen_pp_groups() if rank in g).index(rank)
    per_gen = layers // hl.pp_g
    out = {}
    for i in range(gpp * per_gen, (gpp + 1) * per_gen):
        hf = _hf(i)
        for x, name in zip("qkv", hf[f"l{i}.qkv"]):
            out[name] = parts[f"l{i}.{x}"].chunk(hl.tp_g, 0)[gtp]
        out[hf[f"l{i}.o"][0]] = parts[f"l{i}.o"].chunk(hl.tp_g, 1)[gtp]
        out[hf[f"l{i}.norm"][0]] = parts[f"l{i}.norm"]
        out[hf[f"l{i}.bias"][0]] = parts[f"l{i}.bias"].chunk(hl.tp_g, 0)[gtp]
    return out


def _check_generation(rs, expected):
    rs.to_generation()
    got = dict(rs.named_generation_weights(hf_names=True))
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, want in expected.items():
        assert torch.equal(got[name], want), name
    rs.verify()
    rs.to_training()
    return rs.last_stats.received_bytes


def check_dtensor(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hybridflow_comm.interop.dtensor import from_dtensor

    out = []
    for (pp, tp, dp), tp_g in cases:
        hl = HybridLayout(ParallelLayout(pp, tp, dp), pp_g=1, tp_g=tp_g)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parts = _parts(seed=tp * 3 + tp_g, layers=1)
        full = _fused_full(parts, 0)
        sd = {}
        for name, t in full.items():
            d = DIMS[name.split(".")[1]]
            sd[name] = distribute_tensor(t, mesh, [Replicate(), Replicate() if d is None
                                                   else Shard(d)])
        sd["l0.norm"] = full["l0.norm"]  # a plain tensor: replicated
        groups = build_hybrid_groups(hl)
        specs, local = from_dtensor(sd, groups, fusions={"l0.qkv": QKV}, hf_names=_hf(0))
        assert {s.name: s.partition_dim for s in specs} == {"l0.qkv": 0, "l0.o": 1,
                                                           "l0.norm": None, "l0.bias": 0}
        rs = Resharder(specs, groups)
        load_local_tensors(rs.buffer, local)
        out.append(_check_generation(rs, _expected_hf(parts, hl, rank, 1)))
    return out


def check_plain(rank, world, cases):
    out = []
    for (pp, tp, dp), (pp_g, tp_g) in cases:
        train = ParallelLayout(pp, tp, dp)
        hl = HybridLayout(train, pp_g=pp_g, tp_g=tp_g)
        groups = build_hybrid_groups(hl, pool=list(range(train.world_size)))
        if groups is None:
            continue
        parts = _parts(seed=pp * 7 + tp, layers=pp)
        specs, local = [], {}
        c = train.coords(rank)
        for i in range(pp):
            hf = _hf(i)
            for name, t in _fused_full(parts, i).items():
                d = DIMS[name.split(".")[1]]
                specs.append(ShardSpec(name, t.shape, dtype=t.dtype, partition_dim=d, stage=i,
                                       fusion=QKV if name.endswith("qkv") else None,
                                       hf_names=hf[name]))
                if i == c.pp:  # our own cut: tp_rank-th chunk, written out by slicing
                    n = t.shape[d] // tp if d is not None else None
                    local[name] = t if d is None else t.narrow(d, c.tp * n, n)
        specs, local = from_state_dict(local, specs, train, groups.rank)
        rs = Resharder(specs, groups)
        load_local_tensors(rs.buffer, local)
        out.append(_check_generation(rs, _expected_hf(parts, hl, rank, pp)))
    return out


def check_bad_inputs(rank, world):
    """Each error is local (no collective) and names the offending tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from hybridflow_comm.interop.dtensor import stage_specs_from_dtensor

    msgs = []
    train = ParallelLayout(1, 2, 2)
    spec = ShardSpec("w", (8, 4), partition_dim=1)

    def err(fn):
        try:
            fn()
        except (ValueError, TypeError) as exc:
            return str(exc)
        return "no error"

    msgs.append(err(lambda: from_state_dict({"w": torch.zeros(8, 4)}, [spec], train, rank)))
    msgs.append(err(lambda: from_state_dict({}, [spec], train, rank)))
    msgs.append(err(lambda: from_state_dict({"w": torch.zeros(8, 2), "x": torch.zeros(1)},
                                            [spec], train, rank)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.ones(8, 4)
    fsdp = distribute_tensor(t, mesh, [Shard(0), Replicate()])
    partial = DTensor.from_local(t, mesh, [Replicate(), Partial()], run_check=False)
    uneven = distribute_tensor(torch.ones(5, 4), mesh, [Replicate(), Shard(0)])
    good = distribute_tensor(t, mesh, [Replicate(), Shard(1)])
    msgs.append(err(lambda: stage_specs_from_dtensor({"fsdp_w": fsdp}, train, rank)))
    msgs.append(err(lambda: stage_specs_from_dtensor({"partial_w": partial}, train, rank)))
    msgs.append(err(lambda: stage_specs_from_dtensor({"uneven_w": uneven}, train, rank)))
    msgs.append(err(lambda: stage_specs_from_dtensor({"good_w": good}, ParallelLayout(1, 4, 1),
                                                     rank)))
    msgs.append(err(lambda: stage_specs_from_dtensor({"good_w": good}, train, rank,
                                                     tp_axis="model")))
    return msgs


def test_dtensor_state_dict_reshards_bit_exact(pool4):
    cases = [((1, 4, 1), 2), ((1, 4, 1), 1), ((1, 2, 2), 1)]
    reports = pool4.run(check_dtensor, cases, timeout_s=240)
    assert all(len(r) == len(cases) for r in reports)
    assert all(r[2] > 0 and r[0] > 0 for r in reports)


def test_plain_state_dict_reshards_bit_exact(pool4):
    cases = [((2, 2, 1), (1, 2)), ((2, 2, 1), (1, 1)), ((1, 2, 2), (1, 1)), ((1, 2, 1), (1, 1))]
    reports = pool4.run(check_plain, cases, timeout_s=240)
    assert [len(r) for r in reports] == [4, 4, 3, 3]


def test_bad_state_dicts_raise_value_error(pool4):
    for m in pool4.run(check_bad_inputs, timeout_s=120):
        assert "'w': local shape (8, 4) != training shard shape (8, 2)" in m[0], m[0]
        assert "no local tensor for ['w']" in m[1], m[1]
        assert "tensors ['x'] have no shard spec" in m[2], m[2]
        assert m[3].startswith("fsdp_w: placement S(0) on mesh axis 0"), m[3]
        assert m[4].startswith("partial_w: placement P"), m[4]
        assert m[5].startswith("uneven_w: dim 0 of global shape (5, 4)"), m[5]
        assert m[6].startswith("good_w: mesh TP axis 1 has size 2"), m[6]
        assert m[7].startswith("good_w: mesh axes ('dp', 'tp') have no TP axis named 'model'"), m[7]
