"""A user's own model, tokenizer, data and reward function (nothing downloaded): the shipped
example (examples/gsm8k_style) makes a BPE tokenizer with a chat template and GSM8K-format
data; a Llama checkpoint is written with transformers.  Pure-logic checks first, then one
2-rank torchrun job that runs GRPO on them end to end (and a reward function that raises)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from rlhf.task import CharTokenizer, HFTokenizer, load_tokenizer
from rlhf.task.reward_fn import FunctionReward, RewardFunctionError, load_function
from tests.example_data import ROOT, build_example
from tests.rlhf_jobs import launch

REWARD = ROOT / "examples" / "gsm8k_style" / "reward.py"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> pathlib.Path:
    """The example's tokenizer and data, plus a small Llama checkpoint that uses them."""
    return build_example(tmp_path_factory.mktemp("gsm8k"), train=48, val=8, sft=8)


def test_chat_prompts_render_with_the_tokenizers_template(example):
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(str(example / "tokenizer"))
    tok = load_tokenizer(str(example / "llama"))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == len(ref)
    row = json.loads((example / "train.jsonl").read_text().splitlines()[0])
    want = ref.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert tok.encode_prompt(row["prompt"]) == list(want)
    assert tok.encode_prompt("12 apples") == ref("12 apples")["input_ids"]
    ids = ref("#### 42", add_special_tokens=False)["input_ids"]
    assert tok.decode_response(ids + [tok.eos_id, tok.pad_id, 7]) == "#### 42"
    assert tok.decode_response(ids[:2] + [len(ref) + 5] + ids[2:]) == "#### 42"  # padded row
    with pytest.raises(ValueError, match="string or a chat list"):
        tok.encode_prompt([{"text": "hi"}])
    with pytest.raises(ValueError, match="chat prompts need an HF tokenizer"):
        CharTokenizer.build().encode_prompt(row["prompt"])


def test_reward_function_scores_and_reports_where_it_failed(tmp_path):
    fn = FunctionReward(f"{REWARD}:compute_score")
    scores, fields = fn(["so #### 7", "it is 8", "no idea"], ["7", "7", "7"], ["g"] * 3,
                        [None] * 3, [10, 11, 12])
    assert scores.tolist() == [1.0, 0.0, 0.0] and fields["format"].tolist() == [1.0, 0.0, 0.0]
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    if 'boom' in solution_str:\n"
                   "        raise KeyError('no ' + ground_truth)\n"
                   "    return 1.0\n")
    with pytest.raises(RewardFunctionError, match=rf"{bad}:compute_score raised KeyError: "
                                                  rf"'no 5' at {bad}:3 on sample 31"):
        FunctionReward(f"{bad}:compute_score")(["ok", "boom"], ["4", "5"], ["g", "g"],
                                               [None, None], [30, 31])
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_function(f"{bad}:nope")
    with pytest.raises(ValueError, match="must be path/to/file.py:function_name"):
        load_function(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        load_function("/nonexistent.py:f")


def test_bad_inputs_fail_before_any_rank_starts(example, tmp_path):
    from rlhf.builders import check_run, tokenizer_of
    from rlhf.config import load_config

    user = [f"actor.model.init_from={example / 'llama'}", "algo=grpo", "actor.layout.tp=1",
            "actor.layout.gen_tp=0", f"data.train_files={example / 'train.jsonl'}",
            "data.max_prompt_len=96"]
    cfg = load_config(user)
    assert isinstance(tokenizer_of(cfg), HFTokenizer)
    check_run(cfg, tokenizer_of(cfg))
    small = tmp_path / "small"
    import transformers
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(str(small))
    cfg = load_config(user + [f"actor.model.init_from={small}",
                              f"tokenizer={example / 'tokenizer'}"])
    with pytest.raises(ValueError, match=r"vocab_size=100 but the tokenizer .* has \d+ tokens"):
        check_run(cfg, tokenizer_of(cfg))
    cfg = load_config(user + ["reward.kind=function", "reward.function=/nope.py:f"])
    with pytest.raises(ValueError, match="does not exist"):
        check_run(cfg, tokenizer_of(cfg))
    cfg = load_config(user + ["actor.router_replay=true"])
    with pytest.raises(ValueError, match=r"router_replay=true but the actor \(llama\) has no "
                                         r"experts"):
        check_run(cfg, tokenizer_of(cfg))
    cfg = load_config(user + ["actor.router_aux_loss_coef=0.01"])
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01 but the actor \(llama\) "
                                         r"has no experts"):
        check_run(cfg, tokenizer_of(cfg))
    with pytest.raises(ValueError, match="router_aux_loss_coef=-1"):
        load_config(user + ["actor.router_aux_loss_coef=-1"])
    cfg = load_config(user + ["data.val_files=/nope.jsonl"])
    with pytest.raises(ValueError, match=r"data.val_files: \['/nope.jsonl'\] do not exist"):
        check_run(cfg, tokenizer_of(cfg))
    with pytest.raises(ValueError, match="needs both kind=function and function="):
        load_config(user + ["reward.kind=function"])


