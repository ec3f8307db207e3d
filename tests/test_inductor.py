"""engine.inductor: compiled where big enough, eager otherwise, eager after a failed compile
(raised instead during a CUDA graph capture), eager and counted past dynamo's recompile limit;
and the LM head's vocabulary log-prob/entropy on its compiled pass against float64 softmax."""

import os
import subprocess
import sys

import pytest
import torch

from engine import inductor, tp_ops
from engine.inductor import MIN_NUMEL, Compiled
from engine.tp_ops import vocab_log_prob_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def compile_on():
    previous = inductor.set_enabled(True)
    yield
    inductor.set_enabled(previous)


def _reference(z: torch.Tensor, targets: torch.Tensor, w_lp: float, w_ent: float):
    """log_softmax in float64: log-probs, entropy and the gradient of the weighted sum."""
    z = z.double().requires_grad_()
    log_p = torch.log_softmax(z, dim=-1)
    lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    (w_lp * lp.sum() + w_ent * ent.sum()).backward()
    return lp.detach(), ent.detach(), z.grad


def _ours(z: torch.Tensor, targets: torch.Tensor, w_lp: float, w_ent: float):
    z = z.clone().requires_grad_()
    lp, ent = vocab_log_prob_entropy(z, targets, None)
    (w_lp * lp.sum() + w_ent * ent.sum()).backward()
    return lp.detach(), ent.detach(), z.grad


@pytest.mark.parametrize("w_ent", [0.0, 0.3])
def test_compiled_vocab_head_matches_float64_softmax(compile_on, w_ent, monkeypatch):
    g = torch.Generator().manual_seed(3)
    rows, vocab = 2, 8192  # [2, 65, 8192]: just above the threshold
    z = torch.randn(rows, 65, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (rows, 65), generator=g)
    assert inductor.enabled() and z.numel() >= MIN_NUMEL
    passes = [Compiled(tp_ops._vocab_row_sums), Compiled(tp_ops._vocab_grad)]  # not yet run
    monkeypatch.setattr(tp_ops, "_row_sums", passes[0])
    monkeypatch.setattr(tp_ops, "_grad", passes[1])
    want = _reference(z, targets, 0.7, w_ent)
    got = _ours(z, targets, 0.7, w_ent)
    # both passes ran compiled: each built its compiled function and none fell back to eager
    assert all(p._compiled is not None and p.uses_compiled(z) for p in passes)
    inductor.set_enabled(False)
    eager = _ours(z, targets, 0.7, w_ent)
    for name, a, b, e in zip(("log_probs", "entropy", "grad"), got, want, eager):
        scale = max(1.0, float(b.abs().max()))
        # float32 over a 3K-term sum: ~1e-5 relative (exp's rounding and summation order)
        assert float((a.double() - b).abs().max()) <= 1e-4 * scale, name
        assert float((e.double() - b).abs().max()) <= 1e-4 * scale, name


def test_below_the_threshold_runs_eagerly(compile_on):
    calls = []

    def fn(x):
        calls.append(torch.compiler.is_compiling())
        return x * 2

    f = Compiled(fn)
    small = torch.ones(8)
    assert not f.uses_compiled(small)
    assert torch.equal(f(small), small * 2) and calls == [False]
    assert f.uses_compiled(torch.ones(MIN_NUMEL))
    inductor.set_enabled(False)
    assert not f.uses_compiled(torch.ones(MIN_NUMEL))


def test_a_failed_compile_warns_and_stays_eager(compile_on):
    def data_dependent(x):  # fullgraph=True cannot trace a Python branch on a tensor's value
        return x + 1 if float(x.sum()) > 0 else x - 1

    f = Compiled(data_dependent)
    x = torch.ones(MIN_NUMEL)
    with pytest.warns(RuntimeWarning, match="data_dependent"):
        out = f(x)
    assert torch.equal(out, x + 1)
    assert not f.uses_compiled(x)  # remembered: no second attempt


def test_out_of_memory_is_raised_not_turned_eager(compile_on, monkeypatch):
    """Running out of memory in compiled code is no compile failure: it propagates (the eager
    formula needs more memory still) and the function stays compiled."""
    def oom(*args):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: oom)
    f = Compiled(lambda x: x + 1)
    x = torch.ones(MIN_NUMEL)
    with pytest.raises(torch.OutOfMemoryError):
        f(x)
    assert f.uses_compiled(x)


