"""engine._kernels.argmax_logsumexp (csrc/engine/vocab_rows.cpp: the greedy choice and the
log-normaliser of next-token logits) against direct computations, and engine.sampling's greedy
and top-k = 1 steps on it against the tensor-op path they replace."""

from __future__ import annotations

import pytest
import torch

from engine import sampling
from engine.sampling import SamplingParams, sample_next

_kernels = pytest.importorskip("engine._kernels")


def first_argmax(row: torch.Tensor, banned: int) -> int:
    """Lowest column holding the largest value among the columns but ``banned``."""
    best, arg = -float("inf"), None
    for j, x in enumerate(row.tolist()):
        if j != banned and (arg is None or x > best):
            best, arg = x, j
    return arg


@pytest.mark.parametrize("vocab", [2, 7, 33, 64, 1000, 8192])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_direct_loop_and_float64(vocab, threads):
    gen = torch.Generator().manual_seed(vocab + threads)
    rows = 9
    z = torch.randn(rows, vocab, generator=gen) * 4
    z[1] = z[1].round()  # many ties: the first maximum wins
    z[2, vocab // 2] = z[2].max() + 1  # the maximum banned below: the runner-up wins
    z[3, -1] = -float("inf")  # a column that can never be chosen
    z[4] = 0.0  # all equal
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for banned in (-1, 0, vocab // 2, vocab - 1):
            arg, best, lse = _kernels.argmax_logsumexp(z, banned)
            want_lse = torch.logsumexp(z.double(), dim=-1)
            for r in range(rows):
                want = first_argmax(z[r], banned)
                assert arg[r].item() == want, (r, banned)
                assert best[r].item() == z[r, want].item()
            torch.testing.assert_close(lse, want_lse, rtol=0, atol=2e-6)
    finally:
        torch.set_num_threads(before)


def test_bad_arguments_raise():
    z = torch.randn(3, 5)
    with pytest.raises(RuntimeError, match="banned column 5"):
        _kernels.argmax_logsumexp(z, 5)
    with pytest.raises(RuntimeError, match=r"\[R, V > 0\]"):
        _kernels.argmax_logsumexp(z[0], -1)
    with pytest.raises(RuntimeError, match="float32"):
        _kernels.argmax_logsumexp(z.double(), -1)
    with pytest.raises(RuntimeError, match="only one"):
        _kernels.argmax_logsumexp(z[:, :1], 0)


@pytest.mark.parametrize("params, step", [
    (SamplingParams(temperature=0.0), 0),
    (SamplingParams(temperature=0.0, eos_token_id=3, min_new_tokens=2), 1),  # EOS banned
    (SamplingParams(temperature=0.7, top_k=1), 0)])
def test_sampler_steps_agree_with_the_tensor_ops(params, step, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 50, generator=gen) * 3
    logits[:, 3] = logits.max() + 1  # EOS is everyone's argmax
    tok, lp = sample_next(logits, params, None, None, step=step)
    monkeypatch.setattr(sampling, "_kernels", None)
    want_tok, want_lp = sample_next(logits, params, None, None, step=step)
    assert torch.equal(tok, want_tok)
    banned = params.banned_token(step) is not None
    assert ((tok != 3) if banned else (tok == 3)).all()
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
