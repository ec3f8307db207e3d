"""Batched autoregressive generation on the generation layout ``(pp_g, tp_g)``.

The model is the training code's layer functions (:mod:`engine.layers`) fed with this rank's
generation shards, e.g. :meth:`hybridflow_comm.reshard.Resharder.generation_params` (views of
the flat buffer: column weights ``[rows/t_g, H]``, row weights stacked ``[m, H, in/t]``), the
generation TP group for the collectives and the generation PP group for stages.  How a step
runs is chosen once (:mod:`engine.forward_paths`): the stage boundary when the engine is built,
the layer paths when the weights are set.  Float32 Llama-style models without o_proj biases
or q/k norms (Llama, Mistral, Qwen2 with its q/k/v biases; not Qwen3) run the decode steps
through the C++ kernels of ``engine._kernels`` (the whole stage in one call without TP, two
calls per layer with it), reading the same views; the prefill and every other step run the
Python layers, the reference the kernels are tested against.  A greedy call whose rows all run
to the end, on one stage without TP, takes all its decode steps in one call
(``engine._kernels.greedy_decode``, ``greedy_loop=True``): the same kernel calls per step with
no Python between them, so the same bits as the loop below.

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

Early exit (``early_exit=True``, the default): a row that has finished (EOS or its own
``max_new_tokens``) stops being computed.  Between decode steps the running batch is
compacted to the rows still alive: the KV cache (:meth:`engine.kv_cache.KVCache.keep_rows_`),
the RoPE tables, the key mask and the step input keep only those rows, and each step's
tokens are scattered back to their rows of the full output::

    full batch   0 1 2 3 4 5 6 7        run = [0 2 3 5 6 7 ...]: full row of each running row
    running      0 . 2 3 . 5 6 7 ...    (finished rows 1, 4 dropped at the last compaction)

Results are bit-identical to ``early_exit=False`` (tests/test_generation_early_exit.py):

- a sampled row's random draw does not depend on the running rows: the noise is drawn for
  the full batch every step and indexed (``rows`` of :func:`engine.sampling.sample_next`);
- a row's floats do not depend on the running batch size, which the policy of
  :func:`decode_rows` keeps true.  BLAS (MKL here) gives a row of a product other bits in a
  batch whose row count is small for its threads and not a multiple of 4 (measured: 1-3, 5-7
  and 9-11 rows at 2 threads, also 17-19 and 25-27 at 16), and the same bits in every batch
  of a multiple of 4 (1 to 32 threads), so a running batch is a multiple of
  :data:`ROW_QUANTUM` = 4 rows (finished rows fill it up) and a batch that is not one is
  never compacted.  The C++ decode kernels give each thread a block of rows and switch from
  their small-M product to BLAS above ``small_gemm_max_rows`` rows per block, so a batch that
  runs BLAS blocks is only compacted to sizes that still do.  Their small-M product has two
  forms that round differently (csrc/engine/small_gemm.h); a call picks one by its full
  batch (:func:`uses_row_lanes`), the row-lane form only where no row can leave.

When: a compaction copies the kept rows' filled KV cache (about what one decode step's
attention reads), so it is worth doing for a real cut in compute, not for every finished row:
the batch is compacted once the rows it would drop are at least 1/:data:`COMPACT_DIVISOR` of
the running rows.  Then at most 1/8 of a step's rows are finished ones (plus the quantum's
fill), and since each compaction shrinks the batch by 1/8 or more, a call copies at most 8
batch-sized caches in all, however its rows finish.  With ``pp_g > 1`` every stage compacts
alike (all know every token) and only the running rows' hidden states cross the boundary.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine.forward_paths import ForwardPaths, KernelLayers, KernelStage, LayerPath, \
    PipelineStage, Rope, Sample, SingleStage, StageLayers, choose_paths, resolve_kernels
from engine.kv_cache import KVCache, kv_cache_nbytes
from engine.layers import causal_mask, position_ids_from_mask, rms_norm, rope_tables
from engine.llama_spec import LlamaConfig, head_weight_name
from engine.sampling import SamplingParams, sample_next
from engine.tp_ops import column_linear, vocab_embedding
from hybridflow_comm.groups import HybridGroups


ROW_QUANTUM = 4
"""A compacted running batch is a multiple of this many rows (see the module docstring)."""
COMPACT_DIVISOR = 8
"""Compact once the rows to drop are at least 1/COMPACT_DIVISOR of the running rows."""
ROW_LANES_MIN_ROWS = 28
"""A call of this many rows or more (and at most the kernels' ``small_gemm_max_rows``) whose
rows all run every step runs its decode products in the row-lane form
(csrc/engine/small_gemm.h): at the ``small`` shape a greedy step of 32 rows takes 0.88-0.92x
the k-lane form's time, 28 rows 0.96x, 24 rows 1.04x."""


def uses_row_lanes(batch: int, block_rows: int | None, supported: bool,
                   rows_stay: bool) -> bool:
    """Does a generation of ``batch`` rows run its small decode products in the row-lane form
    (pure)?  Only where every row runs every step (``rows_stay``: no EOS before the last step
    and no shorter per-row limit; early exit on or off alike): at 16 rows or fewer the row-lane
    form costs about what it does at 32 (a greedy run of 32 x 128 where half the rows stop
    after 16 tokens: 1.07x the k-lane form's time; three quarters: 1.21x).  Chosen once a
    call, by the full batch: the two forms round differently."""
    return (supported and rows_stay and block_rows is not None
            and ROW_LANES_MIN_ROWS <= batch <= block_rows)


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def decode_rows(batch: int, running: int, alive: int, threads: int,
                block_rows: int | None) -> int:
    """How many rows the next decode step runs (the early-exit policy, pure).

    Args:
        batch: the call's full batch B.
        running: rows the last step ran.
        alive: rows not yet finished (>= 1), all among the running ones.
        threads: intra-op threads of the decode step.
        block_rows: the C++ decode kernels' largest small-M row block
            (``_kernels.small_gemm_max_rows``), or None when the decode step runs the Python
            layers.

    Returns:
        ``running`` (no compaction), or fewer: a multiple of :data:`ROW_QUANTUM` that holds
        every alive row, never below the size at which a row's floats would change.
    """
    if batch % ROW_QUANTUM:
        return running  # BLAS rounds a remainder row of B differently than in a batch of 4s
    floor = ROW_QUANTUM
    if block_rows is not None and batch > block_rows * threads:
        # some kernel row blocks run BLAS: stay above block_rows per block, or do not compact
        floor = _round_up((block_rows + 1) * threads, ROW_QUANTUM)
        if batch < floor:
            return running
    target = max(_round_up(alive, ROW_QUANTUM), floor)
    return target if (running - target) * COMPACT_DIVISOR >= running else running


def kept_rows(alive: torch.Tensor, rows: int) -> torch.Tensor:
    """Indices (ascending) of the ``rows`` running rows to keep: every alive one (``alive``
    ``[running]`` bool), then finished ones in order to fill a multiple of the quantum."""
    return torch.argsort(~alive, stable=True)[:rows].sort().values


@dataclass
class GenerationOutput:
    """Prompts and responses of one batch (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    """``[B, P + N]`` int64: left-padded prompt, then the right-padded response."""
    attention_mask: torch.Tensor
    """``[B, P + N]`` int64, 1 for real tokens."""
    log_probs: torch.Tensor
    """``[B, N]`` float32 log-probs of the response tokens under ``softmax(logits / T)``
    before top-k/top-p truncation and the EOS mask of ``min_new_tokens`` (greedy: ``T = 1``);
    0 where masked (:mod:`engine.sampling`)."""
    prompt_length: int
    """P."""
    stats: dict = field(default_factory=dict)
    """This rank's timing and memory: ``time_s``, ``new_tokens``, ``kv_cache_bytes``..."""

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length:]

    @property
    def response_mask(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompt_length:]


