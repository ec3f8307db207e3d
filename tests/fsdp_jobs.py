"""Rank-side jobs of tests/test_interop_fsdp.py: a model-like state dict sharded by real
``fully_shard`` (1-D, and over ``parallelize_module`` TP for 2-D) or ``distribute_tensor``,
resharded by ``from_fsdp`` and checked against independent references.

Every tensor has an *ids twin*: the same construction with float64 element ids, so the bytes a
rank must receive are counted by brute force (ids of its generation shard not among the ids of
its FSDP shard), independently of the plan's box maths.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow_comm.interop.fsdp import from_fsdp
from hybridflow_comm.interop.fsdp_plan import ConcatFusion
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion
from hybridflow_comm.transition import Transition

HEADS, KV, HD, HID, FFN, VOCAB = 8, 4, 2, 8, 12, 32
QKV = QKVFusion(HEADS, KV, HD)
QKV_CAT = ConcatFusion.qkv(HEADS, KV, HD)
GU_CAT = ConcatFusion.gate_up(FFN)
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64

# name -> (shape, dtype, generation dim, fusion); the module child that holds it in TOY_CHILD
TOY = {
    "embed": ((VOCAB, HID), F32, 0, None),
    "l0.qkv": (((HEADS // KV + 2) * HD * KV, HID), F32, 0, QKV),
    "l0.qkv_cat": (((HEADS + 2 * KV) * HD, HID), F32, 0, QKV_CAT),
    "l0.o": ((HID, HEADS * HD), F32, 1, None),
    "l0.gate_up": ((2 * FFN, HID), BF16, 0, GateUpFusion()),
    "l0.gate_up_cat": ((2 * FFN, HID), BF16, 0, GU_CAT),
    "l0.down": ((HID, FFN), BF16, 1, None),
    "l0.norm": ((HID,), F64, None, None),
    "l0.bias": ((FFN,), F64, 0, None),
    "head": ((VOCAB, HID), F32, 0, None),
    "big": ((256, 64), F32, 1, None),  # spans whole pages: to_training() releases some
}
TP_PLAN = {"l0.qkv": "col", "l0.o": "row", "l0.gate_up": "col", "l0.down": "row",
           "head": "col"}  # 2-D: the tensors torch TP shards (parallelize_module)
TP_DIMS = {n: v[2] for n, v in TOY.items()} | {"rope": None}
FUSIONS = {n: v[3] for n, v in TOY.items() if v[3] is not None}
HF = {"l0.qkv": ("q", "k", "v"), "l0.qkv_cat": ("qc", "kc", "vc"), "l0.gate_up": ("g", "u"),
      "l0.gate_up_cat": ("gc", "uc"), "l0.norm": ("model.norm.weight",)}


def toy_full(seed: int, ids: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors (the same on every rank); ``ids``: float64 element ids, unique overall."""
    g = torch.Generator().manual_seed(seed)
    out, start = {}, 0
    for name, (shape, dtype, _, _) in TOY.items():
        n = torch.Size(shape).numel()
        if ids:
            out[name] = torch.arange(start, start + n, dtype=F64).view(shape)
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        start += n
    out["rope"] = torch.arange(start, start + 4, dtype=F64) if ids else torch.randn(4, generator=g)
    return out


def _key(name: str) -> str:
    return name.replace(".", "_")


class _Toy(nn.Module):
    """One child per dtype (FSDP2 all-gathers one dtype per group) plus TP'd Linears."""

    def __init__(self, full: dict[str, torch.Tensor], tp_names: set[str]) -> None:
        super().__init__()
        self.plain = nn.ModuleDict()
        self.linears = nn.ModuleDict()
        groups: dict[str, nn.ParameterDict] = {}
        for name, t in full.items():
            if name == "rope":
                continue
            if name in tp_names:
                lin = nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
                lin.weight.data.copy_(t)
                self.linears[_key(name)] = lin
            else:
                pd = groups.setdefault("p_" + str(t.dtype).split(".")[1], nn.ParameterDict())
                pd[_key(name)] = nn.Parameter(t.clone())
        for k, pd in groups.items():
            self.plain[k] = pd

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for pd in self.plain.values():
            out |= {k: p for k, p in pd.items()}
        out |= {k: lin.weight for k, lin in self.linears.items()}
        return {name: out[_key(name)] for name in TOY}


