"""Pieces every role worker shares: building a model from its :class:`ModelSpec`, sharded
checkpoint I/O (:class:`ShardCheckpoint`), and the sequence layout of a rollout batch.

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

from engine.hf_interop import load_hf_checkpoint
from engine.hf_shards import shard_parts
from engine.llama_spec import init_full_state_dict
from engine.micro_batches import count_micro_batches, partition_by_tokens
from engine.lora import init_lora_state_dict
from engine.model import ParallelLlama, load_adapter_state_dict, load_full_state_dict
from engine.peft_interop import read_peft_adapter
from engine.train import TrainEngine
from hybridflow_comm.groups import ExpertGroups, Group, HybridGroups
from rlhf.algos import agg_count, agg_denominator
from rlhf.checkpoint import MOMENTS, OPTIM_STEP, Block, Blocks, ShardedSave, load_blocks, moment_key
from rlhf.controller import ONE_TO_ALL, Batch, Worker, protocol
from rlhf.workers.specs import ModelSpec, UpdateSpec


def build_model(args: ModelSpec, groups: HybridGroups, device: torch.device | None = None,
                experts: ExpertGroups | None = None) -> ParallelLlama:
    """This rank's :class:`ParallelLlama` on ``device`` (default cpu), initialised from
    ``args`` (deterministic: the initial weights are drawn on the host, then copied);
    ``experts``: its expert groups when the role splits the experts over EP ranks."""
    model = ParallelLlama(args.config, groups, head=args.head, device=device, lora=args.lora,
                          experts=experts)
    load_full_state_dict(model, init_full_state_dict(args.config, args.seed, args.head))
    if args.init_from:
        load_hf_checkpoint(model, args.init_from, load_head=not args.fresh_head)
    if args.lora is not None:
        load_adapter_state_dict(model, read_peft_adapter(args.lora_init_from, args.config,
                                                         args.lora)
                                if args.lora_init_from else
                                init_lora_state_dict(args.config, args.lora, args.seed))
    return model


def response_head_from(batch: Batch) -> int:
    """The position predicting the first response token, ``P - 1``: where the head starts."""
    return prompt_width(batch) - 1


def response_outputs(t: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Head outputs from :func:`response_head_from` on -> the response positions ``[B, N]``."""
    return t[:, :batch["response_mask"].shape[1]]


def model_inputs(batch: Batch, replay: bool = False) -> dict[str, torch.Tensor]:
    """What a forward reads: ids, mask and, with ``replay`` where the rollout recorded them
    (router replay: the policy's passes and its reference), its ``routes``."""
    extra = {"routes": batch["routes"]} if replay and "routes" in batch.keys() else {}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **extra}


def split_micro(batch: Batch, micro: int) -> list[Batch]:
    """Consecutive micro-batches of ``micro`` rows (the last may be shorter)."""
    return [batch.rows(slice(i, i + micro)) for i in range(0, len(batch), micro)]


def minibatches(batch: Batch, rows: int, micro: int) -> list[list[dict]]:
    """Mini-batches of ``rows`` rows, each a list of equal micro-batch dicts."""
    return [[{k: v for k, v in mb.tensors.items()} for mb in split_micro(batch.rows(
        slice(i, i + rows)), micro)] for i in range(0, len(batch), rows)]


def largest_counts(counts: list[int], dp: Group) -> list[int]:
    """Each of ``counts`` (micro-batch counts, one per mini-batch) as the largest over the DP
    group: one all-reduce (max) of host counts (gloo side of the group), so every rank plans
    the same split on the host."""
    t = torch.tensor(counts, device="cpu")
    if dp.pg is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp.pg)
    return t.tolist()


