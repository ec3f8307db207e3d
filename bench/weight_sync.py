"""Cross-pool weight sync (training pool -> generation pool) against its baselines, in one run.

    python bench/weight_sync.py --shape tiny [--train 1,2,1 --gen 1,2 --gen-ranks 2]
                                [--repeat 5] [--bucket-mb 32] [--json PATH]

Starts ``|A| + |B|`` gloo ranks (training pool first), builds a Llama-shaped model
(``bench/shapes.py``'s ``--shape``, its :meth:`~bench.shapes.BenchShape.model_shape`;
``llama-1b`` needs 8 ranks and ~14 GB of RAM, slow) and times, interleaved, after one warm-up (slowest rank, median over ``--repeat``):

* ``weight_sync``: :class:`hybridflow_comm.sync.WeightSync`, every training rank sends what it
  owns, point to point, into the generation buffers.
* ``gather_broadcast`` (what most frameworks do): per bucket of whole tensors, the training
  ranks of DP replica 0 send their shards to training rank 0 (p2p), which broadcasts the bucket
  to every generation rank; each generation rank cuts its shard out of the full tensors.
* ``per_tensor_broadcast``: the same, one tensor at a time (gather, broadcast, cut).
* ``raw_p2p``: the plan's bytes, one contiguous scratch-to-scratch message per (sender,
  receiver) pair and bucket: the practical limit of moving the minimum bytes.

Every method but ``raw_p2p`` fills the same generation buffers, which must end up identical
(checked by checksum from zeroed buffers).  JSON: ``ratio_vs_gather_broadcast`` and
``ratio_vs_raw`` (our time / theirs), ``bytes_vs_minimum`` (largest received / generation
shard over the generation ranks), ``send_vs_balanced`` (largest sent / the plan's bound).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ranks import launch, max_over_ranks  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.shapes import add_shape_argument, get_shape  # noqa: E402
from hybridflow_comm import _C, comm  # noqa: E402
from hybridflow_comm.comm import CommLedger  # noqa: E402
from hybridflow_comm.flat_buffer import FlatParamBuffer  # noqa: E402
from hybridflow_comm.groups import Group  # noqa: E402
from hybridflow_comm.layout import HybridLayout, parse_sizes  # noqa: E402
from hybridflow_comm.shard_spec import ShardSpec, slot_specs  # noqa: E402
from hybridflow_comm.strided import logical_from_stacked  # noqa: E402
from hybridflow_comm.sync import LABEL, WeightSync, build_sync_group  # noqa: E402
from hybridflow_comm.sync_plan import SyncLayout, check_sync_specs, llama_specs  # noqa: E402

# Default pools per shape: (train pp,tp,dp), (gen pp_g,tp_g), gen ranks.
POOLS = {"tiny": ((1, 2, 1), (1, 2), 2), "small": ((1, 2, 1), (1, 2), 2),
         "llama-1b": ((1, 4, 1), (1, 2), 4)}
SLOW_SHAPES = ("llama-1b",)


class GatherBroadcast:
    """The baselines: gather to training rank 0, broadcast whole tensors, cut the shards.

    Streams buckets of whole tensors (``[tp, *shard]`` stacked per partitioned tensor, the
    tensor itself when replicated) through one reusable scratch of ``bucket_bytes`` (or the
    largest tensor) on rank 0 and every generation rank, as bucketed broadcasts do in the
    frameworks: no rank holds the whole model twice.
    """

    def __init__(self, specs: list[ShardSpec], layout: SyncLayout, *, world: Group,
                 bcast: Group | None, train_shards: dict | None, gen: FlatParamBuffer | None,
                 bucket_bytes: int, ledger: CommLedger) -> None:
        self.specs, self.layout, self.world, self.bcast = specs, layout, world, bcast
        self.gen, self.ledger, self.bucket_bytes = gen, ledger, bucket_bytes
        self.rank = world.ranks[world.rank]
        self.root = layout.train_ranks[0]
        self.train_shards = train_shards
        t = layout.train
        # Senders of each tensor's pieces: DP replica 0's rank of (stage, tp piece).
        self.senders: dict[str, list[int]] = {}
        for s in specs:
            pieces = t.tp if s.partition_dim is not None else 1
            self.senders[s.name] = [
                next(r for i, r in enumerate(layout.train_ranks)
                     if t.coords(i).dp == 0 and t.coords(i).pp == s.stage and t.coords(i).tp == k)
                for k in range(pieces)]
        self.mine = {s.name for s in gen.specs} if gen is not None else set()
        biggest = max(s.nbytes for s in specs)
        self.scratch = (torch.empty(max(bucket_bytes, biggest), dtype=torch.uint8)
                        if bcast is not None else None)

    def _stacked(self, spec: ShardSpec, offset: int) -> torch.Tensor:
        """``[pieces, *shard]`` view of the scratch at byte ``offset``."""
        pieces = len(self.senders[spec.name])
        raw = self.scratch[offset:offset + spec.nbytes].view(spec.dtype)
        return raw.view(pieces, *spec.shard_shape(self.layout.train.tp))

    def _bucket(self, bucket: list[ShardSpec]) -> None:
        """Gather ``bucket``'s tensors into rank 0's scratch, broadcast it, cut the shards."""
        offsets, total = [], 0
        for s in bucket:
            offsets.append(total)
            total += s.nbytes
        sends, recvs = [], []
        for s, off in zip(bucket, offsets):
            for piece, src in enumerate(self.senders[s.name]):
                if src == self.rank == self.root:
                    self._stacked(s, off)[piece].copy_(self.train_shards[s.name])
                elif src == self.rank:
                    sends.append((self.train_shards[s.name], self.world.ranks.index(self.root)))
                elif self.rank == self.root:
                    recvs.append((self._stacked(s, off)[piece], self.world.ranks.index(src)))
        for work in comm.exchange_(sends, recvs, self.world, self.ledger, LABEL):
            work.wait()
        if self.bcast is None:
            return
        comm.broadcast_(self.scratch[:total], 0, self.bcast, self.ledger, LABEL)
        if self.gen is not None:
            for s, off in zip(bucket, offsets):
                if s.name in self.mine:
                    self._cut(s, self._stacked(s, off))

    def _cut(self, spec: ShardSpec, stacked: torch.Tensor) -> None:
        """Generation rank: its shard of ``spec`` out of the whole (assembled) tensor."""
        g = self.layout.gen.coords(self.layout.gen_ranks.index(self.rank))
        if spec.partition_dim is None:
            self.gen.slot_view(spec.name, 0).copy_(stacked[0])
            return
        whole = logical_from_stacked(stacked, spec.partition_dim)
        self.gen.slot_view(spec.name, 0).copy_(
            whole.chunk(self.layout.gen.tp, dim=spec.partition_dim)[g.tp])

    def bucketed(self) -> None:
        """Buckets of whole tensors up to ``bucket_bytes`` (a larger tensor goes alone)."""
        bucket, filled = [], 0
        for s in self.specs + [None]:
            if s is None or (bucket and filled + s.nbytes > self.bucket_bytes):
                self._bucket(bucket)
                bucket, filled = [], 0
            if s is not None:
                bucket.append(s)
                filled += s.nbytes

    def per_tensor(self) -> None:
        """One gather and one broadcast per tensor, each cut as soon as it arrives."""
        for s in self.specs:
            self._bucket([s])


class RawP2P:
    """The plan's bytes per bucket, one contiguous message per (sender, receiver) pair."""

    def __init__(self, ws: WeightSync, ledger: CommLedger) -> None:
        self.ws, self.ledger = ws, ledger
        self.rounds = []
        index = {r: i for i, r in enumerate(ws.group.ranks)}
        biggest_send, biggest_recv = 0, 0
        for blocks in ws.plan.buckets():
            pairs: dict[tuple[int, int], int] = defaultdict(int)
            for b in blocks:
                pairs[(b.src, b.dst)] += b.nbytes
            sends = [(n, index[d]) for (s, d), n in pairs.items() if s == ws.rank]
            recvs = [(n, index[s]) for (s, d), n in pairs.items() if d == ws.rank]
            biggest_send = max([biggest_send] + [n for n, _ in sends])
            biggest_recv = max(biggest_recv, sum(n for n, _ in recvs))
            self.rounds.append((sends, recvs))
        self.send_buf = torch.ones(biggest_send, dtype=torch.uint8)
        self.recv_buf = torch.empty(biggest_recv, dtype=torch.uint8)

    def __call__(self) -> None:
        for sends, recvs in self.rounds:
            out, offset = [], 0
            for n, peer in recvs:
                out.append((self.recv_buf[offset:offset + n], peer))
                offset += n
            works = comm.exchange_([(self.send_buf[:n], p) for n, p in sends], out,
                                   self.ws.group, self.ledger, LABEL)
            for work in works:
                work.wait()


