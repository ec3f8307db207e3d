"""Equal greedy tokens from two code paths: the margin that makes the equality hold on any CPU.

Two paths that compute the same logits with their sums in another order (a cached decode step
against a full forward, the C++ kernels against BLAS, TP ranks against one process, our layers
against transformers) agree to float32 rounding, and BLAS may round differently on another CPU
or at another batch size.  Their greedy picks are equal at every step whose two largest logits
are further apart than twice that disagreement, and may part where they are closer (a
near-tie).  A test that asserts equal greedy tokens across paths first checks with
:func:`assert_no_near_tie` that its reference has no near-tie, so that the equality rests on
the margin and not on one machine's rounding.  A sampled call (without top-p) is the same
kind of argmax, over the logits plus each candidate's random clock term, so its tokens are
checked the same way (:func:`assert_clear_draws`).
"""

from __future__ import annotations

import torch

from engine.sampling import SeedStream, clock_uniforms

MIN_GAP = 1e-4
"""Smallest gap between a step's two largest logits that a cross-path token equality relies
on: the paths' logits differ by float32 rounding, which the tests bound by 2e-5 where they
compare log-probs (twice that is 4e-5, so 2.5x to spare)."""


def step_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                new_tokens: int) -> torch.Tensor:
    """The logits ``[B, new_tokens, V]`` each generated token was picked from, by one full
    forward of the single-process ``model`` over the generated sequences (their last
    ``new_tokens`` columns are the responses)."""
    plen = input_ids.shape[1] - new_tokens
    with torch.no_grad():
        hidden = model.stage_forward(input_ids, attention_mask)
        return model.local_logits(hidden[:, plen - 1:-1]).float()


def assert_clear_picks(model, out, params) -> None:
    """No near-tie in the tokens of the generation ``out`` (a ``GenerationOutput``) under
    ``params`` (greedy, or sampled without top-p and with every row running every step),
    judged on the single-process ``model``'s logits: they are then every path's tokens."""
    new = out.responses.shape[1]
    logits = step_logits(model, out.input_ids, out.attention_mask, new)
    if params.greedy:
        assert_no_near_tie(logits, out.response_mask)
    else:
        assert_clear_draws(logits, out.responses, params.seed, params.temperature,
                           params.top_k)


def assert_clear_draws(logits: torch.Tensor, tokens: torch.Tensor, seed: int,
                       temperature: float, top_k: int = 0) -> None:
    """The sampled ``tokens [B, N]`` of a call without top-p (``SamplingParams(seed=seed,
    temperature=T, top_k=top_k)``, every row running every step) drawn from ``logits [B, N,
    V]`` are the exponential race's winners, and no near-tie could change them.

    engine.sampling._draw takes ``argmax_c z_c / T - log E_c`` over the candidates ``c`` (the
    vocabulary in order; with ``top_k`` the ``top_k`` largest logits in descending order),
    ``E_c`` the clock of row b's candidate c at that step.  A change of ``d`` in the logits
    moves each candidate's score (sorted values included) by at most ``d / T``, so the winning
    candidate holds while the two best scores are more than :data:`MIN_GAP` apart; with
    ``top_k`` its token also needs a logit apart from its neighbours' in the sorted order.
    """
    stream = SeedStream(seed)
    batch, steps, vocab = logits.shape
    width = top_k or vocab
    for i in range(steps):
        z = logits[:, i].double()
        clocks = clock_uniforms(stream, torch.arange(batch), width).double().log().neg()
        if top_k:
            z, ids = z.sort(dim=-1, descending=True)
        else:
            ids = torch.arange(vocab).expand(batch, -1)
        scores = z[:, :width] / temperature - clocks.log()  # [B, width]
        win = scores.argmax(-1, keepdim=True)
        assert torch.equal(ids.gather(1, win)[:, 0], tokens[:, i]), f"step {i}: not the race"
        assert_no_near_tie(scores[:, None])
        if top_k:  # the winner's logit against its neighbours in the sorted order
            inf = torch.full((batch, 1), float("inf"), dtype=z.dtype)
            around = torch.cat([inf, z, -inf], 1).gather(1, win + torch.arange(3))  # [B, 3]
            near = -around.diff(dim=1)
            assert float(near.min()) > MIN_GAP, (f"step {i}: a drawn token's logit is "
                                                 f"{float(near.min()):.2e} from a neighbour's")


def assert_no_near_tie(logits: torch.Tensor, live: torch.Tensor | None = None,
                       min_gap: float = MIN_GAP) -> None:
    """Every step's two largest logits (``logits [B, N, V]``; ``live [B, N]``: the steps that
    produced a token, default all) are more than ``min_gap`` apart."""
    top = logits.double().topk(2, dim=-1).values
    gaps = top[..., 0] - top[..., 1]  # [B, N]
    if live is not None:
        gaps = gaps.masked_fill(~live.bool(), float("inf"))
    row, step = divmod(int(gaps.argmin()), gaps.shape[1])
    assert float(gaps[row, step]) > min_gap, (
        f"near-tie at row {row}, step {step}: the two largest values are "
        f"{float(gaps[row, step]):.2e} apart (<= {min_gap}), so equal tokens across code "
        "paths are not guaranteed there; pick other data or compare up to near-ties")
