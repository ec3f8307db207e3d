"""The whole-vocabulary sampler compiled (engine/sampling.py's ``_whole_vocab``, on by default
on CUDA) against the sampler the CPU runs (C++ kernels) and against SplitMix64 written with
Python integers; compiled here by inductor's CPU backend (Triton on a GPU).

Compiled and eager code round the softmax and the log of the uniforms differently in the last
bit, so a token may differ only where the reference's two best candidates are within a
relative :data:`TIE` of each other (the race's arrival times, or the greedy logits)."""

from __future__ import annotations

import pytest
import torch

from engine import inductor, sampling
from engine.generation import GenerationEngine
from engine.sampling import SamplingParams, SeedStream, sample_next, whole_vocab_formula
from tests.test_compiled_train import GROUPS
from tests.test_generation_early_exit import splitmix64_uniform
from tests.test_kv_cache import CFG, _model, _prompts

TIE = 1e-4


class Counted:
    """The compiled sampler, its calls counted."""

    def __init__(self, compiled):
        self.compiled, self.calls = compiled, 0

    def __call__(self, *args):
        self.calls += 1
        return self.compiled(*args)


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """The CPU dispatches to the compiled sampler, whatever the logits' size; compiling on
    whatever HYBRIDFLOW_COMPILE says, and no fallback by the end."""
    import torch._dynamo

    torch._dynamo.reset()
    previous = inductor.set_enabled(True)
    monkeypatch.setattr(sampling, "COMPILED_DEVICES", ("cpu",))
    monkeypatch.setattr(sampling._whole_vocab, "min_numel", 0)
    counted = Counted(sampling._whole_vocab)
    monkeypatch.setattr(sampling, "_whole_vocab", counted)
    yield counted
    inductor.set_enabled(previous)
    assert not counted.compiled._broken and counted.compiled._compiled is not None