def test_a_failed_compile_during_a_cuda_graph_capture_is_raised(compile_on, monkeypatch):
    """Inside a capture (a stand-in for CUDA's query here) the failure propagates: no eager
    work in a capture it may have invalidated, and the function is not given up on."""
    def broken(*args):
        raise RuntimeError("backend could not compile")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    def step(x):
        return x + 1

    f = Compiled(step)
    x = torch.ones(MIN_NUMEL)
    with pytest.raises(RuntimeError, match="backend could not compile"):
        f(x)
    assert f.uses_compiled(x) and step.__qualname__ not in inductor.fallbacks()
    capturing[0] = False  # outside a capture: the usual fallback
    with pytest.warns(RuntimeWarning, match="failed"):
        assert torch.equal(f(x), x + 1)
    assert not f.uses_compiled(x) and step.__qualname__ in inductor.fallbacks()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_compile_failing_inside_a_real_graph_capture_is_raised(compile_on):
    def data_dependent_step(x):  # fullgraph=True cannot trace a Python branch on a value
        return x + 1 if float(x.sum()) > 0 else x - 1

    f = Compiled(data_dependent_step, min_numel=0)
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(Exception):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            f(x)
    assert f.uses_compiled(x)
    with pytest.warns(RuntimeWarning, match="data_dependent_step"):
        assert torch.equal(f(x), x + 1)  # outside a capture: eager, as everywhere
    assert not f.uses_compiled(x)


def test_calls_past_the_recompile_limit_run_eagerly_and_are_counted(compile_on, monkeypatch):
    """Through inductor: with dynamo's limit at 2 variants, a third dtype is no compile but
    an eager call, counted by compile_counts() and named by fallbacks() (fullgraph=True makes
    dynamo raise at the limit, where it would otherwise run the frame eagerly unseen)."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)

    def variants(x):
        return x * 3 + 1

    f = Compiled(variants, min_numel=0, dynamic=None)
    name = variants.__qualname__
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(f(torch.ones(4, dtype=dtype)), torch.full((4,), 4, dtype=dtype))
    assert inductor.compile_counts()[name] == {"graphs": 2, "recompiles": 1, "eager_calls": 0,
                                               "failed": 0}
    assert name not in inductor.fallbacks()
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        assert torch.equal(f(torch.ones(4, dtype=torch.int64)), torch.full((4,), 4))
    f(torch.ones(4, dtype=torch.int32))  # past the limit again: eager, no second warning
    assert inductor.compile_counts()[name] == {"graphs": 2, "recompiles": 1, "eager_calls": 2,
                                               "failed": 0}
    assert name in inductor.fallbacks() and f.uses_compiled(torch.ones(4))


def test_environment_switch():
    code = "from engine import inductor; print(inductor.enabled())"
    env = dict(os.environ, HYBRIDFLOW_COMPILE="0")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "False"


def test_cache_is_keyed_by_cpu_capability_unless_the_user_chose_one(tmp_path):
    """The compile cache of each ATen capability (and CPU model) is its own directory under
    inductor's default; a directory the user set is kept as it is."""
    assert inductor.keyed_cache_dir("/c", "AVX512", "m") != inductor.keyed_cache_dir(
        "/c", "AVX2", "m") != inductor.keyed_cache_dir("/c", "AVX2", "n")
    code = ("import os, torch; from engine import inductor; inductor._key_the_cache(); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'], torch.backends.cpu.get_cpu_capability())")
    base = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    dirs = {}
    for capability in ("avx2", "default"):
        env = base | {"ATEN_CPU_CAPABILITY": capability, "TMPDIR": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        assert out[0].startswith(str(tmp_path)) and f"-{out[1].lower()}-" in out[0]
        dirs[capability] = out[0]
    assert dirs["avx2"] != dirs["default"]
    env = base | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == str(tmp_path / "mine")


def _swiglu_reference(gu: torch.Tensor, grad: torch.Tensor):
    """Autograd of the formula in float64: the output and the gradient of ``<out, grad>``."""
    from engine.mlp import swiglu_formula

    gu = gu.double().requires_grad_()
    out = swiglu_formula(gu)
    out.backward(grad.double())
    return out.detach(), gu.grad


@pytest.mark.parametrize("numel", [4 * 6 * 32 * 2, MIN_NUMEL * 2], ids=["eager", "compiled"])
def test_swiglu_node_matches_float64_autograd(compile_on, numel, monkeypatch):
    """engine.mlp.swiglu without the C++ kernel (one autograd node; compiled above the
    threshold) against autograd of the formula in float64: output and the interleaved
    gradient of gate and up."""
    from engine import cpu_ops, mlp

    monkeypatch.setattr(cpu_ops, "_kernels", None)  # the kernel: tests/test_swiglu_kernel.py

    g = torch.Generator().manual_seed(5)
    gu = torch.randn(4, numel // (4 * 32 * 2), 32, 2, generator=g) * 3
    grad = torch.randn(gu.shape[:-1], generator=g)
    want_out, want_grad = _swiglu_reference(gu, grad)
    x = gu.clone().requires_grad_()
    out = mlp.swiglu(x)
    out.backward(grad)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_SwiGLUBackward"
    assert mlp._compiled_swiglu.uses_compiled(gu) == (numel >= MIN_NUMEL)
    for a, b in ((out, want_out), (x.grad, want_grad)):
        assert float((a.double() - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))
    with torch.no_grad():  # inference: the same values, no node
        assert torch.equal(mlp.swiglu(gu), out.detach())
