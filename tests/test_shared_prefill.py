"""Shared prefill (engine.generation_io.distinct_prompts): identical prompts in a batch (the samples
of one prompt in GRPO) are prefilled once and their KV cache is copied to each sequence.

References that do not share the prefill: a direct loop for the row grouping, the cache-free
greedy loop of the training model for tokens and log-probs, the training model's full forward
for the log-probs of sampled tokens, and the single-process engine for TP and PP generation."""

from __future__ import annotations

import pytest
import torch

from engine.generation import GenerationEngine
from engine.generation_io import distinct_prompts
from engine.sampling import SamplingParams
from tests.near_ties import assert_clear_picks, assert_no_near_tie, step_logits
from tests.test_generation import loop_reference
from tests.test_generation_early_exit import CFG, QWEN, batch_of, engine, resharded

N_NEW = 12


def grouped_batch(distinct: int, samples: int, seed: int = 1):
    """``distinct`` left-padded prompts, each ``samples`` times, in a shuffled order."""
    ids, mask, _ = batch_of(distinct, seed=seed)
    order = torch.randperm(distinct * samples, generator=torch.Generator().manual_seed(seed))
    rows = torch.arange(distinct).repeat(samples)[order]
    return ids[rows], mask[rows], rows


def test_distinct_prompts_against_a_direct_loop():
    g = torch.Generator().manual_seed(0)
    for batch in (1, 2, 7, 16, 33):
        ids = torch.randint(0, 3, (batch, 3), generator=g)  # few values: many repeats
        mask = (torch.rand(batch, 3, generator=g) < 0.7).long()
        mask[:, -1] = 1
        ids = ids.masked_fill(mask == 0, 0)
        distinct, copies = distinct_prompts(ids, mask)
        firsts, slot_of = [], []
        for r in range(batch):  # first row of each prompt in batch order, slot of every row
            key = (ids[r].tolist(), mask[r].tolist())
            seen = [i for i, f in enumerate(firsts) if (ids[f].tolist(), mask[f].tolist()) == key]
            if not seen:
                firsts.append(r)
            slot_of.append(seen[0] if seen else len(firsts) - 1)
        assert distinct.tolist() == firsts
        if len(firsts) == batch:
            assert copies is None
        else:
            assert copies.tolist() == slot_of
    # the same ids under another padding are another prompt
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]])
    distinct, copies = distinct_prompts(ids, mask)
    assert distinct.tolist() == [0, 1] and copies.tolist() == [0, 1, 0]


@pytest.mark.parametrize("cfg, fused", [(CFG, False), (CFG, True), (QWEN, True)],
                         ids=["python", "kernels", "qwen2-kernels"])
def test_greedy_shared_prefill_matches_the_cache_free_loop(cfg, fused):
    model, eng = engine(cfg, fused, early_exit=True)
    if fused and not eng.fused_decode:
        pytest.skip("C++ kernels not built")
    ids, mask, rows = grouped_batch(5, 4)
    limits = torch.randint(1, N_NEW + 1, (ids.shape[0],),
                           generator=torch.Generator().manual_seed(7))
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=N_NEW, temperature=0.0),
                       max_new_tokens=limits)
    assert out.stats["prefill_rows"] == 5
    toks, lps, live = loop_reference(model, ids, mask, N_NEW, limits=limits)
    assert_no_near_tie(step_logits(model, torch.cat([ids, toks], 1), torch.cat([mask, live], 1),
                                   N_NEW), live)
    assert torch.equal(out.response_mask, live)
    assert torch.equal(out.responses, toks)
    torch.testing.assert_close(out.log_probs, lps, atol=1e-5, rtol=0)
    assert torch.equal(out.input_ids[:, :ids.shape[1]], ids)


@pytest.mark.parametrize("fused", [False, True], ids=["python", "kernels"])
def test_sampled_shared_prefill_log_probs_are_the_models(fused):
    """Every sampled token's log-prob is the training model's full-forward log-softmax at its
    position, and the samples of one prompt are drawn independently (they differ)."""
    model, eng = engine(CFG, fused, early_exit=True)
    if fused and not eng.fused_decode:
        pytest.skip("C++ kernels not built")
    ids, mask, rows = grouped_batch(4, 6, seed=3)
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=N_NEW, temperature=1.0, seed=2))
    assert out.stats["prefill_rows"] == 4
    plen = ids.shape[1]
    with torch.no_grad():
        hidden = model.stage_forward(out.input_ids, out.attention_mask)
        logp = torch.log_softmax(model.local_logits(hidden[:, plen - 1:-1]).float(), -1)
    want = logp.gather(-1, out.responses[..., None])[..., 0]
    torch.testing.assert_close(out.log_probs, want, atol=1e-5, rtol=0)
    for p in range(4):
        same_prompt = out.responses[rows == p]
        assert len({tuple(r) for r in same_prompt.tolist()}) > 1


TWO_RANK_MODES = {"greedy": SamplingParams(max_new_tokens=N_NEW, temperature=0.0),
                  "temp": SamplingParams(max_new_tokens=N_NEW, temperature=1.0, seed=1)}


def two_rank_case(rank: int, world_size: int, train: tuple, gen: tuple) -> dict:
    groups, resharder = resharded(train, gen)
    eng = GenerationEngine(CFG, groups)
    eng.load_weights(resharder)
    ids, mask, _ = grouped_batch(3, 4, seed=5)
    out = {}
    for mode, sp in TWO_RANK_MODES.items():
        out[mode] = eng.generate(ids, mask, sp)
    return out


@pytest.mark.parametrize("train, gen", [((1, 2, 1), (1, 2)), ((2, 1, 1), (2, 1))],
                         ids=["tp2", "pp2"])
def test_shared_prefill_on_two_ranks(pool2, train, gen):
    """TP and PP generation (the last stage samples from the copied rows; the others size
    the broadcast of the tokens by them) give the single-process engine's sequences: its
    tokens (its greedy picks and random draws have no near-tie for TP's other summation
    order to flip) and log-probs within float rounding."""
    results = pool2.run(two_rank_case, train, gen)
    single = two_rank_case(0, 1, (1, 1, 1), (1, 1))
    model, _ = engine(CFG, fused=False, early_exit=False)  # the weights two_rank_case reshards
    for mode, sp in TWO_RANK_MODES.items():
        want = single[mode]
        assert want.stats["prefill_rows"] == 3
        assert_clear_picks(model, want, sp)
        for r in results:
            assert torch.equal(r[mode].input_ids, want.input_ids), mode
            torch.testing.assert_close(r[mode].log_probs, want.log_probs, atol=1e-5, rtol=0)
            assert r[mode].stats["prefill_rows"] == 3
