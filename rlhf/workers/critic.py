"""Critic worker: a Llama with a scalar value head, trained with the clipped value loss.

The Safe-RLHF cost critic is the same class on other fields (``cost_values`` /
``cost_returns``), chosen by ``value_key`` / ``return_key``.
"""

from __future__ import annotations

import functools

import torch

from engine.train import TrainEngine
from rlhf.controller import THREE_D_PROTO, Batch, protocol
from rlhf.metrics import detached, host_records
from rlhf.programs import algorithm
from rlhf.workers.common import (CheckpointedWorker, ShardCheckpoint, build_model,
                                 forward_outputs, loss_denominator, mean_row, response_head_from,
                                 response_outputs, update_micro_batches)
from rlhf.workers.specs import CriticSpec


class CriticWorker(CheckpointedWorker):
    """Value model: ``compute_values`` and ``update_critic``."""

    def __init__(self, spec: CriticSpec) -> None:
        self.spec = spec
        self.model = build_model(spec.model, self.groups, self.device, self.experts)
        self.engine = TrainEngine(self.model, spec.optim, precision=spec.precision)
        self.value_loss = algorithm(spec.algo).value_loss
        self.checkpoint = ShardCheckpoint(self.model, self.engine)

    @protocol(THREE_D_PROTO, phase="log_probs")
    def compute_values(self, batch: Batch) -> Batch | None:
        """Value of the state before each response token, ``[B, N]``."""
        out = forward_outputs(self.engine, batch, self.spec.update.max_tokens,
                              temperature=1.0,  # a value head: no distribution to scale
                              micro_rows=self.spec.update.micro_batch_size)
        if out is None:
            return None
        return Batch({self.spec.value_key: response_outputs(out["values"], batch)})

    @protocol(THREE_D_PROTO, phase="update")
    def update_critic(self, batch: Batch) -> Batch | None:
        s = self.spec
        data = batch.select(["input_ids", "attention_mask", "response_mask", s.value_key,
                             s.return_key])
        records: list[dict[str, torch.Tensor | float]] = []

        def loss_fn(outputs: dict, mb: dict, denominator: float) -> torch.Tensor:
            values = response_outputs(outputs["values"], batch)
            loss, m = self.value_loss(values, mb[s.value_key], mb[s.return_key],
                                      mb["response_mask"], s.loss.value_clip,
                                      s.loss.loss_agg_mode, denominator)
            records.append(detached(m))
            return loss

        norms = []
        for _ in range(s.update.epochs):
            for mbs in update_micro_batches(data, s.update, self.groups.train_dp):
                # one denominator for the whole mini-batch (all micro-batches, all DP ranks)
                d = loss_denominator(mbs, s.loss.loss_agg_mode, self.groups.train_dp)
                norms.append(self.engine.train_step(
                    mbs, functools.partial(loss_fn, denominator=d),
                    head_from=response_head_from(batch), temperature=1.0,
                    remove_padding=s.update.max_tokens is not None)["grad_norm"])
        if not self.model.is_last:
            return None
        records.append({"grad_norm": sum(norms) / len(norms)})
        return mean_row(host_records(records))
