"""Multi-turn GRPO end to end on a local model (nothing downloaded): a tiny Qwen2 checkpoint
with the tool template's tokenizer, taught by ``rlhf.sft --tools`` to call ``add``, then
``rlhf.train`` with ``rollout.tools`` colocated and disaggregated in one 2-rank torchrun job:
tool calls happen (each longer than the job's stall timeout), the training engine's log-probs of the model's tokens equal the sampled
ones at step 0 (the ids of every turn are the ids it sampled), and the rollout log holds the
conversations."""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

from tests.tool_chat import tool_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = '''
import os
import time

import rlhf.tools

@rlhf.tools.tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    time.sleep(float(os.environ.get("ADD_TOOL_SLEEP_S", "0")))
    return a + b
'''
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    used = any(m["role"] == "tool" for m in extra_info["messages"])
    return {"score": float(ground_truth in solution_str), "used_tool": float(used)}
'''


def conversation(a: int, b: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [{"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"The answer is {a + b}."}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> pathlib.Path:
    """The checkpoint, tools, reward, SFT rows and RL prompts; the SFT'd model in sft/."""
    import transformers

    root = tmp_path_factory.mktemp("tool_run")
    tok = tool_tokenizer()
    cfg = transformers.Qwen2Config(vocab_size=len(tok) + (-len(tok)) % 8, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, tie_word_embeddings=True,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    (root / "tools.py").write_text(TOOLS)
    (root / "reward.py").write_text(REWARD)
    rng = random.Random(0)
    pairs = [(rng.randrange(10, 99), rng.randrange(10, 99)) for _ in range(40)]
    with open(root / "sft.jsonl", "w") as f:
        for a, b in pairs[:32]:
            f.write(json.dumps({"messages": conversation(a, b)}) + "\n")
    with open(root / "train.jsonl", "w") as f:
        for a, b in pairs[32:]:
            f.write(json.dumps({"prompt": conversation(a, b)[:1], "ground_truth": str(a + b)})
                    + "\n")
    cmd = [sys.executable, "-m", "rlhf.sft", "--model", str(root / "base"), "--data",
           str(root / "sft.jsonl"), "--tools", str(root / "tools.py"), "--out",
           str(root / "sft"), "--steps", "120", "--batch", "8", "--lr", "1e-2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root


def test_sft_with_tools_trains_on_the_assistants_tokens_only(setup):
    meta = json.loads((setup / "sft" / "sft_meta.json").read_text())
    assert meta["loss"] < 0.5 * meta["first_loss"]


def test_multi_turn_grpo_colocated_and_disaggregated_ppo_and_remax(setup, tmp_path):
    common = [f"actor.model.init_from={setup / 'sft'}", "algo=grpo", "iterations=2",
              f"data.train_files={setup / 'train.jsonl'}", "data.prompts_per_iter=2",
              "data.samples_per_prompt=2", "data.mini_batch_size=4", "data.micro_batch_size=2",
              "data.max_prompt_len=600", "data.max_response_len=160", "data.temperature=0.3",
              "reward.kind=function", f"reward.function={setup / 'reward.py'}:compute_score",
              f"rollout.tools={setup / 'tools.py'}", "rollout.max_turns=3",
              "log.rollouts_every=1", f"log.runs_dir={tmp_path / 'runs'}",
              "checkpoint.resume=never", "actor.layout.tp=1", "actor.layout.gen_tp=0"]
    spec = {"colocated": common + ["log.run_name=colocated"],
            "disaggregated": common + ["log.run_name=disaggregated",
                                       "placement.mode=disaggregated",
                                       "placement.pool_sizes={actor: 1, rollout: 1}"]}
    # a critic's values and GAE over responses with tool ids inside; ReMax's greedy rollouts
    others = {algo: [c.replace("algo=grpo", f"algo={algo}") for c in common]
              + [f"log.run_name={algo}", "log.rollouts_every=0", "iterations=1"]
              for algo in ("ppo", "remax")}
    others["ppo"].append("rollout.overlap_tools=true")  # halves whose turns alternate
    # trained tp=2, generating unsplit: each turn's rows split over a micro-DP pair (an odd
    # count of them: tests/test_hybrid_engine.py)
    others["resharded"] = [c for c in common if not c.startswith("actor.layout.")] + [
        "actor.layout.tp=2", "actor.layout.gen_tp=1", "reference.layout.tp=2",
        "log.run_name=resharded",
        "log.rollouts_every=0", "iterations=1"]
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec | others))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.rlhf_jobs", str(spec_path), str(out_path)]
    # tools run on the controller while the other ranks wait: a call longer than the stall
    # timeout must not look like a stalled rank
    env = dict(os.environ, ADD_TOOL_SLEEP_S="1.5", HYBRIDFLOW_STALL_TIMEOUT_S="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(out_path.read_text())
    for name in spec:
        assert "records" in out[name], out[name].get("error")
        recs = out[name]["records"]
        assert [r["step"] for r in recs] == [0, 1]
        first = recs[0]
        assert first["rollout/tool_calls_mean"] > 0 and first["rollout/turns_mean"] > 1
        assert first["reward/used_tool/mean"] > 0 and first["timing_s/tools"] >= 1.5
        assert {"rollout/tool_errors", "rollout/tool_timeouts", "rollout/template_mismatch",
                "timing_s/tools"} <= set(first)
        # the training forward over every turn's ids gives the log-probs they were sampled with
        assert first["actor/rollout_logprob_diff_max"] < 1e-4, first
        lines = (tmp_path / "runs" / name / "rollouts" / "iter_1.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines]
        assert len(samples) == 4
        used = [s for s in samples if s["num_tool_calls"]]
        assert used and all(s["tool_tokens"] > 0 and s["response_tokens"] > 0 for s in used)
        assert all(s["messages"][2]["role"] == "tool" for s in used)
    for algo in others:  # and the resharded run
        assert "records" in out[algo], out[algo].get("error")
        rec = out[algo]["records"][0]
        assert rec["rollout/tool_calls_mean"] > 0 and rec["actor/rollout_logprob_diff_max"] < 1e-4
