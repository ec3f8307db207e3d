"""Single-process tests of the generation engine: transformers' generate, a cache-free loop
reference, sampling rules, determinism, bad input, the KV cache's sizing, reuse, growth and
release, and storage identity of the weights with the resharded flat buffer."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.generation import GenerationEngine
from engine.hf_interop import config_to_hf, full_to_hf_state_dict
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams, SeedStream, sample_next
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder
from tests.near_ties import assert_no_near_tie, step_logits

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)
STD = 0.2  # large enough that greedy continuations are not one repeated token


def prompts(batch: int = 4, plen: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths plen, plen-1, ..., padding id 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CFG.vocab_size, (batch, plen), generator=g)
    mask = torch.ones(batch, plen, dtype=torch.long)
    for b in range(batch):
        mask[b, :b % plen] = 0
    return ids.masked_fill(mask == 0, 0), mask


def build(cfg: LlamaConfig = CFG, seed: int = 0):
    """Model, resharder (layout 1,1,1 in generation mode) and engine on its views."""
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    full = init_full_state_dict(cfg, seed=seed, std=STD)
    load_full_state_dict(model, full)
    resharder = Resharder(model.specs, groups, buffer=model.buffer)
    resharder.to_generation()
    eng = GenerationEngine(cfg, groups)
    eng.load_weights(resharder)
    return model, full, resharder, eng


def hf_model(cfg: LlamaConfig, full: dict):
    import transformers

    hf = transformers.LlamaForCausalLM(config_to_hf(cfg)).eval()
    sd = full_to_hf_state_dict(full, llama_shard_specs(cfg, 1))
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_matches_transformers_generate(tied):
    cfg = LlamaConfig(**(CFG.__dict__ | {"tie_word_embeddings": tied}))
    model, full, _, eng = build(cfg)
    hf = hf_model(cfg, full)
    ids, mask = prompts(seed=5)  # no near-tie on either model
    n = 12
    first = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                        pad_token_id=0)
    eos = int(first[0, ids.shape[1] + 4])  # ends row 0 after 5 tokens (maybe others earlier)
    hf_out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=eos, output_scores=True,
                         return_dict_in_generate=True)
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=n, eos_token_id=eos,
                                                 temperature=0.0))
    hf_resp = hf_out.sequences[:, ids.shape[1]:]
    width = hf_resp.shape[1]
    at_eos = (hf_resp == eos).long()
    assert_no_near_tie(torch.stack(hf_out.scores, 1), at_eos.cumsum(1) - at_eos == 0)
    assert torch.equal(out.responses[:, :width], hf_resp)  # HF stops when every row ended
    assert bool((out.responses[:, width:] == 0).all()) and out.stats["forward_steps"] == width
    # the response mask covers each row up to and including its EOS
    assert out.response_mask[0].tolist() == [1] * 5 + [0] * (n - 5)
    for b in range(ids.shape[0]):
        row = hf_resp[b].tolist()
        length = row.index(eos) + 1 if eos in row else n
        assert out.response_mask[b].tolist() == [1] * length + [0] * (n - length)
    hf_lp = torch.stack([torch.log_softmax(s.float(), -1) for s in hf_out.scores], 1)
    hf_lp = torch.gather(hf_lp, -1, hf_resp.unsqueeze(-1)).squeeze(-1)
    real = out.response_mask[:, :width].bool()
    torch.testing.assert_close(out.log_probs[:, :width][real], hf_lp[real], atol=1e-5, rtol=0)
    assert bool((out.log_probs[out.response_mask == 0] == 0).all())
    assert torch.equal(out.input_ids[:, :ids.shape[1]], ids)
    assert torch.equal(out.attention_mask[:, :ids.shape[1]], mask)


def loop_reference(model: ParallelLlama, ids, mask, n: int, limits=None, eos=None):
    """Greedy without a KV cache: the training model's full forward on the whole sequence."""
    seq, m = ids.clone(), mask.clone()
    alive = torch.ones(ids.shape[0], dtype=torch.bool)
    toks, lps, live = [], [], []
    for i in range(n):
        with torch.no_grad():
            hidden = model.stage_forward(seq, m)
            logp = torch.log_softmax(model.local_logits(hidden[:, -1]).float(), -1)
        tok = logp.argmax(-1)
        toks.append(torch.where(alive, tok, 0))
        lps.append(torch.where(alive, logp.gather(-1, tok[:, None])[:, 0], 0.0))
        live.append(alive.long())
        if eos is not None:
            alive = alive & (tok != eos)
        if limits is not None:
            alive = alive & (limits > i + 1)
        seq = torch.cat([seq, tok[:, None]], 1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
    return torch.stack(toks, 1), torch.stack(lps, 1), torch.stack(live, 1)


def test_greedy_matches_cache_free_loop_with_limits():
    model, _, _, eng = build()
    ids, mask = prompts(batch=5, plen=6, seed=3)
    limits = torch.tensor([10, 3, 7, 1, 10])
    toks, lps, live = loop_reference(model, ids, mask, 10, limits=limits)
    ref_ids, ref_mask = torch.cat([ids, toks], 1), torch.cat([mask, live], 1)
    assert_no_near_tie(step_logits(model, ref_ids, ref_mask, 10), live)
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=10,
                                                 temperature=0.0), max_new_tokens=limits)
    assert torch.equal(out.response_mask, live)
    assert torch.equal(out.responses, toks)
    torch.testing.assert_close(out.log_probs, lps, atol=1e-5, rtol=0)


