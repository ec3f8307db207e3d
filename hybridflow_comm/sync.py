"""Cross-pool weight sync: the training pool's shards straight into the generation pool's flat
buffers, every training rank sending only what it owns, bucketed, point to point.

:class:`WeightSync` replays a :class:`~hybridflow_comm.sync_plan.SyncPlan` (made once, from
the specs and the two layouts, before any byte moves).  Per bucket, each rank posts all its
messages at once (``batch_isend_irecv`` through :func:`hybridflow_comm.comm.exchange_`)::

    training rank (sender)                           generation rank (receiver)
    training shard  --- contiguous box: no copy -->  generation buffer view, in place
    row-parallel box --> staging (pack) -->          staging --> strided view (unpack)
    small boxes (norms) --> one pack message per pair and bucket --> staging --> views

No rank gathers the model, nothing is broadcast: generation rank ``j`` receives exactly its
generation shard ``G_j`` once, and the training ranks share the sends (the plan's balance).

Roles come from the layout: a job rank in ``train_ranks`` passes its training shards
(``train_shards``: name -> tensor, read in place at every sync, e.g. ``buffer.train_views()``
or a model's parameters); a rank in ``gen_ranks`` gets a generation
:class:`~hybridflow_comm.flat_buffer.FlatParamBuffer` (one slot per parameter, the logical
generation shard; built here unless passed).

``python -m hybridflow_comm.sync --train 1,4,1 --gen 1,2 --gen-ranks 4 [--hf-config PATH |
--dims H,L,Q,G,F,V]`` prints a plan: bytes per rank against the minimum, and each bucket (the
model: a Hugging Face config.json, explicit sizes, or a small default Llama).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow_comm import comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import Group
from hybridflow_comm.layout import parse_sizes
from hybridflow_comm.shard_spec import ShardSpec, hf_named
from hybridflow_comm.sync_plan import (DEFAULT_DIMS, PACK_BYTES, Block, SyncLayout, SyncPlan,
                                       gen_slot_specs, llama_specs, model_shape_from_dims,
                                       model_shape_from_hf_config, plan_sync)
from hybridflow_comm.transition import BUCKET_BYTES, checksum

__all__ = ["SyncStats", "WeightSync", "build_sync_group"]

LABEL = "weight_sync"  # ledger label of the bytes a sync moves
_ALIGN = 64  # staging slices start on a cache line


@dataclass(frozen=True)
class SyncStats:
    """What one sync did on this rank.

    Attributes:
        version: weight version after the sync.
        sent_bytes / received_bytes: payload bytes through the instrumented path.
        minimum_received_bytes: this rank's generation shard (0 on a training rank).
        balanced_sent_bytes: the plan's lower bound for the busiest sender of this rank's
            stage (0 on a generation rank).
        messages: point-to-point messages this rank posted.
        buckets: rounds of messages.
        staged_bytes: bytes this rank copied through its staging buffer.
        time_s: wall time of the sync on this rank.
    """

    version: int
    sent_bytes: int
    received_bytes: int
    minimum_received_bytes: int
    balanced_sent_bytes: int
    messages: int
    buckets: int
    staged_bytes: int
    time_s: float


@dataclass(frozen=True)
class _Round:
    """This rank's part of one bucket, compiled to tensors (views of shards and staging)."""

    packs: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (staging, source box)
    sends: tuple[tuple[torch.Tensor, int], ...]  # (contiguous message, peer group rank)
    recvs: tuple[tuple[torch.Tensor, int], ...]
    unpacks: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (target box, staging)


def _pick_device(device, train_shards, gen_buffer) -> torch.device:
    """The sync's device on this rank: the one asked for, else its inputs'."""
    if device is not None:
        return torch.device(device)
    if gen_buffer is not None:
        return gen_buffer.device
    if train_shards:
        return next(iter(train_shards.values())).device
    return torch.device("cpu")


