"""GRPO with an expert-parallel actor and reference (``actor.layout.ep=2``, router replay, on 2
ranks) against the same run at ``ep=1``; its sharded checkpoint against the ``ep=1`` run's
layout in both directions.

Both runs generate on the same generation layout from generation weights that the transition
moves (never computes), so their first rollouts are the same tokens; every figure of both
iterations then agrees to rounding, and so do the exported HF weights.  The checkpoint of
each run, loaded at the other's layout and saved again, is the same bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlhf.checkpoint import load_checkpoint
from tests.rlhf_jobs import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = ["algo=grpo", "iterations=2", "actor.model.num_experts=4",
       "actor.model.num_experts_per_tok=2", "actor.router_replay=true",
       "actor.router_aux_loss_coef=0.01", "actor.layout.tp=1", "actor.layout.gen_tp=1",
       "reference.layout.tp=1", "data.prompts_per_iter=4", "data.samples_per_prompt=2",
       "data.mini_batch_size=8", "data.micro_batch_size=2", "checkpoint.save_every=2",
       "checkpoint.keep_last=0", "checkpoint.resume=never"]
EP2 = ["actor.layout.ep=2", "reference.layout.ep=2"]
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8",
        "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "actor.optim.lr=1e-3"]
DYNAMIC = ["actor.use_dynamic_bsz=true", "actor.max_token_len_per_micro_batch=24"]
GEN_TP2 = ["actor.layout.tp=2", "actor.layout.gen_tp=2", "reference.layout.tp=2"]
GEN_EP2 = GEN_TP2 + ["actor.layout.ep=2", "actor.layout.gen_ep=2", "reference.layout.ep=2"]
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/router_aux_loss",
            "actor/entropy", "actor/router_replay_fraction")


def agreeing_records(out, first, second):
    """The records of runs ``first`` and ``second``, checked to agree: both finished, the
    same steps and first rollouts, every figure of both iterations to rounding, the rollouts'
    log-probs the training engine's."""
    for name in (first, second):
        assert "records" in out[name], out[name].get("traceback")
    a, b = out[first]["records"], out[second]["records"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1]
    assert a[0]["reward/mean"] == b[0]["reward/mean"]  # the same first rollouts
    for ra, rb in zip(a, b):
        for key in COMPARED:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)
        assert rb["actor/rollout_logprob_diff"] < 1e-4
    return a, b


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_runs")
    common = MOE + [f"log.runs_dir={tmp / 'runs'}"]
    lora = [o for o in common if not o.startswith("reference.")] + LORA
    out = launch({"ep1": common + ["log.run_name=ep1"],
                  "ep2": common + EP2 + ["log.run_name=ep2"],
                  "lora_ep1": lora + ["log.run_name=lora_ep1"],
                  "lora_ep2": lora + ["actor.layout.ep=2", "log.run_name=lora_ep2"],
                  "dyn_ep1": common + DYNAMIC + ["log.run_name=dyn_ep1"],
                  "dyn_ep2": common + EP2 + DYNAMIC + ["log.run_name=dyn_ep2"],
                  "gen_tp2": common + GEN_TP2 + ["log.run_name=gen_tp2"],
                  "gen_ep2": common + GEN_EP2 + ["log.run_name=gen_ep2"]}, tmp)
    return tmp, out


def test_expert_parallel_run_equals_ep_1(runs):
    tmp, out = runs
    _, b = agreeing_records(out, "ep1", "ep2")
    for rb in b:  # experts replayed
        assert 0.8 < rb["actor/router_replay_fraction"] < 1.0
    import transformers

    hf = {n: transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp / "runs" / n / "hf" / "actor")).state_dict() for n in ("ep1", "ep2")}
    assert hf["ep1"].keys() == hf["ep2"].keys()
    for k, v in hf["ep1"].items():
        torch.testing.assert_close(hf["ep2"][k], v, atol=1e-5, rtol=0, msg=k)


DISAGGREGATED = ["placement.mode=disaggregated", "placement.pool_sizes={actor: 2, rollout: 2}"]


