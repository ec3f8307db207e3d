"""Baselines that gather whole-model copies and take the generation shard out of them, as the
systems the paper compares against do:

* :class:`DsChat` (DeepSpeed-Chat): all-gather the whole model over *all* ranks.  Each training
  replica's rank contributes ``1/dp`` of its training shard, so every rank receives
  ``(N - 1)/N M`` and holds the full model ``M`` at the peak.
* :class:`HybridFlowV` (HybridFlow-V): all-gather inside the training model-parallel group
  (``pp x tp`` ranks of one replica), receiving ``(pt - 1)/(pt) M``, peak ``M``.

Every rank's contribution is its *stream*: the training shards of its stage's parameters, in
spec order, back to back (no padding inside).  Streams of different stages are padded to the
longest one, so the counts match the paper's formulas exactly when stages are balanced::

    scratch [n, S]   | rank 0 stream | rank 1 stream | ...        (ds_chat: n = N, S = S_max/dp)
                          p1 | p2 | ...      -> copy_bytes into each generation slot

Both run on CPU flat buffers only.
"""

from __future__ import annotations

import math

import torch

from hybridflow_comm import _C, comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import Group, HybridGroups
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import ShardSpec
from hybridflow_comm.transition import (BUCKET_BYTES, LABEL, HybridWeights, TransitionStats,
                                        check_bucket_bytes)

_Copies = tuple[list[int], list[int], list[int]]  # (src, dst, nbytes) of one copy_bytes call


