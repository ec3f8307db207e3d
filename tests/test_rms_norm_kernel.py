"""The C++ RMSNorm (``engine._kernels.rms_norm_forward/backward``, run by
:func:`engine.norm.rms_norm` for float32 CPU tensors) against the formula in float64 and its
autograd gradients; where the layers choose it and where the formula; the model's layers and
final norm on it."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_ops, norm
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

pytest.importorskip("engine._kernels")

EPS = 1e-5


def reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """``w * x / sqrt(mean(x^2) + eps)`` in float64 and its gradients by autograd."""
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    y = wr * xr / torch.sqrt(xr.pow(2).mean(-1, keepdim=True) + EPS)
    dx, dw = torch.autograd.grad(y, [xr, wr], dy.double())
    return y.detach(), dx, dw


def on_kernel(y: torch.Tensor) -> bool:
    return type(y.grad_fn).__name__ == "_RMSNormBackward"


# hidden sizes: 8 (scalar tail only), 24 (one vector + tail), 48 (two-vector block + one
# vector), 83 (both + a tail of 3), 384 (the `small` model's); rows split over 1 and 2 threads
@pytest.mark.parametrize("shape, threads", [((5, 7, 24), 1), ((3, 33, 48), 2), ((1, 8), 2),
                                            ((0, 4, 16), 1), ((2, 37, 83), 2), ((70, 384), 2)])
def test_kernel_matches_formula_and_gradient(shape, threads):
    gen = torch.Generator().manual_seed(sum(shape) + threads)
    x = torch.randn(*shape, generator=gen) * 3
    w = 1 + torch.randn(shape[-1], generator=gen) / 4
    dy = torch.randn(*shape, generator=gen)
    want, want_dx, want_dw = reference(x, w, dy)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = norm.rms_norm(xf, wf, EPS)
        dx, dw = torch.autograd.grad(got, [xf, wf], dy)
        with torch.no_grad():  # inference calls the kernel directly: the same values
            nograd = norm.rms_norm(x, w, EPS)
    finally:
        torch.set_num_threads(before)
    assert on_kernel(got)
    assert torch.equal(nograd, got.detach())
    # float32 rounding of sums over H terms, relative to the largest entry
    for a, b in ((got, want), (dx, want_dx), (dw, want_dw)):
        tol = 1e-6 * shape[-1] ** 0.5 * max(1.0, b.abs().max().item() if b.numel() else 0.0)
        torch.testing.assert_close(a.detach().double(), b, rtol=0, atol=tol)
    # and the float32 formula the other dtypes run, within the same rounding
    torch.testing.assert_close(got.detach(), norm.rms_norm_formula(x, w, EPS), rtol=1e-5,
                               atol=1e-6)


def test_strided_input_and_weight_are_copied_not_refused():
    """A transposed ``x`` and a strided weight (views, as the q/k norms of a head take) give
    the values and gradients of contiguous copies."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(16, 6, generator=gen).requires_grad_()
    wbase = torch.randn(32, generator=gen).requires_grad_()
    got = norm.rms_norm(base.t(), wbase[::2], EPS)  # [6, 16], weight stride 2
    assert on_kernel(got)
    dy = torch.randn(6, 16, generator=gen)
    dx, dw = torch.autograd.grad(got, [base, wbase], dy)
    want, want_dx, want_dw = reference(base.detach().t(), wbase.detach()[::2], dy)
    torch.testing.assert_close(got.detach().double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(dx.t().double(), want_dx, rtol=0, atol=1e-5)
    torch.testing.assert_close(dw[::2].double(), want_dw, rtol=0, atol=1e-5)
    assert torch.equal(dw[1::2], torch.zeros(16))


def test_formula_where_the_kernel_does_not_apply():
    """Other dtypes, a broadcast weight and code traced by ``torch.compile`` run the formula:
    the same bits as :func:`engine.norm.rms_norm_formula`."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 8, generator=gen)
    w = torch.randn(8, generator=gen)
    for xi, wi in ((x.double(), w.double()), (x.bfloat16(), w.bfloat16()),
                   (x, w.double()), (x, w.expand(5, 8))):
        got = norm.rms_norm(xi.requires_grad_(), wi, EPS)
        assert not on_kernel(got)
        assert torch.equal(got, norm.rms_norm_formula(xi, wi, EPS))
    # dynamo cannot trace the extension: fullgraph would raise if the kernel were called
    traced = torch.compile(norm.rms_norm, backend="eager", fullgraph=True)
    assert torch.equal(traced(x, w, EPS), norm.rms_norm_formula(x, w, EPS))
    torch._dynamo.reset()


def test_bad_arguments_raise_and_no_double_backward():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="does not match hidden size"):
        cpu_ops._kernels.rms_norm_forward(x, torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_ops._kernels.rms_norm_forward(x.t(), torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops._kernels.rms_norm_forward(x.double(), torch.ones(8, dtype=torch.float64), EPS)
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(norm.rms_norm(xg, torch.ones(8), EPS).pow(2).sum(), [xg],
                               create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


class _Counting:
    """``engine._kernels`` with its RMSNorm calls counted."""

    def __init__(self, kernels):
        self.kernels, self.calls = kernels, {"rms_norm_forward": 0, "rms_norm_backward": 0}

    def __getattr__(self, name):
        fn = getattr(self.kernels, name)
        if name not in self.calls:
            return fn

        def counted(*args):
            self.calls[name] += 1
            return fn(*args)
        return counted


@pytest.mark.parametrize("head", ["lm", "value"])
def test_model_norms_run_on_the_kernel(head, monkeypatch):
    """Every layer's two norms and the final norm of a float32 model run the kernel, forward
    and backward; outputs and parameter gradients match the same model on the formula
    (the extension hidden), float64 as the truth."""
    cfg = LlamaConfig(vocab_size=40, hidden_size=48, intermediate_size=72, num_layers=3,
                      num_heads=6, num_kv_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, 11), generator=gen)
    am = torch.ones(3, 11, dtype=torch.long)
    am[1, :4] = am[2, :7] = 0  # left padding
    key = "log_probs" if head == "lm" else "values"

    def run(dtype):
        c = LlamaConfig(**(cfg.__dict__ | {"dtype": dtype}))
        model = ParallelLlama(c, groups, head=head)
        load_full_state_dict(model, init_full_state_dict(c, seed=5, head=head, std=0.2))
        out = model.head_outputs(model.stage_forward(ids, am), ids, temperature=1.0)[key]
        (out * torch.linspace(0.5, 1.5, out.shape[-1], dtype=dtype)).sum().backward()
        return out.detach(), {n: p.grad for n, p in model.params.items()}

    counting = _Counting(cpu_ops._kernels)
    monkeypatch.setattr(cpu_ops, "_kernels", counting)
    got, got_g = run(torch.float32)
    assert counting.calls == {"rms_norm_forward": 2 * 3 + 1, "rms_norm_backward": 2 * 3 + 1}
    monkeypatch.setattr(cpu_ops, "_kernels", None)
    ref, ref_g = run(torch.float32)
    want, want_g = run(torch.float64)
    for name, a, b, truth in [(key, got, ref, want)] + [
            (n, got_g[n], ref_g[n], want_g[n]) for n in want_g]:
        err = (a.double() - truth).abs().max().item()
        ref_err = (b.double() - truth).abs().max().item()
        scale = truth.abs().max().item()
        assert err <= 2 * ref_err + 1e-6 * scale, (name, err, ref_err)  # as accurate
