"""engine._kernels.argmax_logsumexp (csrc/engine/vocab_rows.cpp: the greedy choice and the
log-normaliser of next-token logits) against direct computations, and engine.sampling's greedy
and top-k = 1 steps on it against the tensor-op path they replace."""

from __future__ import annotations

import math

import pytest
import torch

from engine import sampling
from engine.sampling import SamplingParams, sample_next

_kernels = pytest.importorskip("engine._kernels")


def first_argmax(row: torch.Tensor, banned: int) -> int:
    """Lowest column holding the largest value among the columns but ``banned`` (NaNs never;
    the first allowed column when every allowed one is NaN)."""
    best, arg = -float("inf"), None
    for j, x in enumerate(row.tolist()):
        if j != banned and not math.isnan(x) and (arg is None or x > best):
            best, arg = x, j
    return arg if arg is not None else (1 if banned == 0 else 0)


@pytest.mark.parametrize("vocab", [2, 7, 33, 64, 1000, 8192])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_direct_loop_and_float64(vocab, threads):
    gen = torch.Generator().manual_seed(vocab + threads)
    rows = 12
    z = torch.randn(rows, vocab, generator=gen) * 4
    z[1] = z[1].round()  # many ties: the first maximum wins
    z[2, vocab // 2] = z[2].max() + 1  # the maximum banned below: the runner-up wins
    z[3, -1] = -float("inf")  # a column that can never be chosen
    z[4] = 0.0  # all equal
    z[5, 1::3] = float("nan")  # NaNs are never chosen (a vector's lanes and the tail)
    z[6] = -float("inf")  # nothing above -inf: the first allowed column
    z[7] = 0.0
    z[7, ::2] = -0.0  # signed zeros tie
    z[8, -1] = z[8].max() + 1  # the maximum in the last column (past every whole vector)
    z[9, vocab // 2:] = z[9, :vocab - vocab // 2].clone()  # the maximum twice: the first wins
    z[10, [vocab // 3, -1]] = float("inf")  # +inf twice: the first
    z[11] = float("nan")  # nothing to choose: the first allowed column
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for banned in (-1, 0, vocab // 2, vocab - 1):
            arg, best, lse = _kernels.argmax_logsumexp(z, banned)
            want_lse = torch.logsumexp(z.double(), dim=-1)
            for r in range(rows):
                want = first_argmax(z[r], banned)
                assert arg[r].item() == want, (r, banned)
                if z[r, want].isnan():
                    assert best[r].isnan()
                else:  # the same bits, the sign of a zero included
                    assert best[r:r + 1].view(torch.int32) == z[r, want:want + 1].view(torch.int32)
            ok = ~z.isnan().any(1) & ~z.isposinf().any(1) & (z > -float("inf")).any(1)  # finite
            torch.testing.assert_close(lse[ok], want_lse[ok], rtol=0, atol=2e-6)
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


@pytest.mark.parametrize("row_lanes", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_greedy_head_is_the_three_calls_it_replaces(rows, threads, row_lanes):
    """``greedy_head`` (norm, LM head and greedy choice in one parallel region) against
    rms_norm_forward, small_linear (in the same product form) and argmax_logsumexp called in
    turn: the same tokens and the same log-prob bits, with and without a banned column (3
    threads at 1 row: threads without rows), and a log-prob within float rounding of a
    float64 log_softmax."""
    gen = torch.Generator().manual_seed(rows * 10 + threads)
    hidden, vocab, eps = 48, 1001, 1e-6
    x = torch.randn(rows, hidden, generator=gen) * 2
    norm = 1 + 0.1 * torch.randn(hidden, generator=gen)
    table = torch.randn(vocab + 3, hidden, generator=gen) / hidden ** 0.5
    head = table[3:]  # a view with a row offset, as a tied embedding slice would be
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for banned in (-1, 0, 17):
            tok, lp = _kernels.greedy_head(x, norm, eps, head, banned, row_lanes=row_lanes)
            h, _ = _kernels.rms_norm_forward(x, norm, eps)
            logits = _kernels.small_linear(h, head, row_lanes=row_lanes)
            arg, best, lse = _kernels.argmax_logsumexp(logits, banned)
            assert torch.equal(tok, arg)
            assert torch.equal(lp, (best.double() - lse).float())
            want = torch.log_softmax(logits.double(), dim=-1).gather(1, tok[:, None])[:, 0]
            torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)
            if banned >= 0:
                assert (tok != banned).all()
    finally:
        torch.set_num_threads(before)


def test_greedy_head_rejects_bad_arguments():
    x, norm, head = torch.randn(2, 8), torch.ones(8), torch.randn(20, 8)
    with pytest.raises(RuntimeError, match="banned column 20"):
        _kernels.greedy_head(x, norm, 1e-6, head, 20)
    with pytest.raises(RuntimeError, match=r"head \[V > 0, H\] with unit inner stride"):
        _kernels.greedy_head(x, norm, 1e-6, head[:, :7], -1)
    with pytest.raises(RuntimeError, match=r"unit inner stride"):
        _kernels.greedy_head(x, norm, 1e-6, torch.randn(8, 20).t(), -1)
    with pytest.raises(RuntimeError, match=r"norm_weight \[H\]"):
        _kernels.greedy_head(x, norm[:7], 1e-6, head, -1)
    with pytest.raises(RuntimeError, match="float32"):
        _kernels.greedy_head(x.double(), norm, 1e-6, head, -1)
