"""What ``bench/e2e.py --shape small`` runs on: a seeded Qwen2-style checkpoint with its BPE
tokenizer, prompts of exactly ``shape.prompt_len`` tokens, and a rule reward that both sides
compute with the same function.

    folder/                    make_small_model(folder, shape)
      config.json              Qwen2ForCausalLM of the shape (bos/eos/pad ids of the tokenizer)
      generation_config.json
      model.safetensors        init_full_state_dict(seed)
      tokenizer*.json          build_bpe_tokenizer(folder, shape.bpe_vocab)
    prompts.jsonl              write_prompts(...): {"prompt": text, "ground_truth": ""}

Responses of exactly ``shape.response_len`` tokens on both sides: bench/e2e.py gives both
contenders min-new-tokens = ``shape.response_len`` (ours ``data.min_new_tokens``, TRL
``GRPOConfig(generation_kwargs={"min_new_tokens": ...})``, i.e. HF's
``MinNewTokensLengthLogitsProcessor``): EOS is masked at every step, the same rule on both
sides, and the seeded weights are used as they are.  The bench checks that every response has
the full length on both sides.

This file is also loaded by our runtime as ``reward.function=bench/e2e_small.py:compute_score``
(each rank imports it as a file), so its top level imports only the standard library.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_SOURCE = "bench_small"
_WORD = re.compile(r"[A-Za-z]+")


# ---------------------------------------------------------------- the reward (both sides)

@lru_cache(maxsize=1)
def corpus_words() -> frozenset[str]:
    """The lower-case words of :func:`bench.shapes.bench_corpus` (the reward's word list)."""
    if ROOT not in sys.path:  # loaded as a file by our runtime's reward worker
        sys.path.insert(0, ROOT)
    from bench.shapes import bench_corpus

    return frozenset(w.lower() for line in bench_corpus() for w in _WORD.findall(line))


def word_fraction(text: str) -> float:
    """Fraction of the alphabetic words of ``text`` that are corpus words (0 with none): cheap,
    independent of the length and of EOS."""
    words = _WORD.findall(text)
    if not words:
        return 0.0
    known = corpus_words()
    return sum(w.lower() in known for w in words) / len(words)


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's reward signature (our runtime: ``reward.kind=function``)."""
    return word_fraction(solution_str)


def trl_reward(completions, **_) -> list[float]:
    """The same reward as a TRL reward function (plain-text completions)."""
    return [word_fraction(c) for c in completions]


# ---------------------------------------------------------------- model and data

def make_small_model(folder: str, shape, seed: int = 0):
    """Seeded weights of ``shape`` (a :class:`bench.shapes.BenchShape`) as a transformers
    checkpoint folder with its BPE tokenizer.

    Returns:
        The tokenizer both contenders use: ``AutoTokenizer.from_pretrained(folder)``.  With a
        qwen2 ``config.json`` beside it, transformers 5 loads it as ``Qwen2Tokenizer``, whose
        pre-tokenizer splits digits one by one (unlike the trained one), so prompts are cut
        with this one, not with the tokenizer :func:`build_bpe_tokenizer` returns.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    from bench.shapes import build_bpe_tokenizer
    from engine.hf_interop import SINGLE_FILE, config_to_hf, full_to_hf_state_dict
    from engine.llama_spec import init_full_state_dict, llama_shard_specs

    tok = build_bpe_tokenizer(folder, shape.bpe_vocab)
    config = shape.llama_config()
    hf_state = full_to_hf_state_dict(init_full_state_dict(config, seed=seed),
                                     llama_shard_specs(config, 1))
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    hf = config_to_hf(config)
    for k, v in ids.items():
        setattr(hf, k, v)
    hf.save_pretrained(folder)
    GenerationConfig(**ids).save_pretrained(folder)
    save_file(hf_state, os.path.join(folder, SINGLE_FILE), metadata={"format": "pt"})
    return AutoTokenizer.from_pretrained(folder)


def exact_length_prompts(tok, length: int, count: int) -> list[str]:
    """``count`` texts that the tokenizer encodes as exactly ``length`` tokens: consecutive
    windows of the tokenized bench corpus, decoded, kept when they re-encode to ``length``
    tokens (a byte-level BPE may merge differently at a cut)."""
    from bench.shapes import bench_corpus

    if length < 1 or count < 1:
        raise ValueError(f"length={length} and count={count} must be >= 1")
    ids = tok(" ".join(bench_corpus()), add_special_tokens=False)["input_ids"]
    out, specials = [], set(tok.all_special_ids)
    for start in range(0, len(ids) - length + 1, length):
        window = ids[start:start + length]
        text = tok.decode(window)
        again = tok(text)["input_ids"]
        if len(again) == length and not specials & set(again):
            out.append(text)
            if len(out) == count:
                return out
    raise ValueError(f"the bench corpus holds only {len(out)} prompts of {length} tokens, "
                     f"fewer than count={count}")


def write_prompts(path: str, tok, length: int, count: int) -> list[str]:
    """The prompts as verl rows in a JSONL file our runtime reads (``data.train_files``)."""
    prompts = exact_length_prompts(tok, length, count)
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p, "ground_truth": "", "data_source": DATA_SOURCE,
                                "extra_info": {"index": i}}) + "\n")
    return prompts


def read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]