def _race(z: torch.Tensor, seed: int, row_ids: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` float64 race values ``p_j / -log(u_j)`` (the pick is the largest)."""
    u = sampling.counter_uniforms_formula(seed, row_ids, z.shape[-1]).double()
    return torch.softmax(z.double(), -1) / -torch.log(u)


def _assert_equal_but_ties(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> None:
    """Tokens equal wherever the reference ``scores [R, V]``' two best are not within TIE."""
    top = scores.topk(2, dim=-1).values
    tie = (top[:, 0] - top[:, 1]).abs() <= TIE * top[:, 0].abs()
    assert torch.equal(got[~tie], want[~tie]), (got, want)
    assert float(tie.double().mean()) < 0.05


def test_counter_uniforms_compiled_from_a_seed_tensor_are_splitmix64():
    row_ids = torch.tensor([0, 3, 31, (1 << 31) + 7])
    fn = torch.compile(sampling.counter_uniforms_formula, fullgraph=True)
    for seed in (1, (1 << 63) - 1, 0x5DEECE66D << 20):
        want = torch.tensor([[splitmix64_uniform(seed, int(r), j) for j in range(50)]
                             for r in row_ids], dtype=torch.float64)
        got = fn(torch.tensor(seed), row_ids, 50)
        assert torch.equal(got.double(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_vocab_modes_compiled_match_the_cpu_sampler(compiled_on_cpu, dtype):
    """Greedy, top_k=1 at a temperature, and unfiltered draws (EOS banned or not, a subset
    of rows of a larger batch): tokens as the CPU's kernels pick them but at near-ties,
    log-probs within float32 rounding, the seed stream advanced alike."""
    g = torch.Generator().manual_seed(1)
    rows = torch.rand(40, generator=g) < 0.6
    logits = (torch.randn(int(rows.sum()), 300, generator=g) * 3).to(dtype)
    cases = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=1),
             SamplingParams(temperature=0.7, seed=11),
             SamplingParams(temperature=1.0, seed=12, eos_token_id=5, min_new_tokens=4)]
    for params in cases:
        for step in (0, 5):  # EOS banned at step 0 while min_new_tokens = 4
            ours, ref = SeedStream(params.seed), SeedStream(params.seed)
            with pytest.MonkeyPatch.context() as m:
                m.setattr(sampling, "COMPILED_DEVICES", ())
                want, want_lp = sample_next(logits, params, None, ref, rows, step)
            calls = compiled_on_cpu.calls
            got, got_lp = sample_next(logits, params, None, ours, rows, step)
            assert compiled_on_cpu.calls == calls + 1  # the compiled path ran
            assert ours.steps == ref.steps == (0 if params.greedy or params.top_k else 1)
            z = logits.float() / (params.temperature or 1.0)
            banned = params.banned_token(step)
            if banned is not None:
                z[:, banned] = float("-inf")
            seed = SeedStream(params.seed).next()
            scores = z.double() if params.greedy or params.top_k else _race(
                z, seed, torch.nonzero(rows).squeeze(1))
            _assert_equal_but_ties(got, want, scores)
            same = got == want
            torch.testing.assert_close(got_lp[same], want_lp[same], atol=2e-6, rtol=0)
            if banned is not None:
                assert not bool((got == banned).any())


def test_compiled_formula_equals_its_eager_self(compiled_on_cpu):
    """The function compiled and run eagerly on the same tensors (seed as a tensor)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(24, 500, generator=g) * 2
    row_ids = torch.arange(24) + 100
    for seed in (None, torch.tensor(77)):
        args = (logits, torch.tensor(0.9).reciprocal(), 7, seed,
                None if seed is None else row_ids)
        want, want_lp = whole_vocab_formula(*args)
        got, got_lp = compiled_on_cpu(*args)
        scores = (logits / 0.9).double() if seed is None else _race(logits / 0.9, 77, row_ids)
        scores[:, 7] = float("-inf")
        _assert_equal_but_ties(got, want, scores)
        torch.testing.assert_close(got_lp, want_lp, atol=2e-6, rtol=0)


def test_generation_with_the_compiled_sampler(compiled_on_cpu):
    """A sampled and a greedy call through the compiled sampler: the tokens of the default
    CPU sampler up to near-ties (every step compared until a row's first difference)."""
    model = _model(CFG)
    ids, mask = _prompts(12, 5, padded=True, repeat=True)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=10, temperature=temperature, seed=5)
        outs = {}
        for compiled in (False, True):
            with pytest.MonkeyPatch.context() as m:
                if not compiled:
                    m.setattr(sampling, "COMPILED_DEVICES", ())
                eng = GenerationEngine(CFG, GROUPS, fused_decode=False, kv_layout="dense")
                eng.set_weights(model.params)
                outs[compiled] = eng.generate(ids, mask, params)
            if compiled:
                assert compiled_on_cpu.calls >= params.max_new_tokens  # every step's pick
        equal = (outs[True].responses == outs[False].responses).cumprod(dim=1).bool()
        assert float(equal.double().mean()) > 0.9
        torch.testing.assert_close(outs[True].log_probs[equal], outs[False].log_probs[equal],
                                   atol=2e-5, rtol=0)


def test_a_clock_of_zero_never_draws_an_impossible_candidate(monkeypatch):
    """A uniform of exactly 1 gives the clock -log(1) = 0; a candidate of probability 0 (EOS
    banned here) with it must not win (0 / 0 would be NaN, which argmax picks), a candidate
    of probability > 0 with it rings first, in the eager draw and in the formula."""
    z = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    ones_at = {0: 3, 1: 2}  # row 0: banned token 3's uniform is 1; row 1: token 2's

    def uniforms(seed, row_ids, vocab):
        u = torch.full((row_ids.numel(), vocab), 0.5)
        for i, r in enumerate(row_ids.tolist()):
            u[i, ones_at[r]] = 1.0
        return u

    monkeypatch.setattr(sampling, "counter_uniforms_formula", uniforms)
    monkeypatch.setattr(sampling, "_kernels", None)
    assert float(sampling._clocks(torch.tensor([1.0]))) == sampling.MIN_CLOCK
    for row, want_not, want in ((0, 3, None), (1, None, 2)):
        ids = torch.tensor([row])
        banned = sampling._without(z, 3, 0)
        eager = int(sampling._draw(banned, SeedStream(1), first_row=row)[0, 0])
        formula = int(whole_vocab_formula(z, torch.tensor(1.0), 3, torch.tensor(5), ids)[0][0])
        for pick in (eager, formula):
            assert pick != want_not and (want is None or pick == want), (row, pick)


def test_the_eos_ban_builds_no_tensor_from_host_data():
    """The ban of a vocabulary slice's column (every decode step while EOS is banned) is a
    copy and a scalar fill on the logits' device: no index tensor made on the host and copied
    over (torch.tensor's lift_fresh), and the logits themselves untouched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    z = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    for token, start in ((7, 4), (4, 4), (13, 4)):  # first, inside and last column of a slice
        with Ops() as ops:
            got = sampling._without(z, token, start)
        assert ops.names == ["clone.default", "select.int", "fill_.Scalar"]
        want = z.clone()
        want[:, token - start] = float("-inf")
        assert torch.equal(got, want) and torch.isfinite(z).all()
    assert sampling._without(z, 3, 4) is z and sampling._without(z, 14, 4) is z
    assert sampling._without(z, None, 0) is z
