"""The pre-norm Llama decoder layer, composed of the maths of its parts: :mod:`engine.norm`,
:mod:`engine.rope`, :mod:`engine.attention`, :mod:`engine.mlp` and :mod:`engine.moe`.

One :func:`decoder_layer` serves the training model, the generation engine's Python layers and
the compiled regions (:mod:`engine.compiled_train`, :mod:`engine.compiled_decode`).  The
settings every layer of a model or generation stage shares are one :class:`LayerSpec`, built
once; what changes per call (input, weights, RoPE tables, mask, KV hook, LoRA adapters, the
router loss and route trace of a mixture) are arguments.

Weights come in as arguments (a mapping with the short names below), so the training model
(flat-buffer views) and the generation engine (generation shards, stacked row-parallel slots)
share one implementation.  Shapes use B batch, S sequence, H hidden, D head dim, and local
head counts ``h_q = Q/t``, ``h_kv = G/t``::

    LayerWeights keys       shape (one TP shard)
    input_norm, post_norm   [H]
    qkv                     [h_kv*(Q/G+2)*D, H]       per-query-group fused rows
    o_proj                  [H, h_q*D]  or [m, H, h_q*D/m]
    gate_up                 [2*F/t, H]                gate/up rows interleaved
    down_proj               [H, F/t]    or [m, H, F/t/m]
  a mixture of experts (E experts, routing set by MoeRouting) in place of gate_up, down_proj:
    router                  [E, H]                    replicated
    experts.{e}.gate_up     [2*F/t, H]                each expert split like the dense MLP
    experts.{e}.down_proj   [H, F/t]    or [m, H, F/t/m]
  optional (the model families of engine.hf_families; absent keys = plain Llama):
    qkv_bias                [h_kv*(Q/G+2)*D]          fused like qkv's rows (Qwen2, attention_bias)
    q_norm, k_norm          [D]                       RMSNorm of each head before RoPE (Qwen3)
    o_proj_bias             [H]                       added after the row-parallel sum

The head dim D is its own size (``Q*D`` need not equal H, as in Qwen3).  The q/k norm weights
are replicated but each TP rank applies them to its own heads only, so their gradient is a
partial sum: they enter through :func:`engine.tp_ops.copy_to_tp` (identity forward, TP
all-reduce of the gradient), as the inputs of column-parallel layers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from engine import batched_attention
from engine.attention import AttentionMask, KVHook, PackedBounds, PackedSeqs, attention
from engine.mlp import swiglu
from engine.moe import MoeFn, MoeRouting, RouteRecord, RouterLossTerms, moe_block
from engine.norm import rms_norm
from engine.rope import apply_rope
from engine.tp_ops import column_linear, copy_to_tp, row_linear
from hybridflow_comm.groups import Group

__all__ = [
    "ATTENTION_KEYS", "MLP_KEYS", "REPLICATED_KEYS", "LayerSpec", "LoraDeltas",
    "attention_block", "decoder_layer", "mlp_block", "swiglu_block",
]

ATTENTION_KEYS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj")
"""The weights of a layer's attention half up to its TP reduction (``o_proj_bias`` is added
after it)."""
MLP_KEYS = ("post_norm", "gate_up", "down_proj")
"""The weights of a dense layer's MLP half (a mixture's: ``post_norm``, ``router``,
``experts.*``)."""
REPLICATED_KEYS = ("input_norm", "post_norm", "q_norm", "k_norm")
"""The layer weights every TP rank holds whole and applies to its replicated input."""


class LoraDeltas(Protocol):
    """A layer's LoRA adapters (:class:`engine.lora.LayerLora`): each method returns the delta
    to add to that product's output on this rank, or None where the module has none."""

    def qkv(self, x: torch.Tensor) -> torch.Tensor | None: ...

    def gate_up(self, x: torch.Tensor) -> torch.Tensor | None: ...

    def row(self, module: str, x: torch.Tensor) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class LayerSpec:
    """What every decoder layer of one model (or generation stage) shares, built once::

        spec = LayerSpec(q_per_group=4, head_dim=64, eps=1e-6)   # one rank, dense
        rope = engine.rope.rope_tables(torch.arange(seq).expand(batch, seq), 64, 10000.0)
        for w in layer_weights:
            x = decoder_layer(x, w, rope, None, spec)               # causal, no KV cache
    """

    q_per_group: int
    """Query heads per KV head (``Q/G``)."""
    head_dim: int
    """D."""
    eps: float
    """RMSNorm epsilon."""
    tp_group: Group | None = None
    """The TP group (None or a group of one: no collectives)."""
    routing: MoeRouting | None = None
    """A mixture of experts' routing (None: a dense SwiGLU MLP)."""
    moe: MoeFn | None = None
    """The mixture-of-experts block (None: :func:`engine.moe.moe_block` over every expert;
    expert parallelism: :class:`engine.expert_parallel.ExpertParallel`)."""


