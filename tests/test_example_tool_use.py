"""examples/tool_use: the generated data, the lookup tool, the reward, and the recipe's commands
run for real at small sizes (SFT with --tools, one GRPO iteration with rollout.tools).

The learning figures are in the example's README (its full run); here the pieces are checked to
work together: the tool answers from each row's extra_info through the run's own catalog, the
SFT'd model calls it, and the run's rollout log holds the tool's answers.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tool_use"
COUNTS = {"train": 16, "val": 8, "sft": 96}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_use_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


make_example, tools, reward = _load("make_example"), _load("tools"), _load("reward")


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> pathlib.Path:
    """The example at small sizes, its SFT'd model in sft/ and a one-iteration GRPO run."""
    out = tmp_path_factory.mktemp("tool_use")
    argv = [str(out), "--seed", "1"] + [a for k, n in COUNTS.items() for a in (f"--{k}", str(n))]
    assert make_example.main(argv) == 0
    _run([sys.executable, "-m", "rlhf.sft", "--model", str(out / "base"), "--data",
          str(out / "sft.jsonl"), "--tools", str(EXAMPLE / "tools.py"), "--out", str(out / "sft"),
          "--steps", "120", "--batch", "16", "--lr", "1e-2"])
    _run([sys.executable, "-m", "rlhf.train", f"actor.model.init_from={out / 'sft'}", "algo=grpo",
          f"data.train_files={out / 'train.jsonl'}", f"data.val_files={out / 'val.jsonl'}",
          "reward.kind=function", f"reward.function={EXAMPLE / 'reward.py'}:compute_score",
          f"rollout.tools={EXAMPLE / 'tools.py'}", "rollout.max_turns=3", "iterations=1",
          "data.max_prompt_len=128", "data.max_response_len=64", "data.prompts_per_iter=4",
          "data.samples_per_prompt=4", "data.mini_batch_size=16", "data.micro_batch_size=8",
          "eval_pass_k=0", "actor.layout.tp=1", "log.rollouts_every=1",
          f"log.runs_dir={out / 'runs'}", "log.run_name=tool_use", "log.plot=false",
          "log.tensorboard=false", "checkpoint.resume=never"])
    return out


def test_rows(out):
    val, notools = _rows(out / "val.jsonl"), _rows(out / "val_notools.jsonl")
    assert len(_rows(out / "train.jsonl")) == COUNTS["train"] and len(val) == COUNTS["val"]
    assert [dict(r, tools=[]) for r in val] == notools
    for r in val + _rows(out / "train.jsonl"):
        extra = r["extra_info"]
        assert r["ground_truth"] == extra["code"] and len(extra["code"]) == 3
        assert f'"{extra["name"]}"' in r["prompt"][0]["content"]


def test_demonstrations_use_the_tool_as_it_answers(out):
    demos = _rows(out / "sft.jsonl")
    assert len(demos) == COUNTS["sft"]
    kinds = {"copied": 0, "misspelt": 0, "guessed": 0}
    for d in demos:
        msgs, extra = d["messages"], d["extra_info"]
        final = reward.compute_score("tool_use", msgs[-1]["content"], d["ground_truth"],
                                     {"messages": msgs})
        if len(msgs) == 2:
            kinds["guessed"] += 1
            assert final["used_tool"] == 0.0
            continue
        (call,) = msgs[1]["tool_calls"]
        asked = call["function"]["arguments"]["name"]
        assert msgs[2]["content"] == tools.lookup(asked, extra)  # what the tool would answer
        assert final == {"score": float(asked == extra["name"]), "used_tool": 1.0} or \
            final["score"] == 0.0  # a misspelt call is followed by a guess (right 1 in 900)
        kinds["copied" if asked == extra["name"] else "misspelt"] += 1
    assert all(kinds.values()), kinds  # imperfect: every kind of demonstration is there


def test_lookup_through_the_run_catalog(out):
    from rlhf.tools.calls import ToolRunner
    from rlhf.tools.catalog import load_catalog
    from rlhf.tools.formats import ToolCall

    catalog = load_catalog(str(EXAMPLE / "tools.py"), {})
    params = catalog.schemas()[0]["function"]["parameters"]
    assert list(params["properties"]) == ["name"]  # extra_info is not shown to the model
    runner = ToolRunner(4, 5.0)
    for r in _rows(out / "val.jsonl")[:3]:
        name, code = r["extra_info"]["name"], r["extra_info"]["code"]
        box = catalog.open(r)
        right, wrong = runner.run([(box, ToolCall("lookup", {"name": name})),
                                   (box, ToolCall("lookup", {"name": name + "x"}))])
        assert (right.text, wrong.text) == (code, tools.UNKNOWN)
    (none,) = runner.run([(catalog.open(_rows(out / "val_notools.jsonl")[0]),
                           ToolCall("lookup", {"name": "x"}))])
    assert none.error and "unknown tool" in none.text


def test_reward():
    extra = {"name": "kalom", "code": "417"}
    call = make_example.call_message("kalom")
    asked = [{"role": "user", "content": make_example.question("kalom", 0)}]
    used = asked + [call, {"role": "tool", "name": "lookup", "content": "417"}]

    def score(text, messages):
        return reward.compute_score("tool_use", text, "417", dict(extra, messages=messages))

    assert score("The code is 417.", used) == {"score": 1.0, "used_tool": 1.0}
    assert score("The code is 471.", used) == {"score": 0.0, "used_tool": 1.0}
    assert score("The code is 417.", asked) == {"score": 1.0, "used_tool": 0.0}
    assert score("417", used)["score"] == 0.0  # not in the answer format
    assert reward.compute_score("tool_use", "The code is 417.", "417", None)["score"] == 1.0


def test_grpo_run_calls_the_tool(out):
    (rec,) = [json.loads(line) for line in (out / "runs" / "tool_use" / "metrics.jsonl")
              .read_text().splitlines() if '"step"' in line]
    assert rec["rollout/tool_calls_mean"] > 0 and rec["reward/used_tool/mean"] > 0
    assert "val/accuracy" in rec
    samples = _rows(out / "runs" / "tool_use" / "rollouts" / "iter_0.jsonl")
    assert len(samples) == 16
    rows = {r["prompt"][0]["content"]: r for r in _rows(out / "train.jsonl")}
    answered = 0
    for s in samples:
        msgs, extra = s["messages"], rows[s["messages"][0]["content"]]["extra_info"]
        for call_msg, result in zip(msgs[1:], msgs[2:]):
            if result["role"] != "tool" or not call_msg.get("tool_calls"):
                continue
            answered += 1
            (call,) = call_msg["tool_calls"]
            args = call["function"]["arguments"]
            if call["function"]["name"] == "lookup" and set(args) == {"name"}:
                assert result["content"] == tools.lookup(args["name"], extra)  # from extra_info
    assert answered, [s["messages"] for s in samples]