def shard(full: dict[str, torch.Tensor], mesh, how: str) -> dict[str, torch.Tensor]:
    """The state dict a training job would hand over (parameters themselves).

    how: ``"fsdp"`` fully_shard on a 1-D mesh; ``"fsdp_tp"`` parallelize_module over ``tp``
    then fully_shard over ``dp`` (FSDP2 over TP: _StridedShard, sub-mesh DTensors);
    ``"dtensor"`` distribute_tensor ``[Shard(0), Shard(d) | Replicate()]`` on the 2-D mesh;
    ``"hsdp"`` distribute_tensor ``[Replicate(), Shard(0)]`` on a ``(rep, dp)`` mesh.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if how in ("fsdp", "fsdp_tp"):
        tp_names = set(TP_PLAN) if how == "fsdp_tp" else set()
        model = _Toy(full, tp_names)
        if tp_names:
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)
            plan = {_key(n): ColwiseParallel() if k == "col" else RowwiseParallel()
                    for n, k in TP_PLAN.items()}
            parallelize_module(model.linears, mesh["tp"], plan)
        dp_mesh = mesh["dp"] if how == "fsdp_tp" else mesh
        for child in list(model.plain.values()) + list(model.linears.values()):
            fully_shard(child, mesh=dp_mesh)
        out = dict(model.named_tensors())
    elif how == "dtensor":
        out = {}
        for name, t in full.items():
            if name == "rope":
                continue
            d = TP_DIMS[name] if name in TP_PLAN else None
            out[name] = distribute_tensor(t, mesh, [Shard(0), Replicate() if d is None
                                                    else Shard(d)])
    elif how == "hsdp":
        out = {n: distribute_tensor(t, mesh, [Replicate(), Shard(0)])
               for n, t in full.items() if n != "rope"}
    else:
        raise ValueError(how)
    out["rope"] = full["rope"].clone()  # a plain tensor: replicated
    return out


def ref_gen(full: torch.Tensor, name: str, tp_g: int, t: int) -> torch.Tensor:
    """Independent reference: the generation shard cut from the full tensor."""
    dim, fusion = TP_DIMS[name], FUSIONS.get(name)
    if dim is None:
        return full
    if isinstance(fusion, ConcatFusion):
        parts = full.split(list(fusion.part_rows), dim=0)
        return torch.cat([p.chunk(tp_g, 0)[t] for p in parts])
    return full.chunk(tp_g, dim)[t]


def ref_hf(full: dict[str, torch.Tensor], tp_g: int, t: int) -> dict[str, torch.Tensor]:
    """HF name -> tensor, split from the unfused pieces (q, k, v / gate, up) independently."""
    out = {}
    for name in TP_DIMS:
        shard_ = ref_gen(full[name], name, tp_g, t)
        if name == "l0.qkv":  # per query group: [q(g) | k(g) | v(g)] for each group
            grouped = shard_.view(-1, (HEADS // KV + 2) * HD, HID)
            q, k, v = grouped.split([HEADS // KV * HD, HD, HD], dim=1)
            parts = [x.reshape(-1, HID) for x in (q, k, v)]
        elif name == "l0.gate_up":
            parts = [shard_[0::2], shard_[1::2]]
        elif name in ("l0.qkv_cat", "l0.gate_up_cat"):
            rows = QKV_CAT.part_rows if name == "l0.qkv_cat" else GU_CAT.part_rows
            parts = list(shard_.split([r // tp_g for r in rows]))
        else:
            parts = [shard_]
        out |= dict(zip(HF.get(name, (name,)), parts))
    return out


def _local(v: torch.Tensor) -> torch.Tensor:
    return v.to_local() if hasattr(v, "to_local") else v


def brute_force_min_bytes(ids_sd: dict, ids_full: dict, tp_g: int, t: int, stage_of,
                          stage: int) -> int:
    """Bytes of this rank's generation shard whose ids are not in its FSDP shard."""
    total = 0
    for name, v in ids_sd.items():
        if stage_of(name) != stage:
            continue
        need = ref_gen(ids_full[name], name, tp_g, t).reshape(-1)
        held = _local(v).reshape(-1)
        missing = int((~torch.isin(need, held)).sum())
        total += missing * (TOY[name][1].itemsize if name in TOY else 4)
    return total


