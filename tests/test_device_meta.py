"""Every tensor the engines create names its device: the engines run under
``torch.set_default_device("meta")``, where a tensor made without a device lands on ``meta``
and the first operation mixing it with a real tensor fails.

Each case runs twice in one process, on CPU tensors: once with the meta default and once
without; the same code on the same device gives the same bits.  Covered: the training
model's forward and a training step (ParallelLlama + TrainEngine, padded and packed
micro-batches), the generation engine (greedy and sampled, early exit on EOS, shared prefill
of repeated prompts, left-padded and unpadded prompts, the C++ decode kernels and the
Python layers, float32 and bfloat16) and the HybridEngine's generation on one process.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace

import pytest
import torch

from engine.forward_paths import kernels_available
from engine.generation import GenerationEngine
from engine.hybrid_engine import HybridEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)
DTYPES = [torch.float32, torch.bfloat16]


@contextmanager
def meta_default():
    """The default device is ``meta`` inside the block, and after it none again (a device
    context, pushed and popped: ``set_default_device(previous)`` would leave a ``cpu`` one
    behind, a torch-function mode that ``torch.compile`` of later tests cannot trace)."""
    with torch.device("meta"):
        yield


def modes():
    return [nullcontext, meta_default]


def groups():
    return build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


def model_of(cfg: LlamaConfig, full: dict) -> ParallelLlama:
    model = ParallelLlama(cfg, groups(), device="cpu")
    load_full_state_dict(model, full)
    return model


def batch(rows: int = 4, plen: int = 7, padded: bool = True, repeat: bool = False):
    """Prompts (left-padded when ``padded``; rows 2k and 2k+1 equal when ``repeat``)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, CFG.vocab_size, (rows, plen), generator=g)
    if repeat:
        ids = ids[::2].repeat_interleave(2, dim=0)
    mask = torch.ones(rows, plen, dtype=torch.long)
    if padded:
        for b in range(rows):
            mask[b, :(b // 2 if repeat else b) % 3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_the_meta_default_catches_a_tensor_without_a_device():
    """The mode bites: a device-less tensor is on meta and cannot meet a CPU tensor."""
    with meta_default():
        stray = torch.zeros(3)
        assert stray.device.type == "meta"
        with pytest.raises((RuntimeError, NotImplementedError)):
            torch.ones(3, device="cpu").add(stray).tolist()
    assert torch.zeros(1).device.type == "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("remove_padding", [False, True])
def test_training_forward_and_step_are_device_clean(dtype, remove_padding):
    cfg = replace(CFG, dtype=dtype)
    full = init_full_state_dict(cfg, seed=4, std=0.2)
    ids, mask = batch(rows=4, plen=9)
    mb = [{"input_ids": ids, "attention_mask": mask}]
    results = []
    for mode in modes():
        with mode():
            model = model_of(cfg, full)
            eng = TrainEngine(model, OptimConfig(lr=1e-2))
            before = eng.forward(mb, temperature=1.0, remove_padding=remove_padding)[0]
            metrics = eng.train_step(
                mb, lambda o, m: -(o["log_probs"] * m["attention_mask"][:, 1:]).sum(),
                temperature=1.0, remove_padding=remove_padding)
            after = eng.forward(mb, temperature=1.0, remove_padding=remove_padding)[0]
        results.append((before, metrics, after, model.buffer.train_views()))
    (b0, m0, a0, w0), (b1, m1, a1, w1) = results
    for key in ("log_probs", "entropy"):
        assert b1[key].device.type == "cpu"
        assert torch.equal(b0[key], b1[key]) and torch.equal(a0[key], a1[key])
    assert not torch.equal(b0["log_probs"], a0["log_probs"])  # the step changed the model
    assert m0["loss"] == m1["loss"]
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


GEN_CASES = [  # (fused_decode, dtype, temperature, padded, repeat, kv_layout)
    (True, torch.float32, 0.0, True, False, "tiled"),
    (True, torch.float32, 1.3, False, True, "tiled"),
    (False, torch.float32, 0.0, False, True, "tiled"),
    (False, torch.float32, 1.3, True, False, "tiled"),
    (False, torch.bfloat16, 0.0, True, True, "tiled"),
    (False, torch.bfloat16, 1.3, False, False, "tiled"),
    (None, torch.float32, 1.3, True, True, "dense"),
    (None, torch.bfloat16, 0.0, False, False, "dense"),
]


@pytest.mark.parametrize("fused, dtype, temperature, padded, repeat, layout", GEN_CASES)
def test_generation_is_device_clean(fused, dtype, temperature, padded, repeat, layout):
    if fused and not kernels_available(dtype, CFG.layer_keys):
        pytest.skip("engine._kernels not built")
    cfg = replace(CFG, dtype=dtype)
    full = init_full_state_dict(cfg, seed=4, std=0.2)
    ids, mask = batch(rows=6, padded=padded, repeat=repeat)
    first = SamplingParams(max_new_tokens=10, temperature=temperature, seed=7)
    outs = []
    for mode in modes():
        with mode():
            model = model_of(cfg, full)
            eng = GenerationEngine(cfg, model.groups, fused_decode=fused, kv_layout=layout)
            eng.set_weights(model.params)
            probe = eng.generate(ids, mask, first)
            # EOS = a token row 1 produces mid-way: rows finish at different steps
            eos = int(probe.responses[1, 4])
            out = eng.generate(ids, mask, replace(first, eos_token_id=eos, min_new_tokens=2),
                               max_new_tokens=torch.tensor([10, 10, 6, 10, 3, 10], device="cpu"))
        outs.append(out)
    plain, meta = outs
    assert meta.input_ids.device.type == "cpu"
    assert torch.equal(plain.input_ids, meta.input_ids)
    assert torch.equal(plain.attention_mask, meta.attention_mask)
    assert torch.equal(plain.log_probs, meta.log_probs)
    assert plain.stats["compactions"] == meta.stats["compactions"]
    assert plain.stats["prefill_rows"] == (3 if repeat else 6)
    assert int(plain.response_mask.sum()) < plain.response_mask.numel()  # rows ended early


def test_hybrid_engine_generation_is_device_clean():
    full = init_full_state_dict(CFG, seed=5, std=0.2)
    ids, mask = batch(rows=4)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    outs = []
    for mode in modes():
        with mode():
            engine = HybridEngine(model_of(CFG, full), OptimConfig(lr=1e-2))
            with engine.generation_mode():
                outs.append(engine.generate_sequences(ids, mask, params))
    assert torch.equal(outs[0].input_ids, outs[1].input_ids)
    assert torch.equal(outs[0].log_probs, outs[1].log_probs)
