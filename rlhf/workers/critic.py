"""Critic worker: a Llama with a scalar value head, trained with the clipped value loss.

The Safe-RLHF cost critic is the same class on other fields (``cost_values`` /
``cost_returns``), chosen by ``value_key`` / ``return_key``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.train import OptimConfig, TrainEngine
from rlhf.algos import value_loss
from rlhf.controller import ONE_TO_ALL, THREE_D_PROTO, Batch, Worker, protocol
from rlhf.workers.common import (ModelArgs, build_model, gather_full_state, load_full_state,
                                 mean_row, minibatches, model_inputs, response_head_from,
                                 response_outputs)


@dataclass(frozen=True)
class ValueLossArgs:
    """Critic update settings (plain values, from the run config)."""

    epochs: int = 1
    mini_batch_rows: int = 8
    """Rows per optimizer step on one DP rank."""
    micro_batch_size: int = 2
    value_clip: float | None = 0.2
    loss_agg_mode: str = "token-mean"
    value_key: str = "values"
    """Field the values are written to / read from (``cost_values`` for the cost critic)."""
    return_key: str = "returns"
    """Field of the value targets (``cost_returns`` for the cost critic)."""


class CriticWorker(Worker):
    """Value model: ``compute_values`` and ``update_critic``."""

    def __init__(self, model: ModelArgs, optim: OptimConfig, loss: ValueLossArgs) -> None:
        self.model = build_model(model, self.groups)
        self.engine = TrainEngine(self.model, optim)
        self.loss = loss

    @protocol(THREE_D_PROTO)
    def compute_values(self, batch: Batch) -> Batch | None:
        """Value of the state before each response token, ``[B, N]``."""
        outs = self.engine.forward([model_inputs(batch)], head_from=response_head_from(batch))
        if outs is None:
            return None
        return Batch({self.loss.value_key: response_outputs(outs[0]["values"], batch)})

    @protocol(THREE_D_PROTO)
    def update_critic(self, batch: Batch) -> Batch | None:
        a = self.loss
        data = batch.select(["input_ids", "attention_mask", "response_mask", a.value_key,
                             a.return_key])
        records: list[dict[str, float]] = []

        def loss_fn(outputs: dict, mb: dict) -> torch.Tensor:
            values = response_outputs(outputs["values"], batch)
            loss, m = value_loss(values, mb[a.value_key], mb[a.return_key],
                                 mb["response_mask"].float(), a.value_clip, a.loss_agg_mode)
            records.append({k: float(v) for k, v in m.items()})
            return loss

        norms = []
        for _ in range(a.epochs):
            for mbs in minibatches(data, a.mini_batch_rows, a.micro_batch_size):
                norms.append(self.engine.train_step(
                    mbs, loss_fn, head_from=response_head_from(batch))["grad_norm"])
        if not self.model.is_last:
            return None
        records.append({"grad_norm": sum(norms) / len(norms)})
        return mean_row(records)

    @protocol(ONE_TO_ALL)
    def full_state(self) -> dict | None:
        return gather_full_state(self.model, self.engine)

    @protocol(ONE_TO_ALL)
    def load_state(self, state: dict) -> None:
        load_full_state(self.model, state, self.engine)
