"""The decode layers of a static step, each layer one ``torch.compile``d function.

Eagerly, one decode layer is some 35 small kernels (two RMSNorms, the q/k/v bias, RoPE on q
and k, the cache writes, the mask, SwiGLU, two residual adds, the four products and the
attention).  Even replayed as a CUDA graph (:mod:`engine.cuda_graphs`) a step then costs the
sum of their durations, a few microseconds each however few rows run: at Qwen2.5-0.5B's 24
layers several times the time of reading the weights once (docs/benchmarks.md, GPU).
Inductor fuses every elementwise chain into one kernel (norm, bias + RoPE, SwiGLU, residual +
norm) and leaves the products and the attention to cuBLAS and SDPA::

    eager    norm(6) qkv bias rope(10) write(2) mask sdpa o add norm(6) gu swiglu(3) down add
    compiled norm    qkv rope+bias+write      sdpa o add+norm          gu swiglu    down add

One function serves every layer: the layer's weights, its rows of the KV cache and the write
position are arguments, so it compiles once for all layers and again once when a second batch
bucket arrives (dynamo then marks the changed sizes dynamic); compiled code is cached on disk
(:mod:`engine.inductor`).  The compiled step is what :class:`engine.cuda_graphs.StaticDecode`
replays, so the graph holds the fused kernels.  Results equal the eager layers up to float
summation order (fused reductions), not bitwise.

Used where the engine's ``compile_decode`` applies (:func:`engine.inductor.compile_applies`)
on the static decode steps (dense KV cache, one stage).  Like the training layers
(:mod:`engine.compiled_train`), a layer under tensor parallelism or with experts runs as two
regions between the TP all-reduces::

    one TP rank, dense   whole layer compiled (KV write and LoRA deltas inside)
    TP > 1, or experts   [norm attention o_proj] --reduce--> + x = h
                         [norm gate_up swiglu down] --reduce--> + h   (a mixture: [norm
                                                                       route experts])

each region computing this rank's partial sum (a row-parallel LoRA delta included), the
collectives outside compiled code.  A mixture's region is the sync-free block of
:mod:`engine.moe_static` (every held expert over the step's few rows), returning the experts
each token was routed to beside its output, so that a captured step records routes too.
The same functions run the static steps eagerly (:data:`EAGER`), so one layer code serves
eager, compiled and captured steps.  Where the backend cannot compile
it the layers run eagerly after one warning (:class:`engine.inductor.Compiled`).
"""

from __future__ import annotations

import torch

from engine import inductor
from engine.forward_paths import Rope, StageLayers
from engine.kv_cache import DecodeSlots, LayerSlots
from engine.layers import ATTENTION_KEYS, LayerSpec, attention_block, decoder_layer, \
    swiglu_block
from engine.lora import compiled_adapters, lora_from_values
from engine.lora_config import ATTENTION, MLP
from engine.moe import MoeRouting
from engine.moe_static import static_moe_block
from engine.norm import rms_norm
from engine.route_trace import RouteTrace
from engine.tp_ops import reduce_from_tp


def decode_layer(x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor,
                 sin: torch.Tensor, attn: torch.Tensor | None, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, pos: torch.Tensor, q_per_group: int, head_dim: int,
                 eps: float, *adapters) -> torch.Tensor:
    """One decode layer of ``x [b, 1, H]`` writing its keys and values at ``pos`` of
    ``k_cache, v_cache [b, h_kv, max_len, D]`` (the function that is compiled), with the
    layer's LoRA ``adapters`` (:func:`engine.lora.compiled_adapters`: tensors, not the
    :class:`engine.lora.LayerLora` object, so one compiled function serves every layer)."""
    return decoder_layer(x, w, (cos, sin), attn, LayerSpec(q_per_group, head_dim, eps),
                         kv_hook=LayerSlots(k_cache, v_cache, pos),
                         lora=lora_from_values(adapters, q_per_group, head_dim))


def decode_attention_part(x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor,
                          sin: torch.Tensor, attn: torch.Tensor | None, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, pos: torch.Tensor, q_per_group: int,
                          head_dim: int, eps: float, *adapters) -> torch.Tensor:
    """This rank's partial ``o_proj(attention(norm(x)))`` of a decode step, writing the KV
    cache as :func:`decode_layer` (``w`` without ``o_proj_bias``)."""
    return attention_block(rms_norm(x, w["input_norm"], eps), w, (cos, sin), attn,
                           LayerSpec(q_per_group, head_dim, eps),
                           kv_hook=LayerSlots(k_cache, v_cache, pos),
                           lora=lora_from_values(adapters, q_per_group, head_dim))


