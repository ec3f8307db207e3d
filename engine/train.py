"""Training step: micro-batches through the pipeline, bucketed DP gradient reduction, clipping,
AdamW; and forward-only inference (log-probs / values).

Gradients live in one flat buffer per dtype holding this rank's training parameters, each
``param.grad`` a view at a fixed offset (:class:`engine.train_state.GradBuffer`, diagram
there).  After the last backward of a step every bucket is all-reduced over the DP group
(async, one collective per bucket, never one per tensor), then divided by ``dp``.  Under expert
parallelism the experts' gradients live in a second buffer, reduced over the expert-DP group.

Mixed precision.  The engine takes the run's resolved :class:`~hybridflow_comm.devices.
Precision` (it never infers it from the tensors; parameters of another dtype are a
ValueError).  Under ``bf16`` (``master_weights``) the optimizer trains float32 master weights
and the parameters are their low-precision copies (:class:`engine.train_state.MasterWeights`,
diagram there); in ``fp32`` the parameters themselves are trained.

Between steps (while the actor generates) the masters and the Adam state can leave the device
for host memory and the gradient buffer be freed (:meth:`TrainEngine.offload_train_state`,
:class:`engine.train_state.OffloadedState`); the parameters always stay.

Loss convention: ``loss_fn`` returns the mean loss of one micro-batch; the step minimises the
mean over all micro-batches of all DP ranks, so with the same micro-batches a layout
``(pp, tp, dp)`` computes the same gradients as one process that runs them all.  Micro-batches
may differ in shape (dynamic batching by token budget, :mod:`engine.micro_batches`); with
``remove_padding`` each runs as one packed row of its real tokens and the head's outputs come
back in the padded layout, so ``loss_fn`` sees the same tensors either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.route_trace import RouteTrace
from engine.router_loss import RouterLoss
from engine.micro_batches import PackedRows, pack_rows
from engine.model import ParallelLlama, check_temperature
from engine.optim_config import OptimConfig
from engine.pipeline import PipelineExecutor, make_schedule
from engine.train_state import (GradBuffer, MasterWeights, OffloadedState, add_grad_into,
                                params_device)
from hybridflow_comm.devices import Precision

LossFn = Callable[[dict, dict], torch.Tensor]


def _all_reduce_over(t: torch.Tensor, *groups) -> None:
    """Sum ``t`` in place over each group in turn (groups of one rank skipped)."""
    for group in groups:
        if group.pg is not None:
            dist.all_reduce(t, group=group.pg)


def _check_micro_batches(micro_batches: list[dict]) -> None:
    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch, got 0")
    shapes = {tuple(mb["input_ids"].shape) for mb in micro_batches}
    if any(len(shape) != 2 for shape in shapes):
        raise ValueError(f"every micro-batch needs input_ids [B, S], got shapes {shapes}")
    for mb in micro_batches:
        mask = mb.get("attention_mask")
        if mask is not None and tuple(mask.shape) != tuple(mb["input_ids"].shape):
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape "
                             f"{tuple(mb['input_ids'].shape)}")


class TrainEngine:
    """Training and inference of one :class:`ParallelLlama` on its layout.

    Args:
        model: the rank's model (its parameters are the flat-buffer views).
        optim: optimiser, clipping, bucketing and schedule settings.
        precision: the run's resolved precision (:func:`hybridflow_comm.devices.
            resolve_precision`): every parameter must be its ``param_dtype``, and
            ``master_weights`` decides the float32 masters.  None: the precision of the
            model's own ``config.dtype`` (a model built by hand in that dtype).
        frozen: forward only (a reference or reward model): no gradient buffer, no master
            weights, no optimizer state; :meth:`train_step` refuses.

    Every rank of the layout calls the same methods with its own DP share of the
    micro-batches (all ranks of one TP x PP replica pass the same micro-batches).
    Construction is collective over the PP group (one tiny all-reduce before the pipeline's
    first point-to-point message).

    Attributes:
        precision: the precision the engine trains in.
        masters: float32 master weights under ``precision.master_weights`` (bf16), else None.
        train_params: what the optimizer steps, by name: the masters' parameters, or the
            model's own in float32; their ``.grad`` are the :class:`GradBuffer` views.
        offloaded: the training state parked in host memory, or None while it is on the
            device (:meth:`offload_train_state`).
    """

    def __init__(self, model: ParallelLlama, optim: OptimConfig | None = None, *,
                 precision: Precision | None = None, frozen: bool = False) -> None:
        self.precision = precision if precision is not None \
            else Precision.of_dtype(model.config.dtype)
        self.precision.check_params({**model.params, **model.adapter_params})
        self.model = model
        self.optim_cfg = optim or OptimConfig()
        self.groups = model.groups
        self.device = params_device(model.params)
        self.frozen = frozen
        self.step_count = 0
        self.offloaded: OffloadedState | None = None
        pp = self.groups.train_pp
        if pp.pg is not None:  # NCCL wants a collective on a group before its first send
            dist.all_reduce(torch.zeros(1, device=self.device), group=pp.pg)
        if frozen:
            self.masters = self.grads = self.expert_grads = self.optimizer = None
            self.train_params = {}
            return
        # what is trained: every parameter, or the LoRA adapters of a frozen base
        trained = model.trainable_params()
        self.masters = MasterWeights(trained) if self.precision.master_weights else None
        self.train_params = trained if self.masters is None else self.masters.params
        # under expert parallelism the experts' gradients reduce over another group
        experts = [s.name for s in model.trainable_specs() if s.expert is not None] \
            if model.experts is not None else []  # in spec order: the same layout on every rank
        dense = {n: p for n, p in self.train_params.items() if n not in frozenset(experts)}
        self.grads = GradBuffer(dense)
        self.expert_grads = GradBuffer({n: self.train_params[n] for n in experts}) \
            if experts else None
        if self.masters is not None:
            for name, p in trained.items():
                p.register_post_accumulate_grad_hook(
                    add_grad_into(self.train_params[name].grad))
        decay = [p for p in self.train_params.values() if p.dim() > 1]
        no_decay = [p for p in self.train_params.values() if p.dim() <= 1]
        c = self.optim_cfg
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": c.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=c.lr, betas=c.betas, eps=c.eps, fused=True)  # one kernel for all tensors

    # Offload ---------------------------------------------------------------------------------
    def offload_train_state(self) -> int:
        """Move the masters and the optimizer state to host memory and free the gradient
        buffer, giving their device storage back (:class:`OffloadedState`); the parameters
        stay.  Forward passes still run; :meth:`train_step` refuses until
        :meth:`reload_train_state`.

        Returns:
            The device bytes given back (0 for a frozen engine, which has no such state).
        """
        if self.offloaded is not None:
            raise RuntimeError("offload_train_state: the training state is already offloaded")
        if self.frozen:
            return 0
        kept = list(self.masters.flat.values()) if self.masters is not None else []
        kept += [v for state in self.optimizer.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor)]  # exp_avg, exp_avg_sq, step (fused: tensors)
        grads = [t for buf in self._grad_buffers() for t in buf.flat.values()]
        self.offloaded = OffloadedState(kept, grads, pin=self.device.type == "cuda")
        return self.offloaded.device_nbytes

    def reload_train_state(self) -> None:
        """Bring back what :meth:`offload_train_state` moved, bit for bit (the gradient
        buffer uninitialised: every step zeroes it first)."""
        if self.frozen:
            return
        if self.offloaded is None:
            raise RuntimeError("reload_train_state: the training state is not offloaded")
        self.offloaded.restore()
        self.offloaded = None

    # Pipeline --------------------------------------------------------------------------------
    def _executor(self, micro_batches: list[dict],
                  packings: list[PackedRows] | None) -> PipelineExecutor:
        cfg = self.model.config
        shapes = ([(1, p.total) for p in packings] if packings is not None
                  else [tuple(mb["input_ids"].shape) for mb in micro_batches])
        return PipelineExecutor(self.groups.train_pp, lambda i: (*shapes[i], cfg.hidden_size),
                                cfg.dtype, self.device)

    @staticmethod
    def _packings(micro_batches: list[dict], remove_padding: bool) -> list[PackedRows] | None:
        """Each micro-batch's packing (from its attention mask; none = every token real)."""
        if not remove_padding:
            return None
        return [pack_rows(mb["attention_mask"] if mb.get("attention_mask") is not None
                          else torch.ones_like(mb["input_ids"])) for mb in micro_batches]

    def _forward_fn(self, micro_batches: list[dict], packings: list[PackedRows] | None,
                    with_logits: bool, head_from: int, temperature: float,
                    router_terms: list[torch.Tensor] | None = None):
        """The pipeline's forward of micro-batch ``i``; with ``router_terms`` (training a
        mixture of experts) each forward also trains the load-balancing loss and appends
        this stage's sum of its layers' terms (detached).  A micro-batch with ``routes [B, S,
        layers, k]`` (router replay) routes this stage's layers as they say."""
        model, cfg = self.model, self.model.config
        weight = cfg.router_aux_loss_coef / (cfg.num_layers * len(micro_batches))

        def replayed(mb: dict, packing: PackedRows | None = None) -> RouteTrace | None:
            routes = mb.get("routes")
            if routes is None or not cfg.num_experts:
                return None
            if tuple(routes.shape[2:]) != (cfg.num_layers, cfg.num_experts_per_tok):
                raise ValueError(f"routes {tuple(routes.shape)} are not [B, S, num_layers="
                                 f"{cfg.num_layers}, num_experts_per_tok="
                                 f"{cfg.num_experts_per_tok}]")
            if packing is not None:
                routes = packing.pack(routes)
            local = routes[:, :, model.layer_ids[0]:model.layer_ids[-1] + 1]
            return RouteTrace(replay=local.flatten(0, 1))

        def router_loss(mask: torch.Tensor | None) -> RouterLoss | None:
            if router_terms is None:
                return None
            return RouterLoss(weight, None if mask is None else mask.flatten().bool())

        def keep(loss: RouterLoss | None) -> None:
            if loss is not None and loss.terms:
                router_terms.append(loss.total().detach())

        def padded(i: int, x: torch.Tensor | None):
            mb = micro_batches[i]
            inputs = mb["input_ids"] if model.is_first else x
            loss = router_loss(mb.get("attention_mask"))
            hidden = model.stage_forward(inputs, mb.get("attention_mask"),
                                         mb.get("position_ids"), router_loss=loss,
                                         routes=replayed(mb))
            keep(loss)
            if not model.is_last:
                return hidden
            return model.head_outputs(hidden, mb["input_ids"], with_logits, head_from,
                                      temperature=temperature)

        def packed(i: int, x: torch.Tensor | None):
            mb, p = micro_batches[i], packings[i]
            inputs = p.pack(mb["input_ids"]) if model.is_first else x
            pos = mb.get("position_ids")
            loss = router_loss(None)  # packed: every token real
            hidden = model.stage_forward(inputs, position_ids=None if pos is None
                                         else p.pack(pos), packed=p.seqs, router_loss=loss,
                                         routes=replayed(mb, p))
            keep(loss)
            if not model.is_last:
                return hidden
            return model.packed_head_outputs(hidden, mb["input_ids"], p, with_logits,
                                             head_from, temperature=temperature)

        return padded if packings is None else packed

    def train_step(self, micro_batches: list[dict], loss_fn: LossFn,
                   head_from: int = 0, *, temperature: float,
                   remove_padding: bool = False) -> dict[str, float]:
        """One optimiser step over this rank's micro-batches.

        Args:
            micro_batches: dicts with ``input_ids [B, S]``, optional ``attention_mask``,
                ``position_ids`` and anything ``loss_fn`` needs; ``[B, S]`` may differ between
                micro-batches, and DP ranks may hold different numbers of them.
            loss_fn: ``loss_fn(outputs, micro_batch) -> scalar`` mean loss of the micro-batch;
                ``outputs`` as :meth:`ParallelLlama.head_outputs` from position ``head_from``.
            head_from: first position the head computes (e.g. the last prompt position).
            temperature: the lm head's log-probs and entropy are of ``softmax(logits / T)``
                (the rollouts' sampling temperature; 1.0 for the model's own distribution;
                ignored by a value head), see :meth:`ParallelLlama.head_outputs`.
            remove_padding: run each micro-batch as one packed row of its real tokens
                (:func:`engine.micro_batches.pack_rows`); ``loss_fn`` still gets the padded
                layout, with zeros at the positions that predict or hold padding.

        Returns:
            ``loss`` (each rank's mean over its micro-batches, averaged over DP ranks),
            ``grad_norm`` (before clipping), ``lr``; identical on every rank.  A mixture of
            experts also minimises its load-balancing loss with weight
            ``config.router_aux_loss_coef`` (:class:`engine.router_loss.RouterLoss`, the mean over
            layers and micro-batches) and returns it as ``router_aux_loss`` (unweighted,
            averaged over DP ranks).
        """
        if self.frozen:
            raise ValueError("train_step on a frozen TrainEngine (built with frozen=True for "
                             "forward passes only)")
        if self.offloaded is not None:
            raise RuntimeError("train_step while the training state is offloaded "
                               "(reload_train_state first)")
        _check_micro_batches(micro_batches)
        check_temperature(temperature)
        packings = self._packings(micro_batches, remove_padding)  # before any collective
        self._check_expert_parallel_counts(len(micro_batches))
        model, n = self.model, len(micro_batches)
        for buf in self._grad_buffers():
            buf.zero_()
        losses: list[torch.Tensor] = []

        def loss_of(i: int, outputs: dict) -> torch.Tensor:
            loss = loss_fn(outputs, micro_batches[i])
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            losses.append(loss.detach())
            return loss / n

        actions = make_schedule(self.optim_cfg.schedule, model.layout.pp, model.stage, n)
        router_terms = [] if model.config.num_experts else None
        forward = self._forward_fn(micro_batches, packings, False, head_from, temperature,
                                   router_terms)
        self._executor(micro_batches, packings).run(actions, forward, loss_of)
        self._sync_tied_embedding()
        # this rank's mean, so that DP ranks with different micro-batch counts average right
        loss_sum = (torch.stack(losses).sum() / n if losses
                    else torch.zeros((), device=self.device)).float()
        dp = self.groups.train_dp
        loss_work = None
        if self.groups.train_pp.pg is None and dp.pg is not None:
            # no PP sum needed: the loss rides beside the gradient buckets (gloo overlaps them)
            loss_work = dist.all_reduce(loss_sum, group=dp.pg, async_op=True)
        self._reduce_dp()
        grad_norm = self._clip()
        self.optimizer.step()
        if self.masters is not None:
            self.masters.copy_to_(model.trainable_params())
        self.step_count += 1
        if loss_work is not None:
            loss_work.wait()
            loss = loss_sum.item() / dp.size
        else:
            loss = self._all_stages_mean(loss_sum)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.optim_cfg.lr}
        if router_terms is not None:  # every stage's layers: summed over PP, mean over DP
            total = torch.stack(router_terms).sum() if router_terms else \
                torch.zeros((), device=self.device)
            metrics["router_aux_loss"] = self._all_stages_mean(
                total.float() / (model.config.num_layers * n))
        return metrics

    @torch.no_grad()
    def forward(self, micro_batches: list[dict], with_logits: bool = False,
                head_from: int = 0, *, temperature: float,
                remove_padding: bool = False) -> list[dict] | None:
        """Inference: head outputs of every micro-batch (``compute_log_prob``/``compute_values``).

        Args:
            micro_batches: as for :meth:`train_step`.
            with_logits: lm head: also return this rank's vocab slice ``logits [B, S, V/t]``.
            head_from: first position the head computes (see :meth:`train_step`).
            temperature: of the lm head's log-probs and entropy (see :meth:`train_step`).
            remove_padding: packed rows, outputs in the padded layout (see :meth:`train_step`).

        Returns:
            On the last stage the per-micro-batch outputs (replicated over TP); None elsewhere.
        """
        _check_micro_batches(micro_batches)
        check_temperature(temperature)
        packings = self._packings(micro_batches, remove_padding)
        n = len(micro_batches)
        self._check_expert_parallel_counts(n)
        out = self._executor(micro_batches, packings).run(
            [("F", i) for i in range(n)],
            self._forward_fn(micro_batches, packings, with_logits, head_from, temperature))
        return [out[i] for i in range(n)] if self.model.is_last else None

    def _check_expert_parallel_counts(self, n: int) -> None:
        """Under expert parallelism every MoE layer is a collective over the EP group, whose
        ranks may be different DP ranks: ValueError on each of them unless they all run
        ``n`` micro-batches (a mismatch would hang in the first all-to-all)."""
        group = None if self.model.experts is None else self.model.experts.ep
        if group is None or group.pg is None:
            return
        t = torch.tensor([n, -n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
        if int(t[0]) != -int(t[1]):
            raise ValueError(f"the ranks {list(group.ranks)} of an EP group run from "
                             f"{-int(t[1])} to {int(t[0])} micro-batches; under expert "
                             f"parallelism they must run the same number")

    # Gradients -------------------------------------------------------------------------------
    def _sync_tied_embedding(self) -> None:
        """pp > 1 with tied embeddings: sum the grads of embed_tokens (stage 0) and its copy."""
        m = self.model
        if not (m.config.tie_word_embeddings and m.head == "lm" and m.layout.pp > 1) \
                or m.lora is not None:  # LoRA: the embedding is frozen
            return
        name = "embed_tokens" if m.is_first else "lm_head" if m.is_last else None
        if name is not None:
            g = self.train_params[name].grad
        else:  # inner stages take part in the PP all-reduce with zeros
            g = torch.zeros(m.config.vocab_size // m.layout.tp, m.config.hidden_size,
                            dtype=torch.float32 if self.masters is not None else m.config.dtype,
                            device=self.device)
        dist.all_reduce(g, group=self.groups.train_pp.pg)

    def _grad_buffers(self) -> list[GradBuffer]:
        return [self.grads] + ([self.expert_grads] if self.expert_grads is not None else [])

    def _reduce_dp(self) -> None:
        """Sum the gradients over the DP group (an expert's over its expert-DP group: the
        owners of the same experts, which together saw every DP rank's tokens), then divide
        by ``dp``: the mean over every DP rank's micro-batches."""
        dp = self.groups.train_dp
        reductions = [(self.grads, dp)]
        if self.expert_grads is not None:
            reductions.append((self.expert_grads, self.model.experts.edp))
        works = [dist.all_reduce(b, group=group.pg, async_op=True)
                 for buf, group in reductions if group.pg is not None
                 for b in buf.buckets(self.optim_cfg.bucket_numel)]
        for w in works:
            w.wait()
        if dp.size > 1:
            for buf in self._grad_buffers():
                for t in buf.flat.values():
                    t.div_(dp.size)

    def global_grad_norm(self) -> float:
        """L2 norm of all gradients of the model, each global element counted once."""
        m = self.model
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for spec in m.trainable_specs():
            grad_sq = self.train_params[spec.name].grad.double().pow(2).sum()
            if m.experts is not None and spec.expert is not None:
                if m.experts.edp.rank == 0:  # one holder of each expert counts it
                    expert_sq += grad_sq
                continue
            replicated = spec.partition_dim is None and m.coords.tp != 0
            tied_copy = spec.name == "lm_head" and m.config.tie_word_embeddings
            if not (replicated or tied_copy):
                sq += grad_sq
        _all_reduce_over(sq, self.groups.train_tp)
        if m.experts is not None:  # the stage's experts, known on each of its ranks
            _all_reduce_over(expert_sq, m.experts.ep, m.experts.edp)
            sq += expert_sq
        _all_reduce_over(sq, self.groups.train_pp)
        return math.sqrt(sq.item())  # the norm is a host number (clip coefficient, metrics)

    def _clip(self) -> float:
        norm = self.global_grad_norm()
        max_norm = self.optim_cfg.max_grad_norm
        if max_norm is not None:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for buf in self._grad_buffers():
                    for t in buf.flat.values():
                        t.mul_(coef)
        return norm

    def _all_stages_mean(self, loss_mean: torch.Tensor) -> float:
        """The last stage's mean loss, averaged over DP, known on every rank."""
        g = self.groups
        for group in (g.train_pp, g.train_dp):  # inner stages contribute 0 to the PP sum
            if group.pg is not None:
                dist.all_reduce(loss_mean, group=group.pg)
        return loss_mean.item() / g.train_dp.size
