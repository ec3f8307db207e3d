"""The MLP's activation: SwiGLU of the fused, interleaved gate/up product.

``gu [..., F, 2]`` holds each gate next to its up value (the ``gate_up`` rows interleaved,
:mod:`engine.layers`).  :func:`swiglu` is one pass forward and one backward: the C++ kernel
where :func:`engine.cpu_ops.swiglu_applies`, else one fused loop compiled by
:mod:`engine.inductor`; inside code ``torch.compile`` traces, the formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from engine import cpu_ops
from engine.inductor import Compiled


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


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    if cpu_ops.swiglu_applies(gu):
        return cpu_ops.swiglu(gu)
    return _compiled_swiglu(gu)


def _swiglu_grad(gu: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if cpu_ops.swiglu_applies(gu, grad):
        return cpu_ops.swiglu_grad(gu, grad)
    return _compiled_swiglu_grad(gu, grad)


class _SwiGLU(torch.autograd.Function):
    """:func:`swiglu` with a backward of one pass that writes the interleaved gradient (autograd
    of the formula zero-fills a ``gu``-sized gradient for each of the two selects and adds
    them)."""

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

    Forward and backward are each one pass: the C++ kernel where
    :func:`engine.cpu_ops.swiglu_applies` (float32 CPU tensors; ``bench/kernels_vs_compile.py``
    compares it with the compiled formula), otherwise one fused loop compiled by
    :mod:`engine.inductor` above its size threshold (the formulas eagerly below it, and inside
    any code ``torch.compile`` traces).  All agree with autograd of :func:`swiglu_formula`
    within float32 rounding.
    """
    if torch.compiler.is_compiling():
        return swiglu_formula(gu)
    if torch.is_grad_enabled() and gu.requires_grad:
        return _SwiGLU.apply(gu)
    return _swiglu(gu)

