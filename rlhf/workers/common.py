"""Pieces every role worker shares: building a model from its :class:`ModelSpec`, full-state
checkpoint I/O through the toolkit, and the sequence layout of a rollout batch.

Rollout batch (rows = sequences; P = prompt width, N = response width, S = P + N)::

    input_ids       [B, S]  | pad .. pad  prompt | response  pad .. pad |
    attention_mask  [B, S]  | 0 ..  0    1 .. 1 | 1 .. 1    0 ..  0    |
    response_mask   [B, N]                       | 1 .. 1    0 ..  0    |

A model forward gives per-position outputs (log-prob of token ``t+1`` at position ``t``, or
the value at ``t``).  The response token ``j`` is predicted at position ``P - 1 + j``, so the
roles run the head from position ``P - 1`` only (:func:`response_head_from`; the prompt
positions never reach the LM head) and keep the first ``N`` outputs
(:func:`response_outputs`): the value of the state before each action, the log-prob of each
action.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.hf_interop import gather_full_state_dict, load_hf_checkpoint
from engine.llama_spec import init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from hybridflow_comm.groups import Group, HybridGroups
from hybridflow_comm.shard_spec import train_shard
from rlhf.algos import agg_count, agg_denominator
from rlhf.controller import Batch
from rlhf.workers.specs import ModelSpec


def build_model(args: ModelSpec, groups: HybridGroups) -> ParallelLlama:
    """This rank's :class:`ParallelLlama`, initialised from ``args`` (deterministic)."""
    model = ParallelLlama(args.config, groups, head=args.head)
    load_full_state_dict(model, init_full_state_dict(args.config, args.seed, args.head))
    if args.init_from:
        load_hf_checkpoint(model, args.init_from, load_head=not args.fresh_head)
    return model


def response_head_from(batch: Batch) -> int:
    """The position predicting the first response token, ``P - 1``: where the head starts."""
    return prompt_width(batch) - 1


def response_outputs(t: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Head outputs from :func:`response_head_from` on -> the response positions ``[B, N]``."""
    return t[:, :batch["response_mask"].shape[1]]


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def split_micro(batch: Batch, micro: int) -> list[Batch]:
    """Consecutive micro-batches of ``micro`` rows (the last may be shorter)."""
    return [batch.rows(slice(i, i + micro)) for i in range(0, len(batch), micro)]


def minibatches(batch: Batch, rows: int, micro: int) -> list[list[dict]]:
    """Mini-batches of ``rows`` rows, each a list of equal micro-batch dicts."""
    return [[{k: v for k, v in mb.tensors.items()} for mb in split_micro(batch.rows(
        slice(i, i + rows)), micro)] for i in range(0, len(batch), rows)]


def micro_batch_denominator(count: float, mode: str, micro_batches: int, dp: int) -> float:
    """The denominator each micro-batch's loss takes, ``D / (micro_batches * dp)``.

    :meth:`engine.train.TrainEngine.train_step` minimises the mean of the losses of the
    ``micro_batches`` micro-batches of each of the ``dp`` ranks.  ``D`` is the mini-batch's
    :func:`rlhf.algos.agg_denominator` of ``count`` (its :func:`rlhf.algos.agg_count` over
    every micro-batch and DP rank).  A micro-batch that returns ``numerator / (D / (n * dp))``
    makes the engine's mean ``sum of all numerators / D``: the loss of the whole mini-batch in
    ``mode``, whatever its split (token-mean = mean over all its valid tokens, seq-mean-* =
    mean over all its non-empty sequences).
    """
    return agg_denominator(count, mode) / (micro_batches * dp)


def loss_denominator(micro_batches: list[dict], mode: str, dp: Group) -> float:
    """:func:`micro_batch_denominator` of one mini-batch: its local :func:`rlhf.algos.agg_count`
    summed over the DP group with one all-reduce (a collective: every rank of the role calls it
    once per mini-batch, before the step).

    Args:
        micro_batches: this rank's micro-batches of the mini-batch (``response_mask [b, N]``).
        mode: the loss's ``loss_agg_mode``.
        dp: the role's training DP group (``groups.train_dp``).
    """
    local = sum(agg_count(mb["response_mask"], mode) for mb in micro_batches)
    count = torch.tensor(float(local), dtype=torch.float64)
    if dp.pg is not None:
        dist.all_reduce(count, group=dp.pg)
    return micro_batch_denominator(float(count), mode, len(micro_batches), dp.size)


def mean_row(records: list[dict[str, float]]) -> Batch:
    """One row of per-key means (what the controller averages over DP replicas)."""
    keys = sorted({k for r in records for k in r})
    return Batch({k: torch.tensor([sum(r[k] for r in records if k in r)
                                   / max(1, sum(k in r for r in records))]) for k in keys})


def prompt_width(batch: Batch) -> int:
    return batch["input_ids"].shape[1] - batch["response_mask"].shape[1]


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of the last real token of each row (right padding after it)."""
    pos = torch.arange(attention_mask.shape[1]).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), pos, torch.zeros_like(pos)).max(dim=1).values


# Full-state checkpoints ----------------------------------------------------------------------
def _adam_state(engine, model: ParallelLlama, key: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.params.items():
        st = engine.optimizer.state.get(p, {})
        out[name] = st[key] if key in st else torch.zeros_like(p)
    return out


def gather_full_state(model: ParallelLlama, engine=None) -> dict | None:
    """Global weights (and Adam moments) of a role on its layout rank 0, None elsewhere.

    Collective over the role.  Layout-free: spec names and global shapes only, so a
    checkpoint loads into any ``(pp, tp, dp)`` (see :func:`load_full_state`).
    """
    out = {"weights": gather_full_state_dict(model)}
    if engine is not None:
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = gather_full_state_dict(model, _adam_state(engine, model, key))
        out["optim_step"] = engine.step_count
    return out if out["weights"] is not None else None


def load_full_state(model: ParallelLlama, state: dict, engine=None) -> None:
    """Cut this rank's shards out of a :func:`gather_full_state` result (any source layout)."""
    load_full_state_dict(model, state["weights"])
    if engine is None or "exp_avg" not in state:
        return
    n = int(state["optim_step"])
    engine.step_count = n
    if n == 0:
        return
    for spec in model.local_specs:
        p = model.params[spec.name]
        engine.optimizer.state[p] = {
            "step": torch.tensor(float(n)),
            **{k: train_shard(state[k][spec.name], spec, model.layout, model.groups.rank)
               .clone() for k in ("exp_avg", "exp_avg_sq")}}
