"""engine.onednn: the oneDNN product node against float64 autograd, its fallbacks and switch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine import onednn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not onednn._available(), reason="torch built without oneDNN")


@pytest.fixture
def onednn_on(monkeypatch):
    """oneDNN on for every product, however small (the tests' shapes are under MIN_MACS)."""
    monkeypatch.setattr(onednn, "MIN_MACS", 0)
    previous = onednn.set_enabled(True)
    yield
    onednn.set_enabled(previous)


def test_small_products_stay_on_matmul():
    """Below MIN_MACS multiply-adds the product is torch.matmul's (MKL is faster there and
    oneDNN would build a primitive per new shape); from it on, the oneDNN node."""
    hidden = 64
    rows = onednn.MIN_MACS // (hidden * hidden)
    w = torch.randn(hidden, hidden, requires_grad=True)
    small = torch.randn(rows - 1, hidden)
    assert not onednn.applies(small, w)
    y = onednn.linear(small, w)
    assert type(y.grad_fn).__name__ != "_LinearBackward"
    assert torch.equal(y, torch.matmul(small, w.t()))
    big = torch.randn(rows, hidden)
    assert onednn.applies(big, w) == onednn.enabled()


def _float64_reference(x, w, grad):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = x64 @ w64.t()
    y.backward(grad.double())
    return y.detach(), x64.grad, w64.grad


@pytest.mark.parametrize("x_shape, out", [((7, 33), 19), ((2, 5, 64), 96), ((64,), 8),
                                          ((3, 4, 6, 40), 120)])
def test_linear_node_matches_float64_autograd(onednn_on, x_shape, out):
    g = torch.Generator().manual_seed(len(x_shape) * 10 + out)
    x = torch.randn(*x_shape, generator=g)
    w = torch.randn(out, x_shape[-1], generator=g)
    grad = torch.randn(*x_shape[:-1], out, generator=g)
    want = _float64_reference(x, w, grad)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = onednn.linear(xg, wg)
    assert type(y.grad_fn).__name__ == "_LinearBackward"
    y.backward(grad)
    for got, ref in zip((y, xg.grad, wg.grad), want):
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert float((got.double() - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max()))
    with torch.no_grad():  # inference: the same product, no node
        assert torch.equal(onednn.linear(x, w), y.detach())


def test_only_the_gradients_asked_for(onednn_on):
    x, w = torch.randn(6, 16), torch.randn(4, 16, requires_grad=True)
    onednn.linear(x, w).sum().backward()  # x needs no gradient (the first layer's input)
    torch.testing.assert_close(w.grad, torch.ones(6, 4).t() @ x)
    x = torch.randn(6, 16, requires_grad=True)
    onednn.linear(x, torch.randn(4, 16)).sum().backward()
    assert x.grad.shape == (6, 16)


def _layouts(a: torch.Tensor):
    """``a`` row-major, as the transpose of a row-major tensor, and strided every other row."""
    return {"row-major": a, "transposed": a.t().contiguous().t(),
            "strided": torch.cat([a, a], dim=1)[:, : a.shape[1]]}


@pytest.mark.parametrize("kernels", ["extension", "linear_pointwise"])
def test_mm_reads_every_layout(monkeypatch, kernels):
    """The C++ product (oneDNN reading a transposed operand in place) and the fallback without
    the extension against float64, for each layout of each operand and an empty reduction."""
    if kernels == "extension" and onednn._ROUTE != "kernels":
        pytest.skip("engine._kernels not built, or its oneDNN product refuses this CPU")
    if kernels == "linear_pointwise":
        monkeypatch.setattr(onednn, "_ROUTE", "pointwise")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(37, 53, generator=g), torch.randn(53, 29, generator=g)
    want = a.double() @ b.double()
    for (la, a_), (lb, b_) in ((x, y) for x in _layouts(a).items() for y in _layouts(b).items()):
        got = onednn.mm(a_, b_)
        assert got.shape == (37, 29) and got.is_contiguous(), (la, lb)
        assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), (la, lb)
    torch.testing.assert_close(onednn.mm_t(a, b.t()), a @ b, atol=1e-4, rtol=0)
    assert torch.equal(onednn.mm(torch.ones(3, 0), torch.ones(0, 4)), torch.zeros(3, 4))


