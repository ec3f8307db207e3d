"""What every training <-> generation transition shares: the :class:`Transition` protocol, its
:class:`TransitionStats`, and the :class:`HybridWeights` it moves.

A transition owns one HybridWeights (the flat buffer seen from both layouts, the weight version
and mode, the checks and the generation views) and decides only how the generation slots get
filled::

    Resharder (hybridflow) | HybridFlowV | DsChat     to_generation(), to_training(), accounting()
        | owns one
    HybridWeights                                    buffer, specs, version, mode, verify(), views

Implementations: :class:`hybridflow_comm.reshard.Resharder` and the baselines of
:mod:`hybridflow_comm.baselines`, which also holds the registry of names.  This module imports
neither.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from hybridflow_comm import _C
from hybridflow_comm import comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import Group, HybridGroups
from hybridflow_comm.shard_spec import (ShardSpec, check_specs, hf_named, slot_specs,
                                        stacked_to_logical)

LABEL = "reshard"  # ledger label of the bytes a transition moves
BUCKET_BYTES = 32 << 20  # default bucket size of the coalesced collectives


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


@runtime_checkable
class Transition(Protocol):
    """Moves one model between its training and generation layouts.

    Attributes:
        method: the name the registry knows it by (also ``TransitionStats.method``).
        weights: the model's buffer, version, mode, checks and views.
    """

    method: str
    weights: HybridWeights

    def to_generation(self) -> TransitionStats:
        """Fill every generation slot; returns this rank's stats of the transition."""

    def to_training(self, release: bool = True) -> int:
        """Back to the training layout; returns the generation-only bytes released."""

    def accounting(self) -> TransitionStats | None:
        """Stats of the last :meth:`to_generation` (None before the first)."""


class HybridWeights:
    """One model's flat buffer seen from both layouts, with its weight version and mode.

    Args:
        specs: the model's parameters (the same list on every rank of the layout).
        groups: this rank's groups for the model's HybridLayout.
        method: name of the transition that owns it (ranks must agree on it).
        verify_every: run :meth:`verify` after every transition (debug setting).
        ledger: where bytes are recorded (a new one by default).
        buffer: an existing flat buffer built from ``slot_specs(specs, layout, rank)``.
        device: where a new buffer lives (default cpu); every tensor of the transition's
            collectives is on the buffer's device.

    Construction is collective over the layout's ranks: they exchange a digest of their specs
    and method, and raise ValueError on every rank when any rank differs.
    """

    def __init__(self, specs: list[ShardSpec], groups: HybridGroups, method: str, *,
                 verify_every: bool = False, ledger: CommLedger | None = None,
                 buffer: FlatParamBuffer | None = None,
                 device: torch.device | str | None = None) -> None:
        self.layout = groups.layout
        check_specs(specs, self.layout.train)
        self.specs = list(specs)
        self.groups = groups
        self.method = method
        self.verify_every = verify_every
        self.ledger = ledger if ledger is not None else CommLedger()
        mine = slot_specs(self.specs, self.layout, groups.rank)
        if buffer is None:
            buffer = FlatParamBuffer(mine, device=device or "cpu")
        elif buffer.specs != mine:
            raise ValueError("the flat buffer was not built from slot_specs(specs, layout, rank)")
        self.buffer = buffer
        self.version = 0
        self.mode = "training"
        self._spec_by_name = {s.name: s for s in self.specs}
        self._exchange_specs()

    def spec(self, name: str) -> ShardSpec:
        """The logical spec of parameter ``name``."""
        return self._spec_by_name[name]

    # Spec agreement --------------------------------------------------------------------------
    def _describe(self) -> list[tuple]:
        t = self.layout.train
        head = ("layout", t.pp, t.tp, t.dp, self.layout.pp_g, self.layout.tp_g, self.method)
        return [head] + [(s.name, s.shape, str(s.dtype), s.partition_dim, s.stage, repr(s.fusion))
                         for s in self.specs]

    def _exchange_specs(self) -> None:
        agree_on_specs(self._describe(), self.groups.world, self.ledger, self.buffer.device)

    # Mode and version ------------------------------------------------------------------------
    def enter_generation(self, fill_generation_slots: Callable[[], int]) -> TransitionStats:
        """Run one training -> generation transition around ``fill_generation_slots``.

        Args:
            fill_generation_slots: writes every generation slot, moving bytes under
                :data:`LABEL` of :attr:`ledger`; returns the scratch bytes it held at its peak.

        Returns:
            This rank's stats; the weight version goes up by one.
        """
        if self.mode != "training":
            raise RuntimeError(f"to_generation() called in {self.mode} mode")
        stats = measured_transition(self.ledger, self.method, self.version + 1,
                                    self.buffer.gen_nbytes, fill_generation_slots)
        self.version += 1
        self.mode = "generation"
        if self.verify_every:
            self.verify()
        return stats

    def enter_training(self, release: bool = True) -> int:
        """Back to the training layout (the training shard never moved).

        Args:
            release: return the generation-only pages to the OS.

        Returns:
            The bytes of generation-only pages released.
        """
        if self.mode != "generation":
            raise RuntimeError(f"to_training() called in {self.mode} mode")
        self.mode = "training"
        return self.buffer.release_generation_slots() if release else 0

    # Checks -----------------------------------------------------------------------------------
    def verify(self) -> None:
        """Compare every generation slot with its owner's training shard (checksums).

        Collective over the micro-DP group plus one tiny max-reduce over the layout, so that a
        mismatch on any rank raises RuntimeError on every rank, naming the parameter.
        """
        # Checksums are computed on the host (a debug check); only the exchange is on the device.
        sums = [checksum(self.buffer.train_view(s.name)) if s.own_slot is not None else 0
                for s in self.buffer.specs]
        mine = torch.tensor(sums + [self.version], dtype=torch.int64, device=self.buffer.device)
        group = self.groups.micro_dp
        table = comm.all_gather_tensor(mine, group, self.ledger, "verify").cpu()  # [m, n + 1]
        errors = []
        if not bool((table[:, -1] == self.version).all()):
            errors.append(f"weight versions differ in the micro-DP group: {table[:, -1].tolist()}")
        m_t = self.layout.micro_tp
        for i, s in enumerate(self.buffer.specs):
            stage_slot = (self.spec(s.name).stage % self.layout.micro_pp) * m_t
            for k in range(s.num_slots):
                want = int(table[stage_slot + k, i])
                got = checksum(self.buffer.slot_view(s.name, k))
                if got != want:
                    errors.append(f"parameter {s.name!r} slot {k} (owner rank "
                                  f"{group.ranks[stage_slot + k]}) differs from the owner's "
                                  f"training shard at version {self.version}")
        bad = comm.all_reduce_max(int(bool(errors)), self.groups.world, self.ledger, "verify",
                                  self.buffer.device)
        if bad:
            reports = comm.all_gather_object(errors[:3], self.groups.world, self.ledger, "verify")
            lines = [f"rank {r}: {e}" for r, errs in zip(self.groups.world.ranks, reports)
                     for e in errs]
            raise RuntimeError("weight verification failed:\n" + "\n".join(lines))

    # Generation views ---------------------------------------------------------------------------
    def generation_params(self) -> dict[str, torch.Tensor]:
        """Generation views: dim-0 and replicated tensors in logical form (views), others
        stacked ``[m, *shard]`` (views)."""
        out = {}
        for s in self.buffer.specs:
            spec = self.spec(s.name)
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
            spec = self.spec(s.name)
            logical = stacked_to_logical(self.buffer.gen_view(s.name), spec)
            yield from hf_named(s.name, logical, spec.hf_names if hf_names else (), spec.fusion)


