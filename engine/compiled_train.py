"""The training model's decoder layers through ``torch.compile``d functions, forward and
backward, for every kind of model: dense or a mixture of experts, with or without tensor
parallelism and LoRA adapters.

Eagerly, a layer of a training micro-batch is about 40 kernels forward and more backward.
Beside the four products and the attention they are elementwise passes over ``[tokens, H]``
or ``[tokens, heads, D]``: the two RMSNorms in float32 (upcast, square, mean, rsqrt, scale,
downcast, weight), the q/k/v bias, RoPE on q and k (split, negate, concatenate, two products,
a sum), two residual adds.  At a small model's hidden size (Qwen2.5-0.5B's 896) each pass is a few
tens of microseconds or less, so their launches and memory round trips, not the products,
set much of the step time (docs/benchmarks.md, GPU).  Inductor traces the layer with
autograd (AOTAutograd) and emits the forward and the backward each as the products, the
attention and a few fused loops::

    eager     norm(7) qkv bias split rope(6+6) sdpa o add norm(7) gu swiglu down add
    compiled  norm    qkv bias+split+rope     sdpa o add+norm        gu swiglu down add
              (and the backward likewise, the recomputed norms fused into their users)

Which compiled function runs a layer (:func:`decoder_layer`)::

    one TP rank, dense        whole layer       compiled_layer (LoRA deltas inside)
    TP > 1, or experts        x ──copy──> [norm attention o_proj]  ──reduce──> + x = h
                              h ──copy──> [norm gate_up swiglu down] ──reduce──> + h
                                           compiled_attention / compiled_mlp; a mixture's
                                           MLP is the routed block, eager

The TP collectives stay outside compiled code, at the region boundaries.  Inside a region
every rank computes its own shard's part with no communication: its output is a partial sum
that the one all-reduce after it completes, a row-parallel LoRA delta included (``s B A_t
x_t`` summed over the ranks is ``s B u``).  What the eager layers' mid-layer ``copy_to_tp``
does to the gradients (sum them over the TP group), the region inputs get instead: the
activations, and the replicated weights each rank applies to them (the norms, the
column-parallel adapters' ``A``, the row-parallel adapters' ``B``), enter through
:func:`engine.tp_ops.copy_to_tp`.  The norm sits inside the region, so its input's gradient
is summed after the norm's backward rather than before: the same sum, rounded in another
order.  A mixture of experts routes by data-dependent token counts (a host sync): its
attention region is compiled, its MLP is :func:`engine.layers.mlp_block` (router loss, route
traces and expert parallelism as eagerly).

One function serves every layer of every model of the process: the layer's weights, the RoPE
tables, the attention mask and the adapters are arguments, so it compiles once per kind of
call (with gradients or without, with a padding mask or causal, per dtype, per set of
adapted modules) and once more when sizes change (dynamo then makes them symbolic: any batch,
sequence length or model size).  Past dynamo's recompile limit a new kind runs eagerly.  The
results equal the eager layers up to float summation order: the fused norms keep their
float32 intermediates, so in bf16 they are a little closer to float64 than the eager ones
(tests/test_compiled_train.py; TP and LoRA: tests/test_engine_parallel.py).  LoRA dropout
draws its masks from inductor's generator: the same distribution as eagerly, other masks.

Used where :func:`engine.inductor.compile_applies` (``compile_layers``, None: on for CUDA, and
compiling enabled, ``HYBRIDFLOW_COMPILE``); sequences packed on one row
(:class:`engine.attention.PackedSeqs`, one attention per sequence) run eagerly.  Where the
backend cannot compile (the backward is lowered with the forward, so a failure shows there),
the layers run eagerly after one warning (:class:`engine.inductor.Compiled`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine import inductor
from engine.attention import PackedSeqs
from engine.layers import ATTENTION_KEYS, MLP_KEYS, REPLICATED_KEYS, LayerSpec, LoraDeltas, \
    attention_block, decoder_layer as eager_layer, mlp_block, swiglu_block
from engine.lora import compiled_adapters, lora_from_values
from engine.lora_config import ATTENTION, MLP
from engine.moe import RouteRecord, RouterLossTerms
from engine.norm import rms_norm
from engine.tp_ops import copy_to_tp, reduce_from_tp
from hybridflow_comm.groups import Group

def train_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None, q_per_group: int, head_dim: int,
                eps: float, *adapters) -> torch.Tensor:
    """One decoder layer of ``x [B, S, H]`` on one TP rank, without KV cache (the function
    that is compiled); ``mask``: boolean ``[B, 1, S, S]`` or None (causal); ``adapters``: the
    layer's LoRA adapters (:func:`engine.lora.compiled_adapters`)."""
    return eager_layer(x, w, (cos, sin), mask, LayerSpec(q_per_group, head_dim, eps),
                       lora=lora_from_values(adapters, q_per_group, head_dim))


