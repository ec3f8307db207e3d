"""Zero-redundancy training <-> generation transitions of one model (the 3D-HybridEngine).

A :class:`Resharder` moves a model's :class:`FlatParamBuffer` (held by its
:class:`~hybridflow_comm.transition.HybridWeights`) between the training layout ``p-t-d`` and
the generation layout ``p_g-t_g-d_g-d`` of a :class:`HybridGroups`.

``to_generation()`` runs in two phases that never copy the training shard (it is already slot
``micro_tp_rank`` of its generation region):

1. micro-TP all-gather: for the parameters of this rank's training stage, one coalesced call
   per bucket inside the micro-TP group.  Each region is one contiguous ``[m, slot]`` block
   with this rank's slot already in place, so it is gathered in place
   (``all_gather_single(region, own slot)``, what NCCL and gloo both take); the C++ planner
   cuts the regions into buckets of equally spaced regions of one kind (say every layer's
   ``o_proj``) and a bucket's gathers go out as one coalesced launch.  On host tensors over
   gloo each slot is instead one point-to-point message from and into the flat storage
   (:class:`~hybridflow_comm.comm.TorchBackend`: gloo's all-gather stages through a fresh
   tensor), so no byte is staged either way::

       region l0.o | slot 0 | slot 1 |pad| region l1.o | slot 0 | slot 1 |pad| ...
       rank 1:       ^ gathered ^ own            ^ gathered ^ own         one bucket, one call
2. micro-PP broadcast (only when ``pp_g < pp``): the finished regions of each training stage
   are broadcast in place, straight from and into the flat storage, inside the micro-PP group.

Bytes received per rank are exactly ``gen shard - training shard``, the paper's
``(tp - t_g p_g) / (t_g p_g tp) M`` for a model without replicated tensors.

Non-leading partition dims (row-parallel ``[out, in/t]``): the generation region holds the
stacked form ``[m, out, in/t]`` (contiguous), which the generation layers consume directly;
:func:`hybridflow_comm.shard_spec.stacked_to_logical` makes the ``[out, in/t_g]`` tensor when a
consumer needs it (a copy bounded by that one tensor).

``to_training()`` releases the generation-only slots' pages (the training shard never moves).

The Resharder is one :class:`~hybridflow_comm.transition.Transition`; the baselines that
implement the same protocol, and the registry of names, live in :mod:`hybridflow_comm.baselines`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridflow_comm import _C
from hybridflow_comm import comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import HybridGroups
from hybridflow_comm.shard_spec import ShardSpec
from hybridflow_comm.transition import (BUCKET_BYTES, LABEL, HybridWeights, TransitionStats,
                                        check_bucket_bytes)

__all__ = ["Resharder", "TransitionStats"]


class Resharder:
    """HybridFlow's transition (``method = "hybridflow"``): micro-DP all-gather, zero redundancy.

    Implements :class:`~hybridflow_comm.transition.Transition`.

    Args:
        specs: the model's parameters (the same list on every rank of the layout).
        groups: this rank's groups for the model's HybridLayout.
        bucket_bytes: bucket size of the coalesced collectives.
        verify_every: run :meth:`verify` after every transition (debug setting).
        ledger: where bytes are recorded (a new one by default).
        buffer: an existing flat buffer built from ``slot_specs(specs, layout, rank)``.
        backend: how bytes move (torch.distributed by default; see :mod:`hybridflow_comm.comm`).
        device: where a new buffer lives (default cpu).

    Construction is collective over the layout's ranks: they exchange a digest of their specs
    and raise ValueError on every rank when any rank differs.
    """

    method = "hybridflow"

    def __init__(self, specs: list[ShardSpec], groups: HybridGroups, *,
                 bucket_bytes: int = BUCKET_BYTES, verify_every: bool = False,
                 ledger: CommLedger | None = None, buffer: FlatParamBuffer | None = None,
                 backend: comm.Backend = comm.TORCH,
                 device: torch.device | str | None = None) -> None:
        check_bucket_bytes(bucket_bytes)
        self.weights = HybridWeights(specs, groups, self.method, verify_every=verify_every,
                                     ledger=ledger, buffer=buffer, device=device)
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self._last: TransitionStats | None = None
        self._slots_filled = False
        # The transfer plans depend only on specs and layout: made once, replayed per transition.
        self._tp_plan = self._plan_micro_tp()
        self._pp_plan = self._plan_micro_pp()

    # Transition -------------------------------------------------------------------------------
    def to_generation(self, refill: bool = True) -> TransitionStats:
        """Build every generation shard in the flat buffer; returns this rank's stats.

        ``refill=False`` moves nothing: the generation slots still hold what the last
        transition gathered (they were kept, ``to_training(release=False)``, and the weights
        have not changed since: a frozen LoRA base).  RuntimeError when they were released.
        """
        if not refill and not self._slots_filled:
            raise RuntimeError("to_generation(refill=False) but the generation slots were "
                               "released or never filled")
        self._last = self.weights.enter_generation(
            self._fill_generation_slots if refill else lambda: 0)
        self._slots_filled = True
        return self._last

    def to_training(self, release: bool = True) -> int:
        """Back to the training layout; returns the bytes of generation-only pages released
        (``release=False`` keeps them, for a later ``to_generation(refill=False)``)."""
        released = self.weights.enter_training(release)
        self._slots_filled = self._slots_filled and not release
        return released

    def accounting(self) -> TransitionStats | None:
        """Stats of the last :meth:`to_generation` (None before the first)."""
        return self._last

    def minimum_received_bytes(self) -> int:
        """The least any transition must bring to this rank: its generation shard minus the
        training shard it already holds (what :meth:`to_generation` receives)."""
        return self.buffer.gen_nbytes - self.buffer.train_nbytes

    def _fill_generation_slots(self) -> int:
        """Both phases, in place; no scratch, so nothing beyond the generation regions."""
        self._micro_tp_gather()
        self._micro_pp_broadcast()
        return 0

    # The weights' API, for callers that hold a Resharder (rollouts, engines) ------------------
    @property
    def buffer(self) -> FlatParamBuffer:
        return self.weights.buffer

    @property
    def specs(self) -> list[ShardSpec]:
        return self.weights.specs

    @property
    def version(self) -> int:
        return self.weights.version

    @property
    def mode(self) -> str:
        return self.weights.mode

    @property
    def last_stats(self) -> TransitionStats | None:
        """Same as :meth:`accounting`."""
        return self._last

    def verify(self) -> None:
        """See :meth:`HybridWeights.verify`."""
        self.weights.verify()

    def generation_params(self) -> dict[str, torch.Tensor]:
        """See :meth:`HybridWeights.generation_params`."""
        return self.weights.generation_params()

    def named_generation_weights(self, hf_names: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`HybridWeights.named_generation_weights`."""
        return self.weights.named_generation_weights(hf_names)

    # Plans and phases -----------------------------------------------------------------------
    def _plan_micro_tp(self) -> list[tuple[torch.dtype, int, int, int, int]]:
        """Phase 1 buckets as ``(dtype, first element, count, slot numel, stride)``: slot ``k``
        of a bucket's ``count`` equally spaced regions is one strided view (C++ planner)."""
        buf = self.weights.buffer
        if self.weights.groups.micro_tp.size == 1:
            return []
        own = [s for s in buf.specs if s.own_slot is not None and s.num_slots > 1]
        kinds: dict[tuple, int] = {}
        plan = _C.plan_strided_buckets(
            [kinds.setdefault((str(s.dtype), s.slot_shape), len(kinds)) for s in own],
            [buf.byte_offset(s.name) for s in own], [s.slot_nbytes for s in own],
            self.bucket_bytes)
        out = []
        for b in plan:
            first = own[b.start]
            item = buf.storage(first.dtype).element_size()
            out.append((first.dtype, buf.byte_offset(first.name) // item, b.count,
                        first.slot_numel, b.stride // item))
        return out

    def _micro_tp_gather(self) -> None:
        """Phase 1: per bucket, each ``[m, slot]`` region gathered in place, one call."""
        group = self.weights.groups.micro_tp
        m = group.size
        for dtype, base, count, numel, stride in self._tp_plan:
            storage = self.weights.buffer.storage(dtype)
            regions = [storage[base + j * stride:base + j * stride + m * numel]
                       for j in range(count)]  # [m * slot] each, own slot in place
            comm.all_gather_regions(regions, group, self.weights.ledger, LABEL, self.backend)

    def _plan_micro_pp(self) -> list[tuple[torch.dtype, int, int, int]]:
        """Phase 2 chunks as ``(dtype, root, lo, hi)`` byte ranges: each training stage's
        regions, merged where they touch (no padding sent), cut at ``bucket_bytes``."""
        w, buf = self.weights, self.weights.buffer
        if w.groups.micro_pp.size == 1:
            return []
        micro_pp = w.layout.micro_pp
        out = []
        for dtype in buf.dtypes:
            for root in range(micro_pp):
                runs = _contiguous_runs(
                    [(buf.byte_offset(s.name), s.num_slots * s.slot_nbytes) for s in buf.specs
                     if s.dtype == dtype and w.spec(s.name).stage % micro_pp == root])
                out += [(dtype, root, start, min(hi, start + self.bucket_bytes))
                        for lo, hi in runs for start in range(lo, hi, self.bucket_bytes)]
        return out

    def _micro_pp_broadcast(self) -> None:
        """Phase 2: each training stage's finished regions, broadcast in place."""
        group = self.weights.groups.micro_pp
        for dtype, root, lo, hi in self._pp_plan:
            chunk = self.weights.buffer.byte_storage(dtype)[lo:hi]
            comm.broadcast_(chunk, root, group, self.weights.ledger, LABEL, self.backend)


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
