"""Actor and reference workers.

The actor owns a :class:`engine.hybrid_engine.HybridEngine`: it trains on ``p-t-d`` and, for
``generate_sequences``, reshards in place to ``p_g-t_g`` (micro-DP all-gather), generates its
share, gathers the rollouts back to the training data layout and returns to training.
Every data method uses 3D_PROTO: a DP replica's whole TP x PP block receives the same rows,
and the controller collects from (pp = last, tp = 0) of every replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.hybrid_engine import HybridEngine
from engine.sampling import SamplingParams
from engine.train import OptimConfig, TrainEngine
from rlhf.algos import actor_loss
from rlhf.controller import ONE_TO_ALL, THREE_D_PROTO, Batch, Worker, protocol
from rlhf.workers.common import (ModelArgs, build_model, gather_full_state, load_full_state,
                                 mean_row, minibatches, model_inputs, response_head_from,
                                 response_outputs)


@dataclass(frozen=True)
class PolicyLossArgs:
    """Actor update settings (plain values, from the run config)."""

    epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_rows: int = 8
    """Rows per optimizer step on one DP rank (mini_batch_size / dp)."""
    micro_batch_size: int = 2
    """Rows per forward/backward."""
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"
    kl_loss_coef: float | None = None
    """KL-as-loss coefficient; None = no KL loss term (KL in the reward or none)."""
    kl_estimator: str = "k3"


class ActorWorker(Worker):
    """The policy: generation (HybridEngine), log-probs and the PPO-style update."""

    def __init__(self, model: ModelArgs, optim: OptimConfig, loss: PolicyLossArgs) -> None:
        self.model = build_model(model, self.groups)
        self.engine = HybridEngine(self.model, optim)
        self.loss = loss

    @protocol(THREE_D_PROTO)
    def generate_sequences(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Rollouts of this replica's prompts (input_ids/attention_mask ``[B, P]``)."""
        t0 = time.perf_counter()
        with self.engine.generation_mode() as stats:
            out = self.engine.generate_sequences(prompts["input_ids"],
                                                 prompts["attention_mask"], sampling)
        plen = out.prompt_length
        return Batch({"input_ids": out.input_ids, "attention_mask": out.attention_mask,
                      "response_mask": out.response_mask,
                      "rollout_log_probs": out.log_probs},
                     dict(prompts.non_tensors),
                     {"reshard_s": stats.time_s, "gen_s": time.perf_counter() - t0,
                      "prompt_len": plen})

    @protocol(THREE_D_PROTO)
    def compute_log_prob(self, batch: Batch) -> Batch | None:
        """``old_log_probs [B, N]`` (and ``entropy``) of the rollout under the current policy."""
        outs = self.engine.train.forward([model_inputs(batch)],
                                         head_from=response_head_from(batch))
        if outs is None:
            return None  # not the last pipeline stage: not collected
        return Batch({"old_log_probs": response_outputs(outs[0]["log_probs"], batch),
                      "entropy": response_outputs(outs[0]["entropy"], batch)})

    @protocol(THREE_D_PROTO)
    def update_actor(self, batch: Batch) -> Batch | None:
        """``epochs`` passes of mini-batch steps; returns one row of mean metrics."""
        a = self.loss
        fields = ["input_ids", "attention_mask", "response_mask", "old_log_probs", "advantages"]
        if a.kl_loss_coef is not None:
            fields.append("ref_log_probs")
        data = batch.select(fields)
        records: list[dict[str, float]] = []

        def loss_fn(outputs: dict, mb: dict) -> torch.Tensor:
            lp = response_outputs(outputs["log_probs"], batch)
            ent = response_outputs(outputs["entropy"], batch)
            mask = mb["response_mask"].float()
            loss, m = actor_loss(
                lp, mb["old_log_probs"], mb["advantages"], mask,
                ref_log_prob=mb.get("ref_log_probs"), kl_loss_coef=a.kl_loss_coef or 0.0,
                kl_estimator=a.kl_estimator, entropy=ent, entropy_coeff=a.entropy_coeff,
                loss_agg_mode=a.loss_agg_mode, clip_ratio=a.clip_ratio,
                clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                clip_ratio_c=a.clip_ratio_c)
            records.append({k: float(v) for k, v in m.items()})
            return loss

        grad_norms = []
        for _ in range(a.epochs):
            for mbs in minibatches(data, a.mini_batch_rows, a.micro_batch_size):
                grad_norms.append(self.engine.train.train_step(
                    mbs, loss_fn, head_from=response_head_from(batch))["grad_norm"])
        if not self.model.is_last:
            return None
        records.append({"grad_norm": sum(grad_norms) / len(grad_norms)})
        return mean_row(records)

    @protocol(ONE_TO_ALL)
    def full_state(self) -> dict | None:
        return gather_full_state(self.model, self.engine.train)

    @protocol(ONE_TO_ALL)
    def load_state(self, state: dict) -> None:
        load_full_state(self.model, state, self.engine.train)


class ReferenceWorker(Worker):
    """The frozen initial policy: log-probs for the KL term."""

    def __init__(self, model: ModelArgs) -> None:
        self.model = build_model(model, self.groups)
        self.engine = TrainEngine(self.model)  # forward only; the optimizer is never stepped

    @protocol(THREE_D_PROTO)
    def compute_ref_log_prob(self, batch: Batch) -> Batch | None:
        outs = self.engine.forward([model_inputs(batch)], head_from=response_head_from(batch))
        if outs is None:
            return None
        return Batch({"ref_log_probs": response_outputs(outs[0]["log_probs"], batch)})

    @protocol(ONE_TO_ALL)
    def full_state(self) -> dict | None:
        return gather_full_state(self.model)

    @protocol(ONE_TO_ALL)
    def load_state(self, state: dict) -> None:
        load_full_state(self.model, state)
