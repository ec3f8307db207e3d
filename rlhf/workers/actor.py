"""Actor and reference workers.

:class:`PolicyWorker` is the policy's training side: log-probs and the update on ``p-t-d``
(a :class:`engine.train.TrainEngine`), nothing for generation.  :class:`ActorWorker` adds the
:class:`engine.hybrid_engine.HybridEngine` on the same model: for ``generate_sequences`` it
reshards in place to ``p_g-t_g`` (micro-DP all-gather), generates its share, gathers the
rollouts back to the training data layout and returns to training.  (The actor of a
disaggregated run, :class:`rlhf.workers.rollout.PushingActorWorker`, is a PolicyWorker.)
Every data method uses 3D_PROTO: a DP replica's whole TP x PP block receives the same rows,
and the controller collects from (pp = last, tp = 0) of every replica.
"""

from __future__ import annotations

import functools
import time
from contextlib import ExitStack, contextmanager

import torch

from engine.hf_interop import stream_hf_checkpoint
from engine.hybrid_engine import HybridEngine
from engine.peft_interop import save_merged, save_peft_adapter
from engine.sampling import SamplingParams
from engine.train import TrainEngine
from rlhf.algos import actor_loss, get_policy_loss
from rlhf.controller import ONE_TO_ALL, THREE_D_PROTO, Batch, protocol
from rlhf.metrics import detached, host_records
from rlhf.programs import algorithm
from rlhf.workers.common import (CheckpointedWorker, ShardCheckpoint, build_model,
                                 forward_outputs, loss_denominator, mean_row, response_head_from,
                                 response_outputs, update_micro_batches)
from rlhf.workers.rollout_engine import build_rollout, routes_field
from rlhf.workers.specs import ActorSpec, ReferenceSpec


class PolicyWorker(CheckpointedWorker):
    """The policy's training side: log-probs, the PPO-style update, the HF export.  Its
    model's flat buffer is sized by the role's layout (:func:`hybridflow_comm.shard_spec.
    slot_specs`): the training shard only when the layout's generation side is its training
    side, as in the disaggregated actor's plan."""

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.model = build_model(spec.model, self.groups, self.device, self.experts)
        self.train = TrainEngine(self.model, spec.optim, precision=spec.precision)
        # actor.loss.mode, else the algorithm's own registered policy loss
        self.pg_loss = get_policy_loss(spec.loss.mode or algorithm(spec.algo).policy_loss)
        self.checkpoint = ShardCheckpoint(self.model, self.train)

    @protocol(ONE_TO_ALL)
    def weight_bytes(self) -> int:
        """Bytes of weights this rank's flat buffer holds: its training shard plus, on an
        actor that generates, the other slots of its generation shard (and of its experts'
        buffer under expert parallelism)."""
        experts = self.model.expert_buffer
        return self.model.buffer.gen_nbytes + (0 if experts is None else experts.gen_nbytes)

    @protocol(THREE_D_PROTO, phase="log_probs")
    def compute_log_prob(self, batch: Batch) -> Batch | None:
        """``old_log_probs [B, N]`` (and ``entropy``) of the rollout under the current policy
        at the sampling temperature (what the rollout's own log-probs are)."""
        out = forward_outputs(self.train, batch, self.spec.update.max_tokens,
                              temperature=self.spec.temperature,
                              micro_rows=self.spec.update.micro_batch_size, replay=True)
        if out is None:
            return None  # not the last pipeline stage: not collected
        return Batch({"old_log_probs": response_outputs(out["log_probs"], batch),
                      "entropy": response_outputs(out["entropy"], batch)})

    @protocol(THREE_D_PROTO, phase="log_probs")
    def compute_ref_log_prob(self, batch: Batch) -> Batch | None:
        """``ref_log_probs [B, N]`` of a LoRA actor: its own base with the adapters off (the
        reference policy, with no second model in memory)."""
        if self.model.lora is None:
            raise RuntimeError("compute_ref_log_prob on the actor needs actor.lora.rank > 0 "
                               "(without LoRA the reference is a model of its own)")
        with self.model.adapters_disabled():
            out = forward_outputs(self.train, batch, self.spec.update.max_tokens,
                                  temperature=self.spec.temperature,
                                  micro_rows=self.spec.update.micro_batch_size, replay=True)
        if out is None:
            return None
        return Batch({"ref_log_probs": response_outputs(out["log_probs"], batch)})

    @protocol(THREE_D_PROTO, phase="update")
    def update_actor(self, batch: Batch) -> Batch | None:
        """``epochs`` passes of mini-batch steps; returns one row of mean metrics."""
        s, loss = self.spec, self.spec.loss
        fields = ["input_ids", "attention_mask", "response_mask", "old_log_probs", "advantages"]
        if s.kl_loss is not None:
            fields.append("ref_log_probs")
        if "routes" in batch.keys():  # router replay: the rollout's experts
            fields.append("routes")
        data = batch.select(fields)
        records: list[dict[str, torch.Tensor | float]] = []

        def loss_fn(outputs: dict, mb: dict, denominator: float) -> torch.Tensor:
            lp = response_outputs(outputs["log_probs"], batch)
            ent = response_outputs(outputs["entropy"], batch)
            total, m = actor_loss(
                lp, mb["old_log_probs"], mb["advantages"], mb["response_mask"],
                pg_loss=self.pg_loss, cfg=loss, ref_log_prob=mb.get("ref_log_probs"),
                kl=s.kl_loss, entropy=ent, denominator=denominator)
            records.append(detached(m))
            return total

        steps = []
        u = s.update
        for _ in range(u.epochs):
            for mbs in update_micro_batches(data, u, self.groups.train_dp):
                # one denominator for the whole mini-batch (all micro-batches, all DP ranks)
                d = loss_denominator(mbs, loss.loss_agg_mode, self.groups.train_dp)
                steps.append(self.train.train_step(
                    mbs, functools.partial(loss_fn, denominator=d),
                    head_from=response_head_from(batch), temperature=self.spec.temperature,
                    remove_padding=u.max_tokens is not None))
        if not self.model.is_last:
            return None
        # the step's own figures: its gradient norm, a mixture of experts' load-balancing loss
        for key in ("grad_norm", "router_aux_loss"):
            if key in steps[0]:
                records.append({key: sum(r[key] for r in steps) / len(steps)})
        if "routes" in data.keys():  # router replay: the share of real tokens it routed
            real = batch["attention_mask"].bool()
            replayed = (data["routes"][..., 0, 0] >= 0) & real
            records.append({"router_replay_fraction": float(replayed.sum() / real.sum())})
        return mean_row(host_records(records))

    @protocol(ONE_TO_ALL)
    def save_hf(self, folder: str) -> None:
        """The policy as an HF checkpoint in ``folder`` (collective; layout rank 0 writes it
        one tensor at a time, never holding the whole model); with LoRA the PEFT adapter
        (``adapter_config.json`` + ``adapter_model.safetensors``) over ``init_from``."""
        if self.model.lora is not None:
            save_peft_adapter(self.model, folder, self.spec.model.init_from)
            return
        stream_hf_checkpoint(self.model, folder)

    @protocol(ONE_TO_ALL)
    def save_hf_merged(self, folder: str) -> None:
        """The LoRA policy with its adapters merged (``W + s B A``) as a plain HF checkpoint
        in ``folder`` (collective; the model's own weights are not touched)."""
        save_merged(self.model, folder)


