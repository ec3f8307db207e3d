"""The C++ SwiGLU (``engine._kernels.swiglu_forward/backward``, run by
:func:`engine.mlp.swiglu` for float32 CPU tensors) against autograd of the formula in
float64: whole vectors of 16 pairs and the zero-padded tail, one and two threads, extreme
gates (the clamped exponential), strided inputs, and the checks on bad operands."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_ops, mlp

pytest.importorskip("engine._kernels")
from engine import _kernels  # noqa: E402


def reference(gu: torch.Tensor, dy: torch.Tensor):
    """``silu(gate) * up`` in float64 (sigmoid written out, not the formula under test) and the
    gradient of ``<out, dy>`` by autograd, interleaved like ``gu``."""
    g = gu.double().requires_grad_()
    gate, up = g[..., 0], g[..., 1]
    out = gate / (1 + torch.exp(-gate)) * up
    (grad,) = torch.autograd.grad(out, g, dy.double())
    return out.detach(), grad


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within float32 rounding: 4e-7 of each value's size, 1e-6 absolute near zero."""
    return bool(((got.double() - want).abs() <= 4e-7 * want.abs() + 1e-6).all())


@pytest.mark.parametrize("shape, threads", [((3, 50, 2), 1), ((4, 96, 2), 2), ((1, 2), 1),
                                            ((2, 9, 64, 2), 2), ((0, 8, 2), 1)])
def test_kernel_matches_float64_autograd(shape, threads):
    gen = torch.Generator().manual_seed(sum(shape) + threads)
    gu = torch.randn(*shape, generator=gen) * 4
    dy = torch.randn(*shape[:-1], generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y, dgu = _kernels.swiglu_forward(gu), _kernels.swiglu_backward(gu, dy)
    finally:
        torch.set_num_threads(previous)
    want_y, want_dgu = reference(gu, dy)
    assert y.shape == want_y.shape and dgu.shape == gu.shape
    assert close(y, want_y) and close(dgu, want_dgu)


def test_extreme_gates_and_strided_input():
    gate = torch.tensor([-200.0, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 88.0, 200.0] * 4)
    up = torch.linspace(-3, 3, gate.numel())
    gu = torch.stack([gate, up], -1)  # 36 pairs: two whole vectors and a tail of 4
    dy = torch.linspace(1, 2, gate.numel())
    want_y, want_dgu = reference(gu, dy)
    assert close(_kernels.swiglu_forward(gu), want_y)
    assert close(_kernels.swiglu_backward(gu, dy), want_dgu)
    wide = torch.randn(5, 40, 2)
    strided = torch.cat([wide, wide], dim=1)[:, ::2]  # [5, 40, 2], not contiguous
    grad = torch.randn(5, 40).t().contiguous().t()  # a transposed view
    want_y, want_dgu = reference(strided, grad)
    assert close(_kernels.swiglu_forward(strided), want_y)
    assert close(_kernels.swiglu_backward(strided, grad), want_dgu)


def test_bad_operands_are_refused():
    with pytest.raises(RuntimeError, match="swiglu: gu must be"):
        _kernels.swiglu_forward(torch.ones(4, 3))
    with pytest.raises(RuntimeError, match="float32"):
        _kernels.swiglu_forward(torch.ones(4, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="swiglu: dy must be"):
        _kernels.swiglu_backward(torch.ones(4, 8, 2), torch.ones(4, 7))


def test_layers_run_the_kernel_for_float32_cpu(monkeypatch):
    """engine.mlp.swiglu: the kernel for float32 CPU tensors (forward and the node's
    backward), the compiled formula for other dtypes."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(_kernels, name)

    monkeypatch.setattr(cpu_ops, "_kernels", Spy())
    gu = torch.randn(2, 24, 2, requires_grad=True)
    mlp.swiglu(gu).sum().backward()
    assert calls == ["swiglu_forward", "swiglu_backward"]
    calls.clear()
    out = mlp.swiglu(gu.detach().double())
    assert calls == [] and out.dtype == torch.float64
    want, _ = reference(gu.detach(), torch.ones(2, 24))
    assert close(mlp.swiglu(gu.detach()), want)
