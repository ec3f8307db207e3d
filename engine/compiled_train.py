"""The training model's decoder layers through one ``torch.compile``d function, forward and
backward.

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

One function serves every layer of every model of the process: the layer's weights, the RoPE
tables and the attention mask are arguments, so it compiles once per kind of call (with
gradients or without, with a padding mask or causal, per dtype) and once more when sizes
change (dynamo then makes them symbolic: any batch, sequence length or model size).  Past
dynamo's recompile limit a new kind runs eagerly.  The results equal the eager layers up to
float summation order: the fused norms keep their float32 intermediates, so in bf16 they are a
little closer to float64 than the eager ones (tests/test_compiled_train.py).

Used where :func:`compile_applies`: without tensor parallelism (its collectives stay outside
compiled code), on a dense model (a mixture's expert products are sized by the routing), without
LoRA adapters, and with compiling enabled (``HYBRIDFLOW_COMPILE``); sequences packed on one row
(:class:`engine.layers.PackedSeqs`, one attention per sequence) run eagerly.  Where the backend
cannot compile (the backward is lowered with the forward, so a failure shows there), the
layers run eagerly after one warning (:class:`engine.inductor.Compiled`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine import inductor
from engine.layers import decoder_layer


def train_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None, q_per_group: int, head_dim: int,
                eps: float) -> torch.Tensor:
    """One decoder layer of ``x [B, S, H]`` without TP, KV cache or adapters (the function
    that is compiled); ``mask``: boolean ``[B, 1, S, S]`` or None (causal)."""
    return decoder_layer(x, w, (cos, sin), mask, q_per_group, head_dim, eps, None)


compiled_layer = inductor.Compiled(train_layer, min_numel=0, dynamic=None,
                                   backward_with_forward=True)
"""Compiled on first use, the backward with the forward; eager (with one warning) where the
backend cannot compile."""


def compile_applies(compile_layers: bool | None, device: torch.device, tensor_parallel: bool,
                    experts: bool, lora: bool) -> bool:
    """Whether the training model's layers run :data:`compiled_layer`: ``compile_layers``
    (None: on for CUDA) on a dense model without TP or LoRA, with compiling enabled."""
    wanted = device.type == "cuda" if compile_layers is None else bool(compile_layers)
    return wanted and not (tensor_parallel or experts or lora) and inductor.enabled()
