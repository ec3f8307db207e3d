"""Cross-pool weight sync, the plan: which training rank sends which box of which parameter to
which generation rank, in which bucket.  Pure layout maths: no process, no process group.

Two disjoint pools of ranks, each with its own layout (both :class:`ParallelLayout`, ranks
ordered tp fastest, then pp, then dp)::

    training pool A, pp x tp x dp                  generation pool B, pp_g x tp_g x dp_g
      rank A[i] holds piece (pp, tp) of every         rank B[j] needs piece (pp_g, tp_g): the
      parameter of its stage; the dp replicas          parameters of generation stage pp_g cut
      hold identical copies                            tp_g ways; each of the dp_g replicas
                                                       needs its own copy

Stages: ``pp_g`` must divide ``pp``; training stage ``s`` lands on generation stage
``s // (pp / pp_g)``.  ``tp_g`` is free (it need not divide ``tp`` nor the reverse) as long as
it divides the units of every partitioned parameter (heads, rows, fusion units).

Geometry.  A parameter partitioned on dim ``d`` is seen as a matrix ``[R, L]`` with
``R = prod(shape[:d])`` and ``L = prod(shape[d:])``; training piece ``t`` holds the columns
``[t L/tp, (t+1) L/tp)`` of every row, generation piece ``g`` the columns
``[g L/tp_g, (g+1) L/tp_g)``.  A replicated parameter is ``[1, numel]``, one piece held by every
rank of its stage.  Each training piece that overlaps a generation piece gives one *box*::

    global [R, L]   |   t=0   |   t=1   |   t=2   |   t=3   |        tp   = 4
                    |        g=0        |        g=1        |        tp_g = 2
    box (t=1 -> g=0): R rows x L/4 cols, src col 0 of piece 1, dst col L/4 of piece 0

    src element (r, c) = src_offset + r * src_stride + c     (training shard, flattened)
    dst element (r, c) = dst_offset + r * dst_stride + c     (generation shard, flattened)

A side whose rows are adjacent (``rows == 1`` or ``cols == stride``) is contiguous and moves
with no copy; the other side of a row-parallel box (``tp != tp_g``) goes through a staging
buffer.  Fused tensors (:class:`~hybridflow_comm.shard_spec.QKVFusion`,
:class:`~hybridflow_comm.shard_spec.GateUpFusion`) are stored so that any cut at a unit
boundary is a valid shard, so they are dim-0 boxes like any other.

Chunks, buckets, sources:

1. A box is cut (along rows, or along the columns of one row) into chunks of at most
   ``chunk_bytes = bucket_bytes / |A|``, so that one bucket can spread over every sender.
2. Each generation rank's chunks, in its buffer's order, the training stages that feed it
   interleaved in proportion to their bytes, are cut into buckets of at most ``bucket_bytes``
   (a chunk never straddles two); bucket ``k`` is the ``k``-th bucket of every generation
   rank, so every bucket keeps all generation ranks and every stage's senders busy.
3. Each chunk is sent by one of its *holders* (the dp replicas of its training piece; every
   rank of the stage for a replicated tensor): bucket by bucket, chunks with fewer holders and
   more bytes first, each to the holder that has sent the fewest bytes so far.
4. Chunks under ``pack_bytes`` (norms, biases) are *packed*: per bucket and (sender, receiver)
   pair they travel as one message, copied through staging on both sides, largest element
   size first so that no padding is sent::

       pack message  | f64 boxes | f32 boxes | bf16 boxes | ...     (offsets stay aligned)

Minimums.  Generation rank ``j`` must receive its generation shard, ``G_j`` bytes, from the
other pool; the plan receives exactly ``G_j``.  On the training side no schedule can load the
busiest rank of stage ``s`` with less than::

    S_s = max( max_t P[s, t] / dp ,  (sum_t P[s, t] + Rep[s]) / (tp dp) )

where ``P[s, t]`` is the bytes of piece ``t`` wanted over all generation ranks and ``Rep[s]``
the replicated bytes (with ``SyncLayout.experts``, an expert's bytes over the ``edp`` ranks
of its block count like a piece's over ``dp``); the plan stays within one chunk of it
(tested by enumeration).

Experts.  Under the training pool's expert parallelism (``SyncLayout.experts``, ``ep > 1``)
an expert tensor is held whole by the ranks of its EP block, in its stored form: logical, or
as its ``g`` generation pieces stacked (``down_proj`` under a generation TP of ``g``), which
is the dense geometry of ``tp = g`` pieces laid one after another (piece ``k`` at
``k * numel / g``).  Its boxes are cut from those pieces; the generation side is a dense
tensor's.

Run ``python -m hybridflow_comm.sync --train PP,TP,DP --gen PP_G,TP_G --gen-ranks N`` to print
a plan.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.expert_reshard import check_expert_specs, stacked_pieces
from hybridflow_comm.flat_buffer import SlotSpec
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.model_shape import DecoderSizes, ModelShape
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec, check_specs
from hybridflow_comm.sizes import divisors
from hybridflow_comm.transition import BUCKET_BYTES, check_bucket_bytes

PACK_BYTES = 64 << 10  # default: blocks under 64 KiB travel packed

# Layout ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncLayout:
    """A training pool and a generation pool, each with its layout, on disjoint job ranks.

    Attributes:
        train: training layout ``pp x tp x dp``; pool index ``i`` is job rank ``train_ranks[i]``.
        gen: generation layout ``pp_g x tp_g x dp_g`` (a ParallelLayout: ``gen.pp`` is
            ``pp_g``, ``gen.tp`` is ``tp_g``, ``gen.dp`` is ``dp_g``).
        train_ranks: job ranks of the training pool, ascending, ``train.world_size`` of them.
        gen_ranks: job ranks of the generation pool, ascending, disjoint from ``train_ranks``.
        experts: the training pool's expert layout under expert parallelism (``ep > 1``, its
            training side ``train``), or None.  An expert tensor (``ShardSpec.expert``) is
            then held whole by the ranks of its EP block (stored as its generation pieces
            where :func:`~hybridflow_comm.expert_reshard.stacked_pieces` says so) and sent
            from there; the generation pool cuts it ``tp_g`` ways like a dense tensor.
    """

    train: ParallelLayout
    gen: ParallelLayout
    train_ranks: tuple[int, ...]
    gen_ranks: tuple[int, ...]
    experts: ExpertLayout | None = None

    def __post_init__(self) -> None:
        for name in ("train", "gen"):
            if not isinstance(getattr(self, name), ParallelLayout):
                raise TypeError(f"{name} must be a ParallelLayout, got {getattr(self, name)!r}")
        for name, layout in (("train_ranks", self.train), ("gen_ranks", self.gen)):
            ranks = tuple(int(r) for r in getattr(self, name))
            object.__setattr__(self, name, ranks)
            if list(ranks) != sorted(set(ranks)) or any(r < 0 for r in ranks):
                raise ValueError(f"{name}={list(ranks)} must list distinct ranks >= 0 in "
                                 f"ascending order")
            if len(ranks) != layout.world_size:
                raise ValueError(
                    f"{name} has {len(ranks)} ranks but its layout pp={layout.pp} x "
                    f"tp={layout.tp} x dp={layout.dp} covers {layout.world_size}: give "
                    f"{layout.world_size} ranks or change the layout")
        both = sorted(set(self.train_ranks) & set(self.gen_ranks))
        if both:
            raise ValueError(f"ranks {both} are in both pools: a weight sync runs between "
                             f"disjoint pools (a colocated pool uses hybridflow_comm.reshard)")
        if self.train.pp % self.gen.pp:
            divisors = [d for d in range(1, self.train.pp + 1) if self.train.pp % d == 0]
            raise ValueError(f"pp_g={self.gen.pp} must divide the training pp={self.train.pp} "
                             f"(choose pp_g from {divisors})")
        if self.experts is not None:
            if not isinstance(self.experts, ExpertLayout):
                raise TypeError(f"experts must be an ExpertLayout, got {self.experts!r}")
            if self.experts.hybrid.train != self.train or self.experts.ep == 1:
                raise ValueError(f"experts: an ExpertLayout with ep > 1 over the training "
                                 f"layout {self.train}, got ep={self.experts.ep} over "
                                 f"{self.experts.hybrid.train} (with ep=1 the experts are "
                                 f"split over tp like dense tensors: pass experts=None)")

    @classmethod
    def side_by_side(cls, train: tuple[int, int, int], gen: tuple[int, int],
                     gen_ranks: int) -> SyncLayout:
        """Training ``(pp, tp, dp)`` on ranks ``0..|A|-1``, generation ``(pp_g, tp_g)`` with
        ``dp_g = gen_ranks / (pp_g tp_g)`` on the next ``gen_ranks`` ranks."""
        t = ParallelLayout(*train)
        pp_g, tp_g = gen
        if gen_ranks < 1 or gen_ranks % (pp_g * tp_g):
            raise ValueError(f"gen_ranks={gen_ranks} must be a positive multiple of "
                             f"pp_g * tp_g = {pp_g} * {tp_g}")
        g = ParallelLayout(pp_g, tp_g, gen_ranks // (pp_g * tp_g))
        n = t.world_size
        return cls(t, g, tuple(range(n)), tuple(range(n, n + gen_ranks)))

    @property
    def micro_pp(self) -> int:
        """Training stages per generation stage (``pp / pp_g``)."""
        return self.train.pp // self.gen.pp

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every job rank of both pools, ascending (the sync group)."""
        return tuple(sorted(self.train_ranks + self.gen_ranks))

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless every rank of both pools exists in the job."""
        top = max(self.ranks)
        if top >= world_size:
            raise ValueError(f"the pools use rank {top} but the job has world_size={world_size}")

    def describe(self) -> str:
        t, g = self.train, self.gen
        ep = "" if self.experts is None else \
            f" (ep {self.experts.ep} of {self.experts.num_experts} experts)"
        return (f"train {t.pp}-{t.tp}-{t.dp}{ep} on ranks {list(self.train_ranks)} -> gen "
                f"{g.pp}-{g.tp} x dp_g {g.dp} on ranks {list(self.gen_ranks)}")

    def train_shard_shape(self, spec: ShardSpec, index: int) -> tuple[int, ...] | None:
        """Shape of what training pool rank ``index`` holds of ``spec`` (None: nothing): its
        TP shard, or under :attr:`experts` an expert of its block whole, in its stored form."""
        c = self.train.coords(index)
        if spec.stage != c.pp:
            return None
        if spec.expert is None or self.experts is None:
            return spec.shard_shape(self.train.tp)
        if spec.expert not in self.experts.train_experts(index):
            return None
        g = stacked_pieces(spec, self.experts)
        return spec.shape if g == 1 else (g, *spec.shard_shape(g))


def check_sync_specs(specs: list[ShardSpec], layout: SyncLayout) -> None:
    """Raise ValueError unless both layouts can shard every parameter (names the fix)."""
    if layout.experts is not None:
        check_expert_specs([s for s in specs if s.expert is not None], layout.experts)
        check_specs([s for s in specs if s.expert is None], layout.train)
    else:
        check_specs(specs, layout.train)
    tp_g = layout.gen.tp
    parted = [s for s in specs if s.partition_dim is not None]
    ok = divisors(math.gcd(*(s.units for s in parted))) if parted else [tp_g]
    for s in parted:
        if s.units % tp_g:
            kind = {QKVFusion: "QKV groups (kv heads)", GateUpFusion: "gate/up row pairs"}.get(
                type(s.fusion), f"units along dim {s.partition_dim}")
            raise ValueError(f"{s.name}: {s.units} {kind} cannot be split over tp_g={tp_g} "
                             f"(choose tp_g from {ok})")


def gen_shard_shape(spec: ShardSpec, tp_g: int) -> tuple[int, ...]:
    """Shape of one generation shard: the logical shard, dim ``partition_dim`` cut ``tp_g`` ways."""
    return spec.shard_shape(tp_g)


def gen_slot_specs(specs: list[ShardSpec], layout: SyncLayout, gen_index: int) -> list[SlotSpec]:
    """The flat-buffer regions of generation pool rank ``gen_index``: one slot per parameter of
    its generation stage holding the logical generation shard (``own_slot=None``: nothing of
    it is a training shard), in spec order."""
    g = layout.gen.coords(gen_index)
    return [SlotSpec(s.name, s.dtype, gen_shard_shape(s, layout.gen.tp), 1, None)
            for s in specs if s.stage // layout.micro_pp == g.pp]


# Plan -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One message: a box of one parameter from a training shard to a generation shard.

    Element ``(r, c)``, ``r < rows``, ``c < cols``, is element ``src_offset + r * src_stride + c``
    of the sender's flattened training shard and ``dst_offset + r * dst_stride + c`` of the
    receiver's flattened generation shard.

    Attributes:
        name: parameter name.
        src / dst: job ranks of the sender (training pool) and receiver (generation pool).
        bucket: the bucket (round of messages) it moves in.
        rows, cols, src_offset, src_stride, dst_offset, dst_stride: the box, in elements.
        itemsize: bytes per element.
        packed: travels in its pair's pack message of the bucket (staged on both sides).
    """

    name: str
    src: int
    dst: int
    bucket: int
    rows: int
    cols: int
    src_offset: int
    src_stride: int
    dst_offset: int
    dst_stride: int
    itemsize: int
    packed: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def src_contiguous(self) -> bool:
        return self.rows == 1 or self.cols == self.src_stride

    @property
    def dst_contiguous(self) -> bool:
        return self.rows == 1 or self.cols == self.dst_stride

    @property
    def src_staged(self) -> bool:
        """The sender copies it into staging (packed, or a strided box)."""
        return self.packed or not self.src_contiguous

    @property
    def dst_staged(self) -> bool:
        """The receiver copies it out of staging."""
        return self.packed or not self.dst_contiguous