def _train_shards(specs: list[ShardSpec], layout: SyncLayout,
                  index: int) -> dict[str, torch.Tensor]:
    """The views of a training flat buffer, filled with seeded data (DP replicas agree)."""
    t = layout.train
    hl = HybridLayout(t, pp_g=t.pp, tp_g=t.tp)  # one slot per parameter: the training shard
    views = FlatParamBuffer(slot_specs(specs, hl, index)).train_views()  # views keep the storage
    c = t.coords(index)
    parted = {s.name: s.partition_dim is not None for s in specs}
    for name, view in views.items():
        piece = c.tp if parted[name] else 0
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{piece}".encode()))
        view.copy_(torch.randn(view.shape, generator=gen))
    return views


def _gen_checksum(buf: FlatParamBuffer | None) -> int:
    return 0 if buf is None else sum(_C.checksum(buf.byte_storage(d)) for d in buf.dtypes) % 2**61


def rank_main(rank: int, world: int, cfg: dict) -> dict:
    """One run on every rank (also callable from a test's rank pool); rank 0's result counts."""
    layout = SyncLayout.side_by_side(tuple(cfg["train"]), tuple(cfg["gen"]), cfg["gen_ranks"])
    group = build_sync_group(layout)
    specs = llama_specs(get_shape(cfg["shape"]).model_shape(), layout.train.pp)
    bucket = int(cfg["bucket_mb"] * 2**20)
    train = rank in layout.train_ranks
    shards = _train_shards(specs, layout, layout.train_ranks.index(rank)) if train else None
    ledger = CommLedger()
    ws = WeightSync(specs, layout, group, train_shards=shards, bucket_bytes=bucket, ledger=ledger)
    members = (layout.train_ranks[0],) + layout.gen_ranks
    pg = dist.new_group(list(members))  # every rank calls new_group
    bcast = Group(members, members.index(rank), pg) if rank in members else None
    base = GatherBroadcast(specs, layout, world=group, bcast=bcast, train_shards=shards,
                           gen=ws.buffer, bucket_bytes=bucket, ledger=ledger)
    methods = {"weight_sync": ws.sync, "gather_broadcast": base.bucketed,
               "per_tensor_broadcast": base.per_tensor, "raw_p2p": RawP2P(ws, ledger)}
    out, reference = {"methods": {}}, None
    for name, fn in methods.items():  # warm-up, from zeroed generation buffers: bytes, checks
        if ws.buffer is not None:
            for d in ws.buffer.dtypes:
                ws.buffer.byte_storage(d).zero_()
        sent0, recv0, _ = ledger.snapshot(LABEL)
        fn()
        sent1, recv1, _ = ledger.snapshot(LABEL)
        sums = _gen_checksum(ws.buffer)
        reference = sums if name == "weight_sync" else reference
        differs = max_over_ranks(float(sums != reference))
        out["methods"][name] = {"max_received_bytes": max_over_ranks(recv1 - recv0),
                                "max_sent_bytes": max_over_ranks(sent1 - sent0),
                                "matches_weight_sync": None if name == "raw_p2p" else differs == 0}
    ws.sync()
    t0 = time.perf_counter()
    ws.verify()
    verify_s = max_over_ranks(time.perf_counter() - t0)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(cfg["repeat"]):
        for name, fn in methods.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(max_over_ranks(time.perf_counter() - t0))
    for name in methods:
        out["methods"][name]["time_s"] = statistics.median(times[name])
    stats = ws.sync()
    recv_ratio = stats.received_bytes / stats.minimum_received_bytes if not train else 0.0
    send_ratio = stats.sent_bytes / stats.balanced_sent_bytes if train else 0.0
    m = out["methods"]
    ours = m["weight_sync"]["time_s"]
    out.update({"ratio_vs_gather_broadcast": ours / m["gather_broadcast"]["time_s"],
                "ratio_vs_per_tensor_broadcast": ours / m["per_tensor_broadcast"]["time_s"],
                "ratio_vs_raw": ours / m["raw_p2p"]["time_s"],
                "bytes_vs_minimum": max_over_ranks(recv_ratio),
                "send_vs_balanced": max_over_ranks(send_ratio),
                "verify_time_s": verify_s,
                "model_bytes": sum(s.nbytes for s in specs), "buckets": ws.plan.num_buckets,
                "messages": len(ws.plan.blocks)})
    return out


