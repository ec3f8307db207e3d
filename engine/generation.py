"""Batched autoregressive generation on the generation layout ``(pp_g, tp_g)``.

The model is the training code's layer functions (:mod:`engine.layers`) fed with this rank's
generation shards, e.g. :meth:`hybridflow_comm.reshard.Resharder.generation_params` (views of
the flat buffer: column weights ``[rows/t_g, H]``, row weights stacked ``[m, H, in/t]``), the
generation TP group for the collectives and the generation PP group for stages.  How a step
runs is chosen once (:mod:`engine.forward_paths`): the stage boundary when the engine is built,
the layer paths when the weights are set, the rest of a call's choices
once per call (:func:`engine.forward_paths.plan_call`).  Float32
Llama-style models without o_proj biases or q/k norms (Llama, Mistral, Qwen2 with its q/k/v
biases; not Qwen3) run the decode steps through the C++ kernels of ``engine._kernels``; the
prefill and every other step run the Python layers, the reference the kernels are tested
against.

One call::

    prompts [B, P] left-padded  --prefill-->  token 0  --decode x (N-1), KV cache-->  tokens
    output input_ids [B, P + N] = | pad..pad prompt | response pad..pad |
           attention_mask        = | 0 .. 0  1 .. 1  | 1 .. 1   0 .. 0   |
           log_probs [B, N]      log-prob of each response token under softmax(logits / T),
                                 the sampled distribution before top-k/top-p and the
                                 EOS mask of min_new_tokens (T = 1 when greedy), 0 where
                                 masked

Positions skip the left padding (``cumsum(mask) - 1``, as transformers).  With ``pp_g > 1``
a step runs the stages one after the other (hidden states sent stage to stage over the
generation PP group); the last stage samples and broadcasts ``(token, log-prob)`` back to
every stage, so every rank of the replica knows every token and all stop together.  The
stages are not overlapped across steps (no micro-batching): simple, not fast.

Every rank of a generation replica (its TP x PP group) must pass the same prompts and
settings; the sampled tokens are then identical on all of them (see :mod:`engine.sampling`).

What differs by device is a decode backend picked once when the engine is built
(:mod:`engine.decode_backend`): :class:`engine.decode_cpu.CpuDecode` (tiled KV cache, the C++
kernels, their heads, one-call greedy finish) or :class:`engine.decode_cuda.CudaDecode` (dense
KV cache read in place by SDPA, decode steps at the static shapes of their batch bucket,
compiled where ``compile_decode``, replayed as CUDA graphs where ``cuda_graphs``; the same
bits eagerly).  The backend allocates its cache once and keeps it, and the graphs over it,
from call to call, growing it only for a call that needs more, until
:meth:`GenerationEngine.release` (:mod:`engine.decode_memory`).

Early exit (``early_exit=True``, the default) stops computing the rows that have finished
(:mod:`engine.early_exit`, which states what it guarantees).  A call runs in numbered phases
(:meth:`GenerationEngine.generate`): tables and plan, prefill, the decode loop (step, record,
stop, compact), output.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine import inductor
from engine.cuda_graphs import StaticDecode, graphs_apply, nccl_version, resolve_graphs, \
    tp_backend
from engine.decode_backend import DecodeBackend, Head, Responses, StepTables
from engine.decode_cpu import CpuDecode
from engine.decode_cuda import CudaDecode
from engine.decode_memory import DecodeMemory
from engine.lora import LayerLora, LoraConfig
from engine.early_exit import RunningRows, check_every
from engine.generation_io import GenerationOutput, check_limits, check_prompts, \
    distinct_prompts, padded_prompt
from engine.forward_paths import CallPlan, ForwardPaths, LayerPath, PipelineStage, Rope, \
    Sample, SingleStage, StageLayers, plan_call, resolve_kernels
from engine.kv_cache import KVCache, kv_cache_nbytes, resolve_layout
from engine.moe import experts_mask, moe_block
from engine.llama_spec import LlamaConfig, head_weight_name
from engine.model import same_device
from engine.sampling import SamplingParams, SeedStream
from engine.tp_ops import vocab_embedding
from hybridflow_comm.comm import all_gather_tensor
from hybridflow_comm.groups import HybridGroups

class GenerationEngine:
    """Generation of one rank of a generation replica.

    Args:
        config: architecture.
        groups: this rank's groups (``groups.layout`` gives ``pp_g``, ``tp_g`` and the
            training ``pp`` that names the head weight).
        fused_decode: run the one-token decode steps through the C++ kernels of
            ``engine._kernels`` instead of ~30 tensor ops per layer (one call per step without
            TP, two per layer with it); default: when the extension is built and the model is
            float32 without o_proj biases or q/k norms.  False: every step through the Python
            layers (the prefill always runs them).
        early_exit: drop finished rows from the running batch (see the module docstring);
            False computes every row until all have finished (same results, more work).
        greedy_loop: run the decode steps of a greedy generation whose rows all run to the
            end in one C++ call (``engine._kernels.greedy_decode``: the same kernels on the same
            operands, no Python between steps) where the whole step is the kernels' (one
            stage, no TP); False keeps the Python loop (same results).
        device: where the weights (:meth:`set_weights`) live; every tensor of a call is made
            there and the prompts are moved there.  The C++ kernels run on the CPU only.
        kv_layout: the KV cache's layout (:mod:`engine.kv_cache`): ``"tiled"`` (the C++
            kernels' layout), ``"dense"`` (read in place by SDPA; its decode steps run at the
            static shapes of :class:`engine.cuda_graphs.StaticDecode`, each pipeline stage's
            its own), or None: dense on CUDA, tiled elsewhere.  The dense layout decodes on
            the Python layers (``fused_decode`` False).
        cuda_graphs: replay the decode steps as CUDA graphs per batch bucket
            (:mod:`engine.cuda_graphs`, each pipeline stage its own); None: on for CUDA.  With
            the dense layout, and under TP where the TP group runs NCCL
            (:func:`engine.cuda_graphs.graphs_apply`); elsewhere the steps run eagerly (same
            tokens).
        compile_decode: run the static decode steps' layers ``torch.compile``d
            (:mod:`engine.compiled_decode`: the elementwise chains fused; with TP or experts
            the regions between the collectives); None: on for CUDA.  Only where the steps
            are static; the same tokens up to float summation order.
        record_routes: a mixture of experts records every token's experts in every layer
            (:attr:`GenerationOutput.routes`).
        experts: the experts whose pieces this rank holds and computes (generation expert
            parallelism: :meth:`hybridflow_comm.expert_layout.ExpertLayout.gen_experts`, the
            TP all-reduce adding the rest); None: every expert.
        keep_cache: :meth:`release` keeps the KV cache and the decode graphs for the next
            weights (a generation-only process, or memory to spare during training); False
            drops them, so that training gets their memory back (:mod:`engine.decode_memory`).

    Attributes:
        boundary: how a step enters and leaves this stage (:class:`engine.forward_paths.
            SingleStage` or :class:`engine.forward_paths.PipelineStage`), fixed at build.
        paths: the layer paths for the current weights (:func:`engine.forward_paths.
            choose_paths`), chosen by :meth:`set_weights`; None without weights.
    """

    def __init__(self, config: LlamaConfig, groups: HybridGroups,
                 fused_decode: bool | None = None, early_exit: bool = True,
                 greedy_loop: bool = True, device: torch.device | str = "cpu",
                 kv_layout: str | None = None, cuda_graphs: bool | None = None,
                 compile_decode: bool | None = None, record_routes: bool = False,
                 experts: Sequence[int] | None = None, keep_cache: bool = False) -> None:
        layout = groups.layout
        config.check_parallel(layout.pp_g, layout.tp_g)
        self.config, self.groups = config, groups
        coords = layout.gen_coords(groups.rank)
        self.stage, self.num_stages = coords.pp_g, layout.pp_g
        self.is_first, self.is_last = self.stage == 0, self.stage == layout.pp_g - 1
        self.layer_ids = [i for i in range(config.num_layers)
                          if config.layer_stage(i, layout.train.pp) // layout.micro_pp
                          == self.stage]
        self.head_name = head_weight_name(config, layout.train.pp)
        self.tp_group, self.pp_group = groups.gen_tp, groups.gen_pp
        self.kv_heads = config.num_kv_heads // layout.tp_g
        self.device = torch.device(device)
        self.experts = _check_experts(experts, config)
        # the decode backend, picked once by the KV cache layout (engine.decode_backend)
        self.kv_layout = resolve_layout(kv_layout, self.device)
        if self.kv_layout == "dense" and fused_decode:
            raise ValueError("fused_decode=True reads the tiled KV cache; kv_layout='dense' "
                             "decodes on the Python layers (fused_decode=None or False)")
        graphs = resolve_graphs(cuda_graphs, self.device)
        self.fused_decode = self.kv_layout == "tiled" and resolve_kernels(
            fused_decode, config.dtype, config.layer_keys, self.device)
        # the dense layout's decode steps at static shapes (a stage's step: the first stage's
        # embedding and the stage's layers, a mixture's by the sync-free block), compiled
        # where asked, captured as CUDA graphs where graphs_apply
        self.static_decode = self.kv_layout == "dense"
        self.cuda_graphs = graphs and self.static_decode and graphs_apply(
            self.device, tp_backend(self.tp_group),
            nccl_version() if self.device.type == "cuda" else None)
        self.compile_decode = self.static_decode and inductor.compile_applies(compile_decode,
                                                                              self.device)
        self.backend: DecodeBackend = (
            CpuDecode(self.device, self.fused_decode, greedy_loop) if self.kv_layout == "tiled"
            else CudaDecode(self.device, self.cuda_graphs, self.compile_decode, self.experts))
        self.adapters: Mapping[str, torch.Tensor] | None = None
        self.lora: LoraConfig | None = None
        self.early_exit = early_exit
        self.route_log: list[torch.Tensor] | None = \
            [] if record_routes and config.num_experts else None
        self.boundary = (SingleStage() if self.num_stages == 1 else
                         PipelineStage(group=self.pp_group, stage=self.stage,
                                       hidden_size=config.hidden_size, dtype=config.dtype,
                                       device=self.device))
        self.weights: Mapping[str, torch.Tensor] | None = None
        self.weights_version: int | None = None
        self.keep_cache = keep_cache

    @property
    def paths(self) -> ForwardPaths | None:
        """The layer paths of the current weights, chosen by :meth:`set_weights`."""
        return self.backend.paths

    @property
    def block_rows(self) -> int | None:
        """The decode kernels' small-M row block where the steps run them (plan_call)."""
        return self.backend.block_rows

    @property
    def memory(self) -> DecodeMemory:
        """The KV cache (and static steps) the backend holds from call to call."""
        return self.backend.memory

    # Weights ---------------------------------------------------------------------------------
    @property
    def layer_keys(self) -> tuple[str, ...]:
        """The weights of each local layer: the config's, a mixture's experts limited to
        :attr:`experts`."""
        keys = self.config.layer_keys
        if self.experts is None:
            return keys
        held = {f"experts.{e}.{k}" for e in self.experts for k in ("gate_up", "down_proj")}
        return tuple(k for k in keys if not k.startswith("experts.") or k in held)

    def required_weights(self) -> list[str]:
        names = [f"layers.{i}.{k}" for i in self.layer_ids for k in self.layer_keys]
        if self.is_first:
            names.insert(0, "embed_tokens")
        if self.is_last:
            names += ["norm", self.head_name]
        return names

    def set_weights(self, weights: Mapping[str, torch.Tensor], version: int | None = None
                    ) -> None:
        """Use ``weights`` (this rank's generation shards by spec name; held, never copied)
        and choose the layer paths that read them."""
        missing = [n for n in self.required_weights() if n not in weights]
        if missing:
            raise ValueError(f"generation weights lack {missing[:4]} (stage {self.stage})")
        elsewhere = sorted(n for n in self.required_weights()
                           if not same_device(weights[n].device, self.device))
        if elsewhere:
            raise ValueError(f"generation weights {elsewhere[:4]} live on "
                             f"{weights[elsewhere[0]].device}, the engine on {self.device} "
                             f"(GenerationEngine(device=...))")
        c = self.config
        loras = self._layer_loras()
        stage = StageLayers(
            weights=tuple({k: weights[f"layers.{i}.{k}"] for k in self.layer_keys}
                          for i in self.layer_ids),
            q_per_group=c.q_per_group, head_dim=c.head_dim, eps=c.rms_norm_eps,
            tp_group=self.tp_group, dtype=c.dtype, device=self.device, loras=loras,
            routing=c.routing, route_log=self.route_log,
            moe=None if self.experts is None else functools.partial(
                moe_block, experts=self.experts,
                held_mask=experts_mask(self.experts, c.num_experts, self.device)))
        self.weights, self.weights_version = weights, version
        self.backend.set_weights(stage, _addresses(weights, self.required_weights(),
                                                   self.adapters, self.lora))

    def set_adapters(self, adapters: Mapping[str, torch.Tensor] | Any | None,
                     lora: LoraConfig | None = None) -> None:
        """LoRA adapters for the next :meth:`set_weights` (this rank's generation shards of
        the adapter tensors by spec name, held not copied, or the adapter resharder holding
        them, as :class:`engine.hybrid_engine.Rollout` passes it: its ``generation_params()``;
        None: none), applied unmerged on the Python layers."""
        if (adapters is None) != (lora is None):
            raise ValueError("set_adapters takes the adapter tensors and their LoraConfig")
        if adapters is not None and not isinstance(adapters, Mapping):
            adapters = adapters.generation_params()
        self.adapters, self.lora = adapters, lora

    def _layer_loras(self) -> tuple[LayerLora, ...]:
        """Each local layer's :class:`engine.lora.LayerLora` over the generation shards (the
        generation TP group, no dropout), or ``()`` without adapters."""
        if self.adapters is None:
            return ()
        c, mods = self.config, self.lora.target_modules
        return tuple(LayerLora(a={m: self.adapters[f"layers.{i}.{m}.lora_A"] for m in mods},
                               b={m: self.adapters[f"layers.{i}.{m}.lora_B"] for m in mods},
                               scale=self.lora.scale, dropout=0.0, tp_group=self.tp_group,
                               q_per_group=c.q_per_group, head_dim=c.head_dim)
                     for i in self.layer_ids)

    def load_weights(self, resharder) -> None:
        """Rollout interface: take the resharder's generation views (in generation mode)."""
        if resharder.mode != "generation":
            raise RuntimeError("load_weights needs the resharder in generation mode")
        self.set_weights(resharder.generation_params(), resharder.version)

    def release(self) -> None:
        """Drop the references to the generation views (back to training), and the KV cache
        and decode graphs unless ``keep_cache``."""
        self.weights, self.weights_version = None, None
        self.adapters, self.lora = None, None
        self.backend.release(self.keep_cache)

    # Generation ------------------------------------------------------------------------------
    def kv_cache_bytes(self, batch: int, prompt_length: int, max_new_tokens: int) -> int:
        """Bytes the KV cache of one call takes on this rank (the cache the engine holds
        is as large as the largest call's since it was made)."""
        return kv_cache_nbytes(**self._kv_cache_sizes(batch, prompt_length, max_new_tokens),
                               layout=self.kv_layout)

    def _kv_cache_sizes(self, rows: int, prompt_length: int, max_new_tokens: int,
                        batch: int | None = None) -> dict:
        """KV cache arguments (:data:`engine.kv_cache.KV_CACHES`) of one call of ``batch``
        sequences (default ``rows``) whose prefill runs ``rows``: the last new token is never
        fed back; the capacity holds the batch (the prefill's rows copied to it), static
        decode steps the rows of the batch's bucket."""
        batch = batch or rows
        return dict(num_layers=len(self.layer_ids), batch=rows,
                    max_len=prompt_length + max_new_tokens - 1, kv_heads=self.kv_heads,
                    head_dim=self.config.head_dim, dtype=self.config.dtype,
                    capacity=self.backend.capacity(batch))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 sampling: SamplingParams | None = None,
                 max_new_tokens: torch.Tensor | None = None) -> GenerationOutput:
        """Generate responses for left-padded prompts.

        Args:
            input_ids: ``[B, P]`` prompts, left-padded.
            attention_mask: ``[B, P]``, 1 for real tokens (default all ones).
            sampling: settings (default greedy, 16 tokens).
            max_new_tokens: optional ``[B]`` per-sequence limits, each in
                ``[1, sampling.max_new_tokens]`` (the response width).

        Returns:
            A :class:`GenerationOutput`, identical on every rank of the replica.
        """
        sampling = sampling or SamplingParams(temperature=0.0)
        mask = check_prompts(input_ids, attention_mask, self.config, sampling)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)  # once per call
        batch, plen = input_ids.shape
        n_new = sampling.max_new_tokens
        limits = check_limits(max_new_tokens, batch, n_new, self.device)
        if self.weights is None:
            raise RuntimeError("no generation weights: call load_weights/set_weights first")
        t0 = time.perf_counter()
        # 1. per-call tables, plan and state
        tables = StepTables.build(mask, n_new, self.config)
        prompt = padded_prompt(input_ids, mask, sampling)
        distinct, copies = distinct_prompts(prompt, mask)
        plan = self._plan(batch, limits, sampling)
        # the held KV cache reset for the call (grown where it needs more), and the backend's
        # static steps over it where it has them (engine.decode_memory)
        cache, static = self.backend.call_cache(
            self._kv_cache_sizes(distinct.numel(), plen, n_new, batch),
            self._embed if self.is_first else None, plan)
        rows = RunningRows(limits, sampling.eos_token_id)
        out = Responses.empty(batch, n_new, sampling.pad_token_id, self.device)
        routes = None
        if self.route_log is not None:
            self.route_log.clear()
            routes = torch.full((batch, plen + n_new, len(self.layer_ids),
                                 self.config.num_experts_per_tok), -1, dtype=torch.int16,
                                device=self.device)
        sample = functools.partial(self._sample, sampling=sampling,
                                   stream=SeedStream(sampling.seed), plan=plan)
        # 2. prefill: each distinct prompt once, its cache then copied to its sequences
        tok, lp = self._step(plan.paths.for_prompt(plen), prompt[distinct], cache,
                             *tables.prompt(distinct, plen, mask),
                             functools.partial(sample, step=0), copies)
        if copies is not None:
            cache.keep_rows_(copies)
        if routes is not None:  # the distinct prompts' routing, one row per sequence
            prefilled = self.route_log.pop().unflatten(0, (-1, plen))
            routes[:, :plen] = prefilled if copies is None else prefilled[copies]
        # 3. decode: record the step, stop, compact, next step; the finished rows are counted
        # (the loop's one device-to-host sync) every `every` steps (every step on the CPU)
        every = check_every(self.device)
        for i in range(n_new):
            out.record(i, rows, tok, lp)
            rows.end_step(i, tok)
            if i == n_new - 1:
                break
            if (i + 1) % every == 0:
                alive = rows.alive_count()
                if alive == 0:
                    break
                if plan.greedy_rest:  # no row leaves: the remaining steps in one kernel call
                    self.backend.greedy_rest(plan.paths.decode, out, i, cache, tables,
                                             sampling, rows, self.weights["embed_tokens"],
                                             self._head())
                    break
                keep = rows.compact(alive) if self.early_exit else None
                if keep is not None:
                    tables = tables.keep_rows(keep)
                    cache.keep_rows_(keep)
            tok, lp = self._decode_step(plan.paths.decode, static, out.ids[rows.at, i:i + 1],
                                        cache, tables, plen + i + 1,
                                        functools.partial(sample, rows=rows.mask, step=i + 1))
            if routes is not None:  # the routing of the token fed at position plen + i
                # (the running rows: a static step's bucket pads them); a row token i ended is
                # still fed until compacted: its last token stays -1
                fed = self.route_log.pop()[:rows.run.numel()].to(torch.int16)
                routes[rows.at, plen + i] = fed.masked_fill_(~rows.alive[rows.at, None, None], -1)
        graphs = 0 if static is None else static.captured  # this call's new graphs
        capture_s = 0.0 if static is None else static.capture_s
        if static is not None:
            static.end_call()  # kept for the next call, without this call's weights
        # 4. output
        new_tokens = int(out.mask.sum())  # its sync waits for the device: time_s includes it
        elapsed = time.perf_counter() - t0
        full_mask = torch.cat([mask, out.mask], dim=1)
        if routes is not None:
            routes = self._all_stages_routes(routes.masked_fill_(~full_mask.bool()[..., None, None],
                                                                 -1))
        return GenerationOutput(
            input_ids=torch.cat([prompt, out.ids], dim=1),
            attention_mask=full_mask, log_probs=out.log_probs,
            prompt_length=plen, routes=routes,
            stats={"time_s": elapsed, "new_tokens": new_tokens, "forward_steps": rows.steps,
                   "prefill_rows": int(distinct.numel()), "row_steps": rows.row_steps,
                   "compactions": rows.compactions,
                   "tokens_per_s": new_tokens / max(elapsed, 1e-9),
                   "kv_cache_bytes": self.kv_cache_bytes(batch, plen, n_new),
                   **self.backend.stats(), "graphs_captured": graphs,
                   "capture_s": capture_s,
                   "weights_version": self.weights_version})

    def _all_stages_routes(self, routes: torch.Tensor) -> torch.Tensor:
        """``routes [B, S, local layers, k]`` -> every layer's, stage after stage (one
        all-gather over the generation pipeline; the TP ranks of a stage hold the same)."""
        if self.pp_group.size == 1:
            return routes
        stages = all_gather_tensor(routes.to(torch.int32), self.pp_group)  # [pp_g, B, S, l, k]
        return stages.permute(1, 2, 0, 3, 4).flatten(2, 3).to(torch.int16)

    def _plan(self, batch: int, limits: torch.Tensor, sampling: SamplingParams) -> CallPlan:
        """:func:`engine.forward_paths.plan_call` for a call of ``batch`` rows."""
        n_new = sampling.max_new_tokens
        # whether rows can finish early, not whether they leave (early exit on and off give
        # the same product forms)
        rows_stay = bool((limits == n_new).all()) and (  # a host sync, once per call
            sampling.eos_token_id is None or sampling.min_new_tokens >= n_new - 1)
        whole_vocab = self.tp_group is None or self.tp_group.pg is None
        kernel_loop = self.backend.kernel_loop(isinstance(self.boundary, SingleStage))
        return plan_call(self.paths, batch, self.block_rows, rows_stay,
                         head_in_place=self.is_last
                         and self.weights[self.head_name].stride(1) == 1,
                         greedy_one_rank=sampling.greedy and whole_vocab,
                         kernel_loop=kernel_loop)

    def _step(self, path: LayerPath, ids: torch.Tensor, cache: KVCache, rope: Rope,
              attn: torch.Tensor | None, sample: Sample, copies: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ``ids [B, S]`` through every stage; returns ``(tokens, log_probs)``
        of each row, or of each row of ``copies`` (a row index per sequence) when given."""
        x = self.boundary.enter(ids, self._embed)
        x = path.forward(x, cache, rope, attn)
        cache.advance(ids.shape[1])
        return self.boundary.leave(x, sample, copies)

    def _decode_step(self, path: LayerPath, static: StaticDecode | None, ids: torch.Tensor,
                     cache: KVCache, tables: StepTables, end: int, sample: Sample
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step of ``ids [R, 1]`` at position ``end - 1``: by ``path``, or at the
        static shapes of ``static`` (the first stage's embedding and the stage's layers; a
        later stage's hidden states received before it, sent and the sampler run after
        it)."""
        if static is None:
            return self._step(path, ids, cache, *tables.decode(end), sample)
        inputs = ids if self.is_first else self.boundary.enter(ids, self._embed)
        x = static.step(inputs, tables.cos[:, end - 1:end], tables.sin[:, end - 1:end],
                        tables.keys_ok)
        if isinstance(x, tuple):  # a mixture's step: its routes too
            x, routes = x
            self.route_log.append(routes)
        cache.advance(1)
        return self.boundary.leave(x, sample)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """First stage: ``ids [B, S]`` -> ``[B, S, H]``."""
        return vocab_embedding(ids, self.weights["embed_tokens"], self.tp_group)

    def _head(self) -> Head:
        """The last stage's final norm and LM head."""
        return Head(self.weights["norm"], self.config.rms_norm_eps, self.weights[self.head_name],
                    self.tp_group)

    def _sample(self, x: torch.Tensor, sampling: SamplingParams, stream: SeedStream,
                plan: CallPlan, rows: torch.Tensor | None = None, step: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Last stage: the next token of every row from the last position of ``x [R, S, H]``
        (``rows``: the running rows of the full batch, None = all; ``step``: tokens each row
        has produced, for ``sampling.min_new_tokens``), by the backend's head."""
        return self.backend.sample(self._head(), x, sampling, stream, plan, rows, step)

def _addresses(weights: Mapping[str, torch.Tensor], names: Sequence[str],
               adapters: Mapping[str, torch.Tensor] | None, lora: LoraConfig | None) -> tuple:
    """What a captured decode step reads of the weights and adapters: every tensor's address
    and layout, and the adapters' settings (equal keys: the graphs stay valid)."""
    tensors = [weights[n] for n in names] + list((adapters or {}).values())
    return (lora, *((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors))


def _check_experts(experts: Sequence[int] | None, config: LlamaConfig
                   ) -> tuple[int, ...] | None:
    """``experts`` as a sorted tuple, ValueError (naming them) unless they are distinct
    experts of the config's mixture."""
    if experts is None:
        return None
    held = tuple(sorted(int(e) for e in experts))
    if not config.num_experts:
        raise ValueError(f"GenerationEngine(experts={list(held)[:8]}): the model has no experts")
    if not held or len(set(held)) != len(held) or not 0 <= held[0] <= held[-1] < \
            config.num_experts:
        raise ValueError(f"GenerationEngine(experts={list(held)[:8]}): need distinct experts "
                         f"in [0, {config.num_experts})")
    return held
