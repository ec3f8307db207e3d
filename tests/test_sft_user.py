"""``rlhf.sft`` on a user's model and data: examples/gsm8k_style's tokenizer and rows, and a
small Llama checkpoint written with transformers (nothing downloaded).

Pure checks first (the loss masks of ``messages`` and ``prompt``/``response`` rows, both ways
of finding the assistant tokens, dropped rows, batches and the DP share), then a short run of
the CLI that must lower the response loss and save a checkpoint transformers loads with our
logits, the 2-rank data-parallel run against one process, and bad inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import pytest
import torch

from hybridflow_comm.devices import FP32
from rlhf import sft
from rlhf.task import HFTokenizer
from tests.example_data import build_example

SFT_ROWS = 48


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> pathlib.Path:
    """The example's tokenizer and rows, plus ``llama/``: a small Llama with that tokenizer."""
    return build_example(tmp_path_factory.mktemp("gsm8k_sft"), train=4, val=4, sft=SFT_ROWS)


@pytest.fixture(scope="module")
def tok(example) -> HFTokenizer:
    return HFTokenizer(example / "llama")


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trained(demo: sft.Demo) -> list[int]:
    return [t for t, m in zip(demo.input_ids, demo.loss_mask) if m]


def _answer(tok: HFTokenizer, text: str) -> list[int]:
    return list(tok.tok(text, add_special_tokens=False)["input_ids"]) + [tok.eos_id]


def _span(demo: sft.Demo) -> tuple[int, int]:
    """First and one-past-last trained position; the trained positions must be contiguous."""
    pos = [i for i, m in enumerate(demo.loss_mask) if m]
    assert pos == list(range(pos[0], pos[-1] + 1))
    return pos[0], pos[-1] + 1


# Loss masks ------------------------------------------------------------------------------------
def test_messages_mask_is_the_assistant_tokens_and_eos(example, tok):
    assert sft._GENERATION_BLOCK.search(tok.tok.chat_template)  # the template's own mask
    for row in _rows(example / "sft.jsonl")[:8]:
        user, assistant = row["messages"]
        demo = sft.encode_row(row, tok, "row")
        assert len(demo.input_ids) == len(demo.loss_mask)
        assert _trained(demo) == _answer(tok, assistant["content"])
        start, _ = _span(demo)
        assert demo.input_ids[:start] == tok.encode_prompt([user])  # the RL prompt rendering


def _without_generation_blocks(example, tmp_path) -> HFTokenizer:
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(str(example / "tokenizer"))
    ref.chat_template = ref.chat_template.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", "")
    assert not sft._GENERATION_BLOCK.search(ref.chat_template)
    ref.save_pretrained(str(tmp_path))
    return HFTokenizer(tmp_path)


def test_prefix_rendering_finds_the_same_tokens(example, tok, tmp_path):
    plain = _without_generation_blocks(example, tmp_path)
    rows = _rows(example / "sft.jsonl")[:6]
    two_turns = {"messages": rows[0]["messages"] + rows[1]["messages"]}
    for row in rows + [two_turns]:
        assert sft.encode_row(row, plain, "row") == sft.encode_row(row, tok, "row")
    demo = sft.encode_row(two_turns, plain, "row")
    answers = [m["content"] for m in two_turns["messages"] if m["role"] == "assistant"]
    assert _trained(demo) == _answer(tok, answers[0]) + _answer(tok, answers[1])


def test_prompt_response_mask_is_the_response_and_eos(example, tok):
    chat = _rows(example / "sft.jsonl")[:8]
    for flat, c in zip(_rows(example / "sft_flat.jsonl")[:8], chat):
        for prompt in (flat["prompt"], c["messages"][:1]):  # a string, a chat list
            demo = sft.encode_row({"prompt": prompt, "response": flat["response"]}, tok, "row")
            assert _trained(demo) == _answer(tok, flat["response"])
            start, end = _span(demo)
            assert end == len(demo.input_ids)
            assert demo.input_ids[:start] == tok.encode_prompt(prompt)
        # a chat-list prompt gives the same tokens and mask as the messages row
        assert sft.encode_row({"prompt": c["messages"][:1], "response": flat["response"]},
                              tok, "row").input_ids == \
            sft.encode_row(c, tok, "row").input_ids[:len(demo.input_ids)]


