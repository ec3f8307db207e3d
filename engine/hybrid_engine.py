"""The actor's 3D-HybridEngine: one model, trained on ``p-t-d`` and generating on ``p_g-t_g``.

:class:`HybridEngine` owns the training model (:class:`TrainEngine`), its :class:`Resharder`
(both on one flat buffer; under expert parallelism a :class:`MoeResharder` that also moves the
experts' buffer) and a rollout engine (the native :class:`GenerationEngine` by
default, or any object with the :class:`Rollout` methods, e.g. the vLLM adapter).  One
iteration of the paper's workflow::

    with engine.generation_mode() as stats:         # (1) micro-DP all-gather of the weights
        out = engine.generate_sequences(prompts)    # (2) each generation replica generates its
                                                    #     share, (3) all-gather inside the
                                                    #     micro-DP group -> training data layout
    # leaving the block: (4) back to training; the training shard never moved, the rollout
    #                     drops the weights and (unless it keeps them) its KV cache and graphs
    engine.train.train_step(...)                    # (5) losses and update

Data layout of step (2)-(3) for one training DP rank with ``B`` prompts and micro-DP size m::

    prompts of DP rank d   [B, P]   (the same on every rank of the training replica)
    generation replica k   rows [k*B/m, (k+1)*B/m)        k = micro-DP rank
    after the all-gather   [B, P+N] on every rank of the replica, rows in prompt order
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol

import torch

from engine.generation import GenerationEngine
from engine.generation_io import GenerationOutput, check_prompts
from engine.model import ParallelLlama
from engine.sampling import SamplingParams, derive_seed
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.comm import all_gather_tensor
from hybridflow_comm.expert_reshard import MoeResharder
from hybridflow_comm.reshard import Resharder, TransitionStats


class Rollout(Protocol):
    """What :class:`HybridEngine` needs from a generation backend."""

    def load_weights(self, resharder: Resharder) -> None:
        """Take the new generation weights (the resharder is in generation mode)."""

    def set_adapters(self, source, lora) -> None:
        """LoRA adapters for the next :meth:`load_weights`: ``source`` holds them in the
        generation layout as a resharder holds weights (``generation_params()``,
        ``named_generation_weights()``, ``version``), ``lora`` their
        :class:`engine.lora_config.LoraConfig`; only a LoRA actor calls it."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 sampling: SamplingParams) -> GenerationOutput:
        """Generate for this generation replica's prompts."""

    def release(self) -> None:
        """Drop every reference to the generation weights, and give back the memory of the
        caches (KV cache, decode graphs) unless the backend was built to keep them
        (:class:`GenerationEngine` ``keep_cache``): training runs next."""


