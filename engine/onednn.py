"""Float32 CPU products ``x @ weight.T`` on oneDNN instead of PyTorch's default BLAS.

PyTorch's CPU build runs ``torch.matmul`` on MKL, which may take its AVX2 kernels on AMD
processors; oneDNN (shipped inside the same torch) JIT-compiles for the features the CPU
reports, AVX-512 included.  ``python bench/roofline.py`` reports the GEMM rate of both
libraries on the machine at hand.  Float32 throughout (no reduced-precision mode).

:func:`linear` is one autograd node whose forward and both gradients run oneDNN's
``mkldnn::_linear_pointwise`` (``a @ b.T`` of two dense matrices), for float32 CPU tensors and
a 2-D weight, from :data:`MIN_MACS` multiply-adds; anything else, code that ``torch.compile``
traces, a torch without the op, and ``HYBRIDFLOW_ONEDNN=0`` in the environment run
``torch.matmul``.  The two agree within float32
rounding, not bit for bit.

With the C++ extension built, every product goes through ``engine._kernels.onednn_mm``
(ATen's oneDNN matmul, which reads a transposed operand in place); without it, through
``_linear_pointwise``, which takes row-major operands only, so the weight gradient
``dy.T @ x`` first copies both activations transposed (at long sequences those copies cost
more than the product).  ATen's oneDNN matmul refuses CPUs without AVX-512 (or AVX-NE-CONVERT)
in some torch builds; a one-off product at import (:data:`_ROUTE`) finds which of the two runs
here, and without either every product is ``torch.matmul``.
"""

from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

try:  # C++ kernels (setup.py builds them): the product that reads transposed operands in place
    from engine import _kernels
except ImportError:  # pragma: no cover - a source tree never built
    _kernels = None

ONEDNN_ENV = "HYBRIDFLOW_ONEDNN"
MIN_MACS = 1 << 22
"""Smallest product (``n * k * m`` multiply-adds) run on oneDNN.  Below it MKL is faster, and
every new shape costs oneDNN a primitive to build, which small, varied shapes (tests, the tiny
model) would pay over and over."""


def _route() -> str | None:
    """The oneDNN product this CPU runs: ``"kernels"`` (``engine._kernels.onednn_mm``),
    ``"pointwise"`` (``mkldnn::_linear_pointwise``) or None, tried on a 2 x 3 x 4 product."""
    if not torch.backends.mkldnn.is_available():
        return None
    a, b = torch.ones(2, 3, device="cpu"), torch.ones(3, 4, device="cpu")
    if _kernels is not None:
        try:
            _kernels.onednn_mm(a, b)
            return "kernels"
        except RuntimeError:
            pass
    try:
        torch.ops.mkldnn._linear_pointwise(a, b.t().contiguous(), None, "none", [], "")
        return "pointwise"
    except (RuntimeError, AttributeError):
        return None


_ROUTE = _route()
"""This CPU's oneDNN product (:func:`_route`), found once: code that ``torch.compile`` traces
reads it as a constant."""


def _available() -> bool:
    return _ROUTE is not None


_enabled = os.environ.get(ONEDNN_ENV, "1") != "0" and _available()


def set_enabled(enabled: bool) -> bool:
    """Use oneDNN from now on (where it is available) or not; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled) and _available()
    return previous


def enabled() -> bool:
    return _enabled


def batched() -> bool:
    """Whether :func:`mm` takes batched (3-D) operands: oneDNN on and the extension built."""
    return _enabled and _ROUTE == "kernels"


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [n, k] @ b [k, m]`` -> ``[n, m]`` on oneDNN (float32; either may be a transposed
    view); batched ``[g, n, k] @ [g, k, m]`` where :func:`batched`."""
    if _ROUTE == "kernels":
        return _kernels.onednn_mm(a, b)
    if a.shape[1] == 0:  # oneDNN rejects an empty reduction
        return a.new_zeros(a.shape[0], b.shape[1])
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.t().contiguous(), None, "none",
                                              [], "")


def mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [n, k] @ b[m, k].T`` -> ``[n, m]`` on oneDNN (float32)."""
    return mm(a, b.t())


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ weight[out, in].T`` -> ``[..., out]`` by :func:`mm_t`."""
    return mm_t(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


class _Linear(torch.autograd.Function):
    """``x [..., in] @ weight[out, in].T``: forward, input and weight gradients on oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _product(x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])  # [n, out]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = mm(grad2, weight).view(x.shape)  # [n, out] @ [out, in]
        if ctx.needs_input_grad[1]:
            dw = mm(grad2.t(), x.reshape(-1, x.shape[-1]))  # [out, n] @ [n, in]
        return dx, dw


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs oneDNN for these operands (never in traced code, which
    is asked first: a traced size may be unbacked, with no value to compare)."""
    return (_enabled and not torch.compiler.is_compiling() and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and x.dim() >= 1
            and x.numel() > 0 and x.numel() * weight.shape[0] >= MIN_MACS)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ weight[out, in].T`` -> ``[..., out]`` (see the module docstring)."""
    if not applies(x, weight):
        return torch.matmul(x, weight.t())
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Linear.apply(x, weight)
    return _product(x, weight)
