"""Sequence-level Llama maths as pure functions: RMSNorm, RoPE, attention, SwiGLU, a layer.

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

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from engine import batched_attention, varlen
from engine.inductor import Compiled
from engine.tp_ops import column_linear, copy_to_tp, reduce_from_tp, row_linear, \
    row_linear_pieces
from hybridflow_comm.groups import Group

try:  # torch (imported above) must be loaded before the extension
    from engine import _kernels
except ImportError:  # extension not built: the formula runs everywhere
    _kernels = None

# kv_hook(k, v) -> (k_all, v_all): lets a KV cache append the new keys/values ([B, S, h_kv, D])
# and return everything attention should see ([B, S_kv, h_kv, D]).  A hook whose attribute
# stacked_decode is True hands out views of a dense cache: one new token then attends by
# decode_attention (no GQA expansion of the cache).
KVHook = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LoraDeltas(Protocol):
    """A layer's LoRA adapters (:class:`engine.lora.LayerLora`): each method returns the delta
    to add to that product's output on this rank, or None where the module has none."""

    def qkv(self, x: torch.Tensor) -> torch.Tensor | None: ...

    def gate_up(self, x: torch.Tensor) -> torch.Tensor | None: ...

    def row(self, module: str, x: torch.Tensor) -> torch.Tensor | None: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, computed in float32 (as transformers).

    Float32 CPU tensors with a ``[H]`` weight run the C++ kernel (``engine._kernels``,
    csrc/engine/rms_norm.cpp: one autograd node, a hand-written backward; kept while it runs
    >= 1.3x the compiled formula in ``bench/kernels_vs_compile.py --shape small``) where the
    extension is built; everything else, and any
    code ``torch.compile`` traces, runs :func:`rms_norm_formula`.  The two agree within float32
    rounding (tests/test_rms_norm_kernel.py); the kernel's backward is ``once_differentiable``
    (no double backward).
    """
    if (_kernels is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and weight.shape == x.shape[-1:] and not torch.compiler.is_compiling()):
        x, weight = x.contiguous(), weight.contiguous()  # copies are differentiable
        if torch.is_grad_enabled():
            return _RMSNorm.apply(x, weight, eps)
        return _kernels.rms_norm_forward(x, weight, eps)[0]  # inference: nothing saved
    return rms_norm_formula(x, weight, eps)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` by tensor ops (the reference of the kernel; any dtype and device)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """:func:`rms_norm` by the C++ kernel: contiguous float32 CPU ``x [..., H]``, ``weight
    [H]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _kernels.rms_norm_forward(x, weight, eps)  # rstd [N]: 1/rms of each row
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable  # hand-written backward: no graph of its own (double backward raises)
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _kernels.rms_norm_backward(dy.contiguous(), x, weight, rstd)
        return dx, dw, None


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (transformers' ``rope_type="llama3"``): wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, shorter than ``.../ high_freq_factor`` kept, those between interpolated."""

    rope_type: str
    """Only ``"llama3"``."""
    factor: float
    """Stretch of the low frequencies (8 in Llama 3.1)."""
    low_freq_factor: float
    """Wavelength bound of the stretched band, as a divisor of the original context."""
    high_freq_factor: float
    """Wavelength bound of the kept band, as a divisor of the original context."""
    original_max_position_embeddings: int
    """Context length of pre-training (8192 in Llama 3.1)."""

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"rope_type={self.rope_type!r}: only 'llama3' scaling is supported")
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise ValueError(f"llama3 rope scaling needs factor > 0, 0 < low_freq_factor < "
                             f"high_freq_factor and original_max_position_embeddings > 0, got "
                             f"{self}")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (the operations of transformers, in its order)."""
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                            - self.low_freq_factor)
        smoothed = (1 - smooth) * out / self.factor + smooth * out
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32, scaling: RopeScaling | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary ``(cos, sin)``, each ``[B, S, D]``, for integer ``position_ids [B, S]``
    (optionally with Llama-3 frequency ``scaling``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=position_ids.device).float() / head_dim))
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq)
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, heads, D]`` (half-split convention of transformers' Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1`` clamped at 0, ``[B, S]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_mask(attention_mask: torch.Tensor | None, batch: int, seq: int,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` (True = may attend): causal, keys restricted to real tokens.

    Every query may always see itself, so a padding row is never fully masked (no NaN); its
    output is meaningless and must be masked out of the loss by the caller.  The mask lives on
    ``attention_mask``'s device, or on ``device`` when there is no ``attention_mask``.
    """
    if attention_mask is not None:
        device = attention_mask.device
    elif device is None:
        raise ValueError("causal_mask without an attention_mask needs a device")
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if attention_mask is None:
        return causal.expand(batch, 1, seq, seq)
    keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return (causal & keys) | torch.eye(seq, dtype=torch.bool, device=device)


