"""End-to-end RLHF runtime on 2 ranks: every algorithm and placement for 2 iterations in one
torchrun job, validation before launch, kill -9 and resume (exact metrics), resume on another
world size and layout."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlhf.checkpoint import load_checkpoint
from rlhf.model_arch import llama_config
from rlhf.programs import algorithm_names
from tests.test_user_algorithm import readme_algorithm
from rlhf.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISY = ("timing_s/", "perf/", "memory/")
REQUIRED = ["step", "reward/mean", "timing_s/gen", "timing_s/reshard", "timing_s/ref",
            "timing_s/values", "timing_s/reward", "timing_s/adv", "timing_s/update_critic",
            "timing_s/update_actor", "timing_s/step", "perf/throughput_tokens_per_s",
            "actor/pg_loss", "actor/kl", "actor/entropy", "actor/clipfrac", "critic/vf_loss",
            "memory/peak_rss_gb"]
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot=false"]
TINY = ["actor.model.hidden_size=32", "actor.model.intermediate_size=64"] + QUIET


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *args]


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def _exact(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith(NOISY)}


# Every algorithm and placement, 2 iterations, one job -----------------------------------------
RUNS = {
    "ppo": ["algo=ppo", "reward.kind=both", "reward.model_weight=0.1",
            "log.tensorboard=true", "log.plot=true"],
    "remax": ["algo=remax"],
    "safe_rlhf": ["algo=safe_rlhf", "reward.cost_kind=model"],
    "grpo": ["algo=grpo", "algo.recompute_log_prob=false"],
    "rloo": ["algo=rloo"],
    "reinforce_pp": ["algo=reinforce_pp"],
    "ppo_split": ["algo=ppo", "placement.mode=split", "placement.pool_sizes={actor: 1, critic: 1}",
                  "actor.layout.tp=1"],
    "ppo_auto": ["algo=ppo", "placement.mode=auto"],
    "grpo_standalone": ["algo=grpo", "placement.mode=standalone", "actor.layout.tp=1",
                        "placement.pool_sizes={actor: 1, reference: 1}"],
    # a user's algorithm from a file (the README's my_algo.py, written by the fixture)
    "user_algo": ["algo=my_grpo", "algo.module={dir}/my_algo.py"],
}
RUNS["grpo_again"] = RUNS["grpo"]  # the same run twice: the same curve
# every other registered algorithm with its shipped recipe (a new one is covered at once)
RUNS |= {name: [f"algo={name}"] for name in algorithm_names() if name not in RUNS}
# partial credit: groups that differ on the untrained model (exact match scores all 0)
RUNS["dapo"] += ["reward.rule_weights={exact: 1.0, partial: 1.0}"]


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("algos")
    (d / "my_algo.py").write_text(readme_algorithm())
    spec = {name: [*(a.replace("{dir}", str(d)) for a in o), "iterations=2",
                   f"log.runs_dir={d}", f"log.run_name={name}", "checkpoint.resume=never"]
            for name, o in RUNS.items()}
    with open(d / "spec.json", "w") as f:
        json.dump(spec, f)
    # 23 runs in one job: 1-3.5 min on a loaded 2-core machine, so more than _run's default
    _run(_torchrun(2, "-m", "tests.rlhf_jobs", str(d / "spec.json"), str(d / "out.json")),
         timeout=600)
    with open(d / "out.json") as f:
        return d, json.load(f)


@pytest.mark.parametrize("name", list(RUNS))
def test_algorithm_two_iterations(all_runs, name):
    d, out = all_runs
    assert "error" not in out[name], out[name].get("traceback")
    recs = out[name]["records"]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["timing_s/gen"] > 0 and r["perf/throughput_tokens_per_s"] > 0
        assert r["actor/entropy"] > 0 and "actor/pg_loss" in r
    assert read_metrics(str(d / name / "metrics.jsonl")) == recs
    assert os.path.isfile(d / name / "checkpoints" / "step_00000002" / "meta.json")
    if name == "dapo":
        assert all(r["dapo/trained_groups"] > 0 for r in recs)
        assert all(1 <= r["dapo/gen_rounds"] <= 4 for r in recs)


def test_same_seed_same_curve(all_runs):
    """Reproducible: the same config twice in one job gives the same records (rewards, losses,
    held-out metrics), bit for bit, apart from timings."""
    _, out = all_runs
    first, again = out["grpo"]["records"], out["grpo_again"]["records"]
    assert [_exact(r) for r in first] == [_exact(r) for r in again]
    assert "val/accuracy" in first[0] and "val/pass@k" in first[-1]


def test_ppo_metrics_and_outputs(all_runs):
    d, out = all_runs
    recs = out["ppo"]["records"]
    for r in recs:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
    assert os.path.isfile(d / "ppo" / "metrics.png")
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(d / "ppo"))
    assert "cost/lagrange" in out["safe_rlhf"]["records"][1]
    assert "reward/greedy_baseline" in out["remax"]["records"][0]
    # the generation engine's log-probs against the training engine's: the same policy, the
    # same temperature, other kernels (rounding only)
    assert all(0 <= r["actor/rollout_logprob_diff"] < 1e-4 for r in recs)
    assert "actor/rollout_logprob_diff" not in out["grpo"]["records"][0]  # not recomputed


def test_batch_validation_names_values_before_launch():
    env = _env() | {"WORLD_SIZE": "4", "RANK": "0"}
    res = subprocess.run([sys.executable, "-m", "rlhf.train", "algo=ppo",
                          "data.mini_batch_size=8", "data.micro_batch_size=4"],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)  # a hang guard only (CPU cost: bench/config_check.py)
    assert res.returncode == 2
    assert "mini_batch_size=8" in res.stderr and "micro_batch_size=4" in res.stderr
    assert "dp=4" in res.stderr


# Kill -9 during training, torn saves, exact resume; resume on another layout ----------------
KILL_RUN = ["algo=ppo", "iterations=6", "checkpoint.save_every=2", "checkpoint.keep_last=0",
            "data.prompts_per_iter=8", "data.mini_batch_size=4", "data.micro_batch_size=2",
            *TINY]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(_torchrun(2, "-m", "rlhf.train", *args), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _kill_when(proc: subprocess.Popen, cond, timeout: float = 120) -> bool:
    """SIGKILL the launcher and every rank as soon as ``cond()`` holds; False if the job
    ended first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if cond():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.0005)
    proc.wait()
    return False