def check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  config: LlamaConfig, sampling: SamplingParams) -> torch.Tensor:
    """Validate a prompt batch (ValueError naming the value); returns the mask (int64)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an int tensor [B, P], got "
                         f"{getattr(input_ids, 'shape', type(input_ids))}")
    batch, plen = input_ids.shape
    if batch == 0 or plen == 0:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    if tuple(attention_mask.shape) != (batch, plen):
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{(batch, plen)}")
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 and 1")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("prompts must be left-padded (attention_mask rows 0..0 1..1)")
    if bool((mask[:, -1] == 0).any()):
        raise ValueError(f"prompt rows {torch.nonzero(mask[:, -1] == 0).flatten().tolist()} "
                         f"have no real token")
    real = input_ids[mask.bool()]
    if bool(((real < 0) | (real >= config.vocab_size)).any()):
        raise ValueError(f"prompt token ids must be in [0, {config.vocab_size}), got "
                         f"min={int(real.min())} max={int(real.max())}")
    total = plen + sampling.max_new_tokens
    if total > config.max_position_embeddings:
        raise ValueError(f"prompt length {plen} + max_new_tokens={sampling.max_new_tokens} = "
                         f"{total} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}")
    sampling.check_vocab(config.vocab_size)
    return mask


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

    Attributes:
        boundary: how a step enters and leaves this stage (:class:`engine.forward_paths.
            SingleStage` or :class:`engine.forward_paths.PipelineStage`), fixed at build.
        paths: the layer paths for the current weights (:func:`engine.forward_paths.
            choose_paths`), chosen by :meth:`set_weights`; None without weights.
    """

    def __init__(self, config: LlamaConfig, groups: HybridGroups,
                 fused_decode: bool | None = None, early_exit: bool = True,
                 greedy_loop: bool = True) -> None:
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
        self.fused_decode = resolve_kernels(fused_decode, config.dtype, config.layer_keys)
        self.early_exit, self.greedy_loop = early_exit, greedy_loop
        self.boundary = (SingleStage() if self.num_stages == 1 else
                         PipelineStage(group=self.pp_group, stage=self.stage,
                                       hidden_size=config.hidden_size, dtype=config.dtype))
        self.weights: Mapping[str, torch.Tensor] | None = None
        self.weights_version: int | None = None
        self.paths: ForwardPaths | None = None  # chosen by set_weights for their form
        self.block_rows: int | None = None  # the decode kernels' row blocks (decode_rows)

    # Weights ---------------------------------------------------------------------------------
    def required_weights(self) -> list[str]:
        names = [f"layers.{i}.{k}" for i in self.layer_ids for k in self.config.layer_keys]
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
        c = self.config
        stage = StageLayers(
            weights=tuple({k: weights[f"layers.{i}.{k}"] for k in c.layer_keys}
                          for i in self.layer_ids),
            q_per_group=c.q_per_group, head_dim=c.head_dim, eps=c.rms_norm_eps,
            tp_group=self.tp_group, dtype=c.dtype)
        self.weights, self.weights_version = weights, version
        self.paths = choose_paths(stage, self.fused_decode)
        self.block_rows = None
        if isinstance(self.paths.decode, (KernelStage, KernelLayers)):
            from engine import _kernels  # built: the kernel paths exist only then
            self.block_rows = _kernels.small_gemm_max_rows

    def load_weights(self, resharder) -> None:
        """Rollout interface: take the resharder's generation views (in generation mode)."""
        if resharder.mode != "generation":
            raise RuntimeError("load_weights needs the resharder in generation mode")
        self.set_weights(resharder.generation_params(), resharder.version)

    def release(self) -> None:
        """Drop the references to the generation views (back to training)."""
        self.weights, self.weights_version, self.paths = None, None, None
        self.block_rows = None

    # Generation ------------------------------------------------------------------------------
    def kv_cache_bytes(self, batch: int, prompt_length: int, max_new_tokens: int) -> int:
        """Bytes the KV cache of one call takes on this rank."""
        return kv_cache_nbytes(**self._kv_cache_sizes(batch, prompt_length, max_new_tokens))

    def _kv_cache_sizes(self, batch: int, prompt_length: int, max_new_tokens: int) -> dict:
        """:class:`KVCache` arguments of one call: the last new token is never fed back."""
        return dict(num_layers=len(self.layer_ids), batch=batch,
                    max_len=prompt_length + max_new_tokens - 1, kv_heads=self.kv_heads,
                    head_dim=self.config.head_dim, dtype=self.config.dtype)

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
        batch, plen = input_ids.shape
        n_new = sampling.max_new_tokens
        limits = self._check_limits(max_new_tokens, batch, n_new)
        if self.weights is None:
            raise RuntimeError("no generation weights: call load_weights/set_weights first")
        t0 = time.perf_counter()
        c = self.config
        # Static per-call tables: every position as if all new tokens were real (a finished
        # row's later positions are never used).
        full_mask = torch.cat([mask, torch.ones(batch, n_new, dtype=torch.long)], dim=1)
        positions = position_ids_from_mask(full_mask)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, c.dtype,
                               c.rope_scaling)  # [B, P+N, D]
        keys_ok = full_mask.bool()[:, None, None, :]  # [B, 1, 1, P+N]
        prompt = _padded_prompt(input_ids, mask, sampling)
        distinct, copies = distinct_prompts(prompt, mask)
        cache = KVCache(**self._kv_cache_sizes(distinct.numel(), plen, n_new))
        kv_bytes = self.kv_cache_bytes(batch, plen, n_new)
        generator = torch.Generator().manual_seed(sampling.seed)
        # the head's product is chosen once per call, by the full batch, so that dropping
        # finished rows (early exit) never switches it between BLAS and the kernel
        head_kernel, row_lanes, rest_in_kernels = None, False, False
        if self.block_rows and batch <= self.block_rows:
            from engine import _kernels  # the kernel paths (block_rows) exist only when built
            head_kernel = _kernels.small_linear
            # whether rows can finish early, not whether they leave (early exit on and off
            # give the same bits)
            rows_stay = bool((limits == n_new).all()) and (
                sampling.eos_token_id is None or sampling.min_new_tokens >= n_new - 1)
            row_lanes = uses_row_lanes(batch, self.block_rows, _kernels.row_lanes_supported,
                                       rows_stay)
            rest_in_kernels = rows_stay and self._greedy_loop_applies(sampling)
        paths = self.paths.with_row_lanes(row_lanes)  # one product form for the whole call
        sample = functools.partial(self._sample, sampling=sampling, generator=generator,
                                   head_kernel=head_kernel, row_lanes=row_lanes)
        out_ids = torch.full((batch, n_new), sampling.pad_token_id, dtype=torch.long)
        out_mask = torch.zeros(batch, n_new, dtype=torch.long)
        out_lp = torch.zeros(batch, n_new, dtype=torch.float32)
        alive = torch.ones(batch, dtype=torch.bool)
        run = torch.arange(batch)  # [R] the full-batch row of each running row
        at: slice | torch.Tensor = slice(None)  # run as an index: every row until a compaction
        threads = torch.get_num_threads()
        # step 0 is the prefill of positions [0, P) of the distinct prompts (each prompt once
        # however many sequences share it); step i > 0 decodes position P + i - 1 of every row
        path, step_in, end = paths.for_prompt(plen), prompt[distinct], plen
        attn = causal_mask(mask[distinct], distinct.numel(), plen)
        rope = (cos[distinct, :plen], sin[distinct, :plen])
        steps = row_steps = compactions = 0
        for i in range(n_new):
            tok, lp = self._step(path, step_in, cache, rope, attn,
                                 functools.partial(sample, step=i), copies)  # [R] each
            if copies is not None:  # the prompts' caches, copied to each of their sequences
                cache.keep_rows_(copies)
                copies = None
            steps, row_steps = steps + 1, row_steps + run.numel()
            live = alive[at]  # a view before the first compaction: used before alive changes
            out_ids[at, i] = torch.where(live, tok, sampling.pad_token_id)
            out_mask[at, i] = live.long()
            out_lp[at, i] = torch.where(live, lp, 0.0)
            if sampling.eos_token_id is not None:
                alive[at] = live & (tok != sampling.eos_token_id)
            alive &= limits > i + 1
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if rest_in_kernels:  # every row runs steps i + 1 .. n_new - 1: one call for them all
                rest = n_new - 1 - i
                out_ids[:, i + 1:], out_lp[:, i + 1:] = self._greedy_rest(
                    paths.decode, out_ids[:, i], rest, cache, cos, sin, keys_ok[:, 0, 0],
                    [sampling.banned_token(j) for j in range(i + 1, n_new)])
                out_mask[:, i + 1:] = 1
                steps, row_steps = steps + rest, row_steps + rest * batch
                break
            rows = (decode_rows(batch, run.numel(), n_alive, threads, self.block_rows)
                    if self.early_exit else run.numel())
            if rows < run.numel():  # drop finished rows (every rank of the replica alike)
                keep = kept_rows(alive[run], rows)
                run, cos, sin, keys_ok = run[keep], cos[keep], sin[keep], keys_ok[keep]
                at = run
                cache.keep_rows_(keep)
                running = torch.zeros(batch, dtype=torch.bool)
                running[run] = True
                sample = functools.partial(self._sample, sampling=sampling,
                                           generator=generator, rows=running,
                                           head_kernel=head_kernel, row_lanes=row_lanes)
                compactions += 1
            path, step_in, end = paths.decode, out_ids[at, i:i + 1], end + 1
            attn, rope = keys_ok[..., :end], (cos[:, end - 1:end], sin[:, end - 1:end])
        del cache  # the KV cache lives only for the call
        elapsed = time.perf_counter() - t0
        new_tokens = int(out_mask.sum())
        return GenerationOutput(
            input_ids=torch.cat([prompt, out_ids], dim=1),
            attention_mask=torch.cat([mask, out_mask], dim=1), log_probs=out_lp,
            prompt_length=plen,
            stats={"time_s": elapsed, "new_tokens": new_tokens, "forward_steps": steps,
                   "prefill_rows": int(distinct.numel()),
                   "row_steps": row_steps, "compactions": compactions,
                   "tokens_per_s": new_tokens / max(elapsed, 1e-9), "kv_cache_bytes": kv_bytes,
                   "weights_version": self.weights_version})

    def _greedy_loop_applies(self, sampling: SamplingParams) -> bool:
        """Whether :meth:`_greedy_rest` can take the decode steps: greedy, one stage, the
        decode path is the one-call kernel stage and the head is read in place with no TP
        (the conditions under which each step is exactly ``greedy_head(decode_layers(...))``)."""
        return (self.greedy_loop and sampling.greedy and isinstance(self.boundary, SingleStage)
                and isinstance(self.paths.decode, KernelStage)
                and self.weights[self.head_name].stride(1) == 1
                and (self.tp_group is None or self.tp_group.pg is None))

    def _greedy_rest(self, decode: KernelStage, last: torch.Tensor, steps: int, cache: KVCache,
                     cos: torch.Tensor, sin: torch.Tensor, keys_ok: torch.Tensor,
                     banned: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """``steps`` greedy decode steps of every row after the tokens ``last [B]`` in one
        kernel call; the cache advances by ``steps``.  Returns tokens and log-probs
        ``[B, steps]`` each."""
        from engine import _kernels
        s = decode.stage
        toks, lps = _kernels.greedy_decode(
            last, steps, self.weights["embed_tokens"], decode.flat_weights, s.eps, cos, sin,
            cache.k, cache.v, cache.length, keys_ok, s.q_per_group, decode.qkv_biases,
            self.weights["norm"], self.config.rms_norm_eps, self.weights[self.head_name],
            [-1 if b is None else b for b in banned], row_lanes=decode.row_lanes)
        cache.advance(steps)
        return toks, lps

    @staticmethod
    def _check_limits(limits: torch.Tensor | None, batch: int, n_new: int) -> torch.Tensor:
        if limits is None:
            return torch.full((batch,), n_new, dtype=torch.long)
        limits = torch.as_tensor(limits, dtype=torch.long)
        if tuple(limits.shape) != (batch,) or bool(((limits < 1) | (limits > n_new)).any()):
            raise ValueError(f"max_new_tokens per sequence must be [B={batch}] ints in "
                             f"[1, {n_new}], got {limits.tolist()}")
        return limits

    def _step(self, path: LayerPath, ids: torch.Tensor, cache: KVCache, rope: Rope,
              attn: torch.Tensor, sample: Sample, copies: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ``ids [B, S]`` through every stage; returns ``(tokens, log_probs)``
        of each row, or of each row of ``copies`` (a row index per sequence) when given."""
        x = self.boundary.enter(ids, self._embed)
        x = path.forward(x, cache, rope, attn)
        cache.advance(ids.shape[1])
        return self.boundary.leave(x, sample, copies)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """First stage: ``ids [B, S]`` -> ``[B, S, H]``."""
        return vocab_embedding(ids, self.weights["embed_tokens"], self.tp_group)

    def _sample(self, x: torch.Tensor, sampling: SamplingParams, generator: torch.Generator,
                rows: torch.Tensor | None = None, step: int = 0, head_kernel=None,
                row_lanes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Last stage: the next token of every row from the last position of ``x [R, S, H]``
        (``rows``: the running rows of the full batch, None = all; ``step``: tokens each row
        has produced, for ``sampling.min_new_tokens``; ``head_kernel``: the decode kernels'
        small-M product for the LM head, or None for BLAS; ``row_lanes``: its form, the call's)."""
        w = self.weights[self.head_name]  # [V/t_g, H]: column-parallel, no comm forward
        if (head_kernel is not None and w.stride(1) == 1 and sampling.greedy
                and (self.tp_group is None or self.tp_group.pg is None)):
            # the whole vocabulary here and argmax only: norm, head and choice in one call
            # (the same bits as the three below, without the Python between them)
            from engine import _kernels
            banned = sampling.banned_token(step)
            return _kernels.greedy_head(x[:, -1], self.weights["norm"],
                                        self.config.rms_norm_eps, w,
                                        -1 if banned is None else banned, row_lanes=row_lanes)
        h = rms_norm(x[:, -1], self.weights["norm"], self.config.rms_norm_eps)  # [R, H]
        if head_kernel is not None and w.stride(1) == 1:
            # a few rows: the kernels' product reads the head in place on every intra-op
            # thread (BLAS packs the whole [V/t_g, H] weight first: 2.4-3.9x slower at 1-4 rows)
            logits = head_kernel(h.contiguous(), w, row_lanes=row_lanes)
        else:
            logits = column_linear(h, w, self.tp_group)  # [R, V/t_g]
        return sample_next(logits, sampling, self.tp_group, generator, rows, step)


def distinct_prompts(prompt: torch.Tensor, mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows to prefill and how to copy them back to one row per sequence.

    Identical prompts (the samples of one prompt in GRPO, RLOO, ...: equal ids and mask) share
    their prefill, as vLLM's ``n > 1`` does.  Returns ``(distinct [U], copies)``: the first
    row of each distinct prompt, in batch order, and ``copies [B]`` with the index into
    ``distinct`` of every row's prompt, or None when all ``B`` prompts differ (then
    ``distinct`` is every row and nothing is copied).
    """
    batch = prompt.shape[0]
    _, group = torch.unique(torch.cat([prompt, mask], dim=1), dim=0, return_inverse=True)
    first = torch.full((int(group.max()) + 1,), batch, dtype=torch.long)
    first.scatter_reduce_(0, group, torch.arange(batch), reduce="amin")
    if first.numel() == batch:
        return torch.arange(batch), None
    distinct, order = first.sort()  # batch order
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel())
    return distinct, slot[group]


def _padded_prompt(input_ids: torch.Tensor, mask: torch.Tensor,
                   sampling: SamplingParams) -> torch.Tensor:
    """The prompt as returned: padding positions hold ``pad_token_id``."""
    return input_ids.long().masked_fill(mask == 0, sampling.pad_token_id)