@dataclass(frozen=True)
class PackedSeqs:
    """Sequences packed back to back on one row (padding removed): sequence ``i`` is the
    positions ``[cu_seqlens[i], cu_seqlens[i+1])``, causal inside itself, blind to the others::

        row   | seq 0 (L0) | seq 1 (L1) | ... |        T = cu_seqlens[-1]
        mask  block-diagonal causal [T, T] (never built: one attention per sequence)

    :func:`attention` takes it in place of a mask and runs one causal attention per sequence
    (:mod:`engine.batched_attention`, or CPU flash attention for long sequences; on CUDA all
    of them in one varlen flash call, :mod:`engine.varlen`), so the cost is ``sum L_i^2``, not
    ``T^2``.
    Built by :func:`engine.micro_batches.pack_rows`.
    """

    cu_seqlens: tuple[int, ...]
    """``0, L0, L0+L1, ..., T`` (non-decreasing; an empty sequence is allowed)."""
    _on_device: dict[torch.device, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = self.cu_seqlens
        if not c or c[0] != 0 or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError(f"cu_seqlens={c} must start at 0 and never decrease")

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def longest(self) -> int:
        """The longest sequence's length."""
        return max((b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:])), default=0)

    def boundaries(self, device: torch.device | str) -> torch.Tensor:
        """``cu_seqlens`` as ``[n + 1]`` int32 on ``device``: copied from the host on the
        first call per device and kept, so that every layer's attention (and the positions)
        of the micro-batch share one host-to-device copy."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = torch.tensor(self.cu_seqlens, dtype=torch.int32,
                                                   device=device)
        return self._on_device[device]

    def position_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[1, T]`` on ``device``: ``0..L_i-1`` inside every sequence (what the padded row's
        :func:`position_ids_from_mask` gives its real tokens), from :meth:`boundaries`."""
        c = self.boundaries(device).long()
        lengths = c[1:] - c[:-1]
        starts = torch.repeat_interleave(c[:-1], lengths, output_size=self.total)
        return (torch.arange(self.total, device=device) - starts).unsqueeze(0)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, S, h_q*D]`` causal attention of ``q [B, S, h_q, D]``, ``k, v [B, S, h_kv, D]``."""
    if batched_attention.applies(q, k, None):
        return batched_attention.attention(q, k, v, None)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


def _packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      packed: PackedSeqs) -> torch.Tensor:
    """``[1, T, h_q*D]`` attention of every packed sequence on its own: in one varlen call
    on CUDA (:mod:`engine.varlen`), else one attention per sequence."""
    if varlen.applies(q) and packed.total > 0:
        return varlen.causal_attention(q, k, v, packed.boundaries(q.device), packed.longest)
    c = packed.cu_seqlens
    return torch.cat([_causal_attention(q[:, a:b], k[:, a:b], v[:, a:b])
                      for a, b in zip(c, c[1:]) if b > a], dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | PackedSeqs | None,
              kv_hook: KVHook | None = None) -> torch.Tensor:
    """Grouped-query scaled dot-product attention.

    Args:
        q: ``[B, S, h_q, D]`` (RoPE applied).
        k, v: ``[B, S, h_kv, D]``; ``h_q`` is a multiple of ``h_kv``.
        mask: boolean ``[B, 1, S, S_kv]`` (True = attend); None where no key is padding:
            causal (``S = S_kv``), or after a KV hook one new query seeing every key
            (``S = 1``); or :class:`PackedSeqs` for sequences packed on one row (``B = 1``, no
            KV hook).  Without a mask SDPA runs ``is_causal`` (CUDA: its flash or efficient
            kernels); a boolean mask is only for padding.
        kv_hook: optional KV-cache hook, see :data:`KVHook`.

    Returns:
        ``[B, S, h_q*D]``.
    """
    if isinstance(mask, PackedSeqs):
        if q.shape[0] != 1 or q.shape[1] != mask.total or kv_hook is not None:
            raise ValueError(f"packed attention needs one row of {mask.total} tokens and no "
                             f"KV hook, got q {tuple(q.shape)}")
        return _packed_attention(q, k, v, mask)
    if kv_hook is not None:
        k, v = kv_hook(k, v)
        if q.shape[1] == 1 and getattr(kv_hook, "stacked_decode", False):
            return decode_attention(q, k, v, mask)
    elif mask is None:
        return _causal_attention(q, k, v)
    elif batched_attention.applies(q, k, mask):  # short sequences, no cache
        return batched_attention.attention(q, k, v, mask)
    queries, keys = q.shape[1], k.shape[1]
    if mask is None and queries not in (1, keys):
        raise ValueError(f"{queries} queries after {keys - queries} cached keys need a mask "
                         f"(without one: a prefill, S = S_kv, or one new token, S = 1)")
    repeat = repeat_kv_heads(q.device, mask is not None, q.shape[2], k.shape[2])
    if repeat:
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
    # no mask where none is needed (SDPA's flash and efficient kernels on CUDA): causal for a
    # prefill; one new token after the cache sees every key (is_causal would align its one
    # query with the first key)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                         is_causal=mask is None and queries > 1,
                                         enable_gqa=not repeat)
    return out.transpose(1, 2).flatten(2)


def repeat_kv_heads(device: torch.device, masked: bool, h_q: int, h_kv: int) -> bool:
    """Whether attention repeats each key/value head for its query heads (pure): on CUDA
    with a mask, where SDPA's memory-efficient kernel (the one that takes a mask) refuses
    ``enable_gqa`` and SDPA would fall back to its math kernel, which materialises the
    ``[B, h_q, S, S_kv]`` float32 scores; the repeated keys and values are ``h_q / h_kv``
    times their size, ``O(S)``.  Elsewhere SDPA broadcasts the groups itself."""
    return device.type == "cuda" and masked and h_q != h_kv


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """One new query per row against cached ``k, v [B, S_kv, h_kv, D]`` (views of a dense
    KV cache), each KV group's query heads stacked as the rows of one SDPA call::

        q [B, 1, h_kv * qpg, D] -> [B, h_kv, qpg, D]    (query head g * qpg + j: group g)
        k, v                    -> [B, h_kv, S_kv, D]   (views, never expanded per query)
        mask [B, 1, 1, S_kv]       broadcast over the heads and the stacked queries

    The same maths as ``scaled_dot_product_attention(enable_gqa=True)``; the mask (None:
    every key) leaves SDPA's memory-efficient kernel eligible on CUDA, where GQA with a mask
    would take the math kernel and copy the cache per query head.

    Returns:
        ``[B, 1, h_q * D]``.
    """
    b, _, h_q, d = q.shape
    h_kv = k.shape[2]
    qg = q.reshape(b, h_kv, h_q // h_kv, d)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask)
    return out.reshape(b, 1, h_q * d)


def attention_block(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                    rope: tuple[torch.Tensor, torch.Tensor],
                    mask: torch.Tensor | PackedSeqs | None,
                    q_per_group: int, head_dim: int, eps: float, tp_group: Group | None,
                    kv_hook: KVHook | None = None, lora: LoraDeltas | None = None
                    ) -> torch.Tensor:
    """``o_proj(attention(rope(qkv(x))))``: ``x [B, S, H]`` (replicated) -> ``[B, S, H]``,
    with the optional biases and q/k norms of ``w`` (see the module docstring) and the
    LoRA deltas of ``lora``."""
    qkv = column_linear(x, w["qkv"], tp_group)  # [B, S, h_kv*(qpg+2)*D]
    delta = lora.qkv(x) if lora is not None else None
    if delta is not None:
        qkv = qkv + delta
    cos, sin = rope
    if ("q_norm" not in w and kv_hook is None and not isinstance(mask, PackedSeqs)
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
        q = rms_norm(q, copy_to_tp(w["q_norm"], tp_group), eps)
        k = rms_norm(k, copy_to_tp(w["k_norm"], tp_group), eps)
    out = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask, kv_hook)
    return _o_proj(out, w, tp_group, lora)


def _o_proj(out: torch.Tensor, w: Mapping[str, torch.Tensor], tp_group: Group | None,
            lora: LoraDeltas | None = None) -> torch.Tensor:
    y = row_linear(out, w["o_proj"], tp_group)
    delta = lora.row("o_proj", out) if lora is not None else None
    if delta is not None:
        y = y + delta
    return y + w["o_proj_bias"] if "o_proj_bias" in w else y


def swiglu_formula(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the interleaved ``gu [..., F, 2]`` -> ``[..., F]``."""
    # silu of a contiguous copy of the gate: on a strided view ATen takes its scalar loop,
    # about twice as slow forward and backward as copy + vectorised silu
    return F.silu(gu[..., 0].contiguous()) * gu[..., 1]


