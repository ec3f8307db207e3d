"""Baseline transitions behind the Resharder API, for side-by-side comparison.

Both gather whole-model copies and then take the generation shard out of them, as the systems
the paper compares against do:

* ``ds_chat`` (DeepSpeed-Chat): all-gather the whole model over *all* ranks.  Each training
  replica's rank contributes ``1/dp`` of its training shard, so every rank receives
  ``(N - 1)/N M`` and holds the full model ``M`` at the peak.
* ``hybridflow_v`` (HybridFlow-V): all-gather inside the training model-parallel group
  (``pp x tp`` ranks of one replica), receiving ``(pt - 1)/(pt) M``, peak ``M``.

Every rank's contribution is its *stream*: the training shards of its stage's parameters, in
spec order, back to back (no padding inside).  Streams of different stages are padded to the
longest one, so the counts match the paper's formulas exactly when stages are balanced::

    scratch [n, S]   | rank 0 stream | rank 1 stream | ...        (ds_chat: n = N, S = S_max/dp)
                          p1 | p2 | ...      -> copy_bytes into each generation slot
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hybridflow_comm import _C, comm

if TYPE_CHECKING:
    from hybridflow_comm.reshard import Resharder


def _stream_offsets(resharder: Resharder) -> tuple[dict[int, dict[str, tuple[int, int]]], int]:
    """Per stage: name -> (offset, nbytes) in that stage's stream; and the longest stream."""
    t = resharder.layout.train
    offsets: dict[int, dict[str, tuple[int, int]]] = {s: {} for s in range(t.pp)}
    cursor = dict.fromkeys(range(t.pp), 0)
    for spec in resharder.specs:
        n = math.prod(spec.shard_shape(t.tp)) * spec.dtype.itemsize
        offsets[spec.stage][spec.name] = (cursor[spec.stage], n)
        cursor[spec.stage] += n
    return offsets, max(cursor.values())


def gather_full_then_slice(resharder: Resharder, method: str) -> int:
    """Run a baseline transition into ``resharder.buffer``; returns the scratch bytes held."""
    layout, groups, buf = resharder.layout, resharder.groups, resharder.buffer
    t = layout.train
    me = t.coords(groups.rank)
    streams, s_max = _stream_offsets(resharder)
    pt = t.pp * t.tp
    if method == "hybridflow_v":
        group, parts = groups.train_mp, 1
    else:
        group, parts = groups.world, t.dp
    part = -(-s_max // parts)  # bytes each rank contributes
    scratch = torch.zeros(group.size * part, dtype=torch.uint8)

    # Pack this rank's share of its own stream into its section of the scratch.
    my_part = me.dp if parts > 1 else 0
    window = (my_part * part, (my_part + 1) * part)
    section_start = group.rank * part
    for dtype in buf.dtypes:
        raw = buf.byte_storage(dtype)
        src, dst, n = [], [], []
        for s in buf.specs:
            if s.dtype != dtype or s.own_slot is None:
                continue
            off, size = streams[me.pp][s.name]
            lo, hi = max(off, window[0]), min(off + size, window[1])
            if lo < hi:
                src.append(buf.byte_offset(s.name, s.own_slot) + lo - off)
                dst.append(section_start + lo - window[0])
                n.append(hi - lo)
        _C.copy_bytes(raw, scratch, src, dst, n)
    comm.all_gather_into(scratch, scratch[section_start:section_start + part], group,
                         resharder.ledger, "reshard", resharder.backend)

    # Take every generation slot out of the gathered streams.
    g = layout.gen_coords(groups.rank)
    for dtype in buf.dtypes:
        raw = buf.byte_storage(dtype)
        src, dst, n = [], [], []
        for s in buf.specs:
            if s.dtype != dtype:
                continue
            spec = resharder._spec_by_name[s.name]
            for k in range(s.num_slots):
                if k == s.own_slot:
                    continue  # the training shard is already in place
                tp_src = g.tp_g * layout.micro_tp + k if spec.partition_dim is not None else 0
                piece = spec.stage * t.tp + tp_src  # index in the model-parallel group
                off, size = streams[spec.stage][s.name]
                for lo, hi, part_idx in _split_by_parts(off, off + size, part, parts):
                    index = part_idx * pt + piece if parts > 1 else piece
                    src.append(index * part + lo - part_idx * part)
                    dst.append(buf.byte_offset(s.name, k) + lo - off)
                    n.append(hi - lo)
        _C.copy_bytes(scratch, raw, src, dst, n)
    return scratch.numel()


def _split_by_parts(lo: int, hi: int, part: int, parts: int) -> list[tuple[int, int, int]]:
    """Cut the stream range ``[lo, hi)`` at part boundaries: ``(lo, hi, part index)``."""
    out = []
    while lo < hi:
        idx = min(lo // part, parts - 1)
        end = min(hi, (idx + 1) * part)
        out.append((lo, end, idx))
        lo = end
    return out
