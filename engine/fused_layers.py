"""The Llama layer of :mod:`engine.layers` as four autograd nodes with C++ forward/backward.

:func:`engine.layers.decoder_layer` records about forty autograd nodes per layer; for the
small models of the RLHF recipes a training step spends most of its time dispatching them
(and CPU ``scaled_dot_product_attention`` is slow at short sequences).  Here each block is one
node whose forward and backward are C++ kernels (``engine._kernels``, csrc/engine/
train_blocks.cpp); the TP collectives stay between the blocks exactly where the Python layer
has them, so any training TP works::

    x -> RMSNorm -> copy_to_tp -> Attention(qkv, RoPE, softmax, o) -> reduce_from_tp -> + x = h
    h -> RMSNorm -> copy_to_tp -> MLP(gate_up, silu * up, down)     -> reduce_from_tp -> + h

Float32 CPU plain Llama layers only (:func:`available`): without the extension, for other
dtypes, or for layers with q/k/v/o biases or q/k norms (Qwen) the model uses the Python
layers.  Under ``torch.no_grad()`` the kernels are called directly (nothing
saved for backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch.autograd.function import once_differentiable

from engine.llama_spec import LAYER_KEYS
from engine.tp_ops import copy_to_tp, reduce_from_tp
from hybridflow_comm.groups import Group

try:  # torch (imported above) must be loaded before the extension
    from engine import _kernels
except ImportError:  # extension not built: the Python layers are used
    _kernels = None


# Longest sequence the automatic choice (ParallelLlama(fused_layers=None), the generation
# prefill) runs on the blocks.  Their attention computes the whole S x S score matrix where
# CPU flash attention skips the masked half, so the blocks win where dispatch dominates (GRPO
# actor, 14 tokens: training step 1.5x the Python layers, forward 1.45x) and stop paying at
# long sequences (128 tokens x 256 hidden: training 0.98x, forward 0.90x; bench/train_layers.py).
AUTO_MAX_SEQ = 64

# kv_sink(k, v): keys (RoPE applied) and values of a layer, each [B, h_kv, S, D]
KVSink = Callable[[torch.Tensor, torch.Tensor], None]


def available(dtype: torch.dtype, layer_keys: Iterable[str]) -> bool:
    """Whether the fused blocks can run a model of ``dtype`` whose layers have the weights
    ``layer_keys`` (extension built, float32, only the plain Llama weights
    :data:`engine.llama_spec.LAYER_KEYS`: the kernels have no biases and no q/k norms)."""
    return _kernels is not None and dtype == torch.float32 and not _lacking(layer_keys)


def _lacking(layer_keys: Iterable[str]) -> list[str]:
    return [k for k in layer_keys if k not in LAYER_KEYS]


# Layer keys the C++ decode kernels (engine.forward_paths) read beyond LAYER_KEYS; the blocks
# read none.
DECODE_EXTRA_KEYS = ("qkv_bias",)


def resolve(requested: bool | None, dtype: torch.dtype, layer_keys: Iterable[str],
            option: str, extra_keys: Iterable[str] = ()) -> bool:
    """Whether to run a model of ``dtype`` with layer weights ``layer_keys`` on the kernels
    when the user's ``option`` is ``requested`` (None: where :func:`available`, allowing the
    ``extra_keys`` that the option's kernels also read); ValueError naming ``option`` for True
    where they are not."""
    extra = set(extra_keys)
    layer_keys = tuple(k for k in layer_keys if k not in extra)
    ok = available(dtype, layer_keys)
    if requested and not ok:
        raise ValueError(f"{option}=True needs the engine._kernels extension, float32 and plain "
                         f"Llama layers (dtype={dtype}, extension "
                         f"{'present' if _kernels is not None else 'missing'}, weights the "
                         f"kernels lack: {_lacking(layer_keys)}); use {option}=None or False")
    return ok if requested is None else bool(requested)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _kernels.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable  # hand-written backward: no graph of its own (double backward raises)
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _kernels.rms_norm_backward(dy.contiguous(), x, weight, rstd)
        return dx, dw, None


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, qkv_w, o_w, cos, sin, mask, q_per_group):
        y, *saved = _kernels.attention_forward(a, qkv_w, o_w, cos, sin, mask, q_per_group)
        ctx.save_for_backward(a, qkv_w, o_w, cos, sin, *saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        a, qkv_w, o_w, cos, sin, *saved = ctx.saved_tensors
        da, d_qkv, d_o = _kernels.attention_backward(dy, a, qkv_w, o_w, cos, sin, saved)
        return da, d_qkv, d_o, None, None, None, None


class _MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b, gate_up_w, down_w):
        z, *saved = _kernels.mlp_forward(b, gate_up_w, down_w)  # gate_up, sigmoid, act
        ctx.save_for_backward(b, gate_up_w, down_w, *saved)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx, dz: torch.Tensor):
        db, d_gate_up, d_down = _kernels.mlp_backward(dz, *ctx.saved_tensors)
        return db, d_gate_up, d_down


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`engine.layers.rms_norm` by the C++ kernel (differentiable)."""
    x = x.contiguous()
    if torch.is_grad_enabled():
        return _RMSNorm.apply(x, weight, eps)
    return _kernels.rms_norm_forward(x, weight, eps)[0]


def decoder_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                  rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                  q_per_group: int, head_dim: int, eps: float, tp_group: Group | None,
                  kv_sink: KVSink | None = None) -> torch.Tensor:
    """:func:`engine.layers.decoder_layer` (no KV hook) by the fused blocks.

    Args:
        x: ``[B, S, H]`` float32, replicated over the TP group.
        w: the layer's weights (2-D training shards; see :mod:`engine.layers`).
        rope: ``(cos, sin)`` ``[B, S, D]``, contiguous.
        mask: contiguous boolean ``[B, 1, S, S]`` (True = attend) or None for plain causal.
        q_per_group, head_dim, eps: as the Python layer (``head_dim`` is read from ``rope``).
        tp_group: training TP group.
        kv_sink: inference only: receives the layer's keys (RoPE applied) and values
            (the generation prefill fills its KV cache from them).

    Returns:
        ``[B, S, H]``.
    """
    grad = torch.is_grad_enabled()
    if grad and kv_sink is not None:
        raise ValueError("kv_sink is for inference (torch.no_grad()) only")
    # the kernels take [B, S, D] tables and contiguous weights; broadcast/copy only if needed
    # (copies are differentiable, so gradients still reach a strided weight)
    cos, sin = (t if t.shape[:2] == x.shape[:2] and t.is_contiguous()
                else t.expand(*x.shape[:2], t.shape[-1]).contiguous() for t in rope)
    w = {k: v if v.is_contiguous() else v.contiguous() for k, v in w.items()}
    a = copy_to_tp(rms_norm(x, w["input_norm"], eps), tp_group)
    if grad:
        y = _Attention.apply(a, w["qkv"], w["o_proj"], cos, sin, mask, q_per_group)
    else:
        y, _, k, v, *_ = _kernels.attention_forward(a, w["qkv"], w["o_proj"], cos, sin, mask,
                                                    q_per_group)
        if kv_sink is not None:
            kv_sink(k, v)
    h = x + reduce_from_tp(y, tp_group)
    b = copy_to_tp(rms_norm(h, w["post_norm"], eps), tp_group)
    if grad:
        z = _MLP.apply(b, w["gate_up"], w["down_proj"])
    else:
        z = _kernels.mlp_forward(b, w["gate_up"], w["down_proj"])[0]
    return h + reduce_from_tp(z, tp_group)
