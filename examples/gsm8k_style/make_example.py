"""Make a self-contained GSM8K-style RL example: tokenizer, two tiny models and the data.

    python examples/gsm8k_style/make_example.py OUT_DIR [--seed S] [--train N] [--val M] [--sft K]

Nothing is downloaded; everything is generated from ``--seed`` (same seed, same files)::

    OUT_DIR/
      tokenizer/       byte-level BPE trained here on the task's text, ChatML chat template
      qwen2/           Qwen2ForCausalLM, random init, tied embeddings (+ tokenizer files)
      qwen3/           Qwen3ForCausalLM, random init, untied, head_dim 32 != 64 / 4 (+ tokenizer)
      train.jsonl      {"prompt": [{"role": "user", ...}], "ground_truth", "data_source",
                        "extra_info": {"index": i}}
      val.jsonl        same fields; no problem text in common with train or sft
      sft.jsonl        {"messages": [user, assistant], ...}; the answer ends with "#### <number>"
      sft_flat.jsonl   the same demonstrations as {"prompt": str, "response": str, ...}

The problems are one or two steps of + / - / * on small numbers ("Tom has 3 apples. He buys 4
more. How many apples does he have now?").  The rule reward is ``reward.py`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from typing import Callable

DATA_SOURCE = "gsm8k_style"
ANSWER_MARK = "####"

BOS, EOS, PAD, IM_START = "<|endoftext|>", "<|im_end|>", "<|pad|>", "<|im_start|>"
SPECIAL_TOKENS = [BOS, IM_START, EOS, PAD]  # ids 0..3, in this order
VOCAB_SIZE = 768  # a target: BPE stops earlier when the corpus has no more pairs to merge
TOKENIZER_PROBLEMS = 2000  # the BPE's training corpus, in problems (question + answer each)
DEFAULT_COUNTS = {"train": 1000, "val": 100, "sft": 1000}  # rows per file, unless asked

# Qwen2's pre-tokenizer regex: digits split one by one, words keep their leading space.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen-style ChatML.  The {% generation %} block lets transformers return an assistant-token
# mask (apply_chat_template(..., return_assistant_tokens_mask=True)) for SFT loss masking.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NAMES = [("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"),
         ("Lucy", "she"), ("Max", "he"), ("Emma", "she"), ("Leo", "he"), ("Zoe", "she"),
         ("Jack", "he"), ("Lily", "she"), ("Oliver", "he"), ("Grace", "she"), ("Henry", "he"),
         ("Chloe", "she"), ("Daniel", "he"), ("Sophia", "she"), ("Lucas", "he"),
         ("Isabella", "she"), ("Nathan", "he"), ("Olivia", "she"), ("Ethan", "he"),
         ("Hannah", "she")]
FRIENDS = ["his sister", "her brother", "a friend", "a neighbour", "the teacher", "a classmate",
           "his cousin", "her grandmother", "the librarian", "a stranger"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "shells",
         "coins", "balloons", "oranges", "stamps", "crayons", "bananas", "cupcakes", "buttons",
         "feathers", "peppers", "tomatoes", "postcards", "candles", "notebooks", "strawberries",
         "pebbles"]
BOXES = [("boxes", "box"), ("bags", "bag"), ("packs", "pack"), ("jars", "jar"),
         ("baskets", "basket"), ("crates", "crate")]
GETS = ["buys", "gets", "picks up", "receives", "collects"]  # verbs for "+ b more"


@dataclass(frozen=True)
class Problem:
    """One word problem with its worked answer."""

    question: str
    reasoning: str  # one line, equations written as "a op b = c"
    answer: int

    def response(self) -> str:
        """The GSM8K-style assistant answer: the reasoning line, then ``#### <answer>``."""
        return f"{self.reasoning}\n{ANSWER_MARK} {self.answer}"


