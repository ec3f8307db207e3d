"""RMSNorm: the formula, and the C++ kernel where it applies (:mod:`engine.cpu_ops`)."""

from __future__ import annotations

import torch

from engine import cpu_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, computed in float32 (as transformers).

    Where :func:`engine.cpu_ops.rms_norm_applies` (float32 CPU tensors with a ``[H]`` weight,
    outside code ``torch.compile`` traces, the extension built) the C++ kernel runs; elsewhere
    :func:`rms_norm_formula`.  The two agree within float32 rounding
    (tests/test_rms_norm_kernel.py); the kernel's backward is ``once_differentiable`` (no
    double backward).
    """
    if cpu_ops.rms_norm_applies(x, weight):
        return cpu_ops.rms_norm(x, weight, eps)
    return rms_norm_formula(x, weight, eps)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` by tensor ops (the reference of the kernel; any dtype and device)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
