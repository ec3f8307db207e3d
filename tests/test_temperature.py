"""Rollout and training log-probs are of the distribution actually sampled, softmax(z / T).

Single process, a tiny random model: for T in {0.5, 1, 1.7} (and with top-k/top-p, which only
truncate the draw) the generation engine's log-probs equal ``log_softmax(logits / T)`` of the
model's plain forward at the sampled tokens, and the training engine's forward at the same T
gives the same log-probs (PPO ratio 1 at step 0) and the entropy of ``softmax(z / T)``.
Greedy keeps temperature-1 log-probs.  The multi-rank paths (vocab-parallel sampling and
log-softmax, pipeline stages) are checked at T = 1.7 in ``tests/test_hybrid_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from engine.generation import GenerationEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from engine.train import TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=32,
                  tie_word_embeddings=False)
P, N = 6, 8
ATOL = 1e-5


@pytest.fixture(scope="module")
def engines():
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, init_full_state_dict(CFG, seed=3, std=0.3))
    gen = GenerationEngine(CFG, groups)
    gen.set_weights(model.params)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, CFG.vocab_size, (5, P), generator=g)
    mask = (torch.arange(P) >= torch.tensor([0, 1, 2, 3, 5])[:, None]).long()  # left padding
    return model, gen, TrainEngine(model), ids.masked_fill(mask == 0, 0), mask


def reference(model: ParallelLlama, out, temperature: float) -> tuple[torch.Tensor, ...]:
    """``(log_probs [B, N], entropy [B, N])`` of ``softmax(z / T)`` from the model's plain
    forward (no generation engine, no head_outputs), at the response tokens."""
    with torch.no_grad():
        z = model.local_logits(model.stage_forward(out.input_ids, out.attention_mask))
    logp = torch.log_softmax(z[:, P - 1:-1].double() / temperature, -1)  # [B, N, V]
    lp = logp.gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)
    return lp.float(), -(logp.exp() * logp).sum(-1).float()


def train_outputs(train: TrainEngine, out, temperature: float) -> dict:
    res = train.forward([{"input_ids": out.input_ids, "attention_mask": out.attention_mask}],
                        head_from=P - 1, temperature=temperature)[0]
    return {k: res[k] for k in ("log_probs", "entropy")}  # [B, N]: the response positions


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.5, 0, 1.0), (1.0, 0, 1.0), (1.7, 0, 1.0), (0.7, 5, 0.9), (1.7, 0, 0.8), (1.7, 1, 1.0)])
def test_rollout_and_training_log_probs_are_of_softmax_z_over_t(engines, temperature, top_k,
                                                                  top_p):
    model, gen, train, ids, mask = engines
    out = gen.generate(ids, mask, SamplingParams(max_new_tokens=N, temperature=temperature,
                                                 top_k=top_k, top_p=top_p, seed=11))
    real = out.response_mask.bool()
    assert int(real.sum()) == real.numel()  # no EOS: every response token counts
    want_lp, want_ent = reference(model, out, temperature)
    torch.testing.assert_close(out.log_probs[real], want_lp[real], atol=ATOL, rtol=0)
    got = train_outputs(train, out, temperature)
    ratio = torch.exp(got["log_probs"] - out.log_probs)
    torch.testing.assert_close(ratio[real], torch.ones_like(ratio[real]), atol=ATOL, rtol=0)
    torch.testing.assert_close(got["entropy"], want_ent, atol=ATOL, rtol=0)
    if temperature != 1.0:  # the temperature-1 log-probs differ: the check has teeth
        t1_lp, _ = reference(model, out, 1.0)
        assert float((t1_lp - out.log_probs).abs().max()) > 1e-2


def test_greedy_keeps_temperature_one_log_probs(engines):
    model, gen, train, ids, mask = engines
    out = gen.generate(ids, mask, SamplingParams(max_new_tokens=N, temperature=0.0))
    want_lp, want_ent = reference(model, out, 1.0)
    torch.testing.assert_close(out.log_probs, want_lp, atol=ATOL, rtol=0)
    got = train_outputs(train, out, 1.0)
    torch.testing.assert_close(got["log_probs"], out.log_probs, atol=ATOL, rtol=0)
    torch.testing.assert_close(got["entropy"], want_ent, atol=ATOL, rtol=0)


def test_head_scales_log_probs_not_the_returned_logits(engines):
    model, _, _, ids, mask = engines
    with torch.no_grad():
        hidden = model.stage_forward(ids, mask)
        hot = model.head_outputs(hidden, ids, with_logits=True, temperature=1.7)
        cold = model.head_outputs(hidden, ids, with_logits=True, temperature=1.0)
    assert torch.equal(hot["logits"], cold["logits"])
    assert torch.equal(hot["logits"], model.local_logits(hidden))
    assert not torch.allclose(hot["log_probs"], cold["log_probs"])
    # a bad temperature is refused before any work
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temperature"):
            model.head_outputs(hidden, ids, temperature=bad)


def test_train_engine_refuses_a_bad_temperature(engines):
    _, _, train, ids, mask = engines
    mb = {"input_ids": ids, "attention_mask": mask}
    with pytest.raises(ValueError, match="temperature=0.0"):
        train.forward([mb], temperature=0.0)
    with pytest.raises(ValueError, match="temperature=-2"):
        train.train_step([mb], lambda o, m: o["log_probs"].mean(), temperature=-2)
