"""Make the tool-use example: a task only a lookup tool can answer, a tokenizer, a tiny model
and the data.

    python examples/tool_use/make_example.py OUT_DIR [--seed S] [--train N] [--val M] [--sft K]

Each row asks for the secret code of a made-up name (``What is the code of "kalom"?``); the
code (three random digits) is in the row's ``extra_info`` only, where the ``lookup`` tool of
``tools.py`` reads it, so a model without the tool can only guess (1 in 900).  Nothing is
downloaded; everything follows from ``--seed``::

    OUT_DIR/
      base/              Qwen2ForCausalLM, random init, fp32, with the tokenizer files
      train.jsonl        RL prompts {"prompt": [user], "ground_truth": code,
                         "data_source": "tool_use", "extra_info": {"name", "code"}}
      val.jsonl          held-out prompts, same fields (codes drawn anew for every row)
      val_notools.jsonl  the same held-out prompts with "tools": [] (no tools offered)
      sft.jsonl          imperfect demonstrations as chat "messages" with tool calls

The demonstrations are imperfect on purpose: for two of the four ways of asking, most of them
call the tool and copy its answer; for the other two, most answer at once with a made-up code.
Some calls misspell the name, get ``unknown name`` and guess.  The SFT policy therefore answers
about half of the questions right; GRPO with the tool, rewarded by ``reward.py``, learns to
call it every time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # tools.py imports rlhf.tools when run as a script from anywhere
    sys.path.insert(0, ROOT)

DATA_SOURCE = "tool_use"
TOOL = "lookup"
BOS, EOS, PAD, IM_START = "<|endoftext|>", "<|im_end|>", "<|pad|>", "<|im_start|>"
SPECIAL_TOKENS = [BOS, IM_START, EOS, PAD]  # ids 0..3, in this order
# Ordinary added tokens (not special: decoding keeps them), one id each as in Qwen2.5.
TAG_TOKENS = ["<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>",
              "</tool_response>"]
NAMES = 24  # the pool of names; each row draws one, with a code of its own
VOCAB_SIZE = 512  # room for every name to be one token
DEFAULT_COUNTS = {"train": 2000, "val": 100, "sft": 2000}

# Ways of asking, and how often the demonstrations of each call the tool.
QUESTIONS = [('What is the code of "{}"?', 0.8), ('Look up the code of "{}".', 0.8),
             ('Tell me the code of "{}".', 0.2), ('Do you know the code of "{}"?', 0.2)]
MISSPELL_RATE = 0.15  # demonstrated calls whose name is misspelt (then the demo guesses)
ANSWER = "The code is {}."

# Words whole, digits one by one, punctuation runs apart from letters: a name is the same
# tokens in the question, in the call's JSON and in the answer, so the model copies ids.
SPLIT = r" ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# ChatML with tools in the Hermes layout: the tools' JSON schemas in a system block, each
# assistant call as a <tool_call> block after the turn's text, consecutive tool results as
# <tool_response> blocks of one user turn.  {% generation %} marks the assistant's tokens
# (rlhf.sft's loss mask); a conversation only ever grows at its end, as the turn loop needs.
TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}"
    "{%- if m['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": '"
    " + (c['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def tools_module():
    """``tools.py`` beside this file (the tool the run loads with rollout.tools)."""
    import importlib.util

    name = "tool_use_tools"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def make_names(count: int, rng: random.Random) -> list[str]:
    """``count`` distinct pronounceable made-up names (CVCVC, like ``kalom``)."""
    if count > 2000:
        raise ValueError(f"at most 2000 names, asked for {count}")
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen["".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(2))
             + rng.choice(CONSONANTS)] = None
    return list(seen)


def make_code(rng: random.Random) -> str:
    return str(rng.randint(100, 999))


def misspell(name: str, rng: random.Random) -> str:
    """``name`` with one letter dropped or doubled (never ``name`` itself)."""
    i = rng.randrange(len(name))
    return name[:i] + name[i + 1:] if rng.random() < 0.5 else name[:i] + name[i] + name[i:]


def question(name: str, kind: int) -> str:
    return QUESTIONS[kind][0].format(name)


def call_message(name: str) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function",
                            "function": {"name": TOOL, "arguments": {"name": name}}}]}


def rl_row(name: str, code: str, kind: int, tools: list[str] | None = None) -> dict:
    row = {"prompt": [{"role": "user", "content": question(name, kind)}], "ground_truth": code,
           "data_source": DATA_SOURCE, "extra_info": {"name": name, "code": code}}
    if tools is not None:
        row["tools"] = tools
    return row


def sft_row(name: str, code: str, kind: int, rng: random.Random) -> dict:
    """One demonstration: the tool called and copied, a misspelt call and a guess, or a guess."""
    messages = [{"role": "user", "content": question(name, kind)}]
    if rng.random() < QUESTIONS[kind][1]:
        asked = misspell(name, rng) if rng.random() < MISSPELL_RATE else name
        messages += [call_message(asked),
                     {"role": "tool", "name": TOOL,
                      "content": code if asked == name else tools_module().UNKNOWN}]
        final = code if asked == name else make_code(rng)
    else:
        final = make_code(rng)
    messages.append({"role": "assistant", "content": ANSWER.format(final)})
    return {"messages": messages, "ground_truth": code, "data_source": DATA_SOURCE,
            "extra_info": {"name": name, "code": code}}


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _wrap(tok_object, vocab_name: str = ""):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    out = PreTrainedTokenizerFast(
        tokenizer_object=tok_object, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=None,
        additional_special_tokens=[IM_START], chat_template=TOOL_TEMPLATE,
        model_max_length=512, clean_up_tokenization_spaces=False, name_or_path=vocab_name)
    out.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return out


def _bare_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(conversations: list[tuple[list[dict], list[dict] | None]],
                    vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE trained on the template's text of ``conversations`` (messages, tool
    schemas), so the tools block and the call syntax take few tokens.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with :data:`TOOL_TEMPLATE`, eos
        ``<|im_end|>`` and the tag tokens.
    """
    from tokenizers import trainers
    from tokenizers.pre_tokenizers import ByteLevel

    renderer = _wrap(_bare_tokenizer())  # the template needs no vocabulary to render text
    corpus = [renderer.apply_chat_template(m, tools=t, tokenize=False) for m, t in conversations]
    for tag in SPECIAL_TOKENS + TAG_TOKENS:
        corpus = [c.replace(tag, "\n") for c in corpus]  # one id each: not part of the BPE
    tok = _bare_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return _wrap(tok)


