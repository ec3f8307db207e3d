"""Rank functions of tests/test_weight_sync.py (run on a RankPool; importable by module path).

Every case builds its pools on a subset of the pool's ranks, syncs twice (with an in-place
"optimizer step" on the training shards in between) and compares each generation shard
bit for bit with a single-process reference cut from the full tensors.
"""

from __future__ import annotations

import torch

from hybridflow_comm.comm import CommLedger
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec, slot_specs
from hybridflow_comm.sync import LABEL, WeightSync, build_sync_group
from hybridflow_comm.sync_plan import SyncLayout


def rich_specs(pp: int, experts: int = 0) -> list[ShardSpec]:
    """Every tensor kind, units divisible by 1, 2, 3, 4, 6 and 12 (so tp_g = 3 maps too); with
    ``experts``, that many experts per layer (gate_up split on dim 0, down_proj on dim 1)."""
    specs = [ShardSpec("embed", (24, 4), partition_dim=0, stage=0, hf_names=("embed_tokens",))]
    for layer in range(pp):
        p = f"layers.{layer}."
        for e in range(experts):
            specs += [ShardSpec(p + f"experts.{e}.gate_up", (24, 4), partition_dim=0,
                                stage=layer, fusion=GateUpFusion(), expert=e,
                                dtype=torch.bfloat16),
                      ShardSpec(p + f"experts.{e}.down_proj", (4, 12), partition_dim=1,
                                stage=layer, expert=e)]
        specs += [
            ShardSpec(p + "qkv", (48, 4), partition_dim=0, stage=layer,
                      fusion=QKVFusion(num_heads=24, num_kv_heads=12, head_dim=1),
                      hf_names=(p + "q", p + "k", p + "v")),
            ShardSpec(p + "o", (4, 24), partition_dim=1, stage=layer, dtype=torch.bfloat16),
            ShardSpec(p + "gate_up", (24, 4), partition_dim=0, stage=layer, fusion=GateUpFusion(),
                      hf_names=(p + "gate", p + "up")),
            ShardSpec(p + "down", (4, 12), partition_dim=1, stage=layer),
            ShardSpec(p + "conv", (2, 12, 3), partition_dim=1, stage=layer, dtype=torch.float64),
            ShardSpec(p + "norm", (4,), stage=layer, dtype=torch.float16),
            ShardSpec(p + "bias", (12,), partition_dim=0, stage=layer),
        ]
    return specs + [ShardSpec("head", (24, 4), partition_dim=0, stage=pp - 1)]


def full_tensors(specs: list[ShardSpec], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.dtype)
            for s in specs}