def build_sync_group(layout: SyncLayout, timeout_s: float | None = None) -> Group | None:
    """The group of both pools (job ranks ``layout.ranks``); None on a rank outside them.

    Must be called by every process of the job, in the same order (``dist.new_group``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a weight sync needs torch.distributed with both pools' ranks; "
                         "call dist.init_process_group first")
    world = dist.get_world_size()
    layout.check_world_size(world)
    ranks = layout.ranks
    if len(ranks) == world:
        pg = dist.group.WORLD
    else:
        kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        pg = dist.new_group(list(ranks), **kwargs)
    me = dist.get_rank()
    return Group(ranks, ranks.index(me), pg) if me in ranks else None


class WeightSync:
    """Training pool -> generation pool weight sync, planned once, replayed per call.

    Args:
        specs: the model's parameters (the same list on every rank of both pools).
        layout: the two pools and their layouts.
        group: this rank's :func:`build_sync_group` group.
        train_shards: on a training rank, name -> its training shard (contiguous, shape
            ``layout.train_shard_shape(spec, index)``: ``spec.shard_shape(tp)``, or a whole
            expert of its EP block) for every parameter of its stage it holds; read at each
            sync.
        gen_buffer: on a generation rank, a buffer built from ``gen_slot_specs`` (default:
            a new one on ``device``).
        bucket_bytes: most bytes a generation rank receives per bucket.
        pack_bytes: boxes under this size travel in one message per pair and bucket.
        ledger: where bytes are recorded (a new one by default).
        verify_every: run :meth:`verify` after every sync (debug setting).
        device: where this rank's tensors of the sync live (default: ``gen_buffer``'s or the
            training shards' device, else cpu); every rank of a job uses its own device of
            one kind, so each collective and message stays on one backend.

    Layouts that do not map raise ValueError before anything is sent; a rank whose own inputs
    are wrong (or whose specs differ) makes every rank raise ValueError at construction.
    """

    def __init__(self, specs: list[ShardSpec], layout: SyncLayout, group: Group, *,
                 train_shards: Mapping[str, torch.Tensor] | None = None,
                 gen_buffer: FlatParamBuffer | None = None, bucket_bytes: int = BUCKET_BYTES,
                 pack_bytes: int = PACK_BYTES, ledger: CommLedger | None = None,
                 verify_every: bool = False, device: torch.device | str | None = None) -> None:
        self.plan: SyncPlan = plan_sync(specs, layout, bucket_bytes, pack_bytes)  # raises first
        if tuple(group.ranks) != layout.ranks:
            raise ValueError(f"group ranks {list(group.ranks)} are not the pools' ranks "
                             f"{list(layout.ranks)}: build it with build_sync_group(layout)")
        self.specs = list(specs)
        self.layout = layout
        self.group = group
        self.rank = group.ranks[group.rank]
        self.role = "train" if self.rank in layout.train_ranks else "gen"
        self.ledger = ledger if ledger is not None else CommLedger()
        self.verify_every = verify_every
        self.version = 0
        self._spec = {s.name: s for s in self.specs}
        self.device = _pick_device(device, train_shards, gen_buffer)
        problem = ""
        self.buffer: FlatParamBuffer | None = None
        self._train: dict[str, torch.Tensor] = {}
        try:
            if self.role == "train":
                self._train = self._check_train_shards(train_shards, gen_buffer)
            else:
                self.buffer = self._make_gen_buffer(train_shards, gen_buffer)
        except (TypeError, ValueError) as exc:
            problem = str(exc)
        self._agree(problem)
        mine, arena = self._compile()
        self._staging = torch.empty(arena, dtype=torch.uint8, device=self.device)
        self._rounds = [self._bind(blocks) for blocks in mine]
        self._last: SyncStats | None = None

    # Inputs --------------------------------------------------------------------------------------
    def _check_train_shards(self, shards, gen_buffer) -> dict[str, torch.Tensor]:
        if gen_buffer is not None:
            raise ValueError(f"rank {self.rank} is a training rank: pass train_shards, "
                             f"not gen_buffer")
        if shards is None:
            raise ValueError(f"rank {self.rank} is a training rank: pass train_shards")
        index = self.layout.train_ranks.index(self.rank)
        c = self.layout.train.coords(index)
        out = {}
        for s in self.specs:
            want = self.layout.train_shard_shape(s, index)
            if want is None:
                continue
            t = shards.get(s.name)
            if t is None:
                raise ValueError(f"train_shards of rank {self.rank} (stage {c.pp}) lacks "
                                 f"{s.name!r}")
            if tuple(t.shape) != want or t.dtype != s.dtype or not t.is_contiguous() \
                    or t.device != self.device:
                raise ValueError(f"{s.name}: training shard of rank {self.rank} is "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device} (contiguous="
                                 f"{t.is_contiguous()}), expected contiguous {want} {s.dtype} "
                                 f"on {self.device}")
            out[s.name] = t.detach().view(-1)
        return out

    def _make_gen_buffer(self, shards, gen_buffer) -> FlatParamBuffer:
        if shards is not None:
            raise ValueError(f"rank {self.rank} is a generation rank: it takes no train_shards")
        mine = gen_slot_specs(self.specs, self.layout, self.layout.gen_ranks.index(self.rank))
        if gen_buffer is None:
            return FlatParamBuffer(mine, device=self.device)
        if gen_buffer.specs != mine:
            raise ValueError("gen_buffer was not built from gen_slot_specs(specs, layout, "
                             f"{self.layout.gen_ranks.index(self.rank)})")
        if gen_buffer.device != self.device:
            raise ValueError(f"gen_buffer is on {gen_buffer.device}, the sync on {self.device}")
        return gen_buffer

    def _agree(self, problem: str) -> None:
        """One collective before any transfer: every rank has the same specs, layout and
        bucket size, and no rank's own inputs are wrong; else ValueError on every rank."""
        lay, p = self.layout, self.plan
        desc = [("layout", lay.describe(), p.bucket_bytes, p.pack_bytes)] + [
            (s.name, s.shape, str(s.dtype), s.partition_dim, s.stage, repr(s.fusion), s.expert)
            for s in self.specs]
        digest = int.from_bytes(hashlib.sha256(repr(desc).encode()).digest()[:7], "little")
        mine = torch.tensor([digest, int(bool(problem))], dtype=torch.int64,
                            device=self.device)
        table = comm.all_gather_tensor(mine, self.group, self.ledger, "meta")  # [n, 2]
        if bool((table[:, 0] == digest).all()) and not bool(table[:, 1].any()):
            return
        reports = comm.all_gather_object((desc, problem), self.group, self.ledger, "meta")
        lines = [f"rank {r}: {prob}" for r, (_, prob) in zip(self.group.ranks, reports) if prob]
        ref_rank, (ref, _) = self.group.ranks[0], reports[0]
        for r, (d, _) in zip(self.group.ranks, reports):
            if d != ref:
                diff = next(((a, b) for a, b in zip(ref, d) if a != b), (len(ref), len(d)))
                lines.append(f"specs or layout differ: rank {ref_rank} has {diff[0]} but "
                             f"rank {r} has {diff[1]}")
                break
        raise ValueError("weight sync set-up failed:\n" + "\n".join(lines))

    # Compilation: the plan's blocks of this rank, as tensors -------------------------------------
    def _compile(self) -> tuple[list[list[tuple[int, tuple[Block, ...], int | None]]], int]:
        """Per bucket, this rank's messages as ``(peer, blocks, staging offset or None)``: the
        pack message of each peer first, then one message per other block; returns them and
        the staging arena's size (the largest bucket's, slices aligned to :data:`_ALIGN`)."""
        rounds, arena = [], 0
        for blocks in self.plan.buckets():
            packed: dict[int, list[Block]] = defaultdict(list)
            single = []
            for b in blocks:
                if self.rank not in (b.src, b.dst):
                    continue
                peer = b.dst if b.src == self.rank else b.src
                (packed[peer] if b.packed else single).append((peer, b))
            msgs, cursor = [], 0
            for peer in sorted(packed):
                boxes = sorted((b for _, b in packed[peer]), key=lambda b: -b.itemsize)
                msgs.append((peer, tuple(boxes), cursor))
                cursor += _aligned(sum(b.nbytes for b in boxes))
            for peer, b in single:
                staged = b.src_staged if b.src == self.rank else b.dst_staged
                msgs.append((peer, (b,), cursor if staged else None))
                cursor += _aligned(b.nbytes) if staged else 0
            rounds.append(msgs)
            arena = max(arena, cursor)
        return rounds, arena

    def _box(self, b: Block) -> torch.Tensor:
        """This rank's side of block ``b``, ``[rows, cols]``: a view of the training shard or
        the generation slot (contiguous unless the box is strided on this side)."""
        if b.src == self.rank:
            flat, off, stride = self._train[b.name], b.src_offset, b.src_stride
        else:
            flat = self.buffer.slot_view(b.name, 0).view(-1)
            off, stride = b.dst_offset, b.dst_stride
        if b.rows == 1 or b.cols == stride:
            return flat[off:off + b.numel].view(b.rows, b.cols)
        return flat.as_strided((b.rows, b.cols), (stride, 1), flat.storage_offset() + off)

    def _bind(self, msgs: list[tuple[int, tuple[Block, ...], int | None]]) -> _Round:
        packs, sends, recvs, unpacks = [], [], [], []
        peer_index = {r: i for i, r in enumerate(self.group.ranks)}
        for peer, boxes, off in msgs:
            sending = boxes[0].src == self.rank
            if off is None:
                tensor = self._box(boxes[0])
            else:
                tensor = self._staging[off:off + sum(b.nbytes for b in boxes)]
                pos = off
                for b in boxes:  # largest itemsize first: every slice is aligned for its dtype
                    piece = self._staging[pos:pos + b.nbytes].view(self._spec[b.name].dtype)
                    piece = piece.view(b.rows, b.cols)
                    if sending:
                        packs.append((piece, self._box(b)))
                    else:
                        unpacks.append((self._box(b), piece))
                    pos += b.nbytes
            (sends if sending else recvs).append((tensor, peer_index[peer]))
        return _Round(tuple(packs), tuple(sends), tuple(recvs), tuple(unpacks))

    # Sync ----------------------------------------------------------------------------------------
    def sync(self) -> SyncStats:
        """Move every generation shard into place; returns this rank's stats."""
        sent0, recv0, calls0 = self.ledger.snapshot(LABEL)
        t0 = time.perf_counter()
        for r in self._rounds:
            for staging, view in r.packs:
                staging.copy_(view)
            for work in comm.exchange_(list(r.sends), list(r.recvs), self.group, self.ledger,
                                       LABEL):
                work.wait()
            for view, staging in r.unpacks:
                view.copy_(staging)
        elapsed = time.perf_counter() - t0
        self.version += 1
        sent1, recv1, _ = self.ledger.snapshot(LABEL)
        p = self.plan
        self._last = SyncStats(
            version=self.version, sent_bytes=sent1 - sent0, received_bytes=recv1 - recv0,
            minimum_received_bytes=p.minimum_received_bytes.get(self.rank, 0),
            balanced_sent_bytes=p.balanced_sent_bytes.get(self.rank, 0),
            messages=sum(len(r.sends) + len(r.recvs) for r in self._rounds),
            buckets=p.num_buckets, staged_bytes=p.staged_bytes[self.rank], time_s=elapsed)
        if self.verify_every:
            self.verify()
        return self._last

    def accounting(self) -> SyncStats | None:
        """Stats of the last :meth:`sync` (None before the first)."""
        return self._last

    # Checks --------------------------------------------------------------------------------------
    def verify(self) -> None:
        """Checksum mode: every sender checksums the boxes it sent (read from its training
        shards now), every receiver the same boxes in its generation buffer; the sender's
        list (and its weight version) goes to the receiver, which compares.

        Collective over the sync group; a mismatch anywhere raises RuntimeError on every rank,
        naming the parameter, the sender and the receiver.
        """
        peer_index = {r: i for i, r in enumerate(self.group.ranks)}
        by_peer: dict[int, list[Block]] = defaultdict(list)
        for b in self.plan.blocks:
            if self.rank in (b.src, b.dst):
                by_peer[b.dst if b.src == self.rank else b.src].append(b)
        sends, recvs, expect = [], [], []
        for peer, blocks in sorted(by_peer.items()):
            sums = torch.tensor([checksum(self._box(b)) for b in blocks] + [self.version],
                                dtype=torch.int64, device=self.device)
            if self.role == "train":
                sends.append((sums, peer_index[peer]))
            else:
                recvs.append((torch.empty_like(sums), peer_index[peer]))
                expect.append((peer, blocks, sums))
        for work in comm.exchange_(sends, recvs, self.group, self.ledger, "verify"):
            work.wait()
        errors = []
        for (peer, blocks, got), (theirs, _) in zip(expect, recvs):
            if int(theirs[-1]) != int(got[-1]):
                errors.append(f"weight version {int(got[-1])} but sender rank {peer} is at "
                              f"{int(theirs[-1])}")
            for b, want, have in zip(blocks, theirs.tolist(), got.tolist()):
                if want != have:
                    errors.append(f"parameter {b.name!r} box from rank {b.src} (rows {b.rows} "
                                  f"x cols {b.cols} at dst element {b.dst_offset}) differs "
                                  f"from the sender's training shard at version {self.version}")
        bad = comm.all_reduce_max(int(bool(errors)), self.group, self.ledger, "verify",
                                  self.device)
        if bad:
            reports = comm.all_gather_object(errors[:3], self.group, self.ledger, "verify")
            lines = [f"rank {r}: {e}" for r, errs in zip(self.group.ranks, reports) for e in errs]
            raise RuntimeError("weight sync verification failed:\n" + "\n".join(lines))

    # Generation views ----------------------------------------------------------------------------
    def generation_params(self) -> dict[str, torch.Tensor]:
        """Generation rank: name -> its logical generation shard (views of the flat buffer)."""
        if self.buffer is None:
            raise ValueError(f"rank {self.rank} is a training rank: it has no generation shards")
        return {s.name: self.buffer.slot_view(s.name, 0) for s in self.buffer.specs}

    def named_generation_weights(self, hf_names: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` of the generation shards; with ``hf_names``, fused tensors split
        into their Hugging Face parts named by ``spec.hf_names`` (what ``load_weights`` takes)."""
        for name, view in self.generation_params().items():
            spec = self._spec[name]
            yield from hf_named(name, view, spec.hf_names if hf_names else (), spec.fusion)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


# CLI --------------------------------------------------------------------------------------------


def format_plan(plan: SyncPlan, model: str) -> str:
    """Per-rank bytes against the minimum, then one line per bucket (MiB)."""
    mib = 2.0 ** 20
    d = plan.describe()
    lines = [f"weight sync {d['layout']}; model {model}; bucket {plan.bucket_bytes / mib:g} MiB, "
             f"chunk {plan.chunk_bytes / mib:g} MiB, packed under {plan.pack_bytes} B; "
             f"{plan.num_buckets} buckets, {d['messages']} messages ({d['blocks']} blocks)",
             f"{'rank':>5} {'role':>6} {'sent':>10} {'balanced':>10} {'recv':>10} "
             f"{'minimum':>10} {'staged':>10}   (MiB)"]
    for r in d["ranks"]:
        lines.append(f"{r['rank']:>5} {r['role']:>6} {r['sent'] / mib:>10.3f} "
                     f"{r['balanced_sent'] / mib:>10.3f} {r['received'] / mib:>10.3f} "
                     f"{r['minimum_received'] / mib:>10.3f} {r['staged'] / mib:>10.3f}")
    lines.append(f"{'bucket':>6} {'messages':>9} {'total':>10} {'max_send':>10} "
                 f"{'min_send':>10} {'max_recv':>10}   (MiB)")
    for b in d["buckets"]:
        lines.append(f"{b['bucket']:>6} {b['messages']:>9} {b['bytes'] / mib:>10.3f} "
                     f"{b['max_send'] / mib:>10.3f} {b['min_send'] / mib:>10.3f} "
                     f"{b['max_recv'] / mib:>10.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow_comm.sync",
                                     description="Print a cross-pool weight sync plan.")
    parser.add_argument("--train", required=True, help="PP,TP,DP of the training pool")
    parser.add_argument("--gen", required=True, help="PP_G,TP_G of the generation pool")
    parser.add_argument("--gen-ranks", type=int, required=True, help="ranks of the generation "
                        "pool (a multiple of PP_G*TP_G; dp_g = gen-ranks / (PP_G*TP_G))")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hf-config", default=None, metavar="PATH",
                       help="the model's Hugging Face config.json, or a folder holding one")
    model.add_argument("--dims", default=None, metavar="H,L,Q,G,F,V",
                       help="hidden, layers, heads, kv heads, ffn, vocab (bf16, tied); "
                            f"default {DEFAULT_DIMS}")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_BYTES / 2**20)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        train = parse_sizes(args.train, ("pp", "tp", "dp"))
        gen = parse_sizes(args.gen, ("pp_g", "tp_g"))
        layout = SyncLayout.side_by_side(train, gen, args.gen_ranks)
        shape = (model_shape_from_hf_config(args.hf_config) if args.hf_config else
                 model_shape_from_dims(args.dims or DEFAULT_DIMS))
        specs = llama_specs(shape, layout.train.pp)
        plan = plan_sync(specs, layout, int(args.bucket_mb * 2**20))
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.hf_config or f"dims {args.dims or DEFAULT_DIMS}"
    print(json.dumps(plan.describe()) if args.json else format_plan(plan, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
