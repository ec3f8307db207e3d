"""Batched autoregressive generation on the generation layout ``(pp_g, tp_g)``.

The model is the training code's layer functions (:mod:`engine.layers`) fed with this rank's
generation shards, e.g. :meth:`hybridflow_comm.reshard.Resharder.generation_params` (views of
the flat buffer: column weights ``[rows/t_g, H]``, row weights stacked ``[m, H, in/t]``), the
generation TP group for the collectives and the generation PP group for stages.  Decode steps
of float32 models run the same maths through the C++ kernels of ``engine._kernels`` (the whole
stage in one call without TP, two calls per layer with it), reading the same views, and the
prefill through the training blocks of :mod:`engine.fused_layers` (their forward, which also
hands each layer's keys and values to the cache) when the layer's weights are 2-D (no stacked
row-parallel weights, i.e. ``tp_g`` equal to the training ``tp``) and the prompts are at most
``fused_layers.AUTO_MAX_SEQ`` tokens wide.

One call::

    prompts [B, P] left-padded  --prefill-->  token 0  --decode x (N-1), KV cache-->  tokens
    output input_ids [B, P + N] = | pad..pad prompt | response pad..pad |
           attention_mask        = | 0 .. 0  1 .. 1  | 1 .. 1   0 .. 0   |
           log_probs [B, N]      model log-prob of each response token, 0 where masked

Positions skip the left padding (``cumsum(mask) - 1``, as transformers).  With ``pp_g > 1``
a step runs the stages one after the other (hidden states sent stage to stage over the
generation PP group); the last stage samples and broadcasts ``(token, log-prob)`` back to
every stage, so every rank of the replica knows every token and all stop together.  The
stages are not overlapped across steps (no micro-batching): simple, not fast.

Every rank of a generation replica (its TP x PP group) must pass the same prompts and
settings; the sampled tokens are then identical on all of them (see :mod:`engine.sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine import fused_layers
from engine.kv_cache import KVCache, kv_cache_nbytes
from engine.layers import causal_mask, decoder_layer, position_ids_from_mask, rms_norm, \
    rope_tables
from engine.llama_spec import LlamaConfig, head_weight_name
from engine.model import LAYER_KEYS
from engine.sampling import SamplingParams, sample_next
from engine.tp_ops import column_linear, reduce_from_tp, vocab_embedding
from hybridflow_comm.groups import HybridGroups

try:  # C++ decode kernels (setup.py builds them; absent in a source tree never built)
    from engine import _kernels
except ImportError:  # pragma: no cover - the Python layers are used instead
    _kernels = None


@dataclass
class GenerationOutput:
    """Prompts and responses of one batch (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    """``[B, P + N]`` int64: left-padded prompt, then the right-padded response."""
    attention_mask: torch.Tensor
    """``[B, P + N]`` int64, 1 for real tokens."""
    log_probs: torch.Tensor
    """``[B, N]`` float32 model log-probs of the response tokens (0 where masked)."""
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
        fused_decode: run the forward passes through the C++ kernels of ``engine._kernels``
            instead of ~30 tensor ops per layer: the one-token decode steps (one call per step
            without TP, two per layer with it) and the prefill (the fused blocks' forward, when
            the weights are 2-D); default: when the extension is built and the model is
            float32.
    """

    def __init__(self, config: LlamaConfig, groups: HybridGroups,
                 fused_decode: bool | None = None) -> None:
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
        self.weights: Mapping[str, torch.Tensor] | None = None
        self.weights_version: int | None = None
        self._flat_weights: list[torch.Tensor] | None = None
        self._prefill: list[dict[str, torch.Tensor]] | None = None  # [] = not possible
        available = fused_layers.available(config.dtype)
        if fused_decode and not available:
            raise ValueError(f"fused_decode=True needs the engine._kernels extension and float32 "
                             f"(dtype={config.dtype}, extension "
                             f"{'present' if _kernels is not None else 'missing'})")
        self.fused_decode = available if fused_decode is None else fused_decode

    # Weights ---------------------------------------------------------------------------------
    def required_weights(self) -> list[str]:
        names = [f"layers.{i}.{k}" for i in self.layer_ids for k in LAYER_KEYS]
        if self.is_first:
            names.insert(0, "embed_tokens")
        if self.is_last:
            names += ["norm", self.head_name]
        return names

    def set_weights(self, weights: Mapping[str, torch.Tensor], version: int | None = None
                    ) -> None:
        """Use ``weights`` (this rank's generation shards by spec name; held, never copied)."""
        missing = [n for n in self.required_weights() if n not in weights]
        if missing:
            raise ValueError(f"generation weights lack {missing[:4]} (stage {self.stage})")
        self.weights, self.weights_version = weights, version
        self._flat_weights = self._prefill = None

    def load_weights(self, resharder) -> None:
        """Rollout interface: take the resharder's generation views (in generation mode)."""
        if resharder.mode != "generation":
            raise RuntimeError("load_weights needs the resharder in generation mode")
        self.set_weights(resharder.generation_params(), resharder.version)

    def release(self) -> None:
        """Drop the references to the generation views (back to training)."""
        self.weights, self.weights_version = None, None
        self._flat_weights = self._prefill = None

    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        return {k: self.weights[f"layers.{i}.{k}"] for k in LAYER_KEYS}

    def _decode_layers(self, x: torch.Tensor, cache: KVCache,
                       rope: tuple[torch.Tensor, torch.Tensor], attn: torch.Tensor
                       ) -> torch.Tensor:
        """The stage's layers for one new token per row, ``x [B, H]``, by the C++ kernels.

        Without TP (``tp_g == 1``) the whole stage is one call; otherwise two calls per layer
        (attention half, MLP half), each returning the row-parallel partial that is summed over
        the TP group here (:func:`engine.tp_ops.reduce_from_tp`).  The result equals :func:`engine.layers.decoder_layer` applied layer
        by layer, up to the rounding of the attention sums.
        """
        c, pos = self.config, cache.length
        cos, sin = rope[0][:, 0], rope[1][:, 0]  # [B, D]
        key_mask = attn[:, 0, 0]  # [B, >= pos + 1]
        if self.tp_group is None or self.tp_group.pg is None:
            return _kernels.decode_layers(x, self._flat_layer_weights(), c.rms_norm_eps, cos, sin,
                                         cache.k, cache.v, pos, key_mask, c.q_per_group)
        for j, i in enumerate(self.layer_ids):
            w = self._layer(i)
            x = x + reduce_from_tp(_kernels.decode_attention(
                x, w["input_norm"], c.rms_norm_eps, w["qkv"], w["o_proj"], cos, sin,
                cache.k[j], cache.v[j], pos, key_mask, c.q_per_group), self.tp_group)
            x = x + reduce_from_tp(_kernels.decode_mlp(
                x, w["post_norm"], c.rms_norm_eps, w["gate_up"], w["down_proj"]),
                self.tp_group)
        return x

    def _prefill_weights(self) -> list[dict[str, torch.Tensor]] | None:
        """Per layer, 2-D contiguous weights for the fused prefill (a stack of one
        row-parallel shard is its matrix); None when the prefill must use the Python layers
        (kernels off, or row-parallel weights stacked from several training shards)."""
        if not self.fused_decode:
            return None
        if self._prefill is None:
            layers = [{k: w[0] if w.dim() == 3 and w.shape[0] == 1 else w
                       for k, w in self._layer(i).items()} for i in self.layer_ids]
            ok = all(w.dim() <= 2 and w.is_contiguous() for ws in layers for w in ws.values())
            self._prefill = layers if ok else []
        return self._prefill or None

    def _flat_layer_weights(self) -> list[torch.Tensor]:
        """The stage's layer weights in :func:`engine._kernels.decode_layers` order (cached)."""
        if self._flat_weights is None:
            self._flat_weights = [self.weights[f"layers.{i}.{k}"] for i in self.layer_ids
                                  for k in LAYER_KEYS]
        return self._flat_weights

    # Generation ------------------------------------------------------------------------------
    def kv_cache_bytes(self, batch: int, prompt_length: int, max_new_tokens: int) -> int:
        """Bytes the KV cache of one call takes on this rank."""
        return kv_cache_nbytes(len(self.layer_ids), batch, prompt_length + max_new_tokens - 1,
                               self.kv_heads, self.config.head_dim, self.config.dtype)

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
        sampling = sampling or SamplingParams()
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
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, c.dtype)  # [B, P+N, D]
        keys_ok = full_mask.bool()[:, None, None, :]  # [B, 1, 1, P+N]
        cache = KVCache(len(self.layer_ids), batch, plen + n_new - 1, self.kv_heads,
                        c.head_dim, c.dtype)
        kv_bytes = cache.nbytes
        generator = torch.Generator().manual_seed(sampling.seed)
        out_ids = torch.full((batch, n_new), sampling.pad_token_id, dtype=torch.long)
        out_mask = torch.zeros(batch, n_new, dtype=torch.long)
        out_lp = torch.zeros(batch, n_new, dtype=torch.float32)
        alive = torch.ones(batch, dtype=torch.bool)
        step_in = input_ids.long().masked_fill(mask == 0, sampling.pad_token_id)
        steps = 0
        for i in range(n_new):
            start = 0 if i == 0 else plen + i - 1
            end = plen if i == 0 else plen + i
            attn = causal_mask(mask, batch, plen) if i == 0 else keys_ok[..., :end]
            tok, lp = self._step(step_in, cache, (cos[:, start:end], sin[:, start:end]), attn,
                                 sampling, generator)
            steps += 1
            out_ids[:, i] = torch.where(alive, tok, sampling.pad_token_id)
            out_mask[:, i] = alive.long()
            out_lp[:, i] = torch.where(alive, lp, 0.0)
            if sampling.eos_token_id is not None:
                alive &= tok != sampling.eos_token_id
            alive &= limits > i + 1
            if not bool(alive.any()):
                break
            step_in = out_ids[:, i:i + 1]
        del cache  # the KV cache lives only for the call
        elapsed = time.perf_counter() - t0
        new_tokens = int(out_mask.sum())
        return GenerationOutput(
            input_ids=torch.cat([_padded_prompt(input_ids, mask, sampling), out_ids], dim=1),
            attention_mask=torch.cat([mask, out_mask], dim=1), log_probs=out_lp,
            prompt_length=plen,
            stats={"time_s": elapsed, "new_tokens": new_tokens, "forward_steps": steps,
                   "tokens_per_s": new_tokens / max(elapsed, 1e-9), "kv_cache_bytes": kv_bytes,
                   "weights_version": self.weights_version})

    @staticmethod
    def _check_limits(limits: torch.Tensor | None, batch: int, n_new: int) -> torch.Tensor:
        if limits is None:
            return torch.full((batch,), n_new, dtype=torch.long)
        limits = torch.as_tensor(limits, dtype=torch.long)
        if tuple(limits.shape) != (batch,) or bool(((limits < 1) | (limits > n_new)).any()):
            raise ValueError(f"max_new_tokens per sequence must be [B={batch}] ints in "
                             f"[1, {n_new}], got {limits.tolist()}")
        return limits

    def _step(self, ids: torch.Tensor, cache: KVCache, rope: tuple[torch.Tensor, torch.Tensor],
              attn: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ``ids [B, S]`` through every stage; returns ``(tokens, log_probs)``."""
        c, w, pp = self.config, self.weights, self.pp_group
        batch, seq = ids.shape
        if self.is_first:
            x = vocab_embedding(ids, w["embed_tokens"], self.tp_group)
        else:
            x = torch.empty(batch, seq, c.hidden_size, dtype=c.dtype)
            dist.recv(x, src=pp.ranks[self.stage - 1], group=pp.pg)
        if seq == 1 and self.fused_decode:
            x = self._decode_layers(x[:, 0], cache, rope, attn).unsqueeze(1)
        elif (cache.length == 0 and seq <= fused_layers.AUTO_MAX_SEQ
              and (prefill := self._prefill_weights()) is not None):
            for j, layer_w in enumerate(prefill):
                x = fused_layers.decoder_layer(x, layer_w, rope, attn, c.q_per_group, c.head_dim,
                                               c.rms_norm_eps, self.tp_group,
                                               kv_sink=cache.sink(j))
        else:
            for j, i in enumerate(self.layer_ids):
                x = decoder_layer(x, self._layer(i), rope, attn, c.q_per_group, c.head_dim,
                                  c.rms_norm_eps, self.tp_group, kv_hook=cache.hook(j))
        cache.advance(seq)
        if self.is_last:
            h = rms_norm(x[:, -1], w["norm"], c.rms_norm_eps)  # [B, H]
            logits = column_linear(h, w[self.head_name], self.tp_group)  # [B, V/t_g]
            tok, lp = sample_next(logits, sampling, self.tp_group, generator)
            if self.num_stages == 1:
                return tok, lp
            packed = torch.stack([tok.double(), lp.double()])
        else:
            dist.send(x.contiguous(), dst=pp.ranks[self.stage + 1], group=pp.pg)
            packed = torch.empty(2, batch, dtype=torch.float64)
        dist.broadcast(packed, src=pp.ranks[-1], group=pp.pg)
        return packed[0].long(), packed[1].float()


def _padded_prompt(input_ids: torch.Tensor, mask: torch.Tensor,
                   sampling: SamplingParams) -> torch.Tensor:
    """The prompt as returned: padding positions hold ``pad_token_id``."""
    return input_ids.long().masked_fill(mask == 0, sampling.pad_token_id)
