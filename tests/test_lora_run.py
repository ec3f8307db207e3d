"""A LoRA GRPO run of ``rlhf.train`` on 2 ranks against the same run without LoRA.

The base is a tiny Llama made with transformers (``actor.model.init_from``); the actor trains
``actor.lora.rank=4`` adapters at tp=2 and generates unsplit (gen_tp=1), with the KL term of
``algo.kl_mode=loss``:

- no reference model is built: the reference log-probs are the actor's own base with the
  adapters off, so at step 0 (B = 0) the KL is exactly 0 and later it is not;
- the training forward of the rollouts gives the log-probs they were sampled with (the
  generation side applies the same adapters): step-0 ``rollout_logprob_diff`` ~ 0;
- bytes into each rank: the first transition the base's other TP half plus the adapters',
  every later one the adapters' alone (``reshard/bytes``, counted from the specs), and the
  same with a disaggregated rollout pool (``weight_sync/bytes``);
- a PPO critic trains adapters of its own;
- the HF export is a PEFT adapter that ``PeftModel.from_pretrained`` loads over the base, and
  with ``log.export_merged`` the merged model too (PEFT's ``merge_and_unload`` logits);
- a run resumed from the step-1 checkpoint (adapters and their Adam state only) repeats the
  uninterrupted run's steps 1 and 2 exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.hf_interop import read_hf_config
from engine.llama_spec import llama_shard_specs
from engine.lora import LoraConfig, lora_shard_specs
from rlhf.checkpoint import step_dir
from tests.rlhf_jobs import launch


def _torchrun(spec: dict, tmp_path, name: str) -> dict:
    out = launch(spec, tmp_path, name)
    for run, result in out.items():
        assert "records" in result, (run, result.get("error"), result.get("traceback"))
    return {run: result["records"] for run, result in out.items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama over the built-in task's 24-token vocabulary, saved by transformers."""
    import transformers

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _received_bytes(specs) -> int:
    """What a tp=2 -> gen_tp=1 transition brings to each rank: the other half of every split
    tensor (float32)."""
    return sum(4 * int(torch.Size(s.shape).numel()) // 2 for s in specs
               if s.partition_dim is not None)


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 16
"""


def test_lora_grpo_run(base, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0)
    # a reward a random base earns unevenly (the response's length): advantages are not 0
    (tmp_path / "reward.py").write_text(REWARD)
    common = [f"actor.model.init_from={base}", "algo=grpo", "algo.kl_mode=loss",
              "reward.kind=function", f"reward.function={tmp_path / 'reward.py'}:compute_score",
              "data.val_size=0",
              "algo.kl_coef=0.1", "data.prompts_per_iter=4", "data.samples_per_prompt=2",
              "data.mini_batch_size=8", "data.micro_batch_size=4", "actor.optim.lr=1e-2",
              "actor.layout.tp=2", "actor.layout.gen_tp=1", f"log.runs_dir={tmp_path}",
              "checkpoint.save_every=1", "checkpoint.keep_last=0", "actor.lora.rank=4",
              "actor.lora.alpha=8"]
    single = [c for c in common if not c.startswith(("actor.layout.", "checkpoint."))] + [
        "actor.layout.tp=1", "checkpoint.resume=never", "iterations=2"]
    first = _torchrun({
        "lora": common + ["iterations=3", "log.run_name=lora", "checkpoint.resume=never",
                          "log.export_merged=true"],
        # the rollout pool gets the frozen base with the first push, then the adapters alone
        "disaggregated": single + ["log.run_name=disaggregated", "placement.mode=disaggregated",
                                   "placement.pool_sizes={actor: 1, rollout: 1}"],
        # a PPO critic with adapters of its own (its value head trained in full)
        "ppo": [c.replace("algo=grpo", "algo=ppo") for c in single]
        + ["log.run_name=ppo", "critic.lora.rank=4", "critic.lora.alpha=8", "iterations=1"]},
        tmp_path, "first")
    recs = first["lora"]
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert recs[0]["actor/kl_loss"] == 0 and recs[2]["actor/kl_loss"] > 0, \
        [r["actor/kl_loss"] for r in recs]
    assert recs[0]["actor/rollout_logprob_diff_max"] < 1e-4, recs[0]
    config = read_hf_config(str(base))
    full, adapters = llama_shard_specs(config, 1), lora_shard_specs(config, 1, lora)
    assert recs[0]["reshard/bytes"] == _received_bytes(full) + _received_bytes(adapters)
    assert recs[1]["reshard/bytes"] == recs[2]["reshard/bytes"] == _received_bytes(adapters)

    pushed = first["disaggregated"]
    assert pushed[0]["actor/rollout_logprob_diff_max"] < 1e-4 and pushed[0]["actor/kl_loss"] == 0
    base_bytes = 4 * sum(torch.Size(s.shape).numel() for s in full)
    adapter_bytes = 4 * sum(torch.Size(s.shape).numel() for s in adapters)
    assert pushed[0]["weight_sync/bytes"] == base_bytes + adapter_bytes  # the start's push
    assert pushed[1]["weight_sync/bytes"] == adapter_bytes
    ppo = first["ppo"][0]
    assert ppo["critic/grad_norm"] > 0 and ppo["actor/grad_norm"] > 0

    # the export: a PEFT adapter over the base
    import peft
    import transformers
    export = tmp_path / "lora" / "hf" / "actor"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(export))
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), str(export))
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and all(float(p.abs().max()) > 0 for p in trained)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "hf" /
                                                               "actor_merged")
    ids = torch.randint(0, 24, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits,
                                   model.merge_and_unload()(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)

    # resume from the step-1 checkpoint: the same steps 1 and 2
    ckpt = step_dir(str(tmp_path / "lora" / "checkpoints"), 1)
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(os.path.join(ckpt, "actor")).read_metadata().state_dict_metadata
    weights = [k for k in saved if ".lora_" in k]
    assert weights and all(".lora_" in k or k == "optim.step" for k in saved), sorted(saved)
    assert not any(k.endswith("embed_tokens.weight") for k in saved)  # the base is not saved
    second = _torchrun({"resumed": common + ["iterations=3", "log.run_name=resumed",
                                             f"checkpoint.resume={ckpt}"]}, tmp_path, "second")
    again = second["resumed"]
    assert [r["step"] for r in again] == [1, 2]
    for a, b in zip(again, recs[1:]):
        for key in ("actor/pg_loss", "actor/kl_loss", "reward/mean", "actor/grad_norm"):
            assert a[key] == b[key], (key, a[key], b[key])
