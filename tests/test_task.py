"""Built-in addition task: tokenizer, deterministic data, pairs, rewards, dataset readers."""

import json

import pytest
import torch

from rlhf.task import (AdditionTask, CharTokenizer, CompositeReward, CostRule, PromptStream,
                       exact_match, format_ok, partial_digits, read_dataset, read_jsonl,
                       read_parquet, write_jsonl)


def test_tokenizer_roundtrip_and_save(tmp_path):
    tok = CharTokenizer.build(pad_to_multiple=8)
    assert tok.vocab_size % 8 == 0 and tok.vocab_size >= 19
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("12+345=", add_bos=True)
    assert ids[0] == tok.bos_id and len(ids) == 8           # one token per character
    assert tok.decode(ids) == "12+345="
    resp = tok.encode("357", add_eos=True) + [tok.pad_id] * 3
    assert tok.decode_response(resp) == "357"
    assert tok.decode_response(tok.encode("35") + [tok.eos_id] + tok.encode("9")) == "35"
    path = tmp_path / "tok.json"
    tok.save(path)
    again = CharTokenizer.load(path)
    assert again.encode("9+9=") == tok.encode("9+9=") and again.vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match=r"\['x'\]"):
        tok.encode("1x2")
    with pytest.raises(ValueError, match="does not exist"):
        CharTokenizer.load(tmp_path / "missing.json")