def test_extension_checks_its_operands():
    if onednn._kernels is None:
        pytest.skip("engine._kernels not built")
    for a, b in ((torch.ones(3, 4), torch.ones(5, 2)), (torch.ones(3, 4).double(),
                                                         torch.ones(4, 2).double())):
        with pytest.raises(RuntimeError, match="onednn_mm_out"):
            onednn._kernels.onednn_mm(a, b)


def test_weight_gradient_needs_no_transposed_copy(onednn_on):
    """The backward hands the transposed views straight to the product: with the extension,
    no copy kernel runs while the gradients are computed."""
    if onednn._ROUTE != "kernels":
        pytest.skip("engine._kernels not built, or its oneDNN product refuses this CPU")
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    grad = torch.randn(64, 48)
    y = onednn.linear(x, w)
    with torch.profiler.profile() as prof:
        y.backward(grad)
    names = {e.key for e in prof.key_averages()}
    assert "aten::copy_" not in names and "aten::clone" not in names, names
    _, dx, dw = _float64_reference(x.detach(), w.detach(), grad)
    torch.testing.assert_close(x.grad.double(), dx, atol=1e-4, rtol=0)
    torch.testing.assert_close(w.grad.double(), dw, atol=1e-4, rtol=0)


def test_non_contiguous_input(onednn_on):
    x = torch.randn(16, 5, 8).transpose(0, 1)  # [5, 16, 8], strided
    w = torch.randn(3, 8)
    torch.testing.assert_close(onednn.linear(x, w), torch.matmul(x, w.t()), atol=1e-5, rtol=0)


def test_falls_back_to_matmul(onednn_on):
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert onednn.applies(x, w)
    for a, b in ((x.bfloat16(), w.bfloat16()), (x.double(), w.double()),
                 (x, torch.randn(2, 3, 4))):
        assert not onednn.applies(a, b)
    bf = onednn.linear(x.bfloat16(), w.bfloat16())
    assert torch.equal(bf, torch.matmul(x.bfloat16(), w.bfloat16().t()))
    onednn.set_enabled(False)
    y = onednn.linear(x.requires_grad_(), w)
    assert not onednn.applies(x, w) and torch.equal(y, torch.matmul(x, w.t()))
    assert type(y.grad_fn).__name__ != "_LinearBackward"


def test_environment_switch():
    code = "from engine import onednn; print(onednn.enabled())"
    for value, want in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, text=True,
                             capture_output=True,
                             env=dict(os.environ, HYBRIDFLOW_ONEDNN=value, PYTHONPATH=ROOT))
        assert out.stdout.strip() == want


def test_a_cpu_without_avx512_takes_a_product_that_runs_there():
    """oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, as on a CPU without AVX-512): ATen's
    oneDNN matmul may refuse it, so the import-time probe routes around it, and a product
    above the threshold (forward and both gradients) still matches float64."""
    code = """
import torch
from engine import onednn
x = torch.randn(64, 256, dtype=torch.float64, requires_grad=True)
w = torch.randn(300, 256, dtype=torch.float64, requires_grad=True)
xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
assert onednn.applies(xf, wf)
y = onednn.linear(xf, wf)
y.backward(torch.ones_like(y))
(x @ w.T).backward(torch.ones(64, 300, dtype=torch.float64))
for got, want in ((y, x @ w.T), (xf.grad, x.grad), (wf.grad, w.grad)):
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-4)
print(onednn._ROUTE)
"""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() in ("kernels", "pointwise")


def test_the_route_is_a_constant_to_torch_compile():
    """Code that torch.compile traces (whole graph) may ask which product runs here."""
    def f(x, w):
        return onednn.linear(x, w) * onednn.batched()
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, w), f(x, w))