@dataclass(frozen=True)
class SyncPlan:
    """Every message of one weight sync, and its byte accounting per job rank.

    Attributes:
        layout: the two pools.
        bucket_bytes: most bytes a generation rank receives in one bucket.
        chunk_bytes: most bytes of one block.
        pack_bytes: blocks under this size are packed (one message per pair and bucket).
        blocks: the boxes, by bucket; between two ranks, a bucket's pack message goes first,
            then the other blocks, one message each, in this order.
        minimum_received_bytes: generation rank -> its generation shard's bytes.
        balanced_sent_bytes: training rank -> ``S_s`` of its stage (module docstring).
        num_buckets / num_messages / sent_bytes / received_bytes / staged_bytes: derived from
            ``blocks`` (``staged_bytes``: bytes that rank copies through a staging buffer).
    """

    layout: SyncLayout
    bucket_bytes: int
    chunk_bytes: int
    pack_bytes: int
    blocks: tuple[Block, ...]
    minimum_received_bytes: dict[int, int]
    balanced_sent_bytes: dict[int, int]
    num_buckets: int = field(init=False)
    num_messages: int = field(init=False)
    sent_bytes: dict[int, int] = field(init=False)
    received_bytes: dict[int, int] = field(init=False)
    staged_bytes: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        sent = dict.fromkeys(self.layout.train_ranks, 0)
        received = dict.fromkeys(self.layout.gen_ranks, 0)
        staged = dict.fromkeys(self.layout.ranks, 0)
        for b in self.blocks:
            sent[b.src] += b.nbytes
            received[b.dst] += b.nbytes
            staged[b.src] += b.nbytes if b.src_staged else 0
            staged[b.dst] += b.nbytes if b.dst_staged else 0
        packs = {(b.bucket, b.src, b.dst) for b in self.blocks if b.packed}
        object.__setattr__(self, "num_buckets", 1 + max((b.bucket for b in self.blocks),
                                                        default=-1))
        object.__setattr__(self, "num_messages",
                           len(packs) + sum(not b.packed for b in self.blocks))
        object.__setattr__(self, "sent_bytes", sent)
        object.__setattr__(self, "received_bytes", received)
        object.__setattr__(self, "staged_bytes", staged)

    def buckets(self) -> list[list[Block]]:
        """The blocks of each bucket, in posting order."""
        out: list[list[Block]] = [[] for _ in range(self.num_buckets)]
        for b in self.blocks:
            out[b.bucket].append(b)
        return out

    def bucket_summary(self) -> list[dict]:
        """Per bucket: messages, bytes, and the busiest/idlest training and generation rank."""
        out = []
        for k, blocks in enumerate(self.buckets()):
            sent = dict.fromkeys(self.layout.train_ranks, 0)
            recv = dict.fromkeys(self.layout.gen_ranks, 0)
            for b in blocks:
                sent[b.src] += b.nbytes
                recv[b.dst] += b.nbytes
            messages = (len({(b.src, b.dst) for b in blocks if b.packed})
                        + sum(not b.packed for b in blocks))
            out.append({"bucket": k, "messages": messages, "bytes": sum(sent.values()),
                        "max_send": max(sent.values()), "min_send": min(sent.values()),
                        "max_recv": max(recv.values())})
        return out

    def describe(self) -> dict:
        """The plan as plain data (what ``python -m hybridflow_comm.sync --json`` prints)."""
        lay = self.layout
        return {
            "layout": lay.describe(), "bucket_bytes": self.bucket_bytes,
            "chunk_bytes": self.chunk_bytes, "pack_bytes": self.pack_bytes,
            "num_buckets": self.num_buckets, "messages": self.num_messages,
            "blocks": len(self.blocks),
            "ranks": [{"rank": r, "role": "train" if r in self.sent_bytes else "gen",
                       "sent": self.sent_bytes.get(r, 0),
                       "balanced_sent": self.balanced_sent_bytes.get(r, 0),
                       "received": self.received_bytes.get(r, 0),
                       "minimum_received": self.minimum_received_bytes.get(r, 0),
                       "staged": self.staged_bytes[r]} for r in lay.ranks],
            "buckets": self.bucket_summary(),
        }