class HybridEngine:
    """Training and generation of the actor on the same ranks and the same flat buffer.

    Args:
        model: this rank's training model (its buffer becomes the resharder's).
        optim: optimiser settings of the training engine.
        rollout: generation backend (default: :class:`GenerationEngine` on the layout, whose
            KV cache and decode graphs serve every call of a generation block and are
            dropped on the way back to training; one built with ``keep_cache=True`` keeps
            them across iterations).
        verify: checksum-verify the generation weights after every transition (the dense
            ones under expert parallelism).
        train: the training engine of ``model`` when the caller built it (then ``optim`` is
            not given); default: a new one with ``optim``.
        offload_during_generation: park the training state (masters, optimizer state,
            gradient buffer) in host memory for the whole of :meth:`generation_mode`, so that
            generation's peak device memory excludes it (:meth:`TrainEngine.
            offload_train_state`).

    Construction is collective over the layout's ranks (the resharder exchanges specs).
    """

    def __init__(self, model: ParallelLlama, optim: OptimConfig | None = None,
                 rollout: Rollout | None = None, verify: bool = False,
                 train: TrainEngine | None = None,
                 offload_during_generation: bool = False) -> None:
        if train is not None and (optim is not None or train.model is not model):
            raise ValueError("HybridEngine(train=...) takes the training engine of this model "
                             "and no optim (the engine has its own)")
        if isinstance(rollout, GenerationEngine) and rollout.experts != model.generation_experts:
            raise ValueError(f"HybridEngine: the rollout computes experts {rollout.experts}, the "
                             f"generation layout gives this rank {model.generation_experts} "
                             f"(GenerationEngine(experts=model.generation_experts))")
        self.model = model
        self.groups = model.groups
        self.layout = model.groups.layout
        self.train = train if train is not None else TrainEngine(model, optim)
        self.resharder = Resharder(model.specs, model.groups, verify_every=verify,
                                   buffer=model.buffer) if model.experts is None else \
            MoeResharder(model.specs, model.groups, model.experts.layout, verify_every=verify,
                         buffer=model.buffer, expert_buffer=model.expert_buffer)
        # LoRA: the frozen base moves once and its generation slots are kept; the adapters
        # (a flat buffer of their own) move at every transition
        self.adapter_resharder = (Resharder(model.adapter_specs, model.groups,
                                            verify_every=verify, buffer=model.adapter_buffer)
                                  if model.lora is not None else None)
        self.rollout = rollout if rollout is not None else GenerationEngine(
            model.config, model.groups, device=model.device, experts=model.generation_experts)
        self.offload_during_generation = offload_during_generation
        self.last_transition: TransitionStats | None = None
        self.last_offloaded_nbytes = 0
        self._generating = False

    @property
    def version(self) -> int:
        return self.resharder.version

    @contextmanager
    def generation_mode(self):
        """Reshard to the generation layout for the block; back to training on exit.

        Yields the :class:`TransitionStats` of the transition (``time_s``, ``version``...).
        With ``offload_during_generation`` the training state leaves the device before the
        transition and comes back after the return to training.
        """
        if self._generating:
            raise RuntimeError("generation_mode() is already active")
        lora = self.adapter_resharder is not None
        with self._training_state_offloaded():
            before = self.resharder.version
            stats = self.resharder.to_generation(refill=not (lora and before > 0))
            if stats.version != before + 1:
                raise RuntimeError(f"weight version went from {before} to {stats.version}, "
                                   f"expected {before + 1}")
            if lora:
                stats = _combined(stats, self.adapter_resharder.to_generation())
                self.rollout.set_adapters(self.adapter_resharder, self.model.lora)
            self.last_transition = stats
            self._generating = True
            try:
                self.rollout.load_weights(self.resharder)
                yield stats
            finally:
                self.rollout.release()
                self._generating = False
                self.resharder.to_training(release=not lora)
                if lora:
                    self.adapter_resharder.to_training()

    @contextmanager
    def _training_state_offloaded(self):
        """With ``offload_during_generation``: the training state in host memory for the block
        (``last_offloaded_nbytes`` of device memory given back)."""
        if not self.offload_during_generation:
            yield
            return
        self.last_offloaded_nbytes = self.train.offload_train_state()
        try:
            yield
        finally:
            self.train.reload_train_state()

    def generate_sequences(self, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor | None = None,
                           sampling: SamplingParams | None = None) -> GenerationOutput:
        """Generate for this training DP rank's prompts; returns them all, on every rank.

        Args:
            input_ids: ``[B, P]`` left-padded prompts of this DP rank (the same on every rank
                of the training replica), split in equal shares over the micro-DP group (a
                ``B`` it does not divide: the last prompt is repeated up to a multiple, and
                the copies' rollouts dropped).
            attention_mask: ``[B, P]`` (default all ones).
            sampling: settings; generation replica ``dp_g`` samples with its own stream,
                ``derive_seed(seed, "replica", dp_g)``.

        Returns:
            The :class:`GenerationOutput` of all ``B`` rows in prompt order (training data
            layout); ``stats`` are this rank's generation stats plus ``gather_time_s``.
        """
        if not self._generating:
            raise RuntimeError("generate_sequences() must run inside generation_mode()")
        sampling = sampling or SamplingParams(temperature=0.0)
        mask = check_prompts(input_ids, attention_mask, self.model.config, sampling)
        group = self.groups.micro_dp
        m, k = group.size, group.rank
        batch = input_ids.shape[0]
        pad = -batch % m  # equal shares: the last prompt repeated, its copies dropped after
        if pad:
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad, -1)])
            mask = torch.cat([mask, mask[-1:].expand(pad, -1)])
        share = (batch + pad) // m
        coords = self.layout.gen_coords(self.groups.rank)
        assert k == coords.micro_dp, (k, coords)  # group order = micro-DP coordinate
        rows = slice(k * share, (k + 1) * share)
        mine = self.rollout.generate(
            input_ids[rows], mask[rows],
            replace(sampling, seed=derive_seed(sampling.seed, "replica", coords.dp_g)))
        t0 = time.perf_counter()
        gathered = GenerationOutput(
            input_ids=_all_gather_rows(mine.input_ids, group)[:batch],
            attention_mask=_all_gather_rows(mine.attention_mask, group)[:batch],
            log_probs=_all_gather_rows(mine.log_probs, group)[:batch],
            routes=None if mine.routes is None else
            _all_gather_rows(mine.routes.to(torch.int32), group)[:batch].to(torch.int16),
            prompt_length=mine.prompt_length,
            stats={**mine.stats, "gather_time_s": time.perf_counter() - t0})
        return gathered


def _all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every member's ``[b, ...]`` rows in group-rank order."""
    return all_gather_tensor(t, group).flatten(0, 1)


def _combined(base: TransitionStats, adapters: TransitionStats) -> TransitionStats:
    """One transition's stats from the base's and the adapters' (the base's version)."""
    return replace(base, sent_bytes=base.sent_bytes + adapters.sent_bytes,
                   received_bytes=base.received_bytes + adapters.received_bytes,
                   calls=base.calls + adapters.calls,
                   peak_weight_bytes=base.peak_weight_bytes + adapters.peak_weight_bytes,
                   redundant_bytes=base.redundant_bytes + adapters.redundant_bytes,
                   time_s=base.time_s + adapters.time_s)