def _add(rng: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    q = (f"{name} has {a} {item}. {he.capitalize()} {rng.choice(GETS)} {b} more. "
         f"How many {item} does {he} have now?")
    return Problem(q, f"{name} has {a} + {b} = {a + b} {item}.", a + b)


def _sub(rng: random.Random, name: str, he: str, item: str) -> Problem:
    a = rng.randint(2, 30)
    b = rng.randint(1, a - 1)
    q = (f"{name} has {a} {item} and gives {b} to {rng.choice(FRIENDS)}. "
         f"How many {item} does {he} have left?")
    return Problem(q, f"{name} has {a} - {b} = {a - b} {item} left.", a - b)


def _mul(rng: random.Random, name: str, he: str, item: str) -> Problem:
    boxes, box = rng.choice(BOXES)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    q = (f"{name} buys {a} {boxes} of {item}. Each {box} has {b} {item}. "
         f"How many {item} does {he} buy?")
    return Problem(q, f"{name} buys {a} * {b} = {a * b} {item}.", a * b)


def _add_sub(rng: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    c = rng.randint(1, a + b - 1)
    q = (f"{name} has {a} {item}, finds {b} more and then loses {c}. "
         f"How many {item} does {he} have now?")
    r = f"{name} has {a} + {b} = {a + b} {item}, then {a + b} - {c} = {a + b - c}."
    return Problem(q, r, a + b - c)


def _mul_add(rng: random.Random, name: str, he: str, item: str) -> Problem:
    boxes, box = rng.choice(BOXES)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    q = (f"{name} had {c} {item} and buys {a} {boxes} with {b} {item} in each {box}. "
         f"How many {item} does {he} have now?")
    r = f"The {boxes} hold {a} * {b} = {a * b} {item}, and {a * b} + {c} = {a * b + c}."
    return Problem(q, r, a * b + c)


def _mul_sub(rng: random.Random, name: str, he: str, item: str) -> Problem:
    boxes, box = rng.choice(BOXES)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    q = (f"{name} buys {a} {boxes} with {b} {item} in each {box} and gives away {c}. "
         f"How many {item} are left?")
    r = f"{name} buys {a} * {b} = {a * b} {item}, and {a * b} - {c} = {a * b - c} are left."
    return Problem(q, r, a * b - c)


TEMPLATES: tuple[Callable[[random.Random, str, str, str], Problem], ...] = (
    _add, _sub, _mul, _add_sub, _mul_add, _mul_sub)


def make_problems(count: int, seed: int, stream: str = "data") -> list[Problem]:
    """``count`` distinct problems (distinct question text), the same for the same seed/stream.

    Raises:
        ValueError: if ``count`` distinct problems cannot be drawn.
    """
    rng = random.Random(f"gsm8k_style:{stream}:{seed}")
    seen: set[str] = set()
    out: list[Problem] = []
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > 20 * count + 1000:
            raise ValueError(f"could draw only {len(out)} distinct problems of {count} asked; "
                             f"ask for fewer (--train/--val/--sft)")
        name, he = rng.choice(NAMES)
        p = rng.choice(TEMPLATES)(rng, name, he, rng.choice(ITEMS))
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def rl_row(p: Problem, index: int) -> dict:
    return {"prompt": [{"role": "user", "content": p.question}], "ground_truth": str(p.answer),
            "data_source": DATA_SOURCE, "extra_info": {"index": index}}


def sft_row(p: Problem, index: int) -> dict:
    return {"messages": [{"role": "user", "content": p.question},
                         {"role": "assistant", "content": p.response()}],
            "ground_truth": str(p.answer), "data_source": DATA_SOURCE,
            "extra_info": {"index": index}}


def sft_flat_row(p: Problem, index: int) -> dict:
    return {"prompt": p.question, "response": p.response(), "ground_truth": str(p.answer),
            "data_source": DATA_SOURCE, "extra_info": {"index": index}}


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def train_tokenizer(corpus: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (Qwen2's pre-tokenizer) trained on ``corpus``, wrapped for transformers.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with the ChatML template and bos/eos/pad set.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=None,
        additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
        model_max_length=512, clean_up_tokenization_spaces=False)


def tokenizer_corpus(problems: list[Problem]) -> list[str]:
    """The text the BPE is trained on: questions, answers and the chat role names."""
    out = ["user\n", "assistant\n", "system\n"]
    for p in problems:
        out.append(p.question)
        out.append(p.response())
    return out


def make_models(tok, out_dir: str, seed: int) -> None:
    """Write ``qwen2/`` (tied) and ``qwen3/`` (untied, head_dim 32 != 64 / 4) with the tokenizer."""
    import torch
    from transformers import (GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    # the embedding is padded to a multiple of 64 rows, as real checkpoints do (tensor
    # parallelism splits the vocabulary); the extra ids are never produced by the tokenizer
    vocab = -(-len(tok) // 64) * 64
    ids = dict(vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, max_position_embeddings=512,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               rms_norm_eps=1e-6, initializer_range=0.02, dtype="float32")
    configs = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, **ids)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, **ids)),
    }
    for k, (name, (cls, cfg)) in enumerate(configs.items()):
        torch.manual_seed(seed * 1000 + k)
        model = cls(cfg).to(torch.float32)
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id)
        path = os.path.join(out_dir, name)
        model.save_pretrained(path)
        tok.save_pretrained(path)


def build(out_dir: str, *, seed: int, train: int, val: int, sft: int) -> dict[str, int]:
    """Write the whole example under ``out_dir``; returns the row counts and the vocab size."""
    for flag, n in (("--train", train), ("--val", val), ("--sft", sft)):
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
    os.makedirs(out_dir, exist_ok=True)
    # One pool of distinct questions, cut into disjoint val / train / sft slices.
    problems = make_problems(val + train + sft, seed)
    val_p, train_p, sft_p = problems[:val], problems[val:val + train], problems[val + train:]

    write_jsonl(os.path.join(out_dir, "train.jsonl"),
                [rl_row(p, i) for i, p in enumerate(train_p)])
    write_jsonl(os.path.join(out_dir, "val.jsonl"), [rl_row(p, i) for i, p in enumerate(val_p)])
    write_jsonl(os.path.join(out_dir, "sft.jsonl"), [sft_row(p, i) for i, p in enumerate(sft_p)])
    write_jsonl(os.path.join(out_dir, "sft_flat.jsonl"),
                [sft_flat_row(p, i) for i, p in enumerate(sft_p)])

    # The BPE gets its own stream of problems, so the vocabulary does not depend on the row
    # counts; 2000 problems cover every word of the templates and train in well under 1 s.
    tok = train_tokenizer(tokenizer_corpus(make_problems(TOKENIZER_PROBLEMS, seed, "tokenizer")))
    tok_dir = os.path.join(out_dir, "tokenizer")
    if os.path.isdir(tok_dir):
        shutil.rmtree(tok_dir)
    tok.save_pretrained(tok_dir)
    make_models(tok, out_dir, seed)
    return {"train": len(train_p), "val": len(val_p), "sft": len(sft_p), "vocab": len(tok)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="folder to write (created if missing)")
    ap.add_argument("--seed", type=int, default=0, help="everything is derived from it")
    ap.add_argument("--train", type=int, default=DEFAULT_COUNTS["train"], help="RL prompts")
    ap.add_argument("--val", type=int, default=DEFAULT_COUNTS["val"], help="validation prompts")
    ap.add_argument("--sft", type=int, default=DEFAULT_COUNTS["sft"], help="SFT demonstrations")
    a = ap.parse_args(argv)
    counts = build(a.out_dir, seed=a.seed, train=a.train, val=a.val, sft=a.sft)
    print(f"wrote {a.out_dir}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