def test_kill_and_resume_exact(tmp_path):
    ref_args = [*KILL_RUN, f"log.runs_dir={tmp_path}", "log.run_name=ref"]
    _run(_torchrun(2, "-m", "rlhf.train", *ref_args))
    ref = read_metrics(str(tmp_path / "ref" / "metrics.jsonl"))
    assert len(ref) == 6

    args = [*KILL_RUN, f"log.runs_dir={tmp_path}", "log.run_name=killed"]
    metrics = str(tmp_path / "killed" / "metrics.jsonl")
    ckpt = tmp_path / "killed" / "checkpoints"
    # 1. kill -9 mid-training (after the third iteration was logged)
    assert _kill_when(_start(args), lambda: len(read_metrics(metrics)) >= 3)
    assert 3 <= len(read_metrics(metrics)) < 6
    # 2. resume, kill -9 the moment a save's temporary folder appears (the kill can land
    #    just after its rename: either way the resume below must be exact)
    before = set(os.listdir(ckpt))
    assert _kill_when(_start(args), lambda: any(
        n.startswith(".tmp-") and n not in before for n in os.listdir(ckpt)))
    assert len(read_metrics(metrics)) < 6
    # What a torn save leaves: a temporary folder of a dead process and a step folder without
    # a complete meta.json.  Neither may be picked up.
    (ckpt / ".tmp-step_00000004-999999-deadbeef").mkdir(exist_ok=True)
    (ckpt / "step_00000099").mkdir()
    (ckpt / "step_00000099" / "actor.safetensors").write_bytes(b"torn")
    # 3. resume to the end: every metric except timings equals the uninterrupted run's
    res = _run(_torchrun(2, "-m", "rlhf.train", *args))
    assert "resumed from" in res.stdout
    got = read_metrics(metrics)
    assert [r["step"] for r in got] == list(range(6))
    assert [_exact(r) for r in got] == [_exact(r) for r in ref]


def test_resume_on_other_world_size_and_layout(tmp_path):
    """A sharded checkpoint of the 2-rank run (actor 1-2-1, critic 1-1-2) loads bit-exact into
    other layouts (actor pp=2, critic tp=2 on 2 ranks; everything 1-1-1 in one process; every
    role tp=2 on 4 ranks, then tp=1 on 2 ranks from that one and back to 4 ranks tp=2), each
    job saving what it loaded, and a run resumes from it in one process."""
    _run(_torchrun(2, "-m", "rlhf.train", *KILL_RUN, "iterations=4",
                   f"log.runs_dir={tmp_path}", "log.run_name=src"))
    ckpt = str(tmp_path / "src" / "checkpoints" / "step_00000002")
    tp2 = ["actor.layout.tp=2", "critic.layout.tp=2", "reference.layout.tp=2"]
    layouts = {"pp2": (2, ["actor.layout.pp=2", "actor.layout.tp=1", "actor.layout.gen_tp=1",
                           "critic.layout.tp=2", "reference.layout.pp=2"], None),
               "single": (1, ["actor.layout.tp=1"], None),
               # each from the previous job's checkpoint
               "tp2_4ranks": (4, tp2, None),
               "tp1_2ranks": (2, ["actor.layout.tp=1"], "tp2_4ranks"),
               "tp2_4ranks_back": (4, tp2, "tp1_2ranks")}
    _, want, want_state = load_checkpoint(ckpt)
    for name, (nproc, over, source) in layouts.items():
        root = str(tmp_path / name)
        src = ckpt if source is None else str(tmp_path / source / "step_00000002")
        job = ["-m", "tests.rlhf_jobs", "reshard", src, root, *KILL_RUN, *over]
        _run(_torchrun(nproc, *job) if nproc > 1 else [sys.executable, *job])
        _, got, got_state = load_checkpoint(os.path.join(root, "step_00000002"))
        assert sorted(got) == sorted(want)
        for group in want:
            assert sorted(got[group]) == sorted(want[group]), group
            for k, v in want[group].items():
                assert torch.equal(got[group][k], v), (name, group, k)
        assert got_state["optim"] == want_state["optim"]
        assert got_state["stream"] == want_state["stream"]

    dst = tmp_path / "dst" / "checkpoints"
    dst.mkdir(parents=True)
    shutil.copytree(ckpt, dst / "step_00000002")
    _run([sys.executable, "-m", "rlhf.train", *KILL_RUN, "iterations=4", "actor.layout.tp=1",
          f"log.runs_dir={tmp_path}", "log.run_name=dst"])
    b = read_metrics(str(tmp_path / "dst" / "metrics.jsonl"))
    assert [r["step"] for r in b] == [2, 3]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in b)