class ActorWorker(PolicyWorker):
    """The policy that also generates: a :class:`HybridEngine` around the training engine,
    on the same flat buffer, generating with the backend of ``rollout.engine`` (vLLM sleeps
    while the actor trains)."""

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        rollout = build_rollout(spec.rollout, self.model.config, self.groups, self.device,
                                init_from=spec.model.init_from, seed=spec.model.seed,
                                sleep_between_phases=True, lora=spec.model.lora,
                                record_routes=spec.router_replay,
                                experts=self.model.generation_experts)
        self.engine = HybridEngine(self.model, train=self.train, rollout=rollout,
                                   offload_during_generation=spec.offload_during_generation)

    held: ExitStack | None = None
    """The generation layout held across calls (:meth:`hold_generation`)."""

    @protocol(ONE_TO_ALL, phase="generation")
    def hold_generation(self, hold: bool) -> float:
        """Enter the generation layout and stay in it for the following
        ``generate_sequences`` calls (``hold=True``: the turns of a multi-turn rollout, with
        the same weights), or go back to training (``False``); returns the transition's
        seconds (0 on the way back)."""
        if hold == (self.held is not None):
            raise RuntimeError(f"hold_generation({hold}) but the generation layout is "
                               f"{'already' if hold else 'not'} held")
        if not hold:
            self.held, held = None, self.held
            held.close()
            return 0.0
        self.held = ExitStack()
        return self.held.enter_context(self.engine.generation_mode()).time_s

    @protocol(THREE_D_PROTO, phase="generation")
    def generate_sequences(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Rollouts of this replica's prompts (input_ids/attention_mask ``[B, P]``); in the
        held generation layout when :meth:`hold_generation` holds it (no transition)."""
        t0 = time.perf_counter()
        with self._generation_layout() as (reshard_s, reshard_bytes):
            out = self.engine.generate_sequences(prompts["input_ids"],
                                                 prompts["attention_mask"], sampling)
        plen = out.prompt_length
        return Batch({"input_ids": out.input_ids, "attention_mask": out.attention_mask,
                      "response_mask": out.response_mask,
                      "rollout_log_probs": out.log_probs, **routes_field(out)},
                     dict(prompts.non_tensors),
                     {"reshard_s": reshard_s, "reshard_bytes": reshard_bytes,
                      "gen_s": time.perf_counter() - t0, "prompt_len": plen})

    @contextmanager
    def _generation_layout(self):
        """The block in the generation layout; yields the seconds its transition took and the
        bytes this rank received in it (0, 0 inside a held layout)."""
        if self.held is not None:
            yield 0.0, 0
            return
        with self.engine.generation_mode() as stats:
            yield stats.time_s, stats.received_bytes


class ReferenceWorker(CheckpointedWorker):
    """The frozen initial policy: log-probs for the KL term."""

    def __init__(self, spec: ReferenceSpec) -> None:
        self.spec = spec
        self.model = build_model(spec.model, self.groups, self.device, self.experts)
        self.engine = TrainEngine(self.model, precision=spec.precision, frozen=True)
        self.checkpoint = ShardCheckpoint(self.model)

    @protocol(THREE_D_PROTO, phase="log_probs")
    def compute_ref_log_prob(self, batch: Batch) -> Batch | None:
        out = forward_outputs(self.engine, batch, self.spec.max_tokens,
                              temperature=self.spec.temperature,
                              micro_rows=self.spec.micro_batch_size, replay=True)
        if out is None:
            return None
        return Batch({"ref_log_probs": response_outputs(out["log_probs"], batch)})