@dataclass(frozen=True)
class _Want:
    """A chunk a generation rank needs, before its sender is chosen."""

    name: str
    dst: int
    box: tuple[int, int, int, int, int, int]  # rows, cols, src_off, src_stride, dst_off, dst_stride
    itemsize: int
    holders: tuple[int, ...]  # job ranks that hold it
    key: tuple  # (stage, piece) of the holders, for the balance bound

    @property
    def nbytes(self) -> int:
        return self.box[0] * self.box[1] * self.itemsize


def _matrix(spec: ShardSpec) -> tuple[int, int]:
    """``(R, L)``: the parameter as a matrix whose columns are cut by tensor parallelism."""
    if spec.partition_dim is None:
        return 1, spec.numel
    d = spec.partition_dim
    return math.prod(spec.shape[:d]), math.prod(spec.shape[d:])


def _boxes(spec: ShardSpec, tp: int, tp_g: int, g: int) -> list[tuple[int, tuple]]:
    """``(training piece, box)`` for every piece overlapping generation piece ``g``."""
    rows, length = _matrix(spec)
    if spec.partition_dim is None:
        return [(-1, (1, length, 0, length, 0, length))]
    lt, lg = length // tp, length // tp_g
    out = []
    for t in range(g * lg // lt, -(-(g + 1) * lg // lt)):
        lo, hi = max(g * lg, t * lt), min((g + 1) * lg, (t + 1) * lt)
        if lo >= hi:
            continue
        cols = hi - lo
        if rows == 1 or (cols == lt and cols == lg):  # contiguous on both sides: one run
            out.append((t, (1, rows * cols, lo - t * lt, rows * cols, lo - g * lg, rows * cols)))
        else:
            out.append((t, (rows, cols, lo - t * lt, lt, lo - g * lg, lg)))
    return out


def _chunks(box: tuple, chunk_elems: int) -> list[tuple]:
    """Cut a box into boxes of at most ``chunk_elems`` elements (rows first, then columns)."""
    rows, cols, so, ss, do, ds = box
    if rows * cols <= chunk_elems:
        return [box]
    if cols > chunk_elems:  # one row at a time, cut along its columns
        return [(1, min(chunk_elems, cols - c), so + r * ss + c, ss, do + r * ds + c, ds)
                for r in range(rows) for c in range(0, cols, chunk_elems)]
    per = chunk_elems // cols
    return [(min(per, rows - r), cols, so + r * ss, ss, do + r * ds, ds)
            for r in range(0, rows, per)]


def _wants(specs: list[ShardSpec], layout: SyncLayout, chunk_bytes: int) -> list[list[_Want]]:
    """Per generation pool rank, the chunks it needs, in its buffer's order."""
    t, g = layout.train, layout.gen
    holders: dict[tuple, tuple[int, ...]] = {}  # (stage, TP piece, -1 or ("expert", e))
    for i, r in enumerate(layout.train_ranks):
        c = t.coords(i)
        holders[(c.pp, c.tp)] = holders.get((c.pp, c.tp), ()) + (r,)
        holders[(c.pp, -1)] = holders.get((c.pp, -1), ()) + (r,)
        for e in layout.experts.train_experts(i) if layout.experts is not None else ():
            holders[(c.pp, ("expert", e))] = holders.get((c.pp, ("expert", e)), ()) + (r,)
    out = []
    for j, dst in enumerate(layout.gen_ranks):
        gc = g.coords(j)
        mine = []
        for s in specs:
            if s.stage // layout.micro_pp != gc.pp:
                continue
            item = s.dtype.itemsize
            for held_by, key, box in _sources(s, layout, gc.tp, holders):
                for chunk in _chunks(box, max(1, chunk_bytes // item)):
                    mine.append(_Want(s.name, dst, chunk, item, held_by, key))
        out.append(_interleave_stages(mine))
    return out


def _sources(spec: ShardSpec, layout: SyncLayout, g: int, holders: dict[tuple, tuple[int, ...]]
             ) -> list[tuple[tuple[int, ...], tuple, tuple]]:
    """``(holders, key, box)`` for every training piece overlapping generation piece ``g``:
    a dense tensor's TP pieces; under expert parallelism an expert's stored pieces (one
    tensor, piece ``k`` at ``k * numel / pieces``) on the ranks of its EP block."""
    if spec.expert is None or layout.experts is None:
        return [(holders[(spec.stage, t)], (spec.stage, t), box)
                for t, box in _boxes(spec, layout.train.tp, layout.gen.tp, g)]
    key = (spec.stage, ("expert", spec.expert))
    pieces = stacked_pieces(spec, layout.experts)
    out = []
    for k, (rows, cols, so, ss, do, ds) in _boxes(spec, pieces, layout.gen.tp, g):
        box = (rows, cols, so + k * (spec.numel // pieces), ss, do, ds)
        out.append((holders[key], key, box))
    return out


def _interleave_stages(wants: list[_Want]) -> list[_Want]:
    """Merge the chunks of the training stages that feed one generation stage so that each
    stage's share of every prefix matches its share of the whole (its senders stay busy in
    every bucket); each stage's own order is kept."""
    per: dict[int, list[_Want]] = defaultdict(list)
    for w in wants:
        per[w.key[0]].append(w)
    if len(per) < 2:
        return wants
    total = {s: sum(w.nbytes for w in ws) for s, ws in per.items()}
    done, pos, out = dict.fromkeys(per, 0), dict.fromkeys(per, 0), []
    while len(out) < len(wants):
        s = min((s for s in per if pos[s] < len(per[s])), key=lambda s: (done[s] / total[s], s))
        w = per[s][pos[s]]
        pos[s] += 1
        done[s] += w.nbytes
        out.append(w)
    return out


def _balanced(layout: SyncLayout, wants: list[list[_Want]]) -> dict[int, int]:
    """``S_s`` of each training rank's stage (module docstring; an expert's bytes shared by
    the holders of its block, like a TP piece's by its dp replicas)."""
    t = layout.train
    load: dict[tuple, int] = defaultdict(int)
    holders: dict[tuple, int] = {}
    for w in (w for mine in wants for w in mine):
        load[w.key] += w.nbytes
        holders[w.key] = len(w.holders)
    out = {}
    for i, r in enumerate(layout.train_ranks):
        s = t.coords(i).pp
        total = sum(v for (st, _), v in load.items() if st == s)
        piece = max((-(-v // holders[k]) for k, v in load.items() if k[0] == s), default=0)
        out[r] = max(piece, -(-total // (t.tp * t.dp)))
    return out


def _cut_buckets(wants: list[list[_Want]], bucket_bytes: int) -> list[list[_Want]]:
    """Bucket ``k`` = the ``k``-th run of at most ``bucket_bytes`` of every generation rank."""
    buckets: list[list[_Want]] = []
    for mine in wants:
        k, filled = 0, 0
        for w in mine:
            if filled and filled + w.nbytes > bucket_bytes:
                k, filled = k + 1, 0
            filled += w.nbytes
            while len(buckets) <= k:
                buckets.append([])
            buckets[k].append(w)
    return buckets


def _assign_senders(buckets: list[list[_Want]], layout: SyncLayout,
                    pack_bytes: int) -> list[Block]:
    """Bucket by bucket, fewest holders and most bytes first, each chunk to its holder that
    has sent the least so far; blocks keep the bucket's order."""
    sent = dict.fromkeys(layout.train_ranks, 0)
    blocks = []
    for k, bucket in enumerate(buckets):
        src = {}
        for i in sorted(range(len(bucket)),
                        key=lambda i: (len(bucket[i].holders), -bucket[i].nbytes, i)):
            src[i] = min(bucket[i].holders, key=lambda h: (sent[h], h))
            sent[src[i]] += bucket[i].nbytes
        blocks += [Block(w.name, src[i], w.dst, k, *w.box, w.itemsize, w.nbytes < pack_bytes)
                   for i, w in enumerate(bucket)]
    return blocks


def plan_sync(specs: list[ShardSpec], layout: SyncLayout, bucket_bytes: int = BUCKET_BYTES,
              pack_bytes: int = PACK_BYTES) -> SyncPlan:
    """Plan one weight sync from the training pool to the generation pool.

    Args:
        specs: the model's parameters (global shapes; stages are training stages).
        layout: the two pools.
        bucket_bytes: most bytes a generation rank receives per bucket (>= 1024).
        pack_bytes: blocks under this size are packed (0: none).

    Returns:
        The plan (see the module docstring); ValueError for sizes that do not map.
    """
    check_bucket_bytes(bucket_bytes)
    if pack_bytes < 0:
        raise ValueError(f"pack_bytes={pack_bytes} must be >= 0 (0 packs nothing)")
    if not isinstance(layout, SyncLayout):
        raise TypeError(f"layout must be a SyncLayout, got {layout!r}")
    check_sync_specs(specs, layout)
    chunk_bytes = max(1, bucket_bytes // len(layout.train_ranks))
    wants = _wants(specs, layout, chunk_bytes)
    blocks = _assign_senders(_cut_buckets(wants, bucket_bytes), layout, pack_bytes)
    minimum = {layout.gen_ranks[j]: sum(s.num_slots * s.slot_nbytes
                                        for s in gen_slot_specs(specs, layout, j))
               for j in range(len(layout.gen_ranks))}
    return SyncPlan(layout, bucket_bytes, chunk_bytes, pack_bytes, tuple(blocks), minimum,
                    _balanced(layout, wants))


# Model shapes (the CLI's --hf-config / --dims; bench/shapes.py makes them for the benches) -------


# The CLI's default model when neither --hf-config nor --dims is given: a small Llama
# (bench/shapes.py's ``tiny`` sizes; the toolkit cannot import bench).
DEFAULT_DIMS = "256,4,8,4,704,4096"
_DIM_NAMES = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")
_DIM_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
               "vocab_size")
"""The ``--dims`` entries' :class:`DecoderSizes` fields, in order."""
_HF_KEYS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
            "vocab_size": "vocab_size"}


def model_shape_from_dims(text: str, dtype: torch.dtype = torch.bfloat16,
                          tied: bool = True) -> ModelShape:
    """``"H,L,Q,G,F,V"`` (hidden, layers, heads, kv heads, ffn, vocab) as a ModelShape."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != len(_DIM_NAMES) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"dims={text!r} must be six positive integers H,L,Q,G,F,V "
                         f"({','.join(_DIM_NAMES)}), e.g. {DEFAULT_DIMS}")
    sizes = DecoderSizes(**dict(zip(_DIM_FIELDS, (int(p) for p in parts))), dtype=dtype,
                         tie_word_embeddings=tied)
    return _checked(ModelShape(f"dims {text}", sizes), f"dims={text!r}")


def model_shape_from_hf_config(path: str) -> ModelShape:
    """The ModelShape of a Hugging Face ``config.json`` (the file, or a folder holding it).

    Reads hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default:
    the attention heads), intermediate_size, vocab_size, tie_word_embeddings (default False,
    as LlamaConfig) and ``dtype`` / ``torch_dtype`` (default float32, what transformers loads
    without one).
    """
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"hf_config={path!r}: no such file (give a config.json or a folder "
                         f"holding one)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"hf_config={file!r} is not JSON: {exc}") from None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"hf_config={file!r} does not hold a JSON object")
    missing = [k for k in _HF_KEYS.values() if k not in cfg]
    if missing:
        raise ValueError(f"hf_config={file!r} lacks {missing} (a decoder's config.json has them)")
    sizes = {name: cfg[key] for name, key in _HF_KEYS.items()}
    sizes["num_kv_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"hf_config={file!r}: {bad} must be positive integers")
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"hf_config={file!r}: dtype={name!r} is not a torch dtype")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * sizes["num_heads"] != sizes["hidden_size"]:
        raise ValueError(f"hf_config={file!r}: head_dim={head_dim} x num_attention_heads="
                         f"{sizes['num_heads']} != hidden_size={sizes['hidden_size']} (not a "
                         f"Llama layout these plans describe)")
    shape = ModelShape(file, DecoderSizes(
        **sizes, dtype=dtype, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False))))
    return _checked(shape, f"hf_config={file!r}")


def _checked(shape: ModelShape, origin: str) -> ModelShape:
    if shape.hidden_size % shape.num_heads or shape.num_heads % shape.num_kv_heads:
        raise ValueError(f"{origin}: hidden={shape.hidden_size} must be a multiple of heads="
                         f"{shape.num_heads}, itself a multiple of kv_heads={shape.num_kv_heads}")
    return shape


def llama_specs(shape: ModelShape, pp: int) -> list[ShardSpec]:
    """The shard specs of a Llama-like decoder, layers split evenly over ``pp`` stages::

        embed [V, H] dim 0 | qkv [G(Q/G+2)D, H] QKV-fused | o_proj [H, QD] dim 1
        gate_up [2F, H] gate/up-fused | down_proj [H, F] dim 1 | norms [H] replicated
        lm_head [V, H] dim 0 (last stage; only when untied or pp > 1)
    """
    c = shape.config
    extras = {k: getattr(c, k) for k in ("num_experts", "qkv_bias", "o_proj_bias", "qk_norm")
              if getattr(c, k)}
    if extras or shape.value_head:
        raise ValueError(f"{shape.name}: llama_specs describes a dense Llama with an LM head, "
                         f"not {extras or 'a value head'} (engine.llama_spec.llama_shard_specs "
                         f"does)")
    layers, heads, kv_heads, ffn = (shape.num_layers, shape.num_heads, shape.num_kv_heads,
                                    shape.intermediate_size)
    if layers % pp:
        raise ValueError(f"{layers} layers cannot be split over pp={pp} "
                         f"(choose pp from {divisors(layers)})")
    h, dt, hd, vocab = shape.hidden_size, shape.dtype, shape.head_dim, shape.vocab_size
    per = layers // pp
    specs = [ShardSpec("embed", (vocab, h), dt, 0, 0, hf_names=("model.embed_tokens.weight",))]
    for i in range(layers):
        p, st = f"model.layers.{i}.", i // per
        specs += [
            ShardSpec(p + "input_norm", (h,), dt, None, st),
            ShardSpec(p + "qkv", ((heads + 2 * kv_heads) * hd, h), dt, 0, st,
                      QKVFusion(heads, kv_heads, hd)),
            ShardSpec(p + "o_proj", (h, heads * hd), dt, 1, st),
            ShardSpec(p + "post_norm", (h,), dt, None, st),
            ShardSpec(p + "gate_up", (2 * ffn, h), dt, 0, st, GateUpFusion()),
            ShardSpec(p + "down_proj", (h, ffn), dt, 1, st),
        ]
    specs.append(ShardSpec("norm", (h,), dt, None, pp - 1))
    if not shape.tie_word_embeddings or pp > 1:
        specs.append(ShardSpec("lm_head", (vocab, h), dt, 0, pp - 1))
    return specs