def decode_mlp_part(h: torch.Tensor, w: dict[str, torch.Tensor], q_per_group: int,
                    head_dim: int, eps: float, *adapters) -> torch.Tensor:
    """This rank's partial ``down(swiglu(gate_up(norm(h))))``."""
    return swiglu_block(rms_norm(h, w["post_norm"], eps), w, None,
                        lora=lora_from_values(adapters, q_per_group, head_dim))


def decode_moe_part(h: torch.Tensor, w: dict[str, torch.Tensor], eps: float, top_k: int,
                    norm_topk: bool, experts: tuple[int, ...] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial mixture-of-experts MLP of ``norm(h)`` at static shapes
    (:func:`engine.moe_static.static_moe_block`: no host sync) and the experts each token was
    routed to, ``[N, k]``."""
    trace = RouteTrace()
    out = static_moe_block(rms_norm(h, w["post_norm"], eps), w, MoeRouting(top_k, norm_topk),
                           None, trace=trace, experts=experts)
    return out, trace.chosen[0]


EAGER = (decode_layer, decode_attention_part, decode_mlp_part, decode_moe_part)
"""The step's functions run eagerly (the static steps without ``compile_decode``)."""
COMPILED = tuple(inductor.Compiled(fn, min_numel=0, dynamic=None) for fn in EAGER)
"""The same, compiled on first use; eager (with one warning) where the backend cannot
compile."""


class StaticDecodeLayers:
    """The static decode step's layers of one stage (a :data:`engine.cuda_graphs.Layers`),
    eager or compiled: one function per layer on one dense TP rank, else the two regions of
    the module docstring.  A mixture's MLP is :func:`decode_moe_part` (no host sync, so the
    step can be captured); where the stage records routes (its ``route_log``) a step returns
    ``(x, routes [b, layers, k])``, outputs a captured step rewrites at each replay, else
    ``x``.

    Args:
        stage: the stage's weights and settings.
        compiled: run :data:`COMPILED` (else :data:`EAGER`).
        experts: the experts this rank holds (generation EP; None: all).
    """

    def __init__(self, stage: StageLayers, compiled: bool,
                 experts: tuple[int, ...] | None = None) -> None:
        self.stage, self.compiled = stage, compiled
        self.layer, self.attention_part, self.mlp_part, self.moe_part = \
            COMPILED if compiled else EAGER
        self.experts = None if experts is None else tuple(sorted(experts))
        self.weights = tuple(dict(w) for w in stage.weights)
        self.split = stage.tensor_parallel or stage.routing is not None
        self.attention = tuple({k: w[k] for k in ATTENTION_KEYS if k in w} for w in self.weights)
        self.mlp = tuple({k: v for k, v in w.items() if k not in ATTENTION_KEYS
                          and k != "o_proj_bias"} for w in self.weights)
        self.records_routes = stage.routing is not None and stage.route_log is not None
        loras = stage.loras or (None,) * len(self.weights)
        # each layer's adapters as the compiled functions take them, made once
        self.adapters = tuple(compiled_adapters(lora, ATTENTION + MLP, None) for lora in loras)
        self.attention_adapters = tuple(compiled_adapters(lora, ATTENTION, None)
                                        for lora in loras)
        self.mlp_adapters = tuple(compiled_adapters(lora, MLP, None) for lora in loras)

    def forward(self, x: torch.Tensor, slots: DecodeSlots, rope: Rope, attn: torch.Tensor | None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        s = self.stage
        cos, sin = rope
        chosen = []
        for j, w in enumerate(self.weights):
            if not self.split:
                x = self.layer(x, w, cos, sin, attn, slots.k[j], slots.v[j], slots.pos,
                               s.q_per_group, s.head_dim, s.eps,
                               *self.adapters[j])
                continue
            part = self.attention_part(x, self.attention[j], cos, sin, attn, slots.k[j],
                                       slots.v[j], slots.pos, s.q_per_group, s.head_dim, s.eps,
                                       *self.attention_adapters[j])
            h = x + reduce_from_tp(part, s.tp_group)
            if "o_proj_bias" in w:
                h = h + w["o_proj_bias"]
            if s.routing is not None:
                part, experts = self.moe_part(h, self.mlp[j], s.eps, s.routing.top_k,
                                              s.routing.norm_topk, self.experts)
                chosen.append(experts)
            else:
                part = self.mlp_part(h, self.mlp[j], s.q_per_group, s.head_dim, s.eps,
                                     *self.mlp_adapters[j])
            x = h + reduce_from_tp(part, s.tp_group)
        if self.records_routes:
            return x, torch.stack(chosen, dim=1)
        return x