def attention_block(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                    rope: tuple[torch.Tensor, torch.Tensor],
                    mask: AttentionMask, spec: LayerSpec,
                    kv_hook: KVHook | None = None, lora: LoraDeltas | None = None
                    ) -> torch.Tensor:
    """``o_proj(attention(rope(qkv(x))))``: ``x [B, S, H]`` (replicated) -> ``[B, S, H]``,
    with the optional biases and q/k norms of ``w`` (see the module docstring) and the
    LoRA deltas of ``lora``."""
    q_per_group, head_dim, tp_group = spec.q_per_group, spec.head_dim, spec.tp_group
    qkv = column_linear(x, w["qkv"], tp_group)  # [B, S, h_kv*(qpg+2)*D]
    delta = lora.qkv(x) if lora is not None else None
    if delta is not None:
        qkv = qkv + delta
    cos, sin = rope
    packed = isinstance(mask, (PackedSeqs, PackedBounds))
    if ("q_norm" not in w and kv_hook is None and not packed
            and batched_attention.qkv_applies(qkv, w.get("qkv_bias"), cos, sin, mask,
                                              q_per_group, head_dim)):
        # bias, RoPE, scale and the attention layout in one C++ pass each way
        out = batched_attention.attention_from_qkv(qkv, w.get("qkv_bias"), cos, sin, mask,
                                                   q_per_group, head_dim)
        return _o_proj(out, w, tp_group, lora)
    if "qkv_bias" in w:
        qkv = qkv + w["qkv_bias"]
    qkv = qkv.unflatten(-1, (-1, q_per_group + 2, head_dim))  # [B, S, h_kv, qpg+2, D]
    # one split (its backward is one cat) rather than three indexings, whose backwards each
    # zero-fill a gradient of qkv's full size and add them up
    q, k, v = qkv.split([q_per_group, 1, 1], dim=-2)
    q = q.flatten(2, 3)  # [B, S, h_q, D]
    k, v = k.squeeze(-2), v.squeeze(-2)  # [B, S, h_kv, D]
    if "q_norm" in w:
        q = rms_norm(q, copy_to_tp(w["q_norm"], tp_group), spec.eps)
        k = rms_norm(k, copy_to_tp(w["k_norm"], tp_group), spec.eps)
    out = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask, kv_hook)
    return _o_proj(out, w, tp_group, lora)


def _o_proj(out: torch.Tensor, w: Mapping[str, torch.Tensor], tp_group: Group | None,
            lora: LoraDeltas | None = None) -> torch.Tensor:
    y = row_linear(out, w["o_proj"], tp_group)
    delta = lora.row("o_proj", out) if lora is not None else None
    if delta is not None:
        y = y + delta
    return y + w["o_proj_bias"] if "o_proj_bias" in w else y


def swiglu_block(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                 tp_group: Group | None, lora: LoraDeltas | None = None) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the interleaved fused gate/up weight (and the
    LoRA deltas of ``lora``)."""
    gu = column_linear(x, w["gate_up"], tp_group)
    if lora is not None:
        delta = lora.gate_up(x)
        gu = gu if delta is None else gu + delta
    h = swiglu(gu.unflatten(-1, (-1, 2)))  # [B, S, F/t]
    y = row_linear(h, w["down_proj"], tp_group)
    delta = lora.row("down_proj", h) if lora is not None else None
    return y if delta is None else y + delta


def mlp_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LayerSpec,
              lora: LoraDeltas | None = None, router_loss: RouterLossTerms | None = None,
              trace: RouteRecord | None = None) -> torch.Tensor:
    """The layer's MLP: where ``spec.routing`` is given ``spec.moe`` (default
    :func:`engine.moe.moe_block`: every expert on this rank), else :func:`swiglu_block` (with
    its LoRA deltas)."""
    if spec.routing is not None:
        return (spec.moe or moe_block)(x, w, spec.routing, spec.tp_group, router_loss, trace)
    return swiglu_block(x, w, spec.tp_group, lora)


def decoder_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                  rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask,
                  spec: LayerSpec, kv_hook: KVHook | None = None, lora: LoraDeltas | None = None,
                  router_loss: RouterLossTerms | None = None, trace: RouteRecord | None = None
                  ) -> torch.Tensor:
    """One pre-norm Llama layer: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``; ``[B, S, H]``
    (with the layer's LoRA adapters when ``lora`` is given; under ``spec.routing`` a mixture
    of experts, its load-balancing term into ``router_loss``, its experts into or from
    ``trace``)."""
    h = x + attention_block(rms_norm(x, w["input_norm"], spec.eps), w, rope, mask, spec,
                            kv_hook, lora)
    return h + mlp_block(rms_norm(h, w["post_norm"], spec.eps), w, spec, lora, router_loss,
                         trace)