def check_reshard(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Each case: (mesh shape, mesh names, how, gen, tp_axis, pp_g stage split or None)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for mesh_shape, names, how, gen, tp_axis, split_stages in cases:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        full, ids_full = toy_full(seed=len(out)), toy_full(0, ids=True)
        sd, ids_sd = shard(full, mesh, how), shard(ids_full, mesh, how)
        stage_of = (lambda n: int(n.startswith("l0.")) if split_stages else 0)
        kwargs = dict(tp_axis=tp_axis, fusions=FUSIONS, hf_names=HF,
                      gen_stages=stage_of if split_stages else None)
        tp_dims = TP_DIMS if how != "fsdp_tp" else {n: d for n, d in TP_DIMS.items()
                                                    if n not in TP_PLAN}
        tr = from_fsdp(sd, gen, tp_dims=tp_dims, **kwargs)
        assert isinstance(tr, Transition) and tr.accounting() is None
        before = {n: _local(v).clone() for n, v in sd.items()}
        ptrs = {n: _local(v).data_ptr() for n, v in sd.items()}
        stage, t = tr.placement.coord(rank)
        report = {"case": (mesh_shape, how, str(gen)), "coord": (stage, t)}
        for step in range(2):
            stats = tr.to_generation()
            want = {k: v for k, v in ref_hf(full, tr.placement.tp_g, t).items()
                    if stage_of(_hf_owner(k)) == stage}
            got = dict(tr.named_generation_weights())
            assert sorted(got) == sorted(want), (sorted(got), sorted(want))
            for k, w in want.items():
                assert got[k].dtype == w.dtype and torch.equal(got[k], w), (report, k)
            released = tr.to_training()
            for n, v in sd.items():  # the FSDP shards: same values, same storage
                assert torch.equal(_local(v), before[n]) and _local(v).data_ptr() == ptrs[n], n
            if step == 0:  # an optimizer step in place; the next transition must see it
                with torch.no_grad():
                    for n, v in sd.items():
                        _local(v).add_(1)
                        full[n] = full[n] + 1
                        before[n] = _local(v).clone()
        report |= {"received": stats.received_bytes, "sent": stats.sent_bytes,
                   "minimum": tr.minimum_received_bytes(), "version": tr.version,
                   "brute": brute_force_min_bytes(ids_sd, ids_full, tr.placement.tp_g, t,
                                                  stage_of, stage),
                   "released": released, "calls": stats.calls,
                   "tp_groups": tr.placement.tp_groups()}
        out.append(report)
    return out


def _hf_owner(hf: str) -> str:
    for name, names in HF.items():
        if hf in names:
            return name
    return hf


def check_bad_inputs(rank: int, world: int) -> list[str]:
    """Each bad input raises ValueError on this rank before any collective; a good transition
    afterwards proves no rank was left inside one."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    half = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp",))
    ok = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    cases = [
        ({"uneven_w": distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])}, (1, 1), {}),
        ({"partial_w": DTensor.from_local(torch.ones(2, 4), mesh, [Partial()],
                                          run_check=False)}, (1, 1), {}),
        ({"half_w": distribute_tensor(torch.ones(8, 4), half, [Shard(0)])}, (1, 1), {}),
        ({"qkv_w": distribute_tensor(torch.ones(24, 4), mesh, [Shard(0)])}, (1, 4),
         {"fusions": {"qkv_w": QKVFusion(8, 2, 2)}}),
        ({"ok_w": ok}, (1, 3), {}),
        ({"dim1_w": distribute_tensor(torch.ones(8, 4), mesh, [Shard(1)])}, (1, 1), {}),
        ({"ok_w": ok, "other_mesh_w": distribute_tensor(torch.ones(8, 4), mesh2,
                                                       [Shard(0), Shard(0)])}, (1, 1), {}),
        ({"ok_w": ok}, (2, 1), {}),
        ({"nodim_w": ok}, (1, 2), {"tp_dims": {}}),
        ({"ok_w": ok}, (1, 2), {"tp_dims": {"ok_w": 0}, "fusions": {"missing": GateUpFusion()}}),
    ]
    msgs = []
    for sd, gen, kw in cases:
        kw = {"tp_dims": {n: 0 for n in sd}} | kw
        try:
            from_fsdp(sd, gen, **kw)
            msgs.append("no error")
        except ValueError as exc:
            msgs.append(str(exc))
    # Ranks that disagree: caught by the digest exchange, on every rank.
    try:
        from_fsdp({"ok_w": ok}, (1, 2), tp_dims={"ok_w": 0 if rank else 1})
        msgs.append("no error")
    except ValueError as exc:
        msgs.append(str(exc))
    tr = from_fsdp({"ok_w": ok}, (1, 2), tp_dims={"ok_w": 0})
    tr.to_generation()
    assert torch.equal(tr.generation_params()["ok_w"], torch.ones(4, 4))
    return msgs