def test_seeded_sampling_is_deterministic_and_respects_top_k():
    _, _, _, eng = build()
    ids, mask = prompts()
    sp = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=5, top_p=0.9, seed=7)
    a = eng.generate(ids, mask, sp)
    b = eng.generate(ids, mask, sp)
    c = eng.generate(ids, mask, SamplingParams(**{**sp.__dict__, "seed": 8}))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.responses, c.responses)
    greedy = eng.generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert not torch.equal(a.responses, greedy.responses)


def _expected_probs(z: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """Sampling distribution written from the definitions (float64, one row)."""
    z = z.double() / t
    order = sorted(range(len(z)), key=lambda i: -float(z[i]))
    keep = order[:k] if k else order
    probs = torch.softmax(z[keep], 0)
    kept, mass = [], 0.0
    for i, q in zip(keep, probs.tolist()):
        if mass >= p:
            break
        kept.append(i)
        mass += q
    out = torch.zeros_like(z)
    out[kept] = torch.softmax(z[kept], 0)
    return out


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6),
                                     (0.8, 4, 0.7)])
def test_sampling_distribution(t, k, p):
    z = torch.tensor([2.0, 1.5, 1.4, 0.3, -0.5, 0.0, 1.0, -2.0])
    rows = 20000
    sp = SamplingParams(temperature=t, top_k=k, top_p=p)
    tok, lp = sample_next(z.expand(rows, -1), sp, None, SeedStream(0))
    want = _expected_probs(z, t, k, p)
    freq = torch.bincount(tok, minlength=len(z)).double() / rows
    assert bool((freq[want == 0] == 0).all()), (freq, want)
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)
    # the log-prob of the sampled distribution before truncation: softmax(z / t)
    torch.testing.assert_close(lp, torch.log_softmax(z / t, 0)[tok], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs, word", [
    (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"),
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_k=-2), "top_k=-2"),
])
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**({"temperature": 0.0} | kwargs))


def test_bad_prompts_raise_before_work():
    _, _, _, eng = build()
    ids, mask = prompts()
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        eng.generate(ids, mask, SamplingParams(max_new_tokens=60, temperature=0.0))
    right = mask.flip(1)
    with pytest.raises(ValueError, match="left-padded"):
        eng.generate(ids, right)
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        eng.generate(ids + 100, mask)
    with pytest.raises(ValueError, match="eos_token_id=200"):
        eng.generate(ids, mask, SamplingParams(eos_token_id=200, temperature=0.0))
    with pytest.raises(ValueError, match="attention_mask shape"):
        eng.generate(ids, mask[:, 1:])
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        eng.generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=0.0),
                     max_new_tokens=torch.tensor([1, 2, 5, 1]))