def test_long_prompts_are_dropped_with_one_warning(example, capsys):
    from rlhf.prompts import fitting_prompts
    from rlhf.task import read_dataset

    tok = load_tokenizer(str(example / "llama"))
    rows = read_dataset(str(example / "train.jsonl"))
    lengths = sorted(len(tok.encode_prompt(e.prompt)) for e in rows)
    width = lengths[len(lengths) // 2]
    keep = fitting_prompts(rows, tok, width, "data.train_files")
    assert len(keep) == sum(n <= width for n in lengths) < len(rows)
    assert capsys.readouterr().out.count("warning") == 1
    with pytest.raises(ValueError, match="all 48 prompts are longer"):
        fitting_prompts(rows, tok, lengths[0] - 1, "data.train_files")


def moe_checkpoint(example: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """A 2-layer Qwen3-MoE (4 experts, top 2) with the example's tokenizer."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(example / "tokenizer"))
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok) + len(tok) % 2, hidden_size=32, intermediate_size=64,  # even: TP 2
        moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def test_grpo_end_to_end_on_a_users_model_data_and_reward(example, tmp_path):
    """GRPO, 2 iterations, 2 ranks, on the example's Qwen3-style checkpoint, chat JSONL and
    reward file: metrics with the reward's fields and the held-out evaluation, and an HF
    export that transformers loads; the same on a mixture of experts (Qwen3-MoE, TP 2); a
    reward function that raises stops the run naming it."""
    import transformers

    bad = tmp_path / "bad_reward.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    raise ZeroDivisionError('from the user')\n")
    common = [f"actor.model.init_from={example / 'qwen3'}", "algo=grpo", "iterations=2",
              "actor.layout.tp=1", "actor.layout.gen_tp=0", "reference.layout.tp=1",
              f"data.train_files={example / 'train.jsonl'}", "data.prompts_per_iter=4",
              "data.samples_per_prompt=2", "data.mini_batch_size=8", "data.micro_batch_size=2",
              "data.max_prompt_len=96", "data.max_response_len=8", "reward.kind=function",
              f"log.runs_dir={tmp_path / 'runs'}", "log.progress=false",
              "log.tensorboard=false", "log.plot=false", "checkpoint.resume=never"]
    spec = {"user": common + [f"data.val_files={example / 'val.jsonl'}", "log.run_name=user",
                              f"reward.function={REWARD}:compute_score"],
            "raises": common + ["log.run_name=raises", f"reward.function={bad}:compute_score"]}
    moe = moe_checkpoint(example, tmp_path / "moe")
    spec["moe"] = common + [f"actor.model.init_from={moe}", "actor.layout.tp=2",
                            "actor.router_aux_loss_coef=0.01", "log.run_name=moe",
                            f"reward.function={REWARD}:compute_score"]
    # router replay, generating at TP 1 from a TP 2 actor with 2 generation replicas
    spec["moe_replay"] = spec["moe"][:-2] + ["actor.router_replay=true", "actor.layout.gen_tp=1",
                                             "log.run_name=moe_replay",
                                             f"reward.function={REWARD}:compute_score"]
    out = launch(spec, tmp_path)
    assert "records" in out["user"], out["user"].get("traceback")
    recs = out["user"]["records"]
    assert [r["step"] for r in recs] == [0, 1]
    assert all("reward/format/mean" in r and 0 <= r["reward/mean"] <= 1 for r in recs)
    assert "val/accuracy" in recs[0] and "val/accuracy" in recs[1]  # start, and after the end
    assert 0 <= recs[1]["val/reward"] <= 1
    hf = tmp_path / "runs" / "user" / "hf" / "actor"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    assert model.config.vocab_size >= len(tok) and model.config.model_type == "qwen3"
    for run in ("moe", "moe_replay"):
        assert "records" in out[run], out[run].get("traceback")
        assert [r["step"] for r in out[run]["records"]] == [0, 1]
        # the rollouts' log-probs are the training engine's (rounding apart)
        assert all(r["actor/rollout_logprob_diff"] < 1e-4 for r in out[run]["records"])
    # every real token but each row's last (never fed to the model) had its experts replayed
    for r in out["moe_replay"]["records"]:
        assert 0.8 < r["actor/router_replay_fraction"] < 1.0, r
    assert "actor/router_replay_fraction" not in out["moe"]["records"][0]
    # the load-balancing loss: E * sum f * P >= k = 2 (equality only if perfectly balanced)
    assert all(r["actor/router_aux_loss"] >= 2 - 1e-5 for r in out["moe"]["records"])
    assert all(0 <= r["actor/rollout_logprob_diff"] < 1e-4 for r in out["moe"]["records"]
               if "actor/rollout_logprob_diff" in r)
    moe_hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "runs" / "moe" / "hf" / "actor"))
    assert type(moe_hf).__name__ == "Qwen3MoeForCausalLM"
    err = out["raises"]["error"]
    assert f"reward function {bad}:compute_score raised ZeroDivisionError: from the user at " \
           f"{bad}:2 on sample" in err, err


def test_critic_from_a_reward_model_takes_the_backbone_with_a_fresh_head(example, tmp_path):
    import transformers

    from engine.hf_interop import read_hf_config
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from rlhf.workers.common import build_model
    from rlhf.workers.specs import ModelSpec

    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(1)
    rm = transformers.LlamaForSequenceClassification(hf_cfg)
    rm.save_pretrained(str(tmp_path / "rm"))
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    models = {fresh: build_model(ModelSpec(config=read_hf_config(str(tmp_path / "rm")),
                                           head="value", init_from=str(tmp_path / "rm"),
                                           seed=0, fresh_head=fresh, lora=None,
                                           lora_init_from=None), groups)
              for fresh in (False, True)}
    score = rm.score.weight.detach()
    torch.testing.assert_close(models[False].params["value_head"].detach(), score)
    assert not torch.equal(models[True].params["value_head"].detach(), score)
    emb = rm.model.embed_tokens.weight.detach()
    for m in models.values():
        torch.testing.assert_close(m.params["embed_tokens"].detach(), emb)