def measured_transition(ledger: CommLedger, method: str, version: int, gen_nbytes: int,
                        fill: Callable[[], int]) -> TransitionStats:
    """Run ``fill`` (it moves bytes under :data:`LABEL` of ``ledger`` and returns the scratch
    bytes it held at its peak) and return this rank's stats of it, the generation weights
    being ``gen_nbytes`` and the new weight version ``version``."""
    sent0, recv0, calls0 = ledger.snapshot(LABEL)
    t0 = time.perf_counter()
    peak = gen_nbytes + fill()
    elapsed = time.perf_counter() - t0
    sent1, recv1, calls1 = ledger.snapshot(LABEL)
    return TransitionStats(
        method=method, version=version, sent_bytes=sent1 - sent0,
        received_bytes=recv1 - recv0, calls=calls1 - calls0, peak_weight_bytes=peak,
        redundant_bytes=peak - gen_nbytes, time_s=elapsed)


def agree_on_specs(desc: list[tuple], world: Group, ledger: CommLedger,
                   device: torch.device) -> None:
    """Collective over ``world``: ValueError on every rank, naming the first difference,
    unless every rank passed the same ``desc`` (one 8-byte digest each when they agree)."""
    digest = hashlib.sha256(repr(desc).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64,
                        device=device)
    everyone = comm.all_gather_tensor(mine, world, ledger, "meta")
    if bool((everyone == mine).all()):
        return
    # Slow path, only on mismatch: find and name the first difference, on every rank.
    descs = comm.all_gather_object(desc, world, ledger, "meta")
    raise ValueError(f"shard specs differ across ranks: {_first_difference(descs, world.ranks)}")


def check_bucket_bytes(bucket_bytes: int) -> None:
    """Raise ValueError for a bucket size below 1 KiB (before any collective)."""
    if bucket_bytes < 1024:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be at least 1024")


def checksum(t: torch.Tensor) -> int:
    """The C++ checksum of ``t``'s bytes (copied to a contiguous CPU tensor when it is not
    one already)."""
    return _C.checksum(t.contiguous() if t.device.type == "cpu" else t.contiguous().cpu())


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
