"""Reward and cost workers: a scalar model (value head read at the last real token), rule
functions and/or a user's reward function of the decoded response, summed.

    score = model_weight * RM(prompt + response)[last token]  +  sum_k w_k * rule_k(text, answer)
            + compute_score(data_source, text, ground_truth, extra_info)

Rule components are returned per row (``reward/<name>``) so the controller logs each one.
Without a model the worker is CPU arithmetic on its DP share of the rows.  Rules and reward
functions read text: the responses are copied to the host once per call to be decoded (a host
synchronisation), and their scores join the model's on the worker's device.
"""

from __future__ import annotations

import torch

from engine.train import TrainEngine
from rlhf.algos import overlong_penalty
from rlhf.controller import THREE_D_PROTO, Batch, protocol
from rlhf.task import CompositeReward, load_tokenizer
from rlhf.task.reward_fn import FunctionReward
from rlhf.workers.common import (CheckpointedWorker, ShardCheckpoint, build_model, last_token_index,
                                 model_inputs, prompt_width)
from rlhf.workers.specs import ScoreSpec


def model_scores(engine: TrainEngine, batch: Batch) -> torch.Tensor | None:
    """``[B]`` value-head output at the last real token of each sequence (None off the last
    pipeline stage)."""
    outs = engine.forward([model_inputs(batch)], temperature=1.0)  # a value head: unused
    if outs is None:
        return None
    idx = last_token_index(batch["attention_mask"])
    return outs[0]["values"].gather(1, idx[:, None]).squeeze(1)


class _ScoreWorker(CheckpointedWorker):
    key = "scores"

    def __init__(self, args: ScoreSpec) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.tokenizer)
        self.function = FunctionReward(args.function) if args.function else None
        self.model = build_model(args.model, self.groups, self.device, self.experts) \
            if args.model else None
        self.engine = TrainEngine(self.model, precision=args.precision, frozen=True) \
            if self.model is not None else None
        self.checkpoint = ShardCheckpoint(self.model)  # no model: nothing to save
        self.rules = CompositeReward.from_weights(args.rule_weights) \
            if any(args.rule_weights.values()) else None

    def _texts(self, batch: Batch) -> list[str]:
        if "solution_str" in batch.non_tensors:  # multi-turn: the final assistant message
            return list(batch["solution_str"])
        plen = prompt_width(batch)
        responses = batch["input_ids"][:, plen:].cpu()  # host synchronisation: decoded to text
        return [self.tokenizer.decode_response(r) for r in responses]

    def _score(self, batch: Batch) -> Batch | None:
        device = batch.device
        total = torch.zeros(len(batch), device=device)
        out: dict[str, torch.Tensor] = {}
        if self.engine is not None:
            s = model_scores(self.engine, batch)
            if s is None:
                return None
            out[f"{self.key}_model"] = s
            total += self.args.model_weight * s
        texts = self._texts(batch)
        if self.rules is not None:
            r = self.rules(texts, batch["answer"])
            for name, v in r.components.items():
                out[f"reward/{name}"] = v
            total += r.total.to(device)
        if self.function is not None:
            scores, fields = self.function(texts, batch["answer"], batch["data_source"],
                                           batch["extra_info"], batch["uid"])
            for name, v in fields.items():
                out[f"reward/{name}"] = v
            total += scores.to(device)
        if self.args.cost_rule is not None:
            total += torch.tensor([self.args.cost_rule.cost(t) for t in texts], device=device)
        if self.args.overlong is not None:
            o = self.args.overlong
            lengths = batch["response_mask"].bool().sum(-1)
            out["reward/overlong_penalty"] = overlong_penalty(lengths, o.max_len, o.buffer,
                                                              o.factor)
            total += out["reward/overlong_penalty"]
        out[self.key] = total
        return Batch(out)



class RewardWorker(_ScoreWorker):
    """``compute_reward``: ``scores [B]`` (+ ``reward/<rule>`` components)."""

    key = "scores"

    @protocol(THREE_D_PROTO, phase="log_probs")
    def compute_reward(self, batch: Batch) -> Batch | None:
        return self._score(batch)


class CostWorker(_ScoreWorker):
    """``compute_cost``: Safe-RLHF ``costs [B]`` from a cost model or the cost rule."""

    key = "costs"

    @protocol(THREE_D_PROTO, phase="log_probs")
    def compute_cost(self, batch: Batch) -> Batch | None:
        return self._score(batch)