def attention_part(x: torch.Tensor, w: Mapping[str, torch.Tensor], cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor | None, q_per_group: int,
                   head_dim: int, eps: float, *adapters) -> torch.Tensor:
    """This rank's part of ``o_proj(attention(norm(x)))`` (a partial sum over the TP group;
    ``w`` without ``o_proj_bias``)."""
    return attention_block(rms_norm(x, w["input_norm"], eps), w, (cos, sin), mask,
                           LayerSpec(q_per_group, head_dim, eps),
                           lora=lora_from_values(adapters, q_per_group, head_dim))


def mlp_part(h: torch.Tensor, w: Mapping[str, torch.Tensor], q_per_group: int, head_dim: int,
             eps: float, *adapters) -> torch.Tensor:
    """This rank's part of ``down(swiglu(gate_up(norm(h))))`` (a partial sum)."""
    return swiglu_block(rms_norm(h, w["post_norm"], eps), w, None,
                        lora=lora_from_values(adapters, q_per_group, head_dim))


compiled_layer = inductor.Compiled(train_layer, min_numel=0, dynamic=None,
                                   backward_with_forward=True)
"""Compiled on first use, the backward with the forward; eager (with one warning) where the
backend cannot compile."""
compiled_attention = inductor.Compiled(attention_part, min_numel=0, dynamic=None,
                                       backward_with_forward=True)
compiled_mlp = inductor.Compiled(mlp_part, min_numel=0, dynamic=None,
                                 backward_with_forward=True)
COMPILED = (compiled_layer, compiled_attention, compiled_mlp)


def _region(w: Mapping[str, torch.Tensor], keys: tuple[str, ...], group: Group | None
            ) -> dict[str, torch.Tensor]:
    return {k: copy_to_tp(w[k], group) if k in REPLICATED_KEYS else w[k] for k in keys if k in w}




def decoder_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                  rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                  spec: LayerSpec, lora: LoraDeltas | None = None,
                  router_loss: RouterLossTerms | None = None, trace: RouteRecord | None = None
                  ) -> torch.Tensor:
    """:func:`engine.layers.decoder_layer`'s result through compiled code (the module
    docstring's table); ``mask`` a boolean mask or None, never packed sequences.  The
    compiled functions take ``spec``'s sizes as plain values (no process group or block
    object reaches compiled code)."""
    assert not isinstance(mask, PackedSeqs), "packed sequences run the eager layers"
    cos, sin = rope
    sizes = spec.q_per_group, spec.head_dim, spec.eps
    g = spec.tp_group
    tensor_parallel = g is not None and g.pg is not None
    if not tensor_parallel and spec.routing is None:
        return compiled_layer(x, w, cos, sin, mask, *sizes,
                              *compiled_adapters(lora, ATTENTION + MLP, None))
    attn = compiled_attention(copy_to_tp(x, g), _region(w, ATTENTION_KEYS, g), cos, sin, mask,
                              *sizes, *compiled_adapters(lora, ATTENTION, g))
    h = x + reduce_from_tp(attn, g)
    if "o_proj_bias" in w:
        h = h + w["o_proj_bias"]
    if spec.routing is not None:
        return h + mlp_block(rms_norm(h, w["post_norm"], spec.eps), w, spec, None, router_loss,
                             trace)
    mlp = compiled_mlp(copy_to_tp(h, g), _region(w, MLP_KEYS, g), *sizes,
                       *compiled_adapters(lora, MLP, g))
    return h + reduce_from_tp(mlp, g)
