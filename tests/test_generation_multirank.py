"""Generation on resharded views, 4 gloo ranks: every generation layout ``(pp_g, tp_g)`` reached
from several training layouts produces the single-process greedy tokens (which
tests/test_generation.py checks against transformers) on the layer paths its weights allow,
every generation TP group samples identical tokens with temperature / top-k / top-p, and every
weight read is a view of the flat buffer."""

from __future__ import annotations

import pytest
import torch

from engine.generation import GenerationEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder
from tests.near_ties import assert_clear_picks

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=8, num_kv_heads=4, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)
TIED = LlamaConfig(**(CFG.__dict__ | {"tie_word_embeddings": True}))
CASES = [  # (training pp, tp, dp), (pp_g, tp_g)
    ((1, 4, 1), (1, 4)), ((1, 4, 1), (1, 2)), ((1, 4, 1), (1, 1)),
    ((1, 2, 2), (1, 1)), ((1, 2, 2), (1, 2)),
    ((2, 2, 1), (1, 1)), ((2, 2, 1), (1, 2)), ((2, 2, 1), (2, 1)), ((2, 2, 1), (2, 2)),
    ((4, 1, 1), (2, 1)), ((4, 1, 1), (1, 1)), ((2, 1, 2), (1, 1)),
]
N_NEW = 8
MODES = {
    "top_k": SamplingParams(max_new_tokens=N_NEW, temperature=0.9, top_k=6, top_p=0.9, seed=3),
    "full": SamplingParams(max_new_tokens=N_NEW, temperature=1.1, top_p=0.8, seed=4),
    "temp": SamplingParams(max_new_tokens=N_NEW, temperature=1.0, seed=5),
}


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, CFG.vocab_size, (4, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def resharded_model(cfg: LlamaConfig, train: tuple, gen: tuple, full: dict):
    """``(groups, model, resharder)``: the ``full`` weights on the training layout, resharded to
    the generation layout ``gen``; None on a rank outside the layout."""
    layout = HybridLayout(ParallelLayout(*train), *gen)
    groups = build_hybrid_groups(layout, pool=list(range(layout.world_size)))
    if groups is None:
        return None
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, full)
    resharder = Resharder(model.specs, groups, buffer=model.buffer)
    resharder.to_generation()
    return groups, model, resharder


def engine_on(cfg: LlamaConfig, train: tuple, gen: tuple, full: dict):
    """Model on the training layout, resharded to ``gen``; engine on the generation views."""
    built = resharded_model(cfg, train, gen, full)
    if built is None:
        return None
    groups, model, resharder = built
    eng = GenerationEngine(cfg, groups)
    eng.load_weights(resharder)
    return model, resharder, eng


def run_case(rank: int, world_size: int, cfg: LlamaConfig, train: tuple, gen: tuple,
             full: dict, ids: torch.Tensor, mask: torch.Tensor, modes: dict) -> dict | None:
    built = engine_on(cfg, train, gen, full)
    if built is None:
        return None
    model, resharder, eng = built
    storage = resharder.buffer.storage(cfg.dtype)
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes
    views = {n: (eng.weights[n].untyped_storage().data_ptr()
                 == storage.untyped_storage().data_ptr() and lo <= eng.weights[n].data_ptr() < hi)
             for n in eng.required_weights()}
    out = {"views": views, "gen_tp": eng.groups.gen_tp.ranks, "layers": eng.layer_ids,
           "paths": (eng.paths.prefill.name, eng.paths.decode.name), "stats": None, "modes": {}}
    greedy = eng.generate(ids, mask, SamplingParams(max_new_tokens=N_NEW, temperature=0.0))
    out["greedy"] = (greedy.input_ids, greedy.attention_mask, greedy.log_probs)
    out["stats"] = greedy.stats
    for name, sp in modes.items():
        o = eng.generate(ids, mask, sp)
        out["modes"][name] = (o.input_ids, o.log_probs)
    return out


@pytest.fixture(scope="module")
def references():
    """Single-process greedy result per config (layout 1,1,1 on its own views)."""
    ids, mask = prompts()
    refs = {}
    greedy = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
    for key, cfg in (("untied", CFG), ("tied", TIED)):
        full = init_full_state_dict(cfg, seed=5, std=0.2)
        model, _, eng = engine_on(cfg, (1, 1, 1), (1, 1), full)
        refs[key] = (full, eng.generate(ids, mask, greedy))
        assert_clear_picks(model, refs[key][1], greedy)  # so every layout's tokens are these
    return refs


@pytest.mark.parametrize("train, gen", CASES)
def test_generation_layouts_match_single_process(pool4, references, train, gen):
    key = "tied" if train[0] > 1 else "untied"  # pp > 1: the tied lm_head copy is resharded too
    full, ref = references[key]
    cfg = TIED if key == "tied" else CFG
    ids, mask = prompts()
    modes = MODES if gen[1] > 1 else {}
    results = pool4.run(run_case, cfg, train, gen, full, ids, mask, modes)
    world = ParallelLayout(*train).world_size
    assert all(r is None for r in results[world:])
    for rank, r in enumerate(results[:world]):
        assert all(r["views"].values()), (rank, r["views"])
        got_ids, got_mask, got_lp = r["greedy"]
        assert torch.equal(got_ids, ref.input_ids), (rank, got_ids, ref.input_ids)
        assert torch.equal(got_mask, ref.attention_mask)
        torch.testing.assert_close(got_lp, ref.log_probs, atol=2e-5, rtol=0)
        assert r["stats"]["weights_version"] == 1
        # kernels: one call per decode step without TP, two per layer with it; the prefill on
        # the Python layers
        assert r["paths"] == ("python", "kernel_layers" if gen[1] > 1 else "kernel_stage"), \
            r["paths"]
    # each generation stage holds exactly its layers; the stages cover the model
    stages = {tuple(r["layers"]) for r in results[:world]}
    assert sorted(i for s in stages for i in s) == list(range(CFG.num_layers))
    for name in modes:  # identical sampled tokens inside every generation TP group
        for r in results[:world]:
            for other in r["gen_tp"]:
                a, b = r["modes"][name], results[other]["modes"][name]
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (name, other)
        sampled = results[0]["modes"][name][0][:, ids.shape[1]:]
        assert not torch.equal(sampled, ref.responses), name  # it really sampled


def hf_stream(rank: int, world_size: int, train: tuple, gen: tuple, full: dict) -> dict | None:
    from engine.vllm_rollout import full_hf_weights

    built = engine_on(TIED if train[0] > 1 else CFG, train, gen, full)
    if built is None:
        return None
    _, resharder, eng = built
    return {name: t.clone() for name, t in full_hf_weights(resharder, eng.groups.gen_tp)}


@pytest.mark.parametrize("train, gen", [((1, 4, 1), (1, 2)), ((2, 2, 1), (2, 2))])
def test_vllm_weight_stream_is_full_hf_tensors(pool4, references, train, gen):
    """What the vLLM adapter feeds ``load_weights``: the HF state dict of the stage's layers,
    gathered over the generation TP group."""
    from engine.hf_interop import full_to_hf_state_dict
    from engine.llama_spec import llama_shard_specs

    cfg = TIED if train[0] > 1 else CFG
    full = references["tied" if train[0] > 1 else "untied"][0]
    want = full_to_hf_state_dict(full, llama_shard_specs(cfg, 1))
    results = pool4.run(hf_stream, train, gen, full)
    covered = set()
    for r in results:
        for name, t in r.items():
            assert torch.equal(t, want[name]), name
        covered |= r.keys()
    assert covered == want.keys()