def test_long_rows_are_dropped_and_counted(example, tok):
    rows = sft.read_rows(str(example / "sft.jsonl"))
    lengths = sorted(len(sft.encode_row(r, tok, w).input_ids) for w, r in rows)
    cut = lengths[len(lengths) // 2]
    kept, dropped = sft.encode_rows(rows, tok, cut)
    assert all(len(d.input_ids) <= cut for d in kept)
    assert dropped == sum(n > cut for n in lengths) > 0 and len(kept) + dropped == len(rows)
    with pytest.raises(ValueError, match="all 48 rows are longer than --max-len=5"):
        sft.encode_rows(rows, tok, 5)


def test_batch_layout_and_dp_share():
    demos = [sft.Demo([5, 6, 7, 8], [0, 0, 1, 1]), sft.Demo([5, 9, 2], [0, 1, 1]),
             sft.Demo([5, 6, 3, 3, 2], [0, 0, 1, 1, 1]), sft.Demo([4, 2], [0, 1])]
    b = sft.sft_user_batch(demos, pad_id=0)
    assert b["input_ids"].shape == (4, 5) and b["loss_mask"].shape == (4, 4)
    assert b["input_ids"][1].tolist() == [5, 9, 2, 0, 0]
    assert b["attention_mask"][1].tolist() == [1, 1, 1, 0, 0]
    assert b["loss_mask"][1].tolist() == [1, 1, 0, 0]  # targets: token t + 1
    whole = sft.dp_share(b, 1, 0)
    assert torch.allclose(whole["loss_weight"], b["loss_mask"] / 8)  # 8 loss tokens
    halves = [sft.dp_share(b, 2, r) for r in range(2)]
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), b["input_ids"])
    # mean over the 2 ranks of the per-rank weighted sums = the token mean of the whole batch
    lp = torch.randn(4, 4)
    per_rank = [-(lp[2 * r:2 * r + 2] * h["loss_weight"]).sum() for r, h in enumerate(halves)]
    assert torch.allclose(sum(per_rank) / 2, -(lp * b["loss_mask"]).sum() / 8)


def test_batch_rows_walk_shuffled_epochs():
    n, batch = 10, 4
    stream = [i for step in range(5) for i in sft.batch_rows(n, batch, step)]
    assert sorted(stream[:10]) == sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]  # a fresh order per epoch
    assert sft.batch_rows(n, batch, 3) == stream[12:16]  # pure: same step, same rows