@pytest.fixture(scope="module")
def disaggregated_runs(tmp_path_factory):
    """A disaggregated run on 4 ranks (actor and reference on 2, the rollout pool on 2),
    the actor at ep=2 and at ep=1."""
    tmp = tmp_path_factory.mktemp("ep_disaggregated")
    common = MOE + DISAGGREGATED + [f"log.runs_dir={tmp / 'runs'}"]
    return launch({"ep1": common + ["log.run_name=ep1"],
                   "ep2": common + EP2 + ["log.run_name=ep2"]}, tmp, nproc=4)


def test_disaggregated_run_pushes_expert_parallel_weights(disaggregated_runs):
    """The weight push from an expert-parallel actor (each expert sent whole from its EP
    block to the rollout pool, cut over its gen_tp there) gives the rollout pool the same
    weights as from the ep=1 actor: the same first rollouts, every figure of both iterations
    to rounding, the push's bytes the same."""
    a, b = agreeing_records(disaggregated_runs, "ep1", "ep2")
    pushed = [k for k in a[0] if "push" in k or "sync" in k]
    assert pushed, sorted(a[0])
    for key in (k for k in pushed if "bytes" in k):
        assert b[0][key] == a[0][key], key


def test_generation_expert_parallel_run_equals_gen_tp(runs):
    """``actor.layout.gen_ep=2`` inside generation TP 2 (each rank generating with half the
    experts, whole) against the same run with every expert split over generation TP: the
    same first rollouts and every figure of both iterations to rounding."""
    agreeing_records(runs[1], "gen_tp2", "gen_ep2")


def test_lora_run_with_expert_parallelism_equals_ep_1(runs):
    """LoRA adapters on the attention of the expert-parallel actor (the reference is the actor
    with its adapters off): both iterations' figures equal the ep=1 run's."""
    _, out = runs
    for name in ("lora_ep1", "lora_ep2"):
        assert "records" in out[name], out[name].get("traceback")
    a, b = out["lora_ep1"]["records"], out["lora_ep2"]["records"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1]
    for ra, rb in zip(a, b):
        for key in COMPARED + ("actor/kl",):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)


def test_token_budget_micro_batches_under_expert_parallelism(runs):
    """use_dynamic_bsz with an EP group across DP ranks (ep=2 > tp=1): every pass runs one
    micro-batch count on all DP ranks, and the figures equal the ep=1 run's."""
    _, out = runs
    for name in ("dyn_ep1", "dyn_ep2"):
        assert "records" in out[name], out[name].get("traceback")
    for ra, rb in zip(out["dyn_ep1"]["records"], out["dyn_ep2"]["records"], strict=True):
        for key in COMPARED:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)


def _latest(folder):
    return os.path.join(folder, sorted(os.listdir(folder))[-1])


def test_checkpoints_move_between_expert_parallel_and_plain_layouts(runs):
    """Each run's checkpoint, loaded by the roles of the other run's layout (and the ep=1
    run's by ep=2 at tp=2, whose experts' down_proj is stored as its 2 generation pieces) and
    saved again, holds the same tensors and optimizer state, bit for bit."""
    tmp, out = runs
    stacked = EP2 + ["actor.layout.tp=2", "actor.layout.gen_tp=2"]  # down_proj as 2 pieces
    for src, layout in (("ep2", []), ("ep1", EP2), ("ep1", stacked)):
        ckpt = _latest(str(tmp / "runs" / src / "checkpoints"))
        root = str(tmp / f"{src}_resaved_{len(layout)}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "tests.rlhf_jobs", "reshard", ckpt, root,
               *MOE, *layout]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
        _, want, want_state = load_checkpoint(ckpt)
        _, got, got_state = load_checkpoint(_latest(root))
        assert sorted(got) == sorted(want)
        experts = 0
        for group in want:
            assert sorted(got[group]) == sorted(want[group]), group
            for k, v in want[group].items():
                assert torch.equal(got[group][k], v), (src, group, k)
                experts += ".experts." in k
        assert experts > 0
        assert got_state["optim"] == want_state["optim"]
