"""The CPU side of the layer ops: the C++ kernels (``engine._kernels``, csrc/engine/) that
replace a formula for float32 CPU tensors, each beside the one test of where it applies::

    op          kernel                       applies to                        elsewhere
    rms_norm    csrc/engine/rms_norm.cpp     float32 CPU x and [H] weight,     engine.norm.
                                             outside traced code               rms_norm_formula
    swiglu      csrc/engine/swiglu.cpp       float32 CPU gu (and gradient)     engine.mlp's
                                                                               compiled formula

(Attention's CPU kernels: :mod:`engine.batched_attention`.)  The layer maths asks
``*_applies`` and calls the op; every device, dtype and extension check is here.  Without the
extension built nothing applies and the formulas run everywhere.  Each kernel is kept while it
runs >= 1.3x the compiled formula in ``bench/kernels_vs_compile.py --shape small``; the two
agree within float32 rounding (tests/test_rms_norm_kernel.py, tests/test_swiglu_kernel.py).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

try:  # torch (imported above) must be loaded before the extension
    from engine import _kernels
except ImportError:  # extension not built: the formula runs everywhere
    _kernels = None


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` runs ``x [..., H]``, ``weight``: float32 CPU tensors, a
    ``[H]`` weight, the extension built, and not inside code ``torch.compile`` traces."""
    return (_kernels is not None and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.shape == x.shape[-1:]
            and not torch.compiler.is_compiling())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`engine.norm.rms_norm` by the C++ kernel (where :func:`rms_norm_applies`): one
    autograd node with a hand-written, ``once_differentiable`` backward (no double backward)
    under autograd, the forward alone (nothing saved) without it."""
    x, weight = x.contiguous(), weight.contiguous()  # copies are differentiable
    if torch.is_grad_enabled():
        return _RMSNorm.apply(x, weight, eps)
    return _kernels.rms_norm_forward(x, weight, eps)[0]  # inference: nothing saved


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


def swiglu_applies(gu: torch.Tensor, grad: torch.Tensor | None = None) -> bool:
    """Whether :func:`swiglu` (and, given ``grad``, :func:`swiglu_grad`) runs: float32 CPU
    ``gu`` (and a float32 ``grad``), the extension built."""
    return (_kernels is not None and gu.dtype == torch.float32 and gu.device.type == "cpu"
            and (grad is None or grad.dtype == torch.float32))


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the interleaved ``gu [..., F, 2]`` by the C++ kernel (which
    splits the pairs with vector shuffles, where inductor's vectoriser does not)."""
    return _kernels.swiglu_forward(gu)


def swiglu_grad(gu: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient ``[..., F, 2]`` of :func:`swiglu` at ``gu`` for ``grad [..., F]``, by the
    C++ kernel in one pass."""
    return _kernels.swiglu_backward(gu, grad)