def make_model(tok, path: str, seed: int) -> None:
    """A tiny ``Qwen2ForCausalLM`` (random init, fp32, tied) with the tokenizer, in ``path``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.02, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def build(out_dir: str, *, seed: int, train: int, val: int, sft: int) -> dict[str, int]:
    """Write the whole example under ``out_dir``; returns the row counts and the vocab size."""
    from rlhf.tools.catalog import tool_schema

    for flag, n in (("--train", train), ("--val", val), ("--sft", sft)):
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(f"tool_use:{seed}")
    pool = make_names(NAMES, rng)
    n = val + train + sft
    kinds = [i % len(QUESTIONS) for i in range(n)]
    rng.shuffle(kinds)
    rows = [(rng.choice(pool), make_code(rng), k) for k in kinds]
    val_r, train_r, sft_r = rows[:val], rows[val:val + train], rows[val + train:]

    write_jsonl(os.path.join(out_dir, "train.jsonl"), [rl_row(*r) for r in train_r])
    write_jsonl(os.path.join(out_dir, "val.jsonl"), [rl_row(*r) for r in val_r])
    write_jsonl(os.path.join(out_dir, "val_notools.jsonl"), [rl_row(*r, tools=[]) for r in val_r])
    demos = [sft_row(*r, rng) for r in sft_r]
    write_jsonl(os.path.join(out_dir, "sft.jsonl"), demos)

    schemas = [tool_schema(tools_module().lookup)]
    corpus = [(d["messages"], schemas) for d in demos]
    corpus += [(rl_row(*r)["prompt"], None) for r in sft_r[:200]]  # asked without tools
    corpus += [([{"role": "user", "content": '"' + '", "'.join(pool) + '"'}], None)] * 20  # names: one id each
    tok = train_tokenizer(corpus)
    make_model(tok, os.path.join(out_dir, "base"), seed)
    return {"train": len(train_r), "val": len(val_r), "sft": len(demos), "vocab": len(tok)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="folder to write (created if missing)")
    ap.add_argument("--seed", type=int, default=0, help="everything is derived from it")
    ap.add_argument("--train", type=int, default=DEFAULT_COUNTS["train"], help="RL prompts")
    ap.add_argument("--val", type=int, default=DEFAULT_COUNTS["val"], help="held-out prompts")
    ap.add_argument("--sft", type=int, default=DEFAULT_COUNTS["sft"], help="demonstrations")
    a = ap.parse_args(argv)
    counts = build(a.out_dir, seed=a.seed, train=a.train, val=a.val, sft=a.sft)
    print(f"wrote {a.out_dir}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
