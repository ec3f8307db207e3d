"""examples/gsm8k_style: the generated tokenizer, models and data, and the rule reward.

The example is built once per module into a temporary folder (small row counts); the ground
truths are recomputed here from the numbers in each problem's text, not taken from the generator.
"""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "gsm8k_style")
COUNTS = {"train": 60, "val": 20, "sft": 40}
SEED = 3


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gsm8k_style_{name}",
                                                  os.path.join(EXAMPLE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


make_example = _load("make_example")
reward = _load("reward")


def _build(out: str, seed: int = SEED) -> None:
    argv = [out, "--seed", str(seed)] + [a for k, n in COUNTS.items() for a in (f"--{k}", str(n))]
    assert make_example.main(argv) == 0


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("gsm8k"))
    _build(out)
    return out


def _rows(out_dir: str, name: str) -> list[dict]:
    with open(os.path.join(out_dir, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# One pattern per template, written from the problem wording; each computes the answer.
_SOLVERS = [
    (re.compile(r"^\w+ has (\d+) \w+\. (?:He|She) [a-z ]+ (\d+) more\. How many \w+ does "
                r"(?:he|she) have now\?$"), lambda a, b: a + b),
    (re.compile(r"^\w+ has (\d+) \w+ and gives (\d+) to [a-z ]+\. How many \w+ does "
                r"(?:he|she) have left\?$"), lambda a, b: a - b),
    (re.compile(r"^\w+ buys (\d+) \w+ of \w+\. Each \w+ has (\d+) \w+\. How many \w+ does "
                r"(?:he|she) buy\?$"), lambda a, b: a * b),
    (re.compile(r"^\w+ has (\d+) \w+, finds (\d+) more and then loses (\d+)\. How many \w+ "
                r"does (?:he|she) have now\?$"), lambda a, b, c: a + b - c),
    (re.compile(r"^\w+ had (\d+) \w+ and buys (\d+) \w+ with (\d+) \w+ in each \w+\. How many "
                r"\w+ does (?:he|she) have now\?$"), lambda a, b, c: a + b * c),
    (re.compile(r"^\w+ buys (\d+) \w+ with (\d+) \w+ in each \w+ and gives away (\d+)\. How "
                r"many \w+ are left\?$"), lambda a, b, c: a * b - c),
]


def solve(question: str) -> int:
    """The answer computed from the question's numbers; fails unless exactly one template fits."""
    hits = [(m, f) for pat, f in _SOLVERS if (m := pat.match(question))]
    assert len(hits) == 1, f"{len(hits)} templates match {question!r}"
    m, f = hits[0]
    return f(*(int(g) for g in m.groups()))


def check_reasoning(response: str) -> int:
    """Every ``a op b = c`` in the response is right; returns the number after ``####``."""
    eqs = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", response)
    assert eqs, response
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for a, op, b, c in eqs:
        assert ops[op](int(a), int(b)) == int(c), response
    lines = response.split("\n")
    assert len(lines) == 2 and lines[1].startswith("#### "), response
    final = int(lines[1][len("#### "):])
    assert final == int(eqs[-1][3]), response
    return final


def test_tokenizer_chat_template(out_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(out_dir, "tokenizer"))
    assert 512 <= len(tok) <= 1024
    special = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    assert None not in special.values() and len(set(special.values())) == 3, special
    assert tok.eos_token == "<|im_end|>"
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", tok.pad_token):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t

    user = [{"role": "user", "content": "Tom has 3 apples. He buys 4 more."}]
    text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nTom has 3 apples. He buys 4 more.<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    ids = tok.apply_chat_template(user, add_generation_prompt=True)["input_ids"]
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(header):] == header and ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    plain = tok.apply_chat_template(user, tokenize=False)
    assert not plain.endswith("<|im_start|>assistant\n")

    # The {% generation %} block marks the answer and its <|im_end|> for SFT loss masking.
    chat = user + [{"role": "assistant", "content": "3 + 4 = 7\n#### 7"}]
    enc = tok.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert masked == tok.encode("3 + 4 = 7\n#### 7<|im_end|>", add_special_tokens=False)


def test_tokenizer_round_trip(out_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(out_dir, "tokenizer"))
    texts = [r["prompt"] + "\n" + r["response"] for r in _rows(out_dir, "sft_flat.jsonl")]
    texts += [r["prompt"][0]["content"] for r in _rows(out_dir, "val.jsonl")]
    texts += ["Zürich: 12,345 ünïcode 🙂 tabs\tand  spaces\n", ""]
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.decode(ids) == t, t
    chat = tok.apply_chat_template(
        [{"role": "user", "content": texts[0]}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(tok.encode(chat, add_special_tokens=False)) == chat
    assert len(tok.encode("12345", add_special_tokens=False)) == 5  # digits one by one (Qwen)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_models_load(out_dir, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(out_dir, name)
    tok = AutoTokenizer.from_pretrained(path)  # the model folder alone is enough
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg = model.config
    assert cfg.model_type == name and cfg.vocab_size == -(-len(tok) // 64) * 64
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.max_position_embeddings == 512
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings == (name == "qwen2")
    if name == "qwen3":
        assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    prompt = [{"role": "user", "content": "Tom has 3 apples. He buys 4 more."}]
    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_rl_rows(out_dir):
    rows = {s: _rows(out_dir, f"{s}.jsonl") for s in ("train", "val")}
    for split, rs in rows.items():
        assert len(rs) == COUNTS[split]
        for i, r in enumerate(rs):
            assert set(r) == {"prompt", "ground_truth", "data_source", "extra_info"}
            assert r["data_source"] == "gsm8k_style" and r["extra_info"] == {"index": i}
            (msg,) = r["prompt"]
            assert msg["role"] == "user" and isinstance(r["ground_truth"], str)
            assert int(r["ground_truth"]) == solve(msg["content"])
    questions = {s: {r["prompt"][0]["content"] for r in rs} for s, rs in rows.items()}
    assert len(questions["train"]) == COUNTS["train"] and len(questions["val"]) == COUNTS["val"]
    assert not questions["train"] & questions["val"]


def test_sft_rows(out_dir):
    chat, flat = _rows(out_dir, "sft.jsonl"), _rows(out_dir, "sft_flat.jsonl")
    assert len(chat) == len(flat) == COUNTS["sft"]
    val = {r["prompt"][0]["content"] for r in _rows(out_dir, "val.jsonl")}
    for i, (c, f) in enumerate(zip(chat, flat)):
        user, assistant = c["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert (f["prompt"], f["response"]) == (user["content"], assistant["content"])
        assert c["extra_info"] == f["extra_info"] == {"index": i}
        assert user["content"] not in val
        truth = solve(user["content"])
        assert check_reasoning(assistant["content"]) == truth == int(c["ground_truth"])
        assert reward.compute_score("gsm8k_style", assistant["content"], c["ground_truth"]) == \
            {"score": 1.0, "format": 1.0}


def test_compute_score_on_rows(out_dir):
    for r in _rows(out_dir, "val.jsonl"):
        truth = solve(r["prompt"][0]["content"])
        gt = r["ground_truth"]

        def score(text):
            return reward.compute_score("gsm8k_style", text, gt, r["extra_info"])

        assert score(f"So it is {truth}.\n#### {truth}") == {"score": 1.0, "format": 1.0}
        assert score(f"It is {truth}.\n#### {truth + 1}") == {"score": 0.0, "format": 1.0}
        assert score(f"I think {truth + 2}, no, {truth}.") == {"score": 1.0, "format": 0.0}
        assert score(f"I think {truth}, no, {truth + 2}.") == {"score": 0.0, "format": 0.0}


@pytest.mark.parametrize("text,truth,score,fmt", [
    ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),
    ("#### 7.", "7", 1.0, 1.0),
    ("####7", 7, 1.0, 1.0),                          # an int ground truth is fine too
    ("#### 1,234", "1234", 1.0, 1.0),
    ("#### $12", "12", 1.0, 1.0),
    ("#### 7.0", "7", 1.0, 1.0),
    ("#### -3", "-3", 1.0, 1.0),
    ("#### 7 then #### 8", "8", 1.0, 1.0),           # the last mark counts
    ("#### 8\nwait, the answer is 7", "7", 0.0, 1.0),  # the marked number wins over a later one
    ("The answer is 7", "7", 1.0, 0.0),              # no mark: the last number
    ("10 - 3", "-3", 0.0, 0.0),                      # "- 3" is an operator, not a sign
    ("10 - 3", "3", 1.0, 0.0),
    ("no numbers at all", "7", 0.0, 0.0),
    ("", "7", 0.0, 0.0),
    ("#### seven", "7", 0.0, 1.0),
    ("#### 17", "7", 0.0, 1.0),
])
def test_compute_score_cases(text, truth, score, fmt):
    assert reward.compute_score("gsm8k_style", text, truth) == {"score": score, "format": fmt}


def test_compute_score_bad_ground_truth():
    with pytest.raises(ValueError, match="not a number"):
        reward.compute_score("gsm8k_style", "#### 7", "seven")


def test_deterministic(out_dir, tmp_path):
    again = str(tmp_path / "again")
    _build(again)
    for sub in ("", "tokenizer", "qwen2", "qwen3"):
        a, b = os.path.join(out_dir, sub), os.path.join(again, sub)
        names = sorted(n for n in os.listdir(a) if os.path.isfile(os.path.join(a, n)))
        assert names == sorted(n for n in os.listdir(b) if os.path.isfile(os.path.join(b, n)))
        match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
        assert not mismatch and not errors, (sub, mismatch, errors)
    a = make_example.make_problems(50, seed=SEED)
    assert a == make_example.make_problems(50, seed=SEED) != make_example.make_problems(50, 4)


def test_bad_counts(tmp_path):
    with pytest.raises(ValueError, match="--val must be >= 1"):
        make_example.build(str(tmp_path), seed=0, train=5, val=0, sft=5)