def test_kv_cache_sized_kept_grown_and_released():
    """The engine allocates its KV cache once: a second call of the same sizes, and a smaller
    one, reuse the storage (same tokens as a fresh engine); a larger call grows it (the old
    storage freed); release() drops it, unless the engine keeps it."""
    model, _, resharder, eng = build()
    greedy = SamplingParams(max_new_tokens=9, temperature=0.0)
    ids, mask = prompts(batch=3, plen=5)
    out = eng.generate(ids, mask, greedy)
    # 2 layers * 3 rows * 2 kv heads * 16 dims * 4 bytes * positions: (5 + 9 - 1) of V, and of
    # K one tile of KEY_TILE (64) positions
    assert out.stats["kv_cache_bytes"] == 2 * 3 * 2 * 16 * 4 * (13 + 64)
    assert out.stats["kv_cache_bytes"] == eng.kv_cache_bytes(3, 5, 9) == eng.memory.nbytes
    cache = eng.memory.cache
    ptr, storage = cache.k.data_ptr(), weakref.ref(cache.k.untyped_storage())
    again = eng.generate(ids, mask, greedy)
    assert eng.memory.cache is cache and cache.k.data_ptr() == ptr
    assert torch.equal(again.input_ids, out.input_ids)
    assert torch.equal(again.log_probs, out.log_probs)
    small_ids, small_mask = prompts(batch=2, plen=4, seed=3)
    small = eng.generate(small_ids, small_mask, greedy)
    assert eng.memory.cache is cache and cache.k.data_ptr() == ptr
    fresh = GenerationEngine(CFG, model.groups)
    fresh.load_weights(resharder)
    assert torch.equal(small.input_ids, fresh.generate(small_ids, small_mask, greedy).input_ids)
    big_ids, big_mask = prompts(batch=5, plen=7, seed=4)
    longer = SamplingParams(max_new_tokens=12, temperature=0.0)
    big = eng.generate(big_ids, big_mask, longer)
    assert eng.memory.cache is not cache and eng.memory.nbytes == eng.kv_cache_bytes(5, 7, 12)
    del cache
    gc.collect()
    assert storage() is None  # the smaller storage went when the larger one came
    want = fresh.generate(big_ids, big_mask, longer)
    assert torch.equal(big.input_ids, want.input_ids)
    assert torch.equal(big.log_probs, want.log_probs)
    storage = weakref.ref(eng.memory.cache.k.untyped_storage())
    eng.release()
    gc.collect()
    assert eng.memory.cache is None and storage() is None
    kept = GenerationEngine(CFG, model.groups, keep_cache=True)
    kept.load_weights(resharder)
    first = kept.generate(ids, mask, greedy)
    cache = kept.memory.cache
    kept.release()
    kept.load_weights(resharder)
    assert kept.memory.cache is cache
    assert torch.equal(kept.generate(ids, mask, greedy).input_ids, first.input_ids)
    assert kept.memory.cache is cache


def test_weights_are_views_of_the_flat_buffer():
    model, _, resharder, eng = build()
    storage = resharder.buffer.storage(torch.float32)
    lo = storage.data_ptr()
    hi = lo + storage.numel() * storage.element_size()
    for name in eng.required_weights():
        w = eng.weights[name]
        assert w.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr(), name
        assert lo <= w.data_ptr() < hi, name
        assert w.data_ptr() == resharder.buffer.gen_view(name).data_ptr(), name
    # an in-place change of the buffer is seen by the next generation (no hidden copy)
    ids, mask = prompts()
    before = eng.generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=0.0))
    with torch.no_grad():
        model.params["norm"].mul_(-1.0)
    after = eng.generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert not torch.equal(before.log_probs, after.log_probs)
    eng.release()
    with pytest.raises(RuntimeError, match="no generation weights"):
        eng.generate(ids, mask)


def test_unfiltered_sampling_without_tp_equals_the_gathered_path():
    """Without TP and without top-k/top-p, sample_next draws directly; same tokens and
    log-probs as the general path (sample the softmax of the candidates divided by the
    temperature, log-prob against their float64 normaliser, which the sampler sums in float32
    after the row maximum: within 1e-6), written out here with the same generator state."""
    from engine.sampling import _filter_and_sample

    z = torch.randn(64, 37, generator=torch.Generator().manual_seed(3)) * 2
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, seed=5)
        tok, lp = sample_next(z, params, None, SeedStream(5))
        ids = torch.arange(z.shape[-1]).expand_as(z)
        scaled = z / temperature
        ref_tok, ref_z = _filter_and_sample(scaled, ids, params, SeedStream(5))
        ref_lp = (ref_z.double() - torch.logsumexp(scaled.double(), dim=-1)).float()
        assert torch.equal(tok, ref_tok)
        torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)