class GatherThenSlice:
    """A whole-model gather, planned once and replayed: pack this rank's share of its stream
    into the scratch, one all-gather over ``group``, copy every generation slot out.

    Args:
        weights: the model's buffer and specs.
        group: the gather group (``world`` or ``train_mp``); member ``k`` is layout rank order.
        parts: pieces each stream is cut into across training replicas (``dp``, or 1).
        backend: how bytes move.

    Calling it fills the generation slots and returns the scratch bytes it held.
    """

    def __init__(self, weights: HybridWeights, group: Group, parts: int,
                 backend: comm.Backend) -> None:
        self.weights, self.group, self.backend = weights, group, backend
        t = weights.layout.train
        streams, s_max = _stream_offsets(weights.specs, t)
        self.part = -(-s_max // parts)  # bytes each rank contributes
        self.section_start = group.rank * self.part
        my_part = t.coords(weights.groups.rank).dp if parts > 1 else 0
        self._pack = self._plan_pack(streams, t, my_part)
        self._unpack = self._plan_unpack(streams, t, parts)

    def _plan_pack(self, streams: dict[int, dict[str, tuple[int, int]]], t: ParallelLayout,
                   my_part: int) -> dict[torch.dtype, _Copies]:
        """Per dtype: this rank's share of its own stream -> its section of the scratch."""
        buf, part = self.weights.buffer, self.part
        window = (my_part * part, (my_part + 1) * part)
        me = t.coords(self.weights.groups.rank)
        out = {}
        for dtype in buf.dtypes:
            src, dst, n = [], [], []
            for s in buf.specs:
                if s.dtype != dtype or s.own_slot is None:
                    continue
                off, size = streams[me.pp][s.name]
                lo, hi = max(off, window[0]), min(off + size, window[1])
                if lo < hi:
                    src.append(buf.byte_offset(s.name, s.own_slot) + lo - off)
                    dst.append(self.section_start + lo - window[0])
                    n.append(hi - lo)
            out[dtype] = (src, dst, n)
        return out

    def _plan_unpack(self, streams: dict[int, dict[str, tuple[int, int]]], t: ParallelLayout,
                     parts: int) -> dict[torch.dtype, _Copies]:
        """Per dtype: every generation slot but the own one <- the gathered streams."""
        w, buf, part = self.weights, self.weights.buffer, self.part
        g = w.layout.gen_coords(w.groups.rank)
        pt = t.pp * t.tp
        out = {}
        for dtype in buf.dtypes:
            src, dst, n = [], [], []
            for s in buf.specs:
                if s.dtype != dtype:
                    continue
                spec = w.spec(s.name)
                for k in range(s.num_slots):
                    if k == s.own_slot:
                        continue  # the training shard is already in place
                    tp_src = g.tp_g * w.layout.micro_tp + k if spec.partition_dim is not None else 0
                    piece = spec.stage * t.tp + tp_src  # index in the model-parallel group
                    off, size = streams[spec.stage][s.name]
                    for lo, hi, part_idx in _split_by_parts(off, off + size, part, parts):
                        index = part_idx * pt + piece if parts > 1 else piece
                        src.append(index * part + lo - part_idx * part)
                        dst.append(buf.byte_offset(s.name, k) + lo - off)
                        n.append(hi - lo)
            out[dtype] = (src, dst, n)
        return out

    def __call__(self) -> int:
        buf = self.weights.buffer
        scratch = torch.zeros(self.group.size * self.part, dtype=torch.uint8, device=buf.device)
        for dtype, (src, dst, n) in self._pack.items():
            _C.copy_bytes(buf.byte_storage(dtype), scratch, src, dst, n)
        mine = scratch[self.section_start:self.section_start + self.part]
        comm.all_gather_into(scratch, mine, self.group, self.weights.ledger, LABEL, self.backend)
        for dtype, (src, dst, n) in self._unpack.items():
            _C.copy_bytes(scratch, buf.byte_storage(dtype), src, dst, n)
        return scratch.numel()


class _GatherFull:
    """A baseline that gathers a whole model copy, then slices every generation shard out of
    it; subclasses name the group the copy is gathered over (:meth:`gathered_over`).

    Implements :class:`~hybridflow_comm.transition.Transition`.  Args as for
    :class:`~hybridflow_comm.reshard.Resharder`; ``bucket_bytes`` is checked but unused (one
    all-gather moves the model) and ``buffer`` must be on CPU.
    """

    method: str

    @staticmethod
    def gathered_over(groups: HybridGroups):
        """``(group, replicas)``: the group one model copy is gathered over, and how many
        copies the world holds."""
        raise NotImplementedError

    def __init__(self, specs: list[ShardSpec], groups: HybridGroups, *,
                 bucket_bytes: int = BUCKET_BYTES, verify_every: bool = False,
                 ledger: CommLedger | None = None, buffer: FlatParamBuffer | None = None,
                 backend: comm.Backend = comm.TORCH) -> None:
        check_bucket_bytes(bucket_bytes)
        _check_cpu(buffer, self.method)
        self.weights = HybridWeights(specs, groups, self.method, verify_every=verify_every,
                                     ledger=ledger, buffer=buffer)
        self._fill = GatherThenSlice(self.weights, *self.gathered_over(groups), backend)
        self._last: TransitionStats | None = None

    def to_generation(self) -> TransitionStats:
        """Gather the model copy, then slice every generation shard out of it."""
        self._last = self.weights.enter_generation(self._fill)
        return self._last

    def to_training(self, release: bool = True) -> int:
        """Back to the training layout; returns the bytes of generation-only pages released."""
        return self.weights.enter_training(release)

    def accounting(self) -> TransitionStats | None:
        """Stats of the last :meth:`to_generation` (None before the first)."""
        return self._last


class DsChat(_GatherFull):
    """DeepSpeed-Chat's transition (``method = "ds_chat"``): the whole model over all ranks."""

    method = "ds_chat"

    @staticmethod
    def gathered_over(groups: HybridGroups):
        return groups.world, groups.layout.train.dp


class HybridFlowV(_GatherFull):
    """HybridFlow-V's transition (``method = "hybridflow_v"``): the whole model inside the
    training model-parallel group."""

    method = "hybridflow_v"

    @staticmethod
    def gathered_over(groups: HybridGroups):
        return groups.train_mp, 1


def _check_cpu(buffer: FlatParamBuffer | None, method: str) -> None:
    if buffer is not None and buffer.device.type != "cpu":
        raise ValueError(f"method={method!r} runs on CPU buffers only; the buffer is on "
                         f"{buffer.device}")


def _stream_offsets(specs: list[ShardSpec], t: ParallelLayout
                    ) -> tuple[dict[int, dict[str, tuple[int, int]]], int]:
    """Per stage: name -> (offset, nbytes) in that stage's stream; and the longest stream."""
    offsets: dict[int, dict[str, tuple[int, int]]] = {s: {} for s in range(t.pp)}
    cursor = dict.fromkeys(range(t.pp), 0)
    for spec in specs:
        n = math.prod(spec.shard_shape(t.tp)) * spec.dtype.itemsize
        offsets[spec.stage][spec.name] = (cursor[spec.stage], n)
        cursor[spec.stage] += n
    return offsets, max(cursor.values())


def _split_by_parts(lo: int, hi: int, part: int, parts: int) -> list[tuple[int, int, int]]:
    """Cut the stream range ``[lo, hi)`` at part boundaries: ``(lo, hi, part index)``."""
    out = []
    while lo < hi:
        idx = min(lo // part, parts - 1)
        end = min(hi, (idx + 1) * part)
        out.append((lo, end, idx))
        lo = end
    return out