def token_minibatches(batch: Batch, rows: int, max_tokens: int, dp: Group) -> list[list[dict]]:
    """Mini-batches of ``rows`` rows, each split by :func:`engine.micro_batches.
    partition_by_tokens` into micro-batches of at most ``max_tokens`` real tokens
    (``attention_mask``), as many on every DP rank: each rank's count for each mini-batch,
    then one all-reduce (max) over ``dp`` for all of them (a collective: every rank of the
    role calls it, with as many mini-batches).  The budget is checked before it.
    """
    minis = [batch.rows(slice(i, i + rows)) for i in range(0, len(batch), rows)]
    lengths = [m["attention_mask"].sum(1).tolist() for m in minis]
    counts = largest_counts([count_micro_batches(n, max_tokens) for n in lengths], dp)
    out = []
    for m, n, k in zip(minis, lengths, counts):
        parts = partition_by_tokens(n, max_tokens, parts=k)
        out.append([{key: v[torch.tensor(p, device=v.device)] for key, v in m.tensors.items()}
                    for p in parts])
    return out


def update_micro_batches(batch: Batch, update: UpdateSpec, dp: Group) -> list[list[dict]]:
    """The mini-batches of one epoch, each a list of micro-batch dicts: fixed rows
    (:func:`minibatches`) or by token budget (:func:`token_minibatches`, a collective)."""
    if update.max_tokens is None:
        return minibatches(batch, update.mini_batch_rows, update.micro_batch_size)
    return token_minibatches(batch, update.mini_batch_rows, update.max_tokens, dp)


LOGITS_PER_FORWARD = 1 << 30
"""Logit elements one padded forward of :func:`forward_outputs` may span (``[rows x
positions, vocab / tp]``), which bounds its rows beyond ``micro_rows``; the head itself holds
at most :data:`engine.tp_ops.LOGITS_PER_CHUNK` of them at a time."""


def forward_outputs(engine: TrainEngine, batch: Batch, max_tokens: int | None, *,
                    temperature: float, micro_rows: int | None = None, replay: bool = False
                    ) -> dict[str, torch.Tensor] | None:
    """The head outputs of every row of ``batch`` from :func:`response_head_from` (in row
    order; None off the last pipeline stage): padded micro-batches of at least
    ``micro_rows`` rows (None: every row), as many more as keep their logits within
    :data:`LOGITS_PER_FORWARD` (a log-prob pass at 151,936 columns runs a few rows at a
    time, a small model's whole batch at once), or with ``max_tokens`` micro-batches by token
    budget with the padding removed (zeros where the padded path predicts or holds padding).
    Only one micro-batch's activations and logits exist at a time.  ``replay``: the
    rollout's routing is replayed (:func:`model_inputs`)."""
    inputs, head_from = model_inputs(batch, replay), response_head_from(batch)
    if max_tokens is None:
        rows, seq = batch["input_ids"].shape
        m = engine.model
        width = m.config.vocab_size // m.layout.tp if m.head == "lm" else 1
        fit = LOGITS_PER_FORWARD // max(1, (seq - head_from) * width)
        step = min(rows, max(micro_rows or rows, fit))
        mbs = [{k: v[i:i + step] for k, v in inputs.items()} for i in range(0, rows, step)]
        outs = engine.forward(mbs, head_from=head_from, temperature=temperature)
        if outs is None:
            return None
        return outs[0] if len(outs) == 1 else {k: torch.cat([o[k] for o in outs])
                                              for k in outs[0]}
    lengths = batch["attention_mask"].sum(1).tolist()
    parts = partition_by_tokens(lengths, max_tokens, parts=_shared_count(engine, lengths,
                                                                         max_tokens))
    mbs = [{k: v[torch.tensor(p, device=v.device)] for k, v in inputs.items()} for p in parts]
    outs = engine.forward(mbs, head_from=head_from, temperature=temperature,
                          remove_padding=True)
    if outs is None:
        return None
    order = [i for p in parts for i in p]
    return {k: torch.cat([o[k] for o in outs])[
        torch.argsort(torch.tensor(order, device=outs[0][k].device))] for k in outs[0]}


