"""bench/lora.py: a smoke run at ``tiny`` (``make bench``): every figure is there, the state
and sync counts agree with the specs, and LoRA holds less.  No timing is asserted."""

import json

import torch

from bench import lora
from bench.shapes import get_shape
from engine.llama_spec import llama_shard_specs


def test_lora_bench_counts_what_each_side_holds(tmp_path):
    path = tmp_path / "lora.json"
    assert lora.main(["--shape", "tiny", "--rank", "4", "--alpha", "8", "--sequences", "2",
                      "--micro-batch", "1", "--repeat", "1", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    full, adapters = r["state_bytes"]["full"], r["state_bytes"]["lora"]
    cfg = lora.config_of(get_shape("tiny", rl=True))
    params = sum(torch.Size(s.shape).numel() for s in llama_shard_specs(cfg, 1))
    assert full["trained_params"] == params
    assert full["grads"] == 4 * params and full["optimizer"] == 8 * params  # Adam: 2 moments
    n = adapters["trained_params"]
    assert adapters["grads"] == 4 * n and adapters["optimizer"] == 8 * n and n < params
    assert r["sync_bytes"]["lora"] == 4 * n and r["sync_bytes"]["full"] == 4 * params
    assert r["state_ratio"] > 1 and r["sync_ratio"] == params / n
    assert set(r["step_s"]) == {"full", "lora"} and all(v > 0 for v in r["step_s"].values())
