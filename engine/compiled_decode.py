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

Used where :func:`compile_applies`: the static decode steps (dense KV cache, one stage) without
tensor parallelism (the collectives of a TP group stay outside compiled code), with compiling
enabled (``HYBRIDFLOW_COMPILE``); where the backend cannot compile it the layers run eagerly
after one warning (:class:`engine.inductor.Compiled`).
"""

from __future__ import annotations

import torch

from engine import inductor
from engine.forward_paths import Rope, StageLayers
from engine.kv_cache import DecodeSlots, LayerSlots
from engine.layers import decoder_layer
from engine.lora import LayerLora


def decode_layer(x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor,
                 sin: torch.Tensor, attn: torch.Tensor | None, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, pos: torch.Tensor, q_per_group: int, head_dim: int,
                 eps: float, lora_a: dict[str, torch.Tensor] | None = None,
                 lora_b: dict[str, torch.Tensor] | None = None,
                 lora_scale: float = 1.0) -> torch.Tensor:
    """One decode layer of ``x [b, 1, H]`` writing its keys and values at ``pos`` of
    ``k_cache, v_cache [b, h_kv, max_len, D]`` (the function that is compiled), with the
    layer's LoRA adapters when ``lora_a``/``lora_b`` are given (tensors, not the
    :class:`engine.lora.LayerLora` object: one compiled function serves every layer)."""
    lora = (LayerLora(a=lora_a, b=lora_b, scale=lora_scale, dropout=0.0, tp_group=None,
                      q_per_group=q_per_group, head_dim=head_dim)
            if lora_a is not None else None)
    return decoder_layer(x, w, (cos, sin), attn, q_per_group, head_dim, eps, None,
                         kv_hook=LayerSlots(k_cache, v_cache, pos), lora=lora)


_compiled_layer = inductor.Compiled(decode_layer, min_numel=0, dynamic=None)
"""Compiled on first use, eager (with one warning) where the backend cannot compile."""


def compile_applies(compile_decode: bool | None, device: torch.device, static_decode: bool,
                    tensor_parallel: bool) -> bool:
    """Whether the static decode steps run compiled layers: ``compile_decode`` (None: on for
    CUDA) where the steps are static, without TP, and compiling is enabled."""
    wanted = device.type == "cuda" if compile_decode is None else bool(compile_decode)
    return wanted and static_decode and not tensor_parallel and inductor.enabled()


class CompiledDecodeLayers:
    """The static decode step's layers of one stage through the compiled
    :func:`decode_layer` (a :data:`engine.cuda_graphs.Layers`)."""

    def __init__(self, stage: StageLayers) -> None:
        if stage.tensor_parallel:
            raise ValueError("compiled decode layers run without tensor parallelism")
        self.stage = stage
        self.weights = tuple(dict(w) for w in stage.weights)

    def forward(self, x: torch.Tensor, slots: DecodeSlots, rope: Rope,
                attn: torch.Tensor | None) -> torch.Tensor:
        s, layer = self.stage, _compiled_layer
        cos, sin = rope
        for j, w in enumerate(self.weights):
            lora = s.loras[j] if s.loras else None
            adapters = ((dict(lora.a), dict(lora.b), lora.scale) if lora is not None else ())
            x = layer(x, w, cos, sin, attn, slots.k[j], slots.v[j], slots.pos,
                      s.q_per_group, s.head_dim, s.eps, *adapters)
        return x
