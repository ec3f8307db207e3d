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
                                           compiled_attention / compiled_mlp
    a mixture's MLP           h ──> [norm router softmax top-k] ──> sort pairs (eager)
                              ──copy──> [each expert's gate_up swiglu down] ──> weigh, add
                              ──reduce──> + h         compiled_route / compiled_expert_rows

The TP collectives stay outside compiled code, at the region boundaries.  Inside a region
every rank computes its own shard's part with no communication: its output is a partial sum
that the one all-reduce after it completes, a row-parallel LoRA delta included (``s B A_t
x_t`` summed over the ranks is ``s B u``).  What the eager layers' mid-layer ``copy_to_tp``
does to the gradients (sum them over the TP group), the region inputs get instead: the
activations, and the replicated weights each rank applies to them (the norms, the
column-parallel adapters' ``A``, the row-parallel adapters' ``B``), enter through
:func:`engine.tp_ops.copy_to_tp`.  The norm sits inside the region, so its input's gradient
is summed after the norm's backward rather than before: the same sum, rounded in another
order.  A mixture of experts' MLP is two compiled functions: the norm and the routing
(replicated, so nothing enters through ``copy_to_tp``: the router loss's gradient reaches the
router once per rank, as eagerly), and the experts' products over the pairs sorted by expert
(:func:`engine.moe.expert_rows`).  Each expert's row count is read on the host, as eagerly,
but inside the compiled function, where it is an unbacked size
(``scalar_outputs``): one compiled function for any split of the tokens, no recompile.  The
sorting, the weighting and, under expert parallelism, the all-to-all exchanges between them
run eagerly (:func:`engine.moe.dispatch`, :meth:`engine.expert_parallel.ExpertParallel.
dispatch`); the router loss and the route trace get the routing's outputs.

One function serves every layer of every model of the process: the layer's weights, the RoPE
tables, the attention mask and the adapters are arguments, so it compiles once per kind of
call (with gradients or without, with a padding mask or causal, per dtype, per set of
adapted modules) and once more when sizes change (dynamo then makes them symbolic: any batch,
sequence length or model size).  Past :data:`RECOMPILE_LIMIT` variants a new kind runs
eagerly.  The results equal the eager layers up to float summation order: the fused norms
keep their float32 intermediates, so in bf16 they are a little closer to float64 than the
eager ones (tests/test_compiled_train.py; TP and LoRA: tests/test_engine_parallel.py).  LoRA dropout
draws its masks from inductor's generator: the same distribution as eagerly, other masks.

Used where :func:`engine.inductor.compile_applies` (``compile_layers``, None: on for CUDA, and
compiling enabled, ``HYBRIDFLOW_COMPILE``).  Sequences packed on one row
(:class:`engine.attention.PackedSeqs`) reach the compiled functions as
:class:`engine.attention.PackedBounds` (their boundaries a tensor: one compiled function for
every packing) where :func:`takes_packed`: on CUDA in bf16/fp16 the varlen flash kernel (a
custom op, traced whole) runs inside the compiled layer; on the CPU the attention takes the
block-diagonal causal mask (``T^2`` scores where eagerly each sequence costs ``L_i^2``: the
CPU compiles to check the code, the C++ layers are its fast path).  Elsewhere (CUDA float32)
packed micro-batches run the eager layers, one attention per sequence.  Where the
backend cannot compile (the backward is lowered with the forward, so a failure shows there),
the layers run eagerly after one warning (:class:`engine.inductor.Compiled`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine import inductor, varlen
from engine.attention import PackedBounds, PackedSeqs
from engine.layers import ATTENTION_KEYS, MLP_KEYS, REPLICATED_KEYS, LayerSpec, LoraDeltas, \
    attention_block, decoder_layer as eager_layer, mlp_block, swiglu_block
from engine.expert_parallel import ExpertParallel
from engine.lora import compiled_adapters, lora_from_values
from engine.lora_config import ATTENTION, MLP
from engine.moe import RouteRecord, RouterLossTerms, choose, dispatch, expert_rows, \
    router_probs
from engine.norm import rms_norm
from engine.tp_ops import copy_to_tp, reduce_from_tp
from hybridflow_comm.groups import Group

def train_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | PackedBounds | None, q_per_group: int,
                head_dim: int, eps: float, *adapters) -> torch.Tensor:
    """One decoder layer of ``x [B, S, H]`` on one TP rank, without KV cache (the function
    that is compiled); ``mask``: boolean ``[B, 1, S, S]``, None (causal) or packed sequences
    (``B = 1``); ``adapters``: the
    layer's LoRA adapters (:func:`engine.lora.compiled_adapters`)."""
    return eager_layer(x, w, (cos, sin), mask, LayerSpec(q_per_group, head_dim, eps),
                       lora=lora_from_values(adapters, q_per_group, head_dim))


def attention_part(x: torch.Tensor, w: Mapping[str, torch.Tensor], cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor | PackedBounds | None, q_per_group: int,
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


RECOMPILE_LIMIT = 32
"""Variants per compiled function: each model of the process (actor, reference, critic: their
own weight keys and adapters) times each kind of call (with gradients or without, the first
layer's input trained or not, a padding mask, causal or packed, static sizes then symbolic)."""


def _compiled(fn, scalar_outputs: bool = False) -> inductor.Compiled:
    """``fn`` compiled on first use, the backward with the forward, sizes symbolic once they
    change; eager (with one warning) where the backend cannot compile."""
    return inductor.Compiled(fn, min_numel=0, dynamic=None, backward_with_forward=True,
                             scalar_outputs=scalar_outputs, recompile_limit=RECOMPILE_LIMIT)


compiled_layer = _compiled(train_layer)
compiled_attention = _compiled(attention_part)
compiled_mlp = _compiled(mlp_part)


def route_part(h: torch.Tensor, post_norm: torch.Tensor, router: torch.Tensor, eps: float,
               top_k: int, norm_topk: bool, *given: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
    """A mixture's normed tokens and routing: ``(tokens [N, H], probs [N, E] float32, own
    [N, k], weights [N, k] in h's dtype, chosen [N, k])`` (:func:`engine.moe.choose`; the
    replayed experts as the one ``given``)."""
    tokens = rms_norm(h, post_norm, eps).flatten(0, -2)
    probs = router_probs(tokens, router)
    weights, own, chosen = choose(probs, top_k, norm_topk, given[0] if given else None)
    return tokens, probs, own, weights.to(h.dtype), chosen


compiled_route = _compiled(route_part)
compiled_expert_rows = _compiled(expert_rows, scalar_outputs=True)
"""The experts' products over their rows, each expert's row count an unbacked size."""
COMPILED = (compiled_layer, compiled_attention, compiled_mlp, compiled_route,
            compiled_expert_rows)


def _region(w: Mapping[str, torch.Tensor], keys: tuple[str, ...], group: Group | None
            ) -> dict[str, torch.Tensor]:
    return {k: copy_to_tp(w[k], group) if k in REPLICATED_KEYS else w[k] for k in keys if k in w}




def routed_mlp(h: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LayerSpec,
               router_loss: RouterLossTerms | None, trace: RouteRecord | None) -> torch.Tensor:
    """A mixture's MLP half (:func:`engine.moe.moe_block` of ``norm(h)``): the norm and the
    routing in one compiled function, the experts' products in another, the sorting of the
    pairs and the EP exchange between them eager.  Another block than these two (a
    ``spec.moe`` of a caller's own) runs eagerly."""
    if spec.moe is not None and not isinstance(spec.moe, ExpertParallel):
        return mlp_block(rms_norm(h, w["post_norm"], spec.eps), w, spec, None, router_loss,
                         trace)
    routing = spec.routing
    given = trace.replayed(h.device) if trace is not None else None
    tokens, probs, own, weights, chosen = compiled_route(
        h, w["post_norm"], w["router"], spec.eps, routing.top_k, routing.norm_topk,
        *(() if given is None else (given,)))
    if router_loss is not None:
        router_loss.add(probs, own)
    if trace is not None:
        trace.record(chosen)
    if spec.moe is None:
        out = dispatch(tokens, weights, chosen, w, spec.tp_group, rows_fn=compiled_expert_rows)
    else:
        out = spec.moe.dispatch(tokens, weights, chosen, w, spec.tp_group,
                                rows_fn=compiled_expert_rows)
    return out.reshape(h.shape)


def takes_packed(x: torch.Tensor) -> bool:
    """Whether :func:`decoder_layer` runs packed sequences of ``x [1, T, H]`` (module
    docstring): where the attention in compiled code has the varlen kernel, or on the CPU."""
    return x.device.type == "cpu" or varlen.applies(x)


def decoder_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                  rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | PackedSeqs | None,
                  spec: LayerSpec, lora: LoraDeltas | None = None,
                  router_loss: RouterLossTerms | None = None, trace: RouteRecord | None = None
                  ) -> torch.Tensor:
    """:func:`engine.layers.decoder_layer`'s result through compiled code (the module
    docstring's table); ``mask`` a boolean mask, None, or packed sequences where
    :func:`takes_packed`.  The compiled functions take ``spec``'s sizes as plain values (no
    process group or block object reaches compiled code)."""
    if isinstance(mask, PackedSeqs):
        mask = mask.bounds(x.device)
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
        return h + routed_mlp(h, w, spec, router_loss, trace)
    mlp = compiled_mlp(copy_to_tp(h, g), _region(w, MLP_KEYS, g), *sizes,
                       *compiled_adapters(lora, MLP, g))
    return h + reduce_from_tp(mlp, g)
