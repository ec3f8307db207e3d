"""The FLOP and byte formulas of bench/roofline.py against direct counts.

FLOPs: torch's FlopCounterMode over the Python layers of the engine (the C++ kernels are
invisible to it), attention through SDPA's math backend so that its products show as
``aten.bmm``.  That backend computes the full S x S score matrix; the causal share of it is
counted independently as the lower triangle of the mask.  Bytes: the weights a decode step
reads and the filled positions of a :class:`engine.kv_cache.TiledKVCache`.
"""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import roofline
from bench.shapes import SHAPES, BenchShape
from engine import onednn
from engine.generation import GenerationEngine
from engine.kv_cache import TiledKVCache
from engine.llama_spec import init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

BASE = BenchShape("t", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=128,
                  dtype=torch.float32, tied=False, qkv_bias=True, model_type="qwen2",
                  prompt_len=5, response_len=7, prompts=2, samples=2, rl=True)
MINI = {"qwen2-untied": BASE,
        "llama-tied": dataclasses.replace(BASE, tied=True, qkv_bias=False, model_type="llama",
                                          heads=8, kv_heads=8, ffn=160)}


@pytest.fixture(autouse=True)
def products_on_matmul():
    """FlopCounterMode counts aten's products; oneDNN's op (engine.onednn) is not among them,
    and the formulas are of the model's maths, whichever GEMM runs them."""
    previous = onednn.set_enabled(False)
    yield
    onednn.set_enabled(previous)


def build(shape: BenchShape) -> ParallelLlama:
    cfg = shape.llama_config()
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=0))
    return model


def counted(fn) -> dict[str, int]:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        fn()
    return {str(k).removeprefix("aten."): v for k, v in fc.get_flop_counts()["Global"].items()}


def causal_share(seq: int) -> float:
    """Visible (query, key) pairs of a causal mask over all S x S pairs, by counting."""
    return float(torch.ones(seq, seq).tril().sum()) / seq**2


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_matrix_params_are_the_models_matrices(name):
    shape = SHAPES[name]
    if not shape.rl:  # llama-1b: 2.5 GB of weights, not built here
        pytest.skip("resharding-only shape")
    model = build(shape)
    untied_embedding = "embed_tokens" if not shape.tied else None
    mats = sum(p.numel() for n, p in model.params.items() if p.dim() == 2 and n != untied_embedding)
    vectors = sum(p.numel() for p in model.params.values() if p.dim() == 1)
    assert roofline.matrix_params(shape) == mats
    assert shape.matmul_param_count() - roofline.matrix_params(shape) == vectors


@pytest.mark.parametrize("name", sorted(MINI))
@pytest.mark.parametrize("head_from", [0, 4])
def test_forward_and_train_flops(name, head_from):
    shape, batch, seq = MINI[name], 3, 12
    model = build(shape)
    ids = torch.randint(0, shape.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def forward():
        return model.head_outputs(model.stage_forward(ids), ids, start=head_from, temperature=1.0)

    def train():
        (-forward()["log_probs"].mean()).backward()

    attention = roofline.attention_flops(shape, batch, seq)
    fwd = counted(forward)
    assert fwd["mm"] == roofline.forward_flops(shape, batch, seq, head_from) - attention
    assert fwd["bmm"] * causal_share(seq) == pytest.approx(attention, rel=1e-12)
    both = counted(train)
    assert both["mm"] + both["bmm"] * causal_share(seq) == pytest.approx(
        roofline.train_flops(shape, batch, seq, head_from), rel=1e-12)
    assert 3 * roofline.forward_flops(shape, batch, seq, head_from) \
        == roofline.train_flops(shape, batch, seq, head_from)


@pytest.mark.parametrize("name", sorted(MINI))
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_flops_and_bytes(name, batch):
    shape, plen = MINI[name], 5
    model = build(shape)
    cfg, groups = model.config, model.groups
    engine = GenerationEngine(cfg, groups, fused_decode=False)
    engine.set_weights(model.params)
    ids = torch.randint(0, shape.vocab, (batch, plen), generator=torch.Generator().manual_seed(1))

    def generate(n):
        return lambda: engine.generate(ids, None, SamplingParams(max_new_tokens=n, temperature=0))

    one, two = counted(generate(1)), counted(generate(2))
    step = {k: two[k] - one.get(k, 0) for k in two}  # the one decode step: context P + 1
    assert step["mm"] + step["bmm"] == roofline.decode_step_flops(shape, batch, plen + 1)
    read = {n: w for n, w in engine.weights.items() if n in engine.required_weights()}
    untied_embedding = "embed_tokens" if not shape.tied else None
    weights = sum(w.nbytes for n, w in read.items() if w.dim() == 2 and n != untied_embedding)
    # K and V of the filled positions: V's bytes twice (the cache pads K's positions to whole
    # tiles, which the step never reads)
    kv = 2 * TiledKVCache(shape.layers, batch, plen + 1, shape.kv_heads, shape.head_dim,
                          shape.dtype).v.nbytes
    assert roofline.decode_step_bytes(shape, batch, plen + 1) == weights + kv


def test_forward_flops_rejects_a_head_outside_the_sequence():
    with pytest.raises(ValueError, match="head_from=11"):
        roofline.forward_flops(BASE, 1, 12, 11)


def test_reshard_ratio_reads_the_transition_json():
    methods = {"hybridflow": {"time_s": 3.0}}
    assert roofline.reshard_ratio({"methods": methods, "raw_allgather_time_s": 2.0}) \
        == (1.5, "methods.hybridflow.time_s / raw_allgather_time_s")
    assert roofline.reshard_ratio({"ratio_vs_raw": 1.25, "methods": methods}) \
        == (1.25, "ratio_vs_raw")
    nested = {"methods": {"hybridflow": {"time_s": 3.0, "ratio_vs_raw": 1.4}},
              "raw_allgather_time_s": 2.0}
    assert roofline.reshard_ratio(nested) == (1.4, "methods.hybridflow.ratio_vs_raw")