def sync_layout(shape: str, train: tuple[int, int, int] | None = None,
                gen: tuple[int, int] | None = None, gen_ranks: int | None = None
                ) -> SyncLayout:
    """The pools of a run at ``shape``: the sizes given, :data:`POOLS`' for the others;
    ValueError unless the shape's model splits over both (before any rank starts)."""
    model = get_shape(shape).model_shape()  # ValueError naming the shapes
    if shape not in POOLS:
        raise ValueError(f"shape={shape!r} has no default pools in bench/weight_sync.py POOLS")
    d_train, d_gen, d_ranks = POOLS[shape]
    layout = SyncLayout.side_by_side(tuple(train or d_train), tuple(gen or d_gen),
                                     gen_ranks or d_ranks)
    check_sync_specs(llama_specs(model, layout.train.pp), layout)
    return layout


def run(shape: str, train: tuple[int, int, int] | None = None, gen: tuple[int, int] | None = None,
        gen_ranks: int | None = None, repeat: int = 5, bucket_mb: float = 32) -> dict:
    """Run the benchmark on fresh ranks; returns the JSON-ready result."""
    layout = sync_layout(shape, train, gen, gen_ranks)
    t, g = layout.train, layout.gen
    cfg = {"shape": shape, "train": [t.pp, t.tp, t.dp], "gen": [g.pp, g.tp],
           "gen_ranks": len(layout.gen_ranks), "repeat": repeat, "bucket_mb": bucket_mb,
           "nproc": len(layout.ranks)}
    return {"config": cfg, **launch(rank_main, cfg["nproc"], cfg, timeout_s=600)}