# Training runs ---------------------------------------------------------------------------------
def _hf_response_loss(folder: pathlib.Path, demos: list[sft.Demo]) -> float:
    """Token-mean NLL of the trained tokens, computed by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    b = sft.sft_user_batch(demos, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, b["input_ids"][:, 1:, None]).squeeze(-1)
    return float(-(lp * b["loss_mask"]).sum() / b["loss_mask"].sum())


def _our_logits(folder: pathlib.Path, ids: torch.Tensor) -> torch.Tensor:
    from engine.hf_interop import read_hf_config
    from engine.train import TrainEngine
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from rlhf.workers.common import build_model
    from rlhf.workers.specs import ModelSpec

    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = build_model(ModelSpec(config=read_hf_config(str(folder)), head="lm",
                                  init_from=str(folder), seed=0, fresh_head=False,
                                  lora=None, lora_init_from=None), groups)
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return TrainEngine(model).forward([mb], with_logits=True, temperature=1.0)[0]["logits"]


def test_sft_run_lowers_the_response_loss_and_saves_an_hf_checkpoint(example, tok, tmp_path,
                                                                     capsys):
    import transformers

    out = tmp_path / "llama-sft"
    argv = ["--model", str(example / "llama"), "--data", str(example / "sft.jsonl"),
            "--out", str(out), "--steps", "40", "--batch", "8", "--lr", "3e-3"]
    assert sft.main(argv) == 0
    assert f"[sft] saved {out}" in capsys.readouterr().out
    meta = json.loads((out / sft.META).read_text())
    assert meta["rows"] == SFT_ROWS and meta["dropped"] == 0
    assert meta["loss"] < 0.7 * meta["first_loss"]

    demos = [sft.encode_row(r, tok, "row") for r in _rows(example / "sft.jsonl")[:16]]
    before = _hf_response_loss(example / "llama", demos)
    after = _hf_response_loss(out, demos)
    assert after < 0.7 * before, (before, after)

    ids = torch.tensor([demos[0].input_ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert (_our_logits(out, ids) - ref).abs().max().item() <= 1e-4
    assert hf.config.eos_token_id == tok.eos_id  # carried from the source config.json

    saved = transformers.AutoTokenizer.from_pretrained(str(out))
    text = _rows(example / "sft_flat.jsonl")[0]["response"]
    assert saved(text)["input_ids"] == tok.tok(text)["input_ids"]
    assert saved.chat_template == tok.tok.chat_template


def _dp_run(rank: int, world: int, args: dict) -> dict:
    job = sft.prepare_user(argparse.Namespace(**args), world, FP32)
    return sft.train_user(job)


def test_data_parallel_matches_one_process(pool2, example, tmp_path):
    from safetensors.torch import load_file

    args = {"model": str(example / "llama"), "data": str(example / "sft.jsonl"), "steps": 3,
            "batch": 8, "lr": 3e-3, "max_len": None}
    one = sft.train_user(sft.prepare_user(argparse.Namespace(**args, out=str(tmp_path / "1")),
                                          1, FP32))
    two = pool2.run(_dp_run, dict(args, out=str(tmp_path / "2")))
    for key in ("first_loss", "loss"):
        assert two[0][key] == two[1][key] == pytest.approx(one[key], rel=1e-5)
    w1 = load_file(str(tmp_path / "1" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "2" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)
    assert json.loads((tmp_path / "2" / sft.META).read_text())["settings"]["world"] == 2


# Bad inputs ------------------------------------------------------------------------------------
def test_bad_inputs_exit_2_with_the_reason(example, tmp_path, capsys):
    model, out = str(example / "llama"), str(tmp_path / "out")
    no_response = tmp_path / "bad.jsonl"
    no_response.write_text(json.dumps({"prompt": "hi"}) + "\n")
    no_assistant = tmp_path / "user_only.jsonl"
    no_assistant.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    (tmp_path / "empty_model").mkdir()
    data = str(example / "sft.jsonl")
    cases = [
        (["--model", model, "--data", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--model", model, "--data", str(no_response)],
         f"{no_response}:1: a row needs 'messages'"),
        (["--model", model, "--data", str(no_assistant)], "has no assistant turn"),
        (["--model", str(tmp_path / "empty_model"), "--data", data], "no config.json"),
        (["--model", model, "--data", data, "--batch", "0"], "--batch=0 must be >= 1"),
        (["--model", model, "--data", data, "--max-len", "100000"], "--max-len=100000"),
        (["--model", model, "--data", data, "device=cuda"] if not torch.cuda.is_available()
         else ["--model", model, "--data", data, "device=tpu"], "device="),
        (["--model", model, "--data", data, "precision=fp16"], "precision='fp16' must be one of"),
    ]
    for argv, message in cases:
        assert sft.main(argv + ["--out", out]) == 2, argv
        assert message in capsys.readouterr().err, (argv, message)
    assert not os.path.exists(out)
    with pytest.raises(ValueError, match="a row needs 'messages'"):
        sft.encode_row({"prompt": "hi", "answer": "x"}, HFTokenizer(model), "row")
    with pytest.raises(SystemExit) as e:  # --model without --data
        sft.main(["--model", model, "--out", out])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # run-config keys other than device and precision
        sft.main(["--model", model, "--data", data, "--out", out, "algo=grpo"])
    assert e.value.code == 2 and "only device=, precision= are taken" in capsys.readouterr().err


def test_bf16_run_trains_and_saves_bf16(example, tmp_path):
    out = tmp_path / "bf16"
    argv = ["--model", str(example / "llama"), "--data", str(example / "sft.jsonl"),
            "--out", str(out), "--steps", "20", "--batch", "8", "--lr", "3e-3",
            "device=cpu", "precision=bf16"]
    assert sft.main(argv) == 0
    meta = json.loads((out / sft.META).read_text())
    assert meta["loss"] < 0.8 * meta["first_loss"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