def swiglu_grad_formula(gu: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient ``[..., F, 2]`` of :func:`swiglu_formula` at ``gu`` for ``grad [..., F]``
    (``silu'(x) = s + x s (1 - s)``, ``s = sigmoid(x)``), interleaved like ``gu``."""
    gate, up = gu[..., 0], gu[..., 1]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    return torch.stack([grad * up * (sig + silu * (1 - sig)), grad * silu], dim=-1)


_compiled_swiglu = Compiled(swiglu_formula)
_compiled_swiglu_grad = Compiled(swiglu_grad_formula)


def _swiglu_kernel_applies(gu: torch.Tensor) -> bool:
    return _kernels is not None and gu.dtype == torch.float32 and gu.device.type == "cpu"


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    if _swiglu_kernel_applies(gu):
        return _kernels.swiglu_forward(gu)
    return _compiled_swiglu(gu)


def _swiglu_grad(gu: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if _swiglu_kernel_applies(gu) and grad.dtype == torch.float32:
        return _kernels.swiglu_backward(gu, grad)
    return _compiled_swiglu_grad(gu, grad)


class _SwiGLU(torch.autograd.Function):
    """:func:`swiglu` with a backward of one pass that writes the interleaved gradient (autograd
    of the formula zero-fills a ``gu``-sized gradient for each of the two selects and adds
    them: 0.2 s of a 5.3 s ``small`` training step on one core)."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gu)
        return _swiglu(gu)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gu,) = ctx.saved_tensors
        return _swiglu_grad(gu, grad)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu [..., F, 2]`` (gate/up interleaved) -> ``[..., F]``.

    Forward and backward are each one pass: for float32 CPU tensors the C++ kernel
    (``engine._kernels``, csrc/engine/swiglu.cpp, which splits the interleaved pairs with
    vector shuffles, where inductor's vectoriser does not: ``bench/kernels_vs_compile.py``
    compares them), otherwise
    one fused loop compiled by :mod:`engine.inductor` above its size threshold (the formulas
    eagerly below it, and inside any code ``torch.compile`` traces).  All agree with autograd
    of :func:`swiglu_formula` within float32 rounding.
    """
    if torch.compiler.is_compiling():
        return swiglu_formula(gu)
    if torch.is_grad_enabled() and gu.requires_grad:
        return _SwiGLU.apply(gu)
    return _swiglu(gu)


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


@dataclass(frozen=True)
class MoeRouting:
    """How a mixture-of-experts layer routes: the top ``top_k`` experts of the router's
    softmax (computed in float32), their weights renormalised to sum to one where
    ``norm_topk``."""

    top_k: int
    norm_topk: bool


@dataclass
class RouterLoss:
    """The load-balancing loss of the mixture-of-experts layers of one training forward
    (Switch Transformer's, per layer)::

        loss_l = E * sum_e f_e * P_e     f_e: expert e's share of the (token, slot) pairs
                                              (sum_e f_e = k), P_e: its mean probability,
                                              both over the real tokens

    Each layer appends its ``loss_l``; :meth:`total` is their sum and :meth:`weighted` that
    sum times ``weight``, the term added to the micro-batch's loss (``coef / (layers * micro-batches)``: the mean over
    the model's layers, like the micro-batch loss a share of the step)."""

    weight: float
    token_mask: torch.Tensor | None = None
    """``[N]`` bool over the flattened tokens, True = real (None: every token)."""
    terms: list[torch.Tensor] = field(default_factory=list)

    def add(self, probs: torch.Tensor, experts: torch.Tensor) -> None:
        """One layer's term from its router's ``probs [N, E]`` (float32) and chosen
        ``experts [N, k]``."""
        n, num_experts = probs.shape
        real = (torch.ones(n, device=probs.device) if self.token_mask is None
                else self.token_mask.to(probs.device, torch.float32))
        pairs = torch.zeros(num_experts, device=probs.device).index_add(
            0, experts.flatten(), real.repeat_interleave(experts.shape[1]))
        tokens = real.sum().clamp(min=1.0)
        mean_prob = (probs * real[:, None]).sum(0) / tokens
        self.terms.append(num_experts * (pairs / tokens * mean_prob).sum())

    def total(self) -> torch.Tensor:
        return torch.stack(self.terms).sum()

    def weighted(self) -> torch.Tensor:
        return self.total() * self.weight


class _AddLossGradient(torch.autograd.Function):
    """``x`` unchanged forward; backward also sends gradient 1 into ``loss`` (a scalar in
    ``x``'s graph), so a pipeline stage's backward of ``x`` trains the loss too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def add_loss_gradient(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``x``, through which backward also minimises ``loss`` (:class:`_AddLossGradient`)."""
    return _AddLossGradient.apply(x, loss)


@dataclass
class RouteTrace:
    """The experts the mixture-of-experts layers of one forward route each token to, in layer
    order: recorded (:attr:`chosen`) and, for router replay, imposed (:attr:`replay`).

    With ``replay [N, L, k]`` the ``j``-th MoE layer of the forward sends token ``n`` to the
    experts ``replay[n, j]`` (a negative entry: the router's own top k for that token) with
    weights the router's current probabilities of those experts (renormalised where the
    routing does): the experts of the rollout, the probabilities of the policy being trained.
    """

    replay: torch.Tensor | None = None
    chosen: list[torch.Tensor] = field(default_factory=list)

    def experts(self, own: torch.Tensor) -> torch.Tensor:
        """This layer's ``[N, k]`` experts given the router's own ``own``; records them."""
        experts = own
        if self.replay is not None:
            given = self.replay[:, len(self.chosen)].to(own.device, torch.int64)
            experts = torch.where(given >= 0, given, own)
        self.chosen.append(experts)
        return experts

    def recorded(self) -> torch.Tensor:
        """``[N, L, k]`` of every layer so far."""
        return torch.stack(self.chosen, dim=1)


def route(x: torch.Tensor, router: torch.Tensor, routing: MoeRouting,
          router_loss: RouterLoss | None = None, trace: RouteTrace | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] in x's dtype, experts [N, k] int64)`` of the tokens ``x [N, H]``
    (and the layer's term of ``router_loss``, of the router's own choice; the experts
    recorded in, or replayed from, ``trace``)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, routing.top_k, dim=-1)
    if router_loss is not None:
        router_loss.add(probs, experts)
    if trace is not None:
        chosen = trace.experts(experts)
        if chosen is not experts:
            weights, experts = probs.gather(-1, chosen), chosen
    if routing.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), experts


def expert_ffn(rows: torch.Tensor, w: Mapping[str, torch.Tensor], e: int) -> torch.Tensor:
    """Expert ``e``'s SwiGLU of ``rows [n, H]`` (of its TP shard: a partial sum, unreduced)."""
    gu = column_linear(rows, w[f"experts.{e}.gate_up"], None)
    h, down = swiglu(gu.unflatten(-1, (-1, 2))), w[f"experts.{e}.down_proj"]
    if down.dim() == 3:  # a trained expert stored as its generation pieces
        return row_linear_pieces(h, down)
    return row_linear(h, down, None)


def moe_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], routing: MoeRouting,
              tp_group: Group | None, router_loss: RouterLoss | None = None,
              trace: RouteTrace | None = None, experts: Sequence[int] | None = None,
              held_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dropless top-k mixture of SwiGLU experts: ``x [..., H]`` (replicated) -> ``[..., H]``.

    The (token, expert) pairs are sorted by expert so each expert runs one matmul pair over
    its tokens (a loop over experts, none over tokens); the weighted outputs are summed back
    per token.  Under TP each expert is split like the dense MLP and its partial outputs
    are all-reduced once for the layer.  With ``experts`` (generation EP inside the TP group,
    :mod:`hybridflow_comm.expert_layout`) only the pairs of those experts, whose pieces ``w``
    holds, are computed here; the TP all-reduce adds the other members' experts.  The
    router is replicated and its inputs whole on every rank; the routing weights scale
    partial outputs, so their gradient is a partial sum: they enter through
    :func:`engine.tp_ops.copy_to_tp`, like the experts' inputs.  The layer's load-balancing
    term goes to ``router_loss`` where given (training), its experts to (or from) ``trace``
    (:class:`RouteTrace`).  ``held_mask``: ``experts`` as a bool ``[E]`` mask on ``x``'s
    device, made once by a caller that runs the block every step (default: made here).
    """
    shape, num_experts = x.shape, w["router"].shape[0]
    tokens = x.reshape(-1, shape[-1])
    weights, chosen = route(tokens, w["router"], routing, router_loss, trace)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    held = range(num_experts) if experts is None else sorted(experts)  # the pairs' order
    if experts is not None:  # this rank's experts' pairs only
        mine = held_mask if held_mask is not None else experts_mask(experts, num_experts,
                                                                    flat.device)
        order = order[mine[flat[order]]]
    counts = torch.bincount(flat[order], minlength=num_experts).tolist()
    token_of = order // routing.top_k
    inputs = copy_to_tp(tokens, tp_group)[token_of]  # [pairs, H], expert after expert
    rows = dict(zip(range(num_experts), inputs.split(counts)))
    outs = [expert_ffn(rows[e], w, e) for e in held]  # an expert without tokens: 0 rows
    scale = copy_to_tp(weights, tp_group).flatten()[order]
    out = torch.zeros_like(tokens).index_add(0, token_of, torch.cat(outs) * scale[:, None])
    return reduce_from_tp(out, tp_group).reshape(shape)


def experts_mask(experts: Sequence[int], num_experts: int,
                 device: torch.device) -> torch.Tensor:
    """``[num_experts]`` bool on ``device``, True at ``experts``."""
    mask = torch.zeros(num_experts, dtype=torch.bool, device=device)
    mask[torch.as_tensor(list(experts), device=device)] = True
    return mask


class MoeFn(Protocol):
    """A mixture-of-experts block with :func:`moe_block`'s signature (e.g.
    :class:`engine.expert_parallel.ExpertParallel`'s, over the rank's EP group)."""

    def __call__(self, x: torch.Tensor, w: Mapping[str, torch.Tensor], routing: MoeRouting,
                 tp_group: Group | None, router_loss: RouterLoss | None = None,
                 trace: RouteTrace | None = None) -> torch.Tensor: ...


def mlp_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], tp_group: Group | None,
              lora: LoraDeltas | None = None, routing: MoeRouting | None = None,
              router_loss: RouterLoss | None = None, trace: RouteTrace | None = None,
              moe: MoeFn | None = None) -> torch.Tensor:
    """The layer's MLP: where ``routing`` is given ``moe`` (default :func:`moe_block`: every
    expert on this rank), else :func:`swiglu_block` (with its LoRA deltas)."""
    if routing is not None:
        return (moe or moe_block)(x, w, routing, tp_group, router_loss, trace)
    return swiglu_block(x, w, tp_group, lora)


def decoder_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor],
                  rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | PackedSeqs | None,
                  q_per_group: int, head_dim: int, eps: float, tp_group: Group | None,
                  kv_hook: KVHook | None = None, lora: LoraDeltas | None = None,
                  routing: MoeRouting | None = None, router_loss: RouterLoss | None = None,
                  trace: RouteTrace | None = None, moe: MoeFn | None = None) -> torch.Tensor:
    """One pre-norm Llama layer: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``; ``[B, S, H]``
    (with the layer's LoRA adapters when ``lora`` is given; a mixture of experts routed by
    ``routing`` when given, by ``moe``, its load-balancing term into ``router_loss``, its
    experts into or from ``trace``)."""
    h = x + attention_block(rms_norm(x, w["input_norm"], eps), w, rope, mask, q_per_group,
                            head_dim, eps, tp_group, kv_hook, lora)
    return h + mlp_block(rms_norm(h, w["post_norm"], eps), w, tp_group, lora, routing,
                         router_loss, trace, moe)