def print_table(result: dict) -> None:
    c = result["config"]
    print(f"{c['shape']} ({result['model_bytes'] / 2**20:.1f} MiB): train {c['train']} -> gen "
          f"{c['gen']} x {c['gen_ranks']} ranks; {result['buckets']} buckets, "
          f"{result['messages']} messages")
    print(f"{'method':<22}{'time_s':>10}{'max recv MiB':>14}{'max sent MiB':>14}{'same':>6}")
    for name, m in result["methods"].items():
        same = "-" if m["matches_weight_sync"] is None else str(m["matches_weight_sync"])
        print(f"{name:<22}{m['time_s']:>10.4f}{m['max_received_bytes'] / 2**20:>14.2f}"
              f"{m['max_sent_bytes'] / 2**20:>14.2f}{same:>6}")
    print(f"ours / gather_broadcast {result['ratio_vs_gather_broadcast']:.3f}, / per-tensor "
          f"{result['ratio_vs_per_tensor_broadcast']:.3f}, / raw {result['ratio_vs_raw']:.3f}; "
          f"bytes vs minimum {result['bytes_vs_minimum']:.3f}, send vs balanced "
          f"{result['send_vs_balanced']:.3f}; verify {result['verify_time_s']:.4f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(p, default="tiny")
    p.add_argument("--train", default=None, help="PP,TP,DP (default: per shape)")
    p.add_argument("--gen", default=None, help="PP_G,TP_G (default: per shape)")
    p.add_argument("--gen-ranks", type=int, default=None)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        train = parse_sizes(a.train, ("pp", "tp", "dp")) if a.train else None
        gen = parse_sizes(a.gen, ("pp_g", "tp_g")) if a.gen else None
        result = run(a.shape, train, gen, a.gen_ranks, a.repeat, a.bucket_mb)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(result)
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