def _shared_count(engine: TrainEngine, lengths: list[int], max_tokens: int) -> int | None:
    """Under expert parallelism, the token-budget micro-batch count every DP rank runs (the
    largest of theirs, one all-reduce: an EP group may span DP ranks, and each MoE layer is a
    collective over it); None otherwise (each rank its own count)."""
    dp = engine.model.groups.train_dp
    if engine.model.experts is None or dp.pg is None:
        return None
    return largest_counts([count_micro_batches(lengths, max_tokens)], dp)[0]


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
    # a host scalar (gloo side of the group): the denominator is a Python float
    count = torch.tensor(float(local), dtype=torch.float64, device="cpu")
    if dp.pg is not None:
        dist.all_reduce(count, group=dp.pg)
    return micro_batch_denominator(float(count), mode, len(micro_batches), dp.size)


def mean_row(records: list[dict[str, float]]) -> Batch:
    """One row of per-key means (what the controller averages over DP replicas)."""
    keys = sorted({k for r in records for k in r})
    return Batch({k: torch.tensor([sum(r[k] for r in records if k in r)
                                   / max(1, sum(k in r for r in records))], device="cpu")
                  for k in keys})


def prompt_width(batch: Batch) -> int:
    return batch["input_ids"].shape[1] - batch["response_mask"].shape[1]


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of the last real token of each row (right padding after it)."""
    pos = torch.arange(attention_mask.shape[1]).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), pos, torch.zeros_like(pos)).max(dim=1).values


# Sharded checkpoints ------------------------------------------------------------------------
def model_blocks(model: ParallelLlama, shards: dict[str, torch.Tensor], prefix: str = "",
                 specs: list | None = None) -> dict[str, Block | Blocks]:
    """This rank's boxes of the global HF-named tensors, over ``shards`` (no copy).

    Args:
        model: the rank's model (its specs and layout say which boxes it holds).
        shards: tensors shaped like this rank's training shards, by spec name (the
            parameters, or Adam moments).
        prefix: put before every HF name (``optim.exp_avg.`` ...).
        specs: the specs of ``shards`` (default the model's parameters of this stage).

    Each HF tensor a spec stands for (q/k/v and gate/up separately) gets one box, the block
    :func:`engine.hf_shards.hf_reads` reads for this rank; a tied LM-head copy (pp > 1) names
    the embedding's boxes, so DCP keeps one of the two.
    """
    out = {}
    for spec in (model.local_specs if specs is None else specs):
        shard = shards[spec.name].detach()
        if shard.dim() != len(spec.shape):  # a whole expert stored as its generation pieces
            (r,) = model.hf_reads(spec)
            out[prefix + r.hf_name] = _piece_blocks(shard, spec, r)
            continue
        parts = shard_parts(spec, shard)
        for r in model.hf_reads(spec):
            sizes = tuple(s.stop - s.start for s in r.index)
            part = parts[r.part]
            try:
                local = part.view(sizes)
            except RuntimeError:  # q/k/v rows of a fused shard: a grouped Block
                local = part
            out[prefix + r.hf_name] = Block(local, r.hf_shape, tuple(s.start for s in r.index),
                                            sizes)
    return out


def _piece_blocks(stacked: torch.Tensor, spec, read) -> Blocks:
    """The boxes of a whole expert tensor stored stacked ``[g, *piece]`` (pieces along
    ``spec.partition_dim``): piece ``i`` is the box at ``i * piece[dim]`` on that dim."""
    dim, size = spec.partition_dim, stacked.shape[1 + spec.partition_dim]
    parts = []
    for i, piece in enumerate(stacked):
        offsets = tuple(s.start + (i * size if d == dim else 0) for d, s in enumerate(read.index))
        parts.append(Block(piece, read.hf_shape, offsets, tuple(piece.shape)))
    return Blocks(tuple(parts))


class ShardCheckpoint:
    """A role's sharded checkpoint on one rank (see :mod:`rlhf.checkpoint`): its weights and,
    for a trained role, Adam moments and step, as DCP blocks saved and loaded over the role's
    process group, so no tensor ever goes through one rank or the controller.

    Args:
        model: the rank's model; None for a role without weights (every call does nothing).
        engine: the training engine of a trained role (Adam state), None for a frozen one.
    """

    def __init__(self, model: ParallelLlama | None, engine: TrainEngine | None = None) -> None:
        self.model, self.engine = model, engine
        self._pending: ShardedSave | None = None

    def _state(self, moments: dict[str, dict[str, torch.Tensor]] | None, step: int
               ) -> dict[str, Block | torch.Tensor]:
        # a trained role's checkpoint holds what it trains: with LoRA the adapters (their
        # PEFT names), the frozen base coming from the run's init_from again on resume
        specs = self.model.trainable_specs() if self.engine is not None else None
        state: dict[str, Block | torch.Tensor] = dict(
            model_blocks(self.model, self._weights(), specs=specs))
        if moments is not None:
            for m in MOMENTS:
                state |= model_blocks(self.model, moments[m], moment_key(m, ""), specs)
            state[OPTIM_STEP] = torch.tensor(step, dtype=torch.int64, device="cpu")  # a counter
        return state

    def _weights(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds, by spec name: a trained role's float32 master
        weights when it has them (bf16 parameters), else the parameters."""
        if self.engine is None:
            return self.model.params
        return self.engine.train_params

    def _moments(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The optimizer's Adam moments by moment and spec name (None for a frozen role);
        zeros where it has no state yet (before the first step)."""
        if self.engine is None:
            return None
        state = self.engine.optimizer.state
        return {m: {n: state[p][m] if m in state.get(p, {}) else torch.zeros_like(p)
                    for n, p in self.engine.train_params.items()} for m in MOMENTS}

    def start_save(self, folder: str) -> None:
        """Copy this rank's blocks and start writing them into ``folder`` (collective over the
        role; the file is written by a background thread)."""
        if self.model is None:
            return
        if self._pending is not None:
            raise RuntimeError("a sharded save is still pending: finish_save() it first")
        step = self.engine.step_count if self.engine is not None else 0
        self._pending = ShardedSave(folder, self._state(self._moments(), step),
                                    self.model.groups.world.pg)

    def finish_save(self) -> None:
        """Wait until every rank's file is on disk; the role's rank 0 writes the index
        (collective over the role)."""
        if self.model is None:
            return
        if self._pending is None:
            raise RuntimeError("finish_save() without a pending start_save()")
        pending, self._pending = self._pending, None
        pending.finish()

    def load(self, folder: str) -> int:
        """Fill the weights (and Adam state) from the role's DCP folder of any layout, reading
        only the saved chunks that overlap this rank's shards (collective over the role).
        Saved tensors of another dtype are cast on load (a float32 checkpoint into a bf16 run
        and back); with master weights the parameters are then re-derived from them.

        Returns:
            Bytes of saved chunks this rank read.
        """
        if self.model is None:
            return 0
        moments = self._moments()  # filled in place
        state = self._state(moments, 0)
        read = load_blocks(folder, state, self.model.groups.world.pg)
        if self.engine is not None:
            engine = self.engine
            if engine.masters is not None:
                engine.masters.copy_to_(self.model.trainable_params())
            n = int(state[OPTIM_STEP])  # a host number: the step counter
            engine.step_count = n
            engine.optimizer.state.clear()
            if n:
                for name, p in engine.train_params.items():
                    engine.optimizer.state[p] = {
                        "step": torch.tensor(float(n), device=p.device),  # as fused AdamW
                        **{m: moments[m][name] for m in MOMENTS}}
        return read


class CheckpointedWorker(Worker):
    """A role worker with a sharded checkpoint: its constructor sets ``self.checkpoint`` (a
    :class:`ShardCheckpoint`, of the weights and, for a trained role, the Adam state); these
    are the checkpoint calls every role answers."""

    checkpoint: ShardCheckpoint

    @protocol(ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        """Start writing this rank's blocks into the DCP folder ``folder`` (every rank its own
        file, in a background thread); returns once they are copied."""
        self.checkpoint.start_save(folder)

    @protocol(ONE_TO_ALL)
    def finish_checkpoint(self) -> None:
        """Wait for the pending save's files; the role's rank 0 writes its index."""
        self.checkpoint.finish_save()

    @protocol(ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        """Load from a DCP folder of any layout (this rank's chunks only)."""
        self.checkpoint.load(folder)
