"""The runtime on devices: device checks before any group, NCCL environment defaults, the
worker boundary's host-to-device move, memory/<phase>/* metrics, and whole RL iterations
under the test modes (meta default device; NCCL's rules on gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from rlhf.controller import Batch
from rlhf.controller.controller import Controller
from rlhf.controller.launch import (NCCL_ENV_DEFAULTS, TEST_META_DEFAULT_ENV,
                                    TEST_NCCL_RULES_ENV, check_device, nccl_env_defaults,
                                    hooks_of_test_modes)
from rlhf.controller.messages import Done
from rlhf.controller.protocols import PHASES, THREE_D_PROTO, phase_of, protocol
from rlhf.controller.worker import WorkerRuntime
from rlhf.metrics import (detached, host_records, memory_metrics, memory_sample,
                          resident_bytes)
from rlhf.workers.actor import ActorWorker, ReferenceWorker
from rlhf.workers.critic import CriticWorker
from rlhf.workers.reward import CostWorker, RewardWorker
from rlhf.workers.rollout import RolloutWorker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = ["algo=grpo", "iterations=1", "actor.model.hidden_size=32",
            "actor.model.intermediate_size=64", "actor.model.num_heads=4",
            "actor.model.num_kv_heads=2", "actor.model.num_layers=2", "log.progress=false",
            "log.tensorboard=false", "log.plot=false", "data.prompts_per_iter=4",
            "data.samples_per_prompt=2", "data.mini_batch_size=8", "data.micro_batch_size=4",
            "actor.layout.tp=1", "actor.layout.gen_tp=1", "checkpoint.save_every=0",
            "data.val_size=0"]


# Device checks and NCCL defaults (no process group) ---------------------------------------------
@pytest.mark.parametrize("index,env,count,fragment", [
    (1, {"RANK": "0", "LOCAL_RANK": "0"}, 2, "GPU of local rank 1"),
    (0, {"RANK": "1", "LOCAL_RANK": "1"}, 2, "GPU of local rank 0"),   # two ranks on cuda:0
    (2, {"RANK": "2", "LOCAL_RANK": "2"}, 2, "does not exist"),
    (0, {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}, 2, "3 ranks"),
    (None, {"RANK": "0", "LOCAL_RANK": "0"}, 1, "no GPU index"),
])
def test_a_rank_on_the_wrong_gpu_is_refused_naming_it(index, env, count, fragment):
    device = torch.device("cuda") if index is None else torch.device("cuda", index)
    with pytest.raises(ValueError, match=fragment) as info:
        check_device(device, env, count)
    assert f"rank {env['RANK']}" in str(info.value) and "\n" not in str(info.value)


def test_one_rank_per_gpu_and_cpu_pass():
    for local in range(4):
        env = {"RANK": str(4 + local), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "4"}
        check_device(torch.device("cuda", local), env, 4)
    check_device(torch.device("cpu"), {"LOCAL_RANK": "7"}, 0)  # no GPU needed


def test_nccl_env_defaults_fill_only_what_the_user_left_unset():
    assert nccl_env_defaults({}) == NCCL_ENV_DEFAULTS
    for key in NCCL_ENV_DEFAULTS:
        for name in (key, key.removeprefix("TORCH_")):  # the deprecated name counts too
            assert key not in nccl_env_defaults({name: "0"})


# Test modes --------------------------------------------------------------------------------------
def test_meta_default_mode_hooks_the_worker_thread_only():
    assert hooks_of_test_modes({}, torch.device("cpu")) is None
    hook = hooks_of_test_modes({TEST_META_DEFAULT_ENV: "1"}, torch.device("cpu"))
    seen = {}

    def worker_thread():
        hook()
        seen["default"] = torch.empty(1).device
        seen["explicit"] = torch.empty(1, device="cpu").device

    t = threading.Thread(target=worker_thread)
    t.start()
    t.join()
    assert seen == {"default": torch.device("meta"), "explicit": torch.device("cpu")}
    assert torch.empty(1).device == torch.device("cpu")  # this thread is untouched


def test_nccl_rules_mode_installs_the_rules_before_any_group():
    import torch.distributed as dist

    from hybridflow_comm import nccl_rules

    assert hooks_of_test_modes({TEST_NCCL_RULES_ENV: "1"}, torch.device("cpu")) is None
    try:
        assert hasattr(dist.all_reduce, "nccl_rules_original")
    finally:
        nccl_rules.uninstall()
    assert not hasattr(dist.all_reduce, "nccl_rules_original")


# The worker boundary -----------------------------------------------------------------------------
def test_call_arguments_move_to_the_worker_device_once():
    runtime = WorkerRuntime(0, None, None, 60.0, device=torch.device("meta"))
    batch = Batch({"input_ids": torch.arange(6).reshape(3, 2)}, {"uid": [1, 2, 3]},
                  {"temperature": 0.5})
    moved = runtime._on_device(batch)
    assert moved.device == torch.device("meta") and moved["input_ids"].shape == (3, 2)
    assert moved.non_tensors == batch.non_tensors and moved.meta == batch.meta
    assert runtime._on_device(torch.ones(2)).device == torch.device("meta")
    sampling = object()
    assert runtime._on_device(sampling) is sampling  # not data: passed as is
    assert batch.device == torch.device("cpu")  # the received batch is not changed


def test_batch_row_operations_index_on_the_batch_device():
    x = torch.arange(8, device="cpu").reshape(4, 2)
    with torch.device("meta"):  # a row index made without a device would land here
        batch = Batch({"x": x})
        out = {"repeat": batch.repeat(2, interleave=False)["x"],
               "pad": batch.pad_to_multiple(3)["x"], "reorder": batch.reorder([3, 1, 0, 2])["x"]}
    assert out["repeat"].tolist() == x.tolist() * 2
    assert out["pad"].tolist() == x.tolist() + x[:2].tolist()
    assert out["reorder"].tolist() == [x[i].tolist() for i in (3, 1, 0, 2)]


# Memory metrics ----------------------------------------------------------------------------------
def test_every_phase_method_of_the_workers_declares_a_known_phase():
    declared = {
        ActorWorker.generate_sequences: "generation", RolloutWorker.generate_sequences:
        "generation", ActorWorker.compute_log_prob: "log_probs",
        ReferenceWorker.compute_ref_log_prob: "log_probs", CriticWorker.compute_values:
        "log_probs", RewardWorker.compute_reward: "log_probs", CostWorker.compute_cost:
        "log_probs", ActorWorker.update_actor: "update", CriticWorker.update_critic: "update"}
    assert {m.__qualname__: phase_of(m) for m in declared} == \
        {m.__qualname__: p for m, p in declared.items()}
    assert phase_of(ActorWorker.save_hf) is None
    with pytest.raises(ValueError, match="phase='train'"):
        protocol(THREE_D_PROTO, phase="train")
    assert set(declared.values()) == set(PHASES)


def test_cpu_memory_sample_is_the_resident_memory():
    block = torch.ones(64 << 20, dtype=torch.uint8, device="cpu")  # 64 MiB, touched
    sample = memory_sample(torch.device("cpu"))
    assert set(sample) == {"rss"}
    # the block is resident (it may reuse pages freed earlier, so RSS need not grow by it)
    assert sample["rss"] >= block.numel()
    with open("/proc/self/status") as f:  # an independent reading of the same quantity
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    assert abs(vmrss - resident_bytes()) < 16 << 20
    del block


def test_controller_keeps_the_largest_reading_per_phase_and_starts_over():
    ctl = Controller({}, {})
    for rank, (phase, rss) in enumerate([("update", 5), ("update", 9), ("generation", 3),
                                         ("update", 7)]):
        ctl._note_memory(Done(rank, rank, None, False, None, {"phase": phase, "rss": rss})
                         .memory)
    assert ctl.take_memory() == {"update": {"rss": 9}, "generation": {"rss": 3}}
    assert ctl.take_memory() == {}
    ctl.close()
    gib = 2**30
    assert memory_metrics({"update": {"peak_allocated": 3 * gib, "allocated": gib}}) == \
        {"memory/update/allocated_gb": 1.0, "memory/update/peak_allocated_gb": 3.0}


def test_host_records_read_tensors_once_and_keep_numbers():
    w = torch.tensor(2.0, requires_grad=True)
    records = [detached({"loss": w * 3, "n": 4}), {"loss": torch.tensor(1.5), "lr": 0.1}]
    assert not records[0]["loss"].requires_grad
    assert host_records(records) == [{"loss": 6.0, "n": 4.0}, {"loss": 1.5, "lr": 0.1}]


# Whole RL iterations under the test modes --------------------------------------------------------
def _train(tmp_path, env: dict, nproc: int = 1) -> list[dict]:
    launcher = [sys.executable, "-m", "rlhf.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "rlhf.train"]
    args = [*TINY_RUN, f"log.runs_dir={tmp_path}", "log.run_name=run"]
    if nproc > 1:
        args += [f"actor.layout.dp={nproc}"]
    proc = subprocess.run([*launcher, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_rl_iteration_with_meta_as_the_default_device(tmp_path):
    (record,) = _train(tmp_path, {TEST_META_DEFAULT_ENV: "1"})
    weights = record["memory/actor_weights_gb"]
    for phase in PHASES:
        assert record[f"memory/{phase}/rss_gb"] > weights  # the process holds the model
    assert record["memory/update/rss_gb"] < 64  # GiB: a reading in bytes, not a count


def test_two_rank_rl_iteration_under_nccl_rules(tmp_path):
    (record,) = _train(tmp_path, {TEST_NCCL_RULES_ENV: "1"}, nproc=2)
    assert record["perf/tokens"] > 0 and "memory/update/rss_gb" in record
