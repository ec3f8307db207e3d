"""The shipped GSM8K-style example (examples/gsm8k_style) built for tests, plus a small Llama
checkpoint that uses its tokenizer (the engine's plain-Llama path)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAKE_EXAMPLE = ROOT / "examples" / "gsm8k_style" / "make_example.py"


def make_example_module():
    spec = importlib.util.spec_from_file_location("gsm8k_style_make", MAKE_EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def build_example(out: pathlib.Path, *, train: int, val: int, sft: int) -> pathlib.Path:
    """The example's files in ``out`` and ``out/llama``: a 2-layer Llama with its tokenizer."""
    import transformers

    make_example_module().build(str(out), seed=0, train=train, val=val, sft=sft)
    tok = transformers.AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(out / "llama"))
    tok.save_pretrained(str(out / "llama"))
    return out