def test_pad_batch():
    tok = CharTokenizer.build()
    ids, mask = tok.pad_batch([[5, 6, 7], [8]], side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    ids, mask = tok.pad_batch([[5], [8, 9]], side="right", length=3)
    assert ids.tolist() == [[5, 0, 0], [8, 9, 0]] and mask.sum().item() == 3
    with pytest.raises(ValueError, match="side='up'"):
        tok.pad_batch([[1]], side="up")


def test_addition_is_deterministic_and_correct():
    task = AdditionTask(min_digits=2, max_digits=4, num_operands=3, seed=7)
    a = task.examples(0, 50)
    assert a == AdditionTask(min_digits=2, max_digits=4, num_operands=3, seed=7).examples(0, 50)
    assert a != AdditionTask(min_digits=2, max_digits=4, num_operands=3, seed=8).examples(0, 50)
    assert task.example(17) == a[17]                  # random access by index
    for e in a:
        ops = e.prompt[:-1].split("+")
        assert e.prompt.endswith("=") and len(ops) == 3
        assert all(2 <= len(o) <= 4 for o in ops)
        assert int(e.answer) == sum(map(int, ops))
        assert len(e.prompt) <= task.max_prompt_chars and len(e.answer) <= task.max_answer_chars
    assert task.examples(0, 5, "eval") != task.examples(0, 5, "train")
    with pytest.raises(ValueError, match="min_digits=3, max_digits=2"):
        AdditionTask(min_digits=3, max_digits=2)


def test_sft_and_preference_pairs():
    task = AdditionTask(max_digits=3, seed=1)
    sft = task.sft_records(20)
    assert all(int(r["answer"]) == sum(map(int, r["prompt"][:-1].split("+"))) for r in sft)
    pairs = task.preference_pairs(200)
    assert pairs == task.preference_pairs(200)
    for p in pairs:
        assert exact_match(p["chosen"], str(sum(map(int, p["prompt"][:-1].split("+"))))) == 1
        assert p["rejected"] != p["chosen"] and p["rejected"].isdigit()


def test_cost_rule_and_pairs():
    rule = CostRule(forbidden_digit="7", max_answer_len=3)
    assert rule.cost("357") == 1 and rule.cost("77") == 2 and rule.cost("12345") == 2
    assert rule.scrub("1777") == "1888"
    pairs = AdditionTask(max_digits=3).cost_pairs(100, rule)
    for p in pairs:
        assert "7" not in p["safer"] and "7" in p["unsafer"]
        assert p["safer_cost"] == rule.cost(p["safer"]) < p["unsafer_cost"] == rule.cost(p["unsafer"])
    with pytest.raises(ValueError, match="forbidden_digit='x'"):
        CostRule(forbidden_digit="x")


def test_rewards_compose():
    assert exact_match(" 357 ", "357") == 1.0 and exact_match("358", "357") == 0.0
    assert partial_digits("358", "357") == pytest.approx(2 / 3)
    assert partial_digits("57", "357") == pytest.approx(2 / 3)     # right-aligned
    assert partial_digits("1357", "357") == pytest.approx(3 / 4)
    assert partial_digits("3a7", "357") == 0.0
    assert format_ok("123", "5") == 1.0 and format_ok("", "5") == 0.0 and format_ok("1+", "5") == 0.0
    reward = CompositeReward.from_weights({"exact": 1.0, "partial": 0.5, "format": 0.1})
    out = reward(["357", "358", "x"], ["357", "357", "357"])
    assert out.components["exact"].tolist() == [1.0, 0.0, 0.0]
    want = [1.0 + 0.5 + 0.1, 0.5 * 2 / 3 + 0.1, 0.0]
    torch.testing.assert_close(out.total, torch.tensor(want))
    m = out.metrics()
    assert set(m) == {"reward/mean", "reward/exact/mean", "reward/partial/mean",
                      "reward/format/mean"}
    custom = CompositeReward([("len", lambda r, a: float(len(r)), 2.0)])
    assert custom(["ab"], ["x"]).total.tolist() == [4.0]
    with pytest.raises(ValueError, match=r"\['bleu'\]"):
        CompositeReward.from_weights({"bleu": 1.0})


def test_jsonl_reader_and_stream(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)])
    data = read_dataset(path, answer_key="answer")
    assert [e.answer for e in data] == ["1", "2", "3", "4", "5"]
    s = PromptStream(data, seed=3)
    first = s.next_batch(7)                            # crosses an epoch boundary
    assert sorted(e.answer for e in first[:5]) == ["1", "2", "3", "4", "5"]
    state = s.state_dict()
    rest = s.next_batch(6)
    s2 = PromptStream(data, seed=3)
    s2.load_state_dict(state)
    assert s2.next_batch(6) == rest
    t = PromptStream(AdditionTask(seed=2))
    t.next_batch(3)
    assert t.next_batch(2) == AdditionTask(seed=2).examples(3, 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: record lacks field\(s\) \['prompt'\]"):
        read_jsonl(bad)
    with pytest.raises(ValueError, match="'.csv'"):
        read_dataset(tmp_path / "x.csv")


def test_parquet_and_saved_dataset_readers(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = [{"role": "user", "content": "1+1?"}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), path)
    assert read_parquet(path, answer_key="answer")[0].answer == "2"
    rows = {"question": [chat, chat], "ground_truth": ["2", "3"],
            "extra_info": [{"index": 0}, {"index": 1}]}
    pq.write_table(pa.table(rows), tmp_path / "chat.parquet")
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    write_jsonl(tmp_path / "c.jsonl", [{"question": chat, "ground_truth": 2,
                                         "data_source": "mine"}])
    both = read_dataset(f"{tmp_path / 'chat.parquet'}, {tmp_path / 'saved'},"
                        f"{tmp_path / 'c.jsonl'}", prompt_key="question")
    assert [e.prompt for e in both] == [chat] * 5
    assert [e.answer for e in both] == ["2", "3", "2", "3", "2"]
    assert [e.data_source for e in both] == ["chat", "chat", "saved", "saved", "mine"]
    assert both[1].extra_info == {"index": 1} and both[4].extra_info is None
    with pytest.raises(ValueError, match="nope.jsonl' does not exist"):
        read_dataset(str(tmp_path / "nope.jsonl"))


# Held-out problems and the warm start's systematic mistake ------------------------------------
def test_heldout_problems_never_reach_training_or_sft_data():
    import zlib

    from rlhf.task.arithmetic import HELDOUT, is_heldout

    task = AdditionTask(1, 2, seed=3)
    held = task.heldout_examples(200)
    prompts = [e.prompt for e in held]
    assert len(set(prompts)) == len(prompts) == 200            # distinct
    assert held == AdditionTask(1, 2, seed=3).heldout_examples(200)  # deterministic
    for e in held:                                               # the hash rule, by hand
        assert zlib.crc32(e.prompt.encode()) % 10 == 0
        assert e.answer == str(sum(int(x) for x in e.prompt.rstrip("=").split("+")))
    held_set = set(prompts)
    for split in ("train", "sft", "pref", "cost", "eval"):
        seen = {e.prompt for e in task.examples(0, 3000, split)}
        assert not seen & held_set, split
        assert not any(is_heldout(p) for p in seen)
    # about a tenth of all problems are held out
    every = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    assert 0.08 < sum(map(is_heldout, every)) / len(every) < 0.12
    assert all(is_heldout(e.prompt) for e in task.examples(0, 50, HELDOUT))
    # a task with few problems gives what it has
    assert 0 < len(AdditionTask(1, 1).heldout_examples(500)) < 100


def test_carry_free_sum_and_carry_errors():
    import random

    from rlhf.task import carry_free_sum

    def by_hand(a: int, b: int) -> int:
        out, place = 0, 1
        while a or b:
            out += ((a % 10 + b % 10) % 10) * place
            a, b, place = a // 10, b // 10, place * 10
        return out

    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(1000), rng.randrange(1000)
        assert carry_free_sum(f"{a}+{b}=") == str(by_hand(a, b))
    assert carry_free_sum("17+25=") == "32" and carry_free_sum("12+34=") == "46"
    task = AdditionTask(1, 2)
    recs = task.noisy_sft_records(4000, 0, noise=0.0, carry_errors=0.6)
    clean = task.sft_records(4000, 0)
    carry = [i for i, r in enumerate(clean) if carry_free_sum(r["prompt"]) != r["answer"]]
    wrong = [i for i, (r, c) in enumerate(zip(recs, clean)) if r["answer"] != c["answer"]]
    assert set(wrong) <= set(carry)                        # only carrying problems change
    assert all(recs[i]["answer"] == carry_free_sum(clean[i]["prompt"]) for i in wrong)
    assert abs(len(wrong) / len(carry) - 0.6) < 0.03
    assert task.noisy_sft_records(100, 7, 0.0, 0.6) == task.noisy_sft_records(100, 7, 0.0, 0.6)
