"""``SamplingParams.min_new_tokens`` / ``data.min_new_tokens``: EOS cannot be drawn before a
row has that many tokens.

References, none of them the code under test: transformers' ``generate(min_new_tokens=)``
(greedy tokens, and the raw logits for the log-probs), the renormalised distribution written
from its definition (:func:`tests.test_generation._expected_probs`) for ``sample_next``'s
draws, the same engine without the option (the exponential race: a row that would not have
drawn EOS draws the same tokens), ``early_exit=False``, and the single-process engine for TP
and PP ranks.  The weights make EOS likely: its ``lm_head`` row points along the mean final
hidden state, so unconstrained greedy ends most rows within two tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.generation import GenerationEngine
from engine.generation_io import GenerationOutput
from engine.llama_spec import init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams, SeedStream, sample_next
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests.test_generation import CFG, _expected_probs, hf_model, prompts
from tests.test_generation_early_exit import assert_same, assert_same_up_to_rounding

EOS = 53  # in the second half of the vocabulary: the second rank's slice with tp_g = 2
N_NEW, MIN_NEW, BATCH = 12, 5, 16
MODES = {
    "greedy": dict(temperature=0.0),
    "temp": dict(temperature=1.0, seed=5),
    "top_k": dict(temperature=0.9, top_k=6, top_p=0.9, seed=3),
    "top_p": dict(temperature=1.1, top_p=0.8, seed=4),
}


def params(mode: str, min_new: int = MIN_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=N_NEW, eos_token_id=EOS, min_new_tokens=min_new,
                          **(MODES[mode] | kw))


@pytest.fixture(scope="module")
def full() -> dict:
    """Seeded weights whose EOS head row is twice the mean row norm along the mean final
    (normed) hidden state of a greedy run."""
    weights = init_full_state_dict(CFG, seed=0, std=0.2)
    ids, mask = prompts(BATCH)
    out = hf_model(CFG, weights).generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
        pad_token_id=0, output_hidden_states=True, return_dict_in_generate=True)
    direction = torch.cat([h[-1][:, -1] for h in out.hidden_states]).mean(0)
    head = weights["lm_head"].clone()
    head[EOS] = 2 * head.norm(dim=1).mean() * direction / direction.norm()
    return weights | {"lm_head": head}


def engine(full: dict, fused: bool, early_exit: bool = True) -> GenerationEngine:
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, full)
    eng = GenerationEngine(CFG, groups, fused_decode=fused, early_exit=early_exit)
    if fused and not eng.fused_decode:
        pytest.skip("C++ kernels not built")
    eng.set_weights(model.params)  # views: they keep the flat buffer alive
    assert (eng.block_rows is not None) == fused  # the decode path under test
    return eng


def first_eos(responses: torch.Tensor) -> torch.Tensor:
    """``[B]`` position of each row's first EOS, N_NEW where there is none."""
    hit = responses == EOS
    return torch.where(hit.any(1), hit.int().argmax(1), N_NEW)


# Against transformers -------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["python", "kernels"])
@pytest.mark.parametrize("early_exit", [True, False], ids=["early_exit", "full_batch"])
def test_greedy_matches_transformers_min_new_tokens(full, fused, early_exit):
    hf = hf_model(CFG, full)
    ids, mask = prompts(BATCH)
    plen = ids.shape[1]
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
              pad_token_id=0, eos_token_id=EOS)
    free = first_eos(hf.generate(**kw)[:, plen:])
    assert int((free < MIN_NEW).sum()) >= BATCH // 2, free  # EOS would otherwise win early
    ref = hf.generate(**kw, min_new_tokens=MIN_NEW, output_logits=True, output_scores=True,
                      return_dict_in_generate=True)
    hf_resp = ref.sequences[:, plen:]
    out = engine(full, fused, early_exit).generate(ids, mask, params("greedy"))
    width = hf_resp.shape[1]
    assert torch.equal(out.responses[:, :width], hf_resp)
    assert bool((out.responses[:, width:] == 0).all())
    ends = first_eos(out.responses)
    assert int(ends.min()) == MIN_NEW  # EOS wins as soon as it may
    lengths = torch.clamp(ends + 1, max=N_NEW)
    assert torch.equal(out.response_mask.sum(1), lengths)
    # log-probs: of the raw (unmasked) logits; HF's processed scores differ by -log(1 - p_eos)
    raw = torch.stack([torch.log_softmax(x.float(), -1) for x in ref.logits], 1)
    processed = torch.stack([torch.log_softmax(x.float(), -1) for x in ref.scores], 1)
    real = out.response_mask[:, :width].bool()
    pick = hf_resp.unsqueeze(-1)
    want = torch.gather(raw, -1, pick).squeeze(-1)
    # within the float32 rounding bound of cross-path log-probs (tests/near_ties.py)
    torch.testing.assert_close(out.log_probs[:, :width][real], want[real], atol=2e-5, rtol=0)
    gap = torch.gather(processed, -1, pick).squeeze(-1) - want
    p_eos = raw[..., EOS].exp()
    torch.testing.assert_close(gap[:, :MIN_NEW], -torch.log1p(-p_eos[:, :MIN_NEW]),
                               atol=1e-4, rtol=1e-3)  # float32 1 - p_eos near p_eos = 1
    assert float(p_eos[:, 0].max()) > 0.5