def test_random_streams_of_steps_and_replicas_never_coincide():
    """Every (run seed, step, replica) gets its own stream: the rollout seed of a step and each
    generation replica's seed derived from it are all distinct (the former seed + step +
    replica gave replica r at step s the stream of replica r - 1 at step s + 1)."""
    from engine.sampling import derive_seed

    streams = {}
    for seed in range(3):
        for step in range(200):
            rollout = derive_seed(seed, "rollout", step)
            for replica in range(16):
                key = derive_seed(rollout, "replica", replica)
                assert key not in streams, ((seed, step, replica), streams.get(key))
                assert 0 <= key < 2**63
                streams[key] = (seed, step, replica)
    old = {seed * 1_000_003 + step + replica for seed in range(3) for step in range(200)
           for replica in range(16)}
    assert len(old) < 3 * 200 * 16  # what the old formula did
    assert derive_seed(0, "rollout", 1) == derive_seed(0, "rollout", 1)  # a pure function


def test_seed_streams_use_all_63_bits_over_4096_steps_and_64_replicas():
    """The streams of 4,096 rollout steps x 64 replicas all start with distinct step seeds, and
    the pairs whose seeds agree in their low 32 bits (what a ``torch.Generator`` keeps, so
    they drew the same tokens) sample independently: first-token agreement on the same logits
    near the chance level ``sum p^2``, not 1."""
    from engine.sampling import derive_seed

    seeds = [derive_seed(derive_seed(0, "rollout", step), "replica", replica)
             for step in range(4096) for replica in range(64)]
    firsts = [(SeedStream(s).next(), s) for s in seeds]
    assert len({f for f, _ in firsts}) == len(seeds)
    by_low: dict[int, int] = {}
    pairs = []
    for s in seeds:
        if (s & 0xFFFFFFFF) in by_low:
            pairs.append((by_low[s & 0xFFFFFFFF], s))
        by_low[s & 0xFFFFFFFF] = s
    assert pairs, "no low-32-bit collisions: the birthday bound says about 8 are expected"
    z = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) * 2
    chance = float((torch.softmax(z, -1) ** 2).sum(-1).mean())
    sp = SamplingParams(temperature=1.0)
    for a, b in pairs:
        legacy = [torch.multinomial(torch.softmax(z, -1), 1,
                                    generator=torch.Generator().manual_seed(s))
                  for s in (a, b)]
        assert torch.equal(*legacy)  # the collision a 32-bit generator seed gives
        tok_a = sample_next(z, sp, None, SeedStream(a))[0]
        tok_b = sample_next(z, sp, None, SeedStream(b))[0]
        agree = float((tok_a == tok_b).double().mean())
        assert agree < chance + 0.15, (a, b, agree, chance)


def test_top_k_one_breaks_ties_like_greedy():
    """top_k=1 is greedy: among equal top logits both take the lowest id (torch.topk's order
    is unspecified), with that token's log-prob under softmax(z / temperature) (greedy's under
    softmax(z)), and draw no random number."""
    from engine.sampling import sample_next

    for vocab, tied in ((16, [3, 7, 11]), (4096, [2000, 100, 4000]), (8, [5, 6])):
        z = torch.randn(4, vocab)
        z[:, tied] = z.max() + 1.0
        greedy = sample_next(z, SamplingParams(temperature=0.0), None, None)
        g = SeedStream(3)
        top1 = sample_next(z, SamplingParams(temperature=0.7, top_k=1), None, g)
        assert top1[0].tolist() == greedy[0].tolist() == [min(tied)] * 4
        torch.testing.assert_close(greedy[1], torch.log_softmax(z, -1)[:, min(tied)])
        torch.testing.assert_close(top1[1], torch.log_softmax(z / 0.7, -1)[:, min(tied)])
        assert g.steps == 0


@pytest.mark.parametrize("seed", [-1, 1 << 63, 2.0, True])
def test_seed_outside_63_bits_is_refused_naming_it(seed):
    with pytest.raises(ValueError, match=rf"seed={seed!r} must be an int in \[0, 2\*\*63\)"):
        SamplingParams(temperature=1.0, seed=seed)
    with pytest.raises(ValueError, match=r"must be an int in \[0, 2\*\*63\)"):
        SeedStream(seed)
