"""The training-side Llama model of one rank: one pipeline stage, one TP shard, flat-buffer params.

Every parameter is an ``nn.Parameter`` that shares storage with
``FlatParamBuffer.train_view(name)``; nothing is ever re-allocated, so the resharder can move
weights in the buffer while the model keeps pointing at them::

    FlatParamBuffer (one storage per dtype)
    | embed_tokens slots | layers.0.input_norm | layers.0.qkv slots | ... |
          ^ own slot = Parameter "embed_tokens"        ^ own slot = Parameter "layers.0.qkv"

Stage ``s`` holds the layers ``[s*L/pp, (s+1)*L/pp)``; stage 0 also the embedding, the last
stage the final norm and the head.  :meth:`ParallelLlama.stage_forward` runs this rank's part:
token ids (first stage) or the previous stage's hidden states in, hidden states (inner stages)
or head outputs (last stage) out.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine import compiled_train, inductor
from engine.attention import PackedSeqs, causal_mask
from engine.expert_parallel import ExpertParallel
from engine.hf_shards import HFRead, hf_reads
from engine.layers import LayerSpec, decoder_layer
from engine.llama_spec import LAYER_KEYS  # noqa: F401  (re-exported: engine.model.LAYER_KEYS)
from engine.llama_spec import LlamaConfig, head_weight_name, llama_shard_specs
from engine.lora import LayerLora, LoraConfig, init_lora_state_dict, lora_shard_specs
from engine.micro_batches import PackedRows
from engine.norm import rms_norm
from engine.rope import position_ids_from_mask, rope_tables
from engine.route_trace import RouteTrace
from engine.router_loss import RouterLoss, add_loss_gradient
from engine.tp_ops import column_linear, linear_log_prob_entropy, vocab_embedding, \
    vocab_log_prob_entropy
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.expert_reshard import expert_slot_specs, from_train_layout, to_train_layout
from hybridflow_comm.groups import ExpertGroups, HybridGroups
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import ShardSpec, slot_specs, train_shard


class ParallelLlama(nn.Module):
    """This rank's stage and TP shard of a Llama model.

    Args:
        config: architecture.
        groups: the rank's groups (``groups.layout.train`` is the training layout).
        head: ``"lm"`` (per-token log-probs and entropy) or ``"value"`` (per-token scalar).
        buffer: flat buffer to live in (must hold every spec of this rank); by default one is
            built from ``slot_specs(specs, groups.layout, groups.rank)`` on ``device``.
        device: where a new buffer lives (default CPU); the model's device is its buffer's
            (:attr:`device`), so ``device`` must match a given ``buffer``.
        lora: LoRA adapters on the frozen layers (:mod:`engine.lora`): their tensors live in
            a flat buffer of their own (:attr:`adapter_buffer`, views :attr:`adapter_params`,
            fresh from :func:`engine.lora.init_lora_state_dict` until loaded), the base
            parameters are frozen (``requires_grad=False``) and :meth:`trainable_params` are
            the adapters (and a value head).  :meth:`adapters_disabled` runs the base model.
        experts: a mixture of experts' expert groups; with ``ep > 1`` the rank trains the
            whole experts of its EP block (:mod:`hybridflow_comm.expert_layout`), which live
            in a flat buffer of their own (:attr:`expert_buffer`, from
            :func:`hybridflow_comm.expert_reshard.expert_slot_specs`; the other weights stay
            in ``buffer``), and its MoE layers exchange tokens over the EP group
            (:mod:`engine.expert_parallel`).
        compile_layers: run the decoder layers through one ``torch.compile``d function
            (:mod:`engine.compiled_train`: the elementwise chains fused, forward and
            backward; with TP or experts, the regions between the collectives); None: on
            for CUDA.  Packed micro-batches too where
            :func:`engine.compiled_train.takes_packed`.  The same results up to float
            summation order.
    """

    def __init__(self, config: LlamaConfig, groups: HybridGroups, head: str = "lm",
                 buffer: FlatParamBuffer | None = None,
                 device: torch.device | str | None = None,
                 lora: LoraConfig | None = None, experts: ExpertGroups | None = None,
                 compile_layers: bool | None = None) -> None:
        super().__init__()
        train = groups.layout.train
        config.check_parallel(train.pp, train.tp)  # before any collective can run
        self.config, self.groups, self.head = config, groups, head
        self.layer_keys = config.layer_keys  # the weights of every layer (engine.layers)
        self.layout = train
        self.coords = train.coords(groups.rank)
        self.specs: list[ShardSpec] = llama_shard_specs(config, train.pp, head)
        self.experts = _check_experts(experts, config, groups)
        dense = [s for s in self.specs if self.experts is None or s.expert is None]
        if buffer is None:
            buffer = FlatParamBuffer(slot_specs(dense, groups.layout, groups.rank),
                                     device="cpu" if device is None else device)
        elif device is not None and not same_device(buffer.device, torch.device(device)):
            raise ValueError(f"device={device} but the given buffer lives on {buffer.device}")
        self.buffer = buffer
        self.stage = self.coords.pp
        self.is_first = self.stage == 0
        self.is_last = self.stage == train.pp - 1
        per_stage = config.num_layers // train.pp
        self.layer_ids = list(range(self.stage * per_stage, (self.stage + 1) * per_stage))
        self.head_name = head_weight_name(config, train.pp, head)
        self.expert_buffer: FlatParamBuffer | None = None
        self.moe: ExpertParallel | None = None
        if self.experts is not None:  # whole experts of this rank's EP block, in their buffer
            self.expert_buffer = FlatParamBuffer(expert_slot_specs(
                [s for s in self.specs if s.expert is not None], self.experts.layout,
                groups.rank), device=buffer.device)
            self.expert_buffer.release_generation_slots()  # generation-only until a transition
            self.moe = ExpertParallel(self.experts.ep, config.num_experts)
        self.layer_spec = LayerSpec(config.q_per_group, config.head_dim, config.rms_norm_eps,
                                    self.tp_group, config.routing, self.moe)
        self.params: dict[str, nn.Parameter] = {}
        for spec in self.local_specs:
            home = buffer if self.expert_buffer is None or spec.expert is None \
                else self.expert_buffer
            p = nn.Parameter(home.train_view(spec.name))  # shares the buffer's storage
            self.params[spec.name] = p
            self.register_parameter(spec.name.replace(".", "_"), p)
        self.lora = lora
        self.adapters_enabled = lora is not None
        self.compile_layers = inductor.compile_applies(compile_layers, buffer.device)
        self.adapter_specs: list[ShardSpec] = []
        self.adapter_params: dict[str, nn.Parameter] = {}
        self.adapter_buffer: FlatParamBuffer | None = None
        if lora is not None:
            self.adapter_specs = lora_shard_specs(config, train.pp, lora)
            self.adapter_buffer = FlatParamBuffer(
                slot_specs(self.adapter_specs, groups.layout, groups.rank), device=buffer.device)
            for name, p in self.params.items():  # frozen base: no gradient is ever made
                p.requires_grad_(name == "value_head")  # (a value model trains its head)
            for spec in self.local_adapter_specs:
                p = nn.Parameter(self.adapter_buffer.train_view(spec.name))
                self.adapter_params[spec.name] = p
                self.register_parameter(spec.name.replace(".", "_"), p)
            load_adapter_state_dict(self, init_lora_state_dict(config, lora))

    @property
    def generation_experts(self) -> tuple[int, ...] | None:
        """The experts this rank computes in generation under generation expert parallelism
        (``gen_ep > 1``: :meth:`~hybridflow_comm.expert_layout.ExpertLayout.gen_experts`);
        None: every expert (pieces of them under generation TP)."""
        if self.experts is None or self.experts.layout.gen_ep == 1:
            return None
        return self.experts.layout.gen_experts(self.groups.rank)

    @property
    def local_specs(self) -> list[ShardSpec]:
        """Specs of the parameters this rank trains (its stage; under expert parallelism,
        of the experts only its EP block's)."""
        held = None if self.experts is None else \
            self.experts.layout.train_experts(self.groups.rank)
        return [s for s in self.specs if s.stage == self.stage
                and (held is None or s.expert is None or s.expert in held)]

    def hf_reads(self, spec: ShardSpec) -> list[HFRead] | None:
        """The HF blocks this rank reads for its training tensor of ``spec`` (None: another
        stage's); a whole expert under expert parallelism is one whole block per HF tensor
        (:func:`engine.hf_shards.hf_reads`)."""
        if self.experts is not None and spec.expert is not None:  # as one rank of its stage
            return hf_reads(spec, ParallelLayout(self.layout.pp, 1, 1), self.stage)
        return hf_reads(spec, self.layout, self.groups.rank)

    def train_shard(self, full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """This rank's training shard of the global tensor ``full`` of ``spec`` (under expert
        parallelism a whole expert, in its stored form: :func:`hybridflow_comm.expert_reshard.
        stacked_pieces`)."""
        if self.experts is not None and spec.expert is not None:
            return to_train_layout(full, spec, self.experts.layout)
        return train_shard(full, spec, self.layout, self.groups.rank)

    def logical_expert(self, tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """A whole expert tensor of this rank (a parameter, or a moment shaped like one) in
        its logical (Hugging Face) shape; the inverse of :meth:`train_shard` for experts."""
        return from_train_layout(tensor, spec, self.experts.layout)

    @property
    def local_adapter_specs(self) -> list[ShardSpec]:
        """Specs of the adapter tensors of this rank's stage (none without LoRA)."""
        return [s for s in self.adapter_specs if s.stage == self.stage]

    def trainable_params(self) -> dict[str, nn.Parameter]:
        """What training updates: with LoRA the adapters (and a value model's head), else every
        parameter."""
        if self.lora is None:
            return self.params
        head = {n: p for n, p in self.params.items() if n == "value_head"}
        return {**self.adapter_params, **head}

    def trainable_specs(self) -> list[ShardSpec]:
        """The specs of :meth:`trainable_params`."""
        if self.lora is None:
            return self.local_specs
        return self.local_adapter_specs + [s for s in self.local_specs if s.name == "value_head"]

    @contextlib.contextmanager
    def adapters_disabled(self):
        """Run the base model inside (the LoRA reference policy: the actor's own weights with
        the adapters off, no second model)."""
        previous, self.adapters_enabled = self.adapters_enabled, False
        try:
            yield
        finally:
            self.adapters_enabled = previous

    def layer_lora(self, layer: int) -> LayerLora | None:
        """The layer's adapters on this rank, or None (no LoRA, or disabled).  Dropout runs
        only where gradients are being recorded (the training step)."""
        if self.lora is None or not self.adapters_enabled:
            return None
        c, prefix = self.config, f"layers.{layer}."
        mods = self.lora.target_modules
        return LayerLora(a={m: self.adapter_params[f"{prefix}{m}.lora_A"] for m in mods},
                         b={m: self.adapter_params[f"{prefix}{m}.lora_B"] for m in mods},
                         scale=self.lora.scale,
                         dropout=self.lora.dropout if torch.is_grad_enabled() else 0.0,
                         tp_group=self.tp_group, q_per_group=c.q_per_group,
                         head_dim=c.head_dim)

    @property
    def device(self) -> torch.device:
        """Where the weights live (the flat buffer's device); inputs must be there."""
        return self.buffer.device

    @property
    def tp_group(self):
        return self.groups.train_tp

    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's weights by key (of the experts, this rank's)."""
        return {k: self.params[f"layers.{layer}.{k}"] for k in self.layer_keys
                if f"layers.{layer}.{k}" in self.params}

    # Forward --------------------------------------------------------------------------------
    def stage_forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      packed: PackedSeqs | None = None,
                      router_loss: RouterLoss | None = None,
                      routes: RouteTrace | None = None) -> torch.Tensor:
        """Embedding (first stage), this stage's layers, final norm (last stage).

        Args:
            inputs: token ids ``[B, S]`` on the first stage, else hidden ``[B, S, H]``.
            attention_mask: ``[B, S]``, 1 for real tokens (left or right padding), or None.
            position_ids: ``[B, S]``; default from the mask (or ``arange(S)``), or from
                ``packed``.
            router_loss: a mixture of experts' load-balancing loss: each layer adds its
                term, and backward through the returned hidden states also minimises
                ``router_loss.weighted()`` (training; ignored by a dense model).
            routes: a mixture of experts' routing of this stage's layers, recorded into it
                and, where it holds ``replay [tokens, layers of this stage, k]`` (the tokens
                flattened as ``inputs``), replayed (:class:`engine.route_trace.RouteTrace`).
            packed: the inputs are sequences packed on one row (``B = 1``, no
                ``attention_mask``; :mod:`engine.micro_batches`): each attends only to itself
                (one causal attention per sequence, :func:`engine.attention.attention`).

        Returns:
            Hidden states ``[B, S, H]`` (normalised on the last stage).
        """
        c = self.config
        batch, seq = inputs.shape[:2]
        longest = seq if packed is None else packed.longest
        if c.sliding_window is not None and longest > c.sliding_window:
            raise ValueError(f"sequence of {longest} tokens is longer than the model's "
                             f"sliding_window={c.sliding_window} (no windowed attention)")
        if packed is not None:
            if attention_mask is not None or batch != 1 or seq != packed.total:
                raise ValueError(f"packed inputs are one row of {packed.total} tokens without "
                                 f"an attention_mask, got {tuple(inputs.shape)}")
            if position_ids is None:
                position_ids = packed.position_ids(inputs.device)
            mask: torch.Tensor | PackedSeqs | None = packed
        else:
            if position_ids is None:
                position_ids = (position_ids_from_mask(attention_mask)
                                if attention_mask is not None
                                else torch.arange(seq, device=inputs.device).expand(batch, seq))
            mask = None if attention_mask is None else causal_mask(attention_mask, batch, seq)
        rope = rope_tables(position_ids, c.head_dim, c.rope_theta, c.dtype, c.rope_scaling)
        x = (vocab_embedding(inputs, self.params["embed_tokens"], self.tp_group)
             if self.is_first else inputs)
        compiled = self.compile_layers and (packed is None or compiled_train.takes_packed(x))
        layer = compiled_train.decoder_layer if compiled else decoder_layer
        for i in self.layer_ids:
            x = layer(x, self.layer_weights(i), rope, mask, self.layer_spec,
                      lora=self.layer_lora(i), router_loss=router_loss, trace=routes)
        if router_loss is not None and router_loss.terms and router_loss.weight:
            x = add_loss_gradient(x, router_loss.weighted())
        if self.is_last:
            x = rms_norm(x, self.params["norm"], c.rms_norm_eps)
        return x

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on the last stage: ``[B, S, H]`` -> this rank's vocab slice ``[B, S, V/t]``."""
        return column_linear(hidden, self.params[self.head_name], self.tp_group)

    def head_outputs(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                     with_logits: bool = False, start: int = 0, *, temperature: float) -> dict:
        """Per-token outputs of the head from the last stage's hidden states.

        Args:
            hidden: ``[B, S, H]`` output of the last stage.
            input_ids: ``[B, S]``; the targets are ``input_ids[:, 1:]``.
            with_logits: also return this rank's vocab slice of the logits (lm head).
            start: first position computed (RLHF roles need only the response: the head and
                the vocab-parallel log-softmax skip the prompt positions).
            temperature: lm head: log-probs and entropy are those of
                ``softmax(logits / temperature)``, the distribution the rollouts were sampled
                from before any top-k/top-p truncation (:mod:`engine.sampling`); 1.0 for the
                model's own (SFT, greedy rollouts).  The value head ignores it.

        Returns:
            lm head: ``log_probs`` and ``entropy`` ``[B, S-1-start]`` (float32) of the next
            token at positions ``start..S-2`` (and the unscaled ``logits [B, S-start, V/t]``);
            value head: ``values [B, S-start]`` at positions ``start..S-1``.
        """
        check_temperature(temperature)
        if not 0 <= start < hidden.shape[1]:
            raise ValueError(f"head start={start} outside the {hidden.shape[1]} positions")
        hidden = hidden[:, start:]
        if self.head == "value":
            values = torch.matmul(hidden, self.params["value_head"].t()).squeeze(-1)
            return {"values": values.float()}
        targets = input_ids[:, start + 1:]
        if not with_logits:  # the head and the log-softmax fused, a chunk of tokens at a time
            log_probs, entropy = linear_log_prob_entropy(
                hidden[:, :-1], self.params[self.head_name], targets, self.tp_group,
                temperature)
            return {"log_probs": log_probs, "entropy": entropy}
        logits = self.local_logits(hidden)  # [B, S-start, V/t]
        extra = {"logits": logits}
        logits = logits[:, :-1]
        if temperature != 1.0:  # a new tensor: the returned logits stay unscaled
            logits = logits.float() / temperature  # scaled in float32, as the log-softmax
        log_probs, entropy = vocab_log_prob_entropy(logits, targets, self.tp_group)
        return {"log_probs": log_probs, "entropy": entropy, **extra}

    def packed_head_outputs(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                            packing: PackedRows, with_logits: bool = False, start: int = 0, *,
                            temperature: float) -> dict:
        """:meth:`head_outputs` of a packed micro-batch, in the padded layout.

        The head runs on the packed tokens at padded columns ``>= start`` only (the lm head
        also only where the next padded position is real: the token it predicts); the results
        go back to their padded ``(row, column)``, zeros at the positions the padded path
        fills with predictions of padding (every loss masks those).

        Args:
            hidden: ``[1, T, H]`` last-stage output of the packed row.
            input_ids: the padded ``[B, S]`` ids (targets).
            packing: the micro-batch's :class:`engine.micro_batches.PackedRows`.
            with_logits, start, temperature: as :meth:`head_outputs`.

        Returns:
            As :meth:`head_outputs`: ``[B, S-1-start]`` log-probs and entropy (and ``[B,
            S-start, V/t]`` logits), or ``[B, S-start]`` values.
        """
        check_temperature(temperature)
        seq = packing.seq
        if not 0 <= start < seq:
            raise ValueError(f"head start={start} outside the {seq} positions")
        keep = packing.cols >= start  # [T]
        if self.head == "value":
            values = torch.matmul(hidden[0, keep], self.params["value_head"].t()).squeeze(-1)
            return {"values": packing.scatter(values.float(), keep, start, seq - start)}
        scored = keep & packing.has_next  # [T]: the tokens whose next token is real
        ids = packing.pack(input_ids)[0]  # [T]
        targets = torch.roll(ids, -1)[scored]  # the next packed token = the next padded one
        extra = {}
        if with_logits:
            logits = self.local_logits(hidden[:, keep])  # [1, n_keep, V/t]
            extra["logits"] = packing.scatter(logits[0], keep, start, seq - start)
            logits = logits[:, scored[keep]]
            if temperature != 1.0:
                logits = logits.float() / temperature  # scaled in float32, as the log-softmax
            log_probs, entropy = vocab_log_prob_entropy(logits, targets[None], self.tp_group)
        else:  # fused head and log-softmax, a chunk of tokens at a time
            log_probs, entropy = linear_log_prob_entropy(
                hidden[:, scored], self.params[self.head_name], targets[None], self.tp_group,
                temperature)
        width = seq - 1 - start
        return {"log_probs": packing.scatter(log_probs[0], scored, start, width),
                "entropy": packing.scatter(entropy[0], scored, start, width), **extra}


def _check_experts(experts: ExpertGroups | None, config: LlamaConfig,
                   groups: HybridGroups) -> ExpertGroups | None:
    """``experts`` where they split the experts (``ep > 1``), else None; ValueError for a
    layout of another model, layout or pool (before any collective)."""
    if experts is None:
        return None
    if experts.layout.num_experts != config.num_experts:
        raise ValueError(f"expert layout of {experts.layout.num_experts} experts for a model "
                         f"of num_experts={config.num_experts}")
    if experts.layout.hybrid != groups.layout:
        raise ValueError(f"expert layout over {experts.layout.hybrid}, model groups over "
                         f"{groups.layout}")
    if experts.ep.ranks[experts.ep.rank] != groups.world.ranks[groups.rank]:
        raise ValueError("the expert groups and the model's groups were built on other pools")
    return experts if experts.layout.ep > 1 else None


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` without an index matches any GPU)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_temperature(temperature: float) -> None:
    """ValueError unless ``temperature`` (of the head's log-probs) is a number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not temperature > 0:
        raise ValueError(f"head temperature={temperature!r} must be a number > 0 (greedy "
                         f"rollouts are scored at 1.0)")


def load_full_state_dict(model: ParallelLlama, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's training shard of every global tensor into the model's flat buffer.

    Args:
        model: the rank's model.
        full: global tensors by spec name (as from :func:`engine.llama_spec.init_full_state_dict`);
            a tied ``lm_head`` copy is taken from ``embed_tokens`` when absent.
    """
    for spec in model.local_specs:
        name = spec.name
        if name == "lm_head" and name not in full and model.config.tie_word_embeddings:
            name = "embed_tokens"
        if name not in full:
            raise KeyError(f"full state dict has no tensor {name!r}")
        if tuple(full[name].shape) != spec.shape:
            raise ValueError(f"{name}: full tensor shape {tuple(full[name].shape)} != spec "
                             f"shape {spec.shape}")
        with torch.no_grad():
            model.params[spec.name].copy_(model.train_shard(full[name], spec))


def load_adapter_state_dict(model: ParallelLlama, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's training shard of every global adapter tensor (by spec name) into the
    model's adapter buffer (:func:`load_full_state_dict` for :attr:`ParallelLlama.
    adapter_specs`)."""
    for spec in model.local_adapter_specs:
        if spec.name not in full:
            raise KeyError(f"adapter state dict has no tensor {spec.name!r}")
        if tuple(full[spec.name].shape) != spec.shape:
            raise ValueError(f"{spec.name}: adapter shape {tuple(full[spec.name].shape)} != "
                             f"{spec.shape} (rank or target modules differ)")
        shard = train_shard(full[spec.name], spec, model.layout, model.groups.rank)
        with torch.no_grad():
            model.adapter_params[spec.name].copy_(shard)