# sample_next: the distribution ----------------------------------------------------------------
@pytest.mark.parametrize("t, k, p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 1.0),
                                     (1.3, 0, 0.6), (0.8, 4, 0.7)])
def test_draws_follow_the_renormalised_distribution(t, k, p):
    z = torch.tensor([2.0, 1.5, 2.4, 0.3, -0.5, 0.0, 1.0, -2.0])  # EOS = 2, the most likely
    rows, eos = 20000, 2
    sp = SamplingParams(max_new_tokens=4, temperature=t, top_k=k, top_p=p, eos_token_id=eos,
                        min_new_tokens=2)
    log_softmax = torch.log_softmax(z / (t or 1.0), 0)
    for step in range(3):
        tok, lp = sample_next(z.expand(rows, -1), sp, None, SeedStream(step),
                              step=step)
        masked = z.clone()
        if step < 2:
            masked[eos] = float("-inf")  # HF: min-new-tokens first, then temperature, top-k, top-p
        if t == 0:
            assert bool((tok == int(masked.argmax())).all())
        else:
            want = _expected_probs(masked, t, k, p)
            freq = torch.bincount(tok, minlength=len(z)).double() / rows
            assert bool((freq[want == 0] == 0).all()), (step, freq, want)
            torch.testing.assert_close(freq, want, atol=0.015, rtol=0)
        assert bool((tok == eos).any()) == (step >= 2)
        torch.testing.assert_close(lp, log_softmax[tok], atol=1e-6, rtol=0)  # unmasked


def test_bad_min_new_tokens():
    for bad in (-1, N_NEW + 1, True, 1.5):
        with pytest.raises(ValueError, match=f"min_new_tokens={bad!r}"):
            SamplingParams(max_new_tokens=N_NEW, temperature=0.0, min_new_tokens=bad)
    # no EOS: nothing to mask
    z = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(max_new_tokens=N_NEW, temperature=0.0, min_new_tokens=N_NEW)
    tok, _ = sample_next(z, sp, None, None, step=0)
    assert torch.equal(tok, z.argmax(-1))


# One process: sampled rows, early exit, the exponential race ---------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["python", "kernels"])
@pytest.mark.parametrize("mode", list(MODES))
def test_early_exit_keeps_the_results_and_rows_are_long_enough(full, fused, mode):
    on, off = engine(full, fused, True), engine(full, fused, False)
    ids, mask = prompts(BATCH)
    g = torch.Generator().manual_seed(7)
    limits = torch.randint(1, N_NEW + 1, (BATCH,), generator=g)  # some below MIN_NEW
    for lim in (None, limits):
        a, b = on.generate(ids, mask, params(mode), lim), off.generate(ids, mask, params(mode), lim)
        if fused:  # fixed-tree sums: bit-equal
            assert_same(a, b)
        else:  # BLAS rows: within rounding, and bitwise repeatable
            assert_same_up_to_rounding(a, b, CFG, params(mode).greedy, full)
            assert_same(a, on.generate(ids, mask, params(mode), lim))
        cap = torch.full((BATCH,), N_NEW) if lim is None else lim
        ends = first_eos(a.responses)
        assert bool((ends >= torch.clamp(cap, max=MIN_NEW)).all()), (ends, cap)
        lengths = a.response_mask.sum(1)
        assert bool((lengths >= torch.clamp(cap, max=MIN_NEW)).all())
        assert bool((lengths == torch.minimum(cap, ends + 1)).all())
    assert a.stats["compactions"] >= 1 and b.stats["compactions"] == 0


@pytest.mark.parametrize("fused", [False, True], ids=["python", "kernels"])
def test_sampled_rows_never_end_early_and_otherwise_draw_the_same(full, fused):
    """Over many seeds: no EOS before MIN_NEW in any row, EOS reachable after it; a row that
    would not have drawn EOS before MIN_NEW without the option draws the same tokens (the
    unfiltered draw is an exponential race, unchanged by removing a losing candidate)."""
    eng = engine(full, fused, early_exit=False)
    ids, mask = prompts(BATCH)
    early = after = same_rows = 0
    for seed in range(12):
        free = eng.generate(ids, mask, params("temp", min_new=0, seed=seed))
        got = eng.generate(ids, mask, params("temp", seed=seed))
        f_end, g_end = first_eos(free.responses), first_eos(got.responses)
        assert int(g_end.min()) >= MIN_NEW, (seed, g_end)
        early += int((f_end < MIN_NEW).sum())
        after += int((g_end < N_NEW).sum())
        for b in range(BATCH):
            upto = int(f_end[b]) if f_end[b] < MIN_NEW else N_NEW
            same_rows += upto == N_NEW
            assert torch.equal(got.responses[b, :upto], free.responses[b, :upto]), (seed, b)
            assert torch.equal(got.log_probs[b, :upto], free.log_probs[b, :upto])
    assert early > BATCH * 12 // 2 and after > 0 and same_rows > 0, (early, after, same_rows)


