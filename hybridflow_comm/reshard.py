"""Zero-redundancy training <-> generation transitions of one model (the 3D-HybridEngine).

A :class:`Resharder` owns a model's :class:`FlatParamBuffer` and moves it between the training
layout ``p-t-d`` and the generation layout ``p_g-t_g-d_g-d`` of a :class:`HybridGroups`.

``to_generation()`` with ``method="hybridflow"``, in two phases that never copy the training
shard (it is already slot ``micro_tp_rank`` of its generation region):

1. micro-TP all-gather: for the parameters of this rank's training stage, one all-gather per
   bucket inside the micro-TP group.  The buffer lays regions of one kind (say every layer's
   ``o_proj``) out equally spaced, so slot ``k`` of a whole bucket of them is a single strided
   view; the C++ planner cuts the kinds into such buckets and the all-gather takes the views
   directly, with no staging buffer of ours::

       region l0.o | slot 0 | slot 1 |pad| region l1.o | slot 0 | slot 1 |pad| ...
       member 0's view: [count, slot] stride R  ->  slot 0 of every region in the bucket
       member 1's view: the same, offset by one slot
2. micro-PP broadcast (only when ``pp_g < pp``): the finished regions of each training stage
   are broadcast in place, straight from and into the flat storage, inside the micro-PP group.

Bytes received per rank are exactly ``gen shard - training shard``, the paper's
``(tp - t_g p_g) / (t_g p_g tp) M`` for a model without replicated tensors.

Non-leading partition dims (row-parallel ``[out, in/t]``): the generation region holds the
stacked form ``[m, out, in/t]`` (contiguous), which the generation layers consume directly;
:func:`hybridflow_comm.shard_spec.stacked_to_logical` makes the ``[out, in/t_g]`` tensor when a
consumer needs it (a copy bounded by that one tensor).

``to_training()`` releases the generation-only slots' pages (the training shard never moves).

Baselines with the same API (``method="ds_chat"`` and ``"hybridflow_v"``) live in
:mod:`hybridflow_comm.reshard_baselines`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hybridflow_comm import _C
from hybridflow_comm import comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import HybridGroups
from hybridflow_comm.shard_spec import ShardSpec, check_specs, slot_specs, stacked_to_logical

METHODS = ("hybridflow", "hybridflow_v", "ds_chat")
LABEL = "reshard"


@dataclass(frozen=True)
class TransitionStats:
    """What one transition did on this rank.

    Attributes:
        method: transition method.
        version: weight version after the transition.
        sent_bytes / received_bytes: payload bytes through the instrumented path.
        calls: collective calls issued.
        peak_weight_bytes: weight bytes held at once at the peak (generation regions plus any
            gathered model copy).
        redundant_bytes: ``peak_weight_bytes`` minus this rank's generation shard.
        time_s: wall time of the transition on this rank.
    """

    method: str
    version: int
    sent_bytes: int
    received_bytes: int
    calls: int
    peak_weight_bytes: int
    redundant_bytes: int
    time_s: float


class Resharder:
    """Moves a model between its training and generation layouts in one flat buffer.

    Args:
        specs: the model's parameters (the same list on every rank of the layout).
        groups: this rank's groups for the model's HybridLayout.
        method: ``"hybridflow"`` (default), ``"hybridflow_v"`` or ``"ds_chat"``.
        bucket_bytes: bucket size of the coalesced collectives.
        verify_every: run :meth:`verify` after every transition (debug setting).
        ledger: where bytes are recorded (a new one by default).
        buffer: an existing flat buffer built from ``slot_specs(specs, layout, rank)``.
        backend: how bytes move (torch.distributed by default; see :mod:`hybridflow_comm.comm`).

    Construction is collective over the layout's ranks: they exchange a digest of their specs
    and raise ValueError on every rank when any rank differs.
    """

    def __init__(self, specs: list[ShardSpec], groups: HybridGroups, method: str = "hybridflow",
                 bucket_bytes: int = 32 << 20, verify_every: bool = False,
                 ledger: CommLedger | None = None, buffer: FlatParamBuffer | None = None,
                 backend: comm.Backend = comm.TORCH) -> None:
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not one of {METHODS}")
        if bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be at least 1024")
        self.layout = groups.layout
        check_specs(specs, self.layout.train)
        self.specs = list(specs)
        self.groups = groups
        self.method = method
        self.bucket_bytes = bucket_bytes
        self.verify_every = verify_every
        self.ledger = ledger if ledger is not None else CommLedger()
        self.backend = backend
        mine = slot_specs(self.specs, self.layout, groups.rank)
        if buffer is None:
            buffer = FlatParamBuffer(mine)
        elif buffer.specs != mine:
            raise ValueError("the flat buffer was not built from slot_specs(specs, layout, rank)")
        if buffer.device.type != "cpu" and method != "hybridflow":
            raise ValueError(f"method={method!r} runs on CPU buffers only; the buffer is on "
                             f"{buffer.device}")
        self.buffer = buffer
        self.version = 0
        self.mode = "training"
        self.last_stats: TransitionStats | None = None
        self._spec_by_name = {s.name: s for s in self.specs}
        # The transfer plans depend only on specs and layout: made once, replayed per transition.
        self._tp_plan = self._plan_micro_tp()
        self._pp_plan = self._plan_micro_pp()
        self._exchange_specs()

    # Spec agreement --------------------------------------------------------------------------
    def _describe(self) -> list[tuple]:
        t = self.layout.train
        head = ("layout", t.pp, t.tp, t.dp, self.layout.pp_g, self.layout.tp_g, self.method)
        return [head] + [(s.name, s.shape, str(s.dtype), s.partition_dim, s.stage, repr(s.fusion))
                         for s in self.specs]

    def _exchange_specs(self) -> None:
        desc = self._describe()
        digest = hashlib.sha256(repr(desc).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        world = self.groups.world
        everyone = comm.all_gather_tensor(mine, world, self.ledger, "meta")
        if bool((everyone == mine).all()):
            return
        # Slow path, only on mismatch: find and name the first difference, on every rank.
        descs = comm.all_gather_object(desc, world, self.ledger, "meta")
        raise ValueError(f"shard specs differ across ranks: {_first_difference(descs, world.ranks)}")

    # Transitions ------------------------------------------------------------------------------
    def to_generation(self) -> TransitionStats:
        """Build every generation shard in the flat buffer; returns this rank's stats."""
        if self.mode != "training":
            raise RuntimeError(f"to_generation() called in {self.mode} mode")
        sent0, recv0, calls0 = self.ledger.snapshot(LABEL)
        t0 = time.perf_counter()
        if self.method == "hybridflow":
            self._micro_tp_gather()
            self._micro_pp_broadcast()
            peak = self.buffer.gen_nbytes
        else:
            from hybridflow_comm.reshard_baselines import gather_full_then_slice

            peak = self.buffer.gen_nbytes + gather_full_then_slice(self, self.method)
        elapsed = time.perf_counter() - t0
        self.version += 1
        self.mode = "generation"
        sent1, recv1, calls1 = self.ledger.snapshot(LABEL)
        self.last_stats = TransitionStats(
            method=self.method, version=self.version, sent_bytes=sent1 - sent0,
            received_bytes=recv1 - recv0, calls=calls1 - calls0, peak_weight_bytes=peak,
            redundant_bytes=peak - self.buffer.gen_nbytes, time_s=elapsed)
        if self.verify_every:
            self.verify()
        return self.last_stats

    def to_training(self, release: bool = True) -> int:
        """Back to the training layout; returns the bytes of generation-only pages released."""
        if self.mode != "generation":
            raise RuntimeError(f"to_training() called in {self.mode} mode")
        self.mode = "training"
        return self.buffer.release_generation_slots() if release else 0

    def _plan_micro_tp(self) -> list[tuple[torch.dtype, int, int, int, int]]:
        """Phase 1 buckets as ``(dtype, first element, count, slot numel, stride)``: slot ``k``
        of a bucket's ``count`` equally spaced regions is one strided view (C++ planner)."""
        if self.groups.micro_tp.size == 1:
            return []
        own = [s for s in self.buffer.specs if s.own_slot is not None and s.num_slots > 1]
        kinds: dict[tuple, int] = {}
        plan = _C.plan_strided_buckets(
            [kinds.setdefault((str(s.dtype), s.slot_shape), len(kinds)) for s in own],
            [self.buffer.byte_offset(s.name) for s in own], [s.slot_nbytes for s in own],
            self.bucket_bytes)
        out = []
        for b in plan:
            first = own[b.start]
            item = self.buffer.storage(first.dtype).element_size()
            out.append((first.dtype, self.buffer.byte_offset(first.name) // item, b.count,
                        first.slot_numel, b.stride // item))
        return out

    def _micro_tp_gather(self) -> None:
        """Phase 1: one all-gather of strided views per bucket; no staging of ours."""
        group = self.groups.micro_tp
        for dtype, base, count, numel, stride in self._tp_plan:
            storage = self.buffer.storage(dtype)
            views = [storage.as_strided((count, numel), (stride, 1), base + k * numel)
                     for k in range(group.size)]  # [count, slot] each
            comm.all_gather_views(views, group, self.ledger, LABEL, self.backend)

    def _plan_micro_pp(self) -> list[tuple[torch.dtype, int, int, int]]:
        """Phase 2 chunks as ``(dtype, root, lo, hi)`` byte ranges: each training stage's
        regions, merged where they touch (no padding sent), cut at ``bucket_bytes``."""
        if self.groups.micro_pp.size == 1:
            return []
        micro_pp = self.layout.micro_pp
        out = []
        for dtype in self.buffer.dtypes:
            for root in range(micro_pp):
                runs = _contiguous_runs(
                    [(self.buffer.byte_offset(s.name), s.num_slots * s.slot_nbytes)
                     for s in self.buffer.specs
                     if s.dtype == dtype and self._spec_by_name[s.name].stage % micro_pp == root])
                out += [(dtype, root, start, min(hi, start + self.bucket_bytes))
                        for lo, hi in runs for start in range(lo, hi, self.bucket_bytes)]
        return out

    def _micro_pp_broadcast(self) -> None:
        """Phase 2: each training stage's finished regions, broadcast in place."""
        group = self.groups.micro_pp
        for dtype, root, lo, hi in self._pp_plan:
            chunk = self.buffer.byte_storage(dtype)[lo:hi]
            comm.broadcast_(chunk, root, group, self.ledger, LABEL, self.backend)

    # Checks -----------------------------------------------------------------------------------
    def verify(self) -> None:
        """Compare every generation slot with its owner's training shard (checksums).

        Collective over the micro-DP group plus one tiny max-reduce over the layout, so that a
        mismatch on any rank raises RuntimeError on every rank, naming the parameter.
        """
        names = [s.name for s in self.buffer.specs]
        mine = torch.zeros(len(names) + 1, dtype=torch.int64)
        mine[-1] = self.version
        for i, s in enumerate(self.buffer.specs):
            if s.own_slot is not None:
                mine[i] = _checksum(self.buffer.train_view(s.name))
        group = self.groups.micro_dp
        table = comm.all_gather_tensor(mine, group, self.ledger, "verify")  # [m, n + 1]
        errors = []
        if not bool((table[:, -1] == self.version).all()):
            errors.append(f"weight versions differ in the micro-DP group: {table[:, -1].tolist()}")
        m_t = self.layout.micro_tp
        for i, s in enumerate(self.buffer.specs):
            stage_slot = (self._spec_by_name[s.name].stage % self.layout.micro_pp) * m_t
            for k in range(s.num_slots):
                want = int(table[stage_slot + k, i])
                got = _checksum(self.buffer.slot_view(s.name, k))
                if got != want:
                    errors.append(f"parameter {s.name!r} slot {k} (owner rank "
                                  f"{group.ranks[stage_slot + k]}) differs from the owner's "
                                  f"training shard at version {self.version}")
        bad = comm.all_reduce_max(int(bool(errors)), self.groups.world, self.ledger, "verify")
        if bad:
            reports = comm.all_gather_object(errors[:3], self.groups.world, self.ledger, "verify")
            lines = [f"rank {r}: {e}" for r, errs in zip(self.groups.world.ranks, reports)
                     for e in errs]
            raise RuntimeError("weight verification failed:\n" + "\n".join(lines))

    # Access -------------------------------------------------------------------------------------
    def generation_params(self) -> dict[str, torch.Tensor]:
        """Generation views: dim-0 and replicated tensors in logical form (views), others
        stacked ``[m, *shard]`` (views)."""
        out = {}
        for s in self.buffer.specs:
            spec = self._spec_by_name[s.name]
            view = self.buffer.gen_view(s.name)
            out[s.name] = stacked_to_logical(view, spec) if spec.partition_dim in (None, 0) else view
        return out

    def named_generation_weights(self, hf_names: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of this rank's generation shards, in logical form.

        With ``hf_names``, fused tensors are split into their Hugging Face parts (q, k, v /
        gate, up) and named by ``spec.hf_names``; what inference engines' ``load_weights``
        take.  Tensors are views except for non-leading partition dims (one tensor's copy).
        """
        if self.mode != "generation":
            raise RuntimeError("named_generation_weights() needs generation mode")
        for s in self.buffer.specs:
            spec = self._spec_by_name[s.name]
            logical = stacked_to_logical(self.buffer.gen_view(s.name), spec)
            if not hf_names or not spec.hf_names:
                yield s.name, logical
            elif spec.fusion is not None:
                yield from zip(spec.hf_names, spec.fusion.split(logical))
            else:
                yield spec.hf_names[0], logical


def _checksum(t: torch.Tensor) -> int:
    return _C.checksum(t if t.device.type == "cpu" else t.cpu())


def _contiguous_runs(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge ``(offset, nbytes)`` regions that touch into ``[lo, hi)`` runs (no padding)."""
    runs: list[list[int]] = []
    for off, n in sorted(regions):
        if n == 0:
            continue
        if runs and runs[-1][1] == off:
            runs[-1][1] = off + n
        else:
            runs.append([off, off + n])
    return [(a, b) for a, b in runs]


def _first_difference(descs: list[list[tuple]], ranks: tuple[int, ...]) -> str:
    ref = descs[0]
    for rank, desc in zip(ranks, descs):
        if desc == ref:
            continue
        for a, b in zip(ref, desc):
            if a != b:
                return f"rank {ranks[0]} has {a} but rank {rank} has {b}"
        return f"rank {ranks[0]} has {len(ref) - 1} parameters but rank {rank} has {len(desc) - 1}"
    return "digests differ"
