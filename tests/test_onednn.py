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
def onednn_on():
    previous = onednn.set_enabled(True)
    yield
    onednn.set_enabled(previous)


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