def ref_train(full: torch.Tensor, spec: ShardSpec, train: ParallelLayout, i: int,
              experts: dict | None = None):
    """Independent reference: rank = dp * (pp tp) + pp_rank * tp + tp_rank.  With ``experts``
    (a case's ``{"num": E, "ep": ep, "stack": g}``) expert ``e`` is held whole by the ranks
    whose index in their stage, ``dp_rank * tp + tp_rank``, is ``e // (E / ep)`` modulo
    ``ep``, a dim-1 tensor stored as its ``g`` column pieces stacked."""
    tp_rank, pp_rank, dp_rank = i % train.tp, (i // train.tp) % train.pp, i // (train.tp * train.pp)
    if spec.stage != pp_rank:
        return None
    if spec.expert is not None and experts is not None:
        if (dp_rank * train.tp + tp_rank) % experts["ep"] != \
                spec.expert // (experts["num"] // experts["ep"]):
            return None
        g = experts.get("stack", 1)
        if spec.partition_dim in (None, 0) or g == 1:
            return full
        return torch.stack(full.chunk(g, spec.partition_dim))
    return full if spec.partition_dim is None else full.chunk(train.tp, spec.partition_dim)[tp_rank]


def ref_gen(full: torch.Tensor, spec: ShardSpec, layout: SyncLayout, j: int):
    g = layout.gen
    tp_g, pp_g = j % g.tp, (j // g.tp) % g.pp
    if spec.stage // (layout.train.pp // g.pp) != pp_g:
        return None
    return full if spec.partition_dim is None else full.chunk(g.tp, spec.partition_dim)[tp_g]


def make_layout(case: dict) -> SyncLayout:
    """The case's pools; with ``case["experts"]`` (``{"num", "ep", "stack"}``) the training
    pool's expert layout, its held down_proj stored as ``stack`` pieces (a generation TP of
    ``stack`` on the training side's own hybrid layout)."""
    train = ParallelLayout(*case["train"])
    experts = None
    if case.get("experts"):
        from hybridflow_comm.expert_layout import ExpertLayout

        x = case["experts"]
        experts = ExpertLayout(HybridLayout(train, pp_g=train.pp, tp_g=x.get("stack", 1)),
                               x["num"], ep=x["ep"])
    return SyncLayout(train, ParallelLayout(*case["gen"]), tuple(case["train_ranks"]),
                      tuple(case["gen_ranks"]), experts)


def _train_shards(specs, full, layout, rank, flat_buffer: bool, experts=None):
    i = layout.train_ranks.index(rank)
    t = layout.train
    if flat_buffer:  # the training flat buffer's own views (what a Resharder holds)
        buf = FlatParamBuffer(slot_specs(specs, HybridLayout(t, pp_g=t.pp, tp_g=t.tp), i))
        shards = buf.train_views()
    else:
        shards = {s.name: ref_train(full[s.name], s, t, i, experts).clone() for s in specs
                  if ref_train(full[s.name], s, t, i, experts) is not None}
    for s in specs:
        if s.name in shards:
            shards[s.name].copy_(ref_train(full[s.name], s, t, i, experts))
    return shards


def check_sync_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Every case: bit-exact twice, zero-copy views, bytes as planned, checksum mode."""
    report = []
    for case in cases:
        layout = make_layout(case)
        group = build_sync_group(layout)
        if group is None:
            continue
        experts = case.get("experts")
        specs = rich_specs(layout.train.pp, experts["num"] if experts else 0)
        full = full_tensors(specs, seed=7)
        train = rank in layout.train_ranks
        shards = _train_shards(specs, full, layout, rank, case.get("flat_buffer", False),
                               experts) if train else None
        ledger = CommLedger()
        ws = WeightSync(specs, layout, group, train_shards=shards, ledger=ledger,
                        bucket_bytes=case["bucket_bytes"], pack_bytes=case["pack_bytes"],
                        verify_every=case.get("verify_every", False))
        assert ws.accounting() is None
        ptrs = {n: v.data_ptr() for n, v in ws.generation_params().items()} if not train else {}
        storages = ({d: ws.buffer.storage(d).untyped_storage().data_ptr() for d in ws.buffer.dtypes}
                    if not train else {})
        for cycle in range(2):
            stats = ws.sync()
            assert ws.accounting() is stats and stats.version == cycle + 1
            if not train:
                j = layout.gen_ranks.index(rank)
                gen = ws.generation_params()
                for s in specs:
                    want = ref_gen(full[s.name], s, layout, j)
                    if want is None:
                        assert s.name not in gen, (case, s.name)
                        continue
                    got = gen[s.name]
                    assert got.dtype == want.dtype and torch.equal(got, want), (case, s.name, cycle)
                    assert got.data_ptr() == ptrs[s.name]  # the generation views never move
                    assert got.untyped_storage().data_ptr() == storages[s.dtype]
                named = dict(ws.named_generation_weights())
                for s in specs:
                    if s.fusion is not None and s.name in gen:
                        parts = s.fusion.split(ref_gen(full[s.name], s, layout, j))
                        for hf, part in zip(s.hf_names, parts):
                            assert torch.equal(named[hf], part), (case, hf)
            ws.verify()
            for s in specs:  # an optimizer step, in place on the training shards
                full[s.name] = (full[s.name].double() + 1).to(s.dtype)
                if train and s.name in shards:
                    i = layout.train_ranks.index(rank)
                    shards[s.name].copy_(ref_train(full[s.name], s, layout.train, i, experts))
        report.append({"case": case["name"], "rank": rank, "role": "train" if train else "gen",
                       "sent": stats.sent_bytes, "received": stats.received_bytes,
                       "minimum": stats.minimum_received_bytes,
                       "balanced": stats.balanced_sent_bytes, "staged": stats.staged_bytes,
                       "plan_sent": ws.plan.sent_bytes.get(rank, 0),
                       "plan_received": ws.plan.received_bytes.get(rank, 0),
                       "messages": stats.messages, "buckets": stats.buckets,
                       "chunk": ws.plan.chunk_bytes, "plan_staged": ws.plan.staged_bytes[rank],
                       "plan_messages": _messages(ws.plan, rank)})
    return report


def _messages(plan, rank: int) -> int:
    """Messages ``rank`` posts, counted from the plan's blocks (one pack per pair and bucket)."""
    packs = {(b.bucket, b.src, b.dst) for b in plan.blocks if b.packed and rank in (b.src, b.dst)}
    return len(packs) + sum(not b.packed and rank in (b.src, b.dst) for b in plan.blocks)


def check_verify_catches(rank: int, world: int, case: dict) -> list[str]:
    """Checksum mode: a corrupted generation element, then a training shard changed after the
    sync; each must raise on every rank, naming the parameter."""
    layout = make_layout(case)
    group = build_sync_group(layout)
    specs = rich_specs(layout.train.pp)
    full = full_tensors(specs, seed=3)
    train = rank in layout.train_ranks
    shards = _train_shards(specs, full, layout, rank, False) if train else None
    ws = WeightSync(specs, layout, group, train_shards=shards, bucket_bytes=1024)
    ws.sync()
    ws.verify()
    msgs = []
    if rank == layout.gen_ranks[-1]:
        ws.generation_params()["layers.0.o"].view(-1)[1] += 1
    try:
        ws.verify()
        msgs.append("no error")
    except RuntimeError as exc:
        msgs.append(str(exc))
    ws.sync()
    ws.verify()
    if rank == layout.train_ranks[0]:
        shards["layers.0.gate_up"].view(-1)[0] += 1  # a step that was never synced
    try:
        ws.verify()
        msgs.append("no error")
    except RuntimeError as exc:
        msgs.append(str(exc))
    return msgs


def check_setup_errors(rank: int, world: int, case: dict) -> list[str]:
    """Errors raise before any byte moves: layouts that do not map (no collective at all),
    then one rank's wrong training shard (every rank raises, nobody hangs)."""
    layout = make_layout(case)
    group = build_sync_group(layout)
    specs = rich_specs(layout.train.pp)
    full = full_tensors(specs, seed=5)
    train = rank in layout.train_ranks
    shards = _train_shards(specs, full, layout, rank, False) if train else None
    out = []
    ledger = CommLedger()
    bad_specs = specs + [ShardSpec("odd", (3, 4), partition_dim=0, stage=0)]
    try:
        WeightSync(bad_specs, layout, group, train_shards=shards, ledger=ledger)
    except ValueError as exc:
        out.append(str(exc))
    assert not ledger.calls, dict(ledger.calls)  # raised before any collective
    if rank == layout.train_ranks[-1]:
        shards["layers.0.o"] = shards["layers.0.o"].t()  # wrong shape on one rank only
    try:
        WeightSync(specs, layout, group, train_shards=shards, ledger=ledger)
    except ValueError as exc:
        out.append(str(exc))
    assert ledger.calls[LABEL] == 0
    return out