# Two ranks: TP (EOS in one rank's slice) and PP ----------------------------------------------
def two_rank_case(rank: int, world_size: int, full: dict, train: tuple, gen: tuple,
                  fused: bool) -> dict:
    from hybridflow_comm.reshard import Resharder

    layout = HybridLayout(ParallelLayout(*train), *gen)
    groups = build_hybrid_groups(layout, pool=list(range(layout.world_size)))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, full)
    resharder = Resharder(model.specs, groups, buffer=model.buffer)
    resharder.to_generation()
    ids, mask = prompts(BATCH)
    out = {}
    for flag in (True, False):
        eng = GenerationEngine(CFG, groups, fused_decode=fused, early_exit=flag)
        eng.load_weights(resharder)
        out["path"] = eng.paths.decode.name
        for mode in MODES:
            o = eng.generate(ids, mask, params(mode))
            out[mode, flag] = (o.input_ids, o.attention_mask, o.log_probs)
    return out


@pytest.mark.parametrize("train, gen, fused", [((1, 2, 1), (1, 2), True),
                                               ((1, 2, 1), (1, 2), False),
                                               ((2, 1, 1), (2, 1), True)],
                         ids=["tp2-kernels", "tp2-python", "pp2-kernels"])
def test_two_ranks(pool2, full, train, gen, fused):
    if fused and not GenerationEngine(CFG, build_hybrid_groups(HybridLayout(
            ParallelLayout(1, 1, 1), 1, 1))).fused_decode:
        pytest.skip("C++ kernels not built")
    results = pool2.run(two_rank_case, full, train, gen, fused)
    ids, mask = prompts(BATCH)
    ref = engine(full, fused).generate(ids, mask, params("greedy"))
    plen = ids.shape[1]
    for mode in MODES:
        base = results[0][mode, False]
        for r in results:  # every rank alike
            for flag in (True, False):
                for x, y in zip(r[mode, flag], results[0][mode, flag]):
                    assert torch.equal(x, y), (mode, flag, r["path"])
        on, off = (GenerationOutput(input_ids=o[0], attention_mask=o[1], log_probs=o[2],
                                    prompt_length=plen) for o in (results[0][mode, True], base))
        if fused:  # both early-exit settings bit-equal on the kernels, within rounding on BLAS
            assert_same(on, off)
        else:
            assert_same_up_to_rounding(on, off, CFG, params(mode).greedy, full)
        assert int(first_eos(base[0][:, plen:]).min()) >= MIN_NEW, mode
        assert int((base[0][:, plen:] == EOS).sum()) > 0, mode  # reachable after MIN_NEW
    got_ids, got_mask, got_lp = results[0]["greedy", True]
    assert torch.equal(got_ids, ref.input_ids) and torch.equal(got_mask, ref.attention_mask)
    torch.testing.assert_close(got_lp, ref.log_probs, atol=2e-5, rtol=0)


# The run config -------------------------------------------------------------------------------
def test_config_validates_and_reaches_rollouts_only():
    from rlhf.builders import sampling_of
    from rlhf.config import DataConfig, load_config

    for bad in (-1, 7, True):
        with pytest.raises(ValueError, match=rf"min_new_tokens={bad!r}.*max_response_len=6"):
            DataConfig(max_response_len=6, min_new_tokens=bad)
    cfg = load_config(["algo=grpo", "data.max_response_len=6", "data.min_new_tokens=4"])
    assert cfg.data.min_new_tokens == 4

    class Tok:
        eos_id, pad_id = 2, 0

    assert sampling_of(cfg, 3, Tok()).min_new_tokens == 4
    assert sampling_of(cfg, 3, Tok(), greedy=True).min_new_tokens == 4  # ReMax's baseline
    assert sampling_of(cfg, 3, Tok(), evaluation=True).min_new_tokens == 0
    assert sampling_of(cfg, 3, Tok(), greedy=True, evaluation=True).min_new_tokens == 0
    with pytest.raises(ValueError, match="min_new_tokens=9"):
        load_config(["algo=grpo", "data.max_response_len=6", "data.min_new_tokens=9"])