# Reward / cost model training (one process) --------------------------------------------------
def test_train_cost_model_bradley_terry(tmp_path):
    from engine.hf_interop import read_hf_config
    from engine.llama_spec import LlamaConfig
    from hybridflow_comm.devices import FP32
    from rlhf.task import AdditionTask, CharTokenizer, CostRule
    from rlhf.train_rm import train_rm
    from rlhf.workers.specs import ModelSpec

    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    spec = ModelSpec(config=cfg, head="value", init_from=None, seed=0, fresh_head=False,
                     lora=None, lora_init_from=None)
    res = train_rm(spec, "cost", AdditionTask(1, 2), CostRule("7"),
                   CharTokenizer.build(), out=str(tmp_path / "cm"), steps=60, batch=32, lr=3e-3,
                   width=14, precision=FP32)
    assert res["accuracy_after"] > 0.9 > res["accuracy_before"]
    assert read_hf_config(str(tmp_path / "cm")) == cfg


def test_init_from_checked_before_launch(tmp_path):
    from engine.hf_interop import config_to_hf
    from rlhf.builders import check_run
    from rlhf.config import load_config
    from rlhf.task import CharTokenizer

    with pytest.raises(ValueError, match="init_from='/nonexistent' is not an HF-format folder"):
        check_run(load_config(["actor.model.init_from=/nonexistent"]), CharTokenizer.build())
    other = llama_config(load_config(["actor.model.hidden_size=32"]).actor.model)
    config_to_hf(other).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"the config sets hidden_size=64 but its config.json "
                                         r"has hidden_size=32"):
        check_run(load_config([f"actor.model.init_from={tmp_path}", "actor.model.hidden_size=64"]),
                  CharTokenizer.build())
    # sizes left out come from the checkpoint
    assert llama_config(load_config([f"actor.model.init_from={tmp_path}"]).actor.model) == other
    with pytest.raises(ValueError, match=r"vocab_size=32 but the tokenizer \(built-in\) has 24"):
        check_run(load_config(["actor.model.vocab_size=32"]), CharTokenizer.build())


def test_role_head_positions_match_the_rollout_log_probs():
    """The roles' head runs from the last prompt position (response_head_from) and keeps N
    outputs (response_outputs): on a left-padded rollout these must be the log-probs the
    generation engine sampled with (KV-cache path, computed independently)."""
    from engine.generation import GenerationEngine
    from engine.llama_spec import LlamaConfig, init_full_state_dict
    from engine.model import ParallelLlama, load_full_state_dict
    from engine.sampling import SamplingParams
    from engine.train import TrainEngine
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from rlhf.controller import Batch
    from rlhf.workers.common import model_inputs, response_head_from, response_outputs

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=1, std=0.3))
    gen = GenerationEngine(cfg, groups)
    gen.set_weights(model.params)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 32, (6, 7), generator=g)
    mask = (torch.arange(7) >= torch.tensor([0, 1, 2, 3, 5, 6])[:, None]).long()
    out = gen.generate(ids, mask, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3,
                                                 eos_token_id=2, pad_token_id=0))
    batch = Batch({"input_ids": out.input_ids, "attention_mask": out.attention_mask,
                   "response_mask": out.response_mask})
    assert response_head_from(batch) == 6  # P - 1
    with torch.no_grad():
        outs = TrainEngine(model).forward([model_inputs(batch)],
                                          head_from=response_head_from(batch), temperature=1.0)
    got = response_outputs(outs[0]["log_probs"], batch)
    keep = out.response_mask.bool()
    assert got.shape == out.log_probs.shape and keep.sum() > 10
    torch.testing.assert_close(got[keep], out.log_probs[keep], rtol=0, atol=1e-4)
