"""Multi-rank tests of the native engine against the single-process reference (4 gloo ranks).

For every layout (pp, tp, dp) with world size 1, 2 or 4 the ranks build the model from the
same full state dict, and check against the reference computed once in the test process with
layout (1, 1, 1): forward log-probs/values, then loss, grad norm and every gradient of step 1,
then the weights after 3 AdamW steps (fp32, atol 1e-5); plus storage identity of every
parameter and gradient with the flat buffers.  Ranks outside a smaller layout's pool only take
part in group creation.
"""

from __future__ import annotations

import pytest
import torch

from engine.hf_interop import config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import train_shard

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                  num_heads=8, num_kv_heads=4, tie_word_embeddings=False)
N_MICRO, MB, SEQ, STEPS = 4, 2, 10, 3
LAYOUTS = [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1), (1, 1, 4), (1, 2, 2), (1, 4, 1),
           (2, 1, 2), (2, 2, 1), (4, 1, 1)]
ATOL = 1e-5


def make_micro_batches(seed: int = 0) -> list[dict]:
    """N_MICRO micro-batches with left and right padding, advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(N_MICRO):
        ids = torch.randint(0, CFG.vocab_size, (MB, SEQ), generator=g)
        mask = torch.ones(MB, SEQ, dtype=torch.long)
        mask[0, SEQ - 1 - i:] = 0  # right padding
        mask[1, :i] = 0  # left padding
        out.append({"input_ids": ids, "attention_mask": mask,
                    "advantages": torch.randn(MB, SEQ - 1, generator=g),
                    "returns": torch.randn(MB, SEQ, generator=g)})
    return out


def policy_loss(outputs: dict, mb: dict) -> torch.Tensor:
    m = (mb["attention_mask"][:, 1:] * mb["attention_mask"][:, :-1]).float()
    per_token = -outputs["log_probs"] * mb["advantages"] - 0.01 * outputs["entropy"]
    return (per_token * m).sum() / m.sum()


def value_loss(outputs: dict, mb: dict) -> torch.Tensor:
    m = mb["attention_mask"].float()
    return ((outputs["values"] - mb["returns"]) ** 2 * m).sum() / m.sum()


# Adam's first steps move every weight by about lr * g / (|g| + eps): for a gradient element
# near eps, fp32 summation-order noise of 1e-9 becomes lr / (4 eps) times larger.  eps=1e-6
# with lr=2e-3 keeps that below 1e-6 while every weight still moves by ~6e-3 in 3 steps.
ADAM = dict(lr=2e-3, eps=1e-6)
VARIANTS = {  # name -> (config, head, loss, optimiser)
    "lm_1f1b": (CFG, "lm", policy_loss, OptimConfig(**ADAM, max_grad_norm=0.05)),
    "tied_gpipe": (LlamaConfig(**(CFG.__dict__ | {"tie_word_embeddings": True})), "lm",
                   policy_loss, OptimConfig(**ADAM, weight_decay=0.1, schedule="gpipe",
                                            bucket_numel=1000)),
    "value": (CFG, "value", value_loss, OptimConfig(**ADAM, max_grad_norm=None)),
}


def build(layout: tuple[int, int, int], config: LlamaConfig, head: str):
    """Groups on ranks [0, world) of the pool (collective over all ranks), then the model."""
    pp, tp, dp = layout
    train = ParallelLayout(pp, tp, dp)
    groups = build_hybrid_groups(HybridLayout(train, 1, 1), pool=list(range(train.world_size)))
    return None if groups is None else ParallelLlama(config, groups, head)


def reference(variant: str) -> dict:
    """Single-process run of all micro-batches: outputs, step-1 grads and metrics, weights."""
    config, head, loss_fn, optim = VARIANTS[variant]
    full = init_full_state_dict(config, seed=7, head=head)
    model = build((1, 1, 1), config, head)
    load_full_state_dict(model, full)
    eng = TrainEngine(model, optim)
    mbs = make_micro_batches()
    ref = {"full": full, "outputs": eng.forward(mbs, temperature=1.0), "metrics": []}
    for step in range(STEPS):
        ref["metrics"].append(eng.train_step(mbs, loss_fn, temperature=1.0))
        if step == 0:
            ref["grads"] = {n: p.grad.clone() for n, p in model.params.items()}
    ref["weights"] = {n: p.detach().clone() for n, p in model.params.items()}
    return ref


def _full_name(model, name: str) -> str:
    tied_copy = name == "lm_head" and model.config.tie_word_embeddings
    return "embed_tokens" if tied_copy else name


def check_layout(rank: int, world_size: int, layout, variant: str, ref: dict) -> int:
    """Run on every rank: compare one layout with the reference; returns checks made."""
    config, head, loss_fn, optim = VARIANTS[variant]
    model = build(layout, config, head)
    if model is None:
        return 0
    lr = model.groups.rank
    load_full_state_dict(model, ref["full"])
    eng = TrainEngine(model, optim)
    per_dp = N_MICRO // layout[2]
    mine = make_micro_batches()[model.coords.dp * per_dp:(model.coords.dp + 1) * per_dp]
    checks = 0

    def shard(full_tensors: dict, name: str) -> torch.Tensor:
        spec = next(s for s in model.specs if s.name == name)
        return train_shard(full_tensors[_full_name(model, name)], spec, model.layout, lr)

    out = eng.forward(mine, temperature=1.0)
    if model.is_last:
        for i, o in enumerate(out):
            for k, v in o.items():
                exp = ref["outputs"][model.coords.dp * per_dp + i][k]
                torch.testing.assert_close(v, exp, atol=ATOL, rtol=0,
                                           msg=lambda m: f"{layout} {k} mb{i}: {m}")
                checks += 1
    ptrs = {n: (p.data_ptr(), p.grad.data_ptr()) for n, p in model.params.items()}
    for step in range(STEPS):
        metrics = eng.train_step(mine, loss_fn, temperature=1.0)
        exp = ref["metrics"][step]
        assert abs(metrics["loss"] - exp["loss"]) < ATOL, (layout, step, metrics, exp)
        assert abs(metrics["grad_norm"] - exp["grad_norm"]) < ATOL, (layout, step, metrics, exp)
        checks += 2
        if step == 0:
            for name, p in model.params.items():
                torch.testing.assert_close(p.grad, shard(ref["grads"], name), atol=ATOL, rtol=0,
                                           msg=lambda m: f"{layout} grad {name}: {m}")
                checks += 1
    for name, p in model.params.items():
        torch.testing.assert_close(p.detach(), shard(ref["weights"], name), atol=ATOL, rtol=0,
                                   msg=lambda m: f"{layout} weight {name} after {STEPS} steps: {m}")
        view = model.buffer.train_view(name)
        assert p.data_ptr() == view.data_ptr() and (p.data_ptr(), p.grad.data_ptr()) == ptrs[name]
        assert (p.untyped_storage().data_ptr()
                == model.buffer.storage(p.dtype).untyped_storage().data_ptr())
        assert (p.grad.untyped_storage().data_ptr()
                == eng.grads.flat[p.dtype].untyped_storage().data_ptr())
        checks += 2
    return checks


def check_variant(rank: int, world_size: int, layouts, variant: str, ref: dict) -> int:
    return sum(check_layout(rank, world_size, lay, variant, ref) for lay in layouts)


@pytest.fixture(scope="module")
def refs():
    return {v: reference(v) for v in VARIANTS}


def test_all_layouts_match_single_process(pool4, refs):
    counts = pool4.run(check_variant, LAYOUTS, "lm_1f1b", refs["lm_1f1b"])
    assert counts[0] > 0 and counts[3] > 0


def check_head_in_chunks(rank: int, world_size: int, layouts, ref: dict) -> int:
    """:func:`check_variant` with the fused LM head forced into chunks of 3 tokens."""
    from engine import tp_ops

    before, tp_ops.LOGITS_PER_CHUNK = tp_ops.LOGITS_PER_CHUNK, 3 * CFG.vocab_size
    try:
        return check_variant(rank, world_size, layouts, "lm_1f1b", ref)
    finally:
        tp_ops.LOGITS_PER_CHUNK = before


def test_head_in_chunks_matches_the_whole_logits(pool4, refs):
    """Log-probs, entropy, every gradient and 3 steps with the head in chunks of 3 tokens
    (recomputed in backward, the vocabulary split over TP) equal the single process's run
    on the whole logits."""
    layouts = [(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)]
    counts = pool4.run(check_head_in_chunks, layouts, refs["lm_1f1b"])
    assert counts[0] > 0 and counts[3] > 0


def test_tied_embeddings_gpipe_and_value_head(pool4, refs):
    tied = [(2, 1, 1), (2, 2, 1), (2, 1, 2), (4, 1, 1), (1, 4, 1)]
    assert pool4.run(check_variant, tied, "tied_gpipe", refs["tied_gpipe"])[3] > 0
    value = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 2)]
    assert pool4.run(check_variant, value, "value", refs["value"])[0] > 0


# HF interop on several layouts -----------------------------------------------------------------
def hf_layouts(rank: int, world_size: int, layouts, folder: str, ids, hf_logits,
               out_folder: str) -> int:
    checks = 0
    for layout in layouts:
        model = build(layout, CFG, "lm")
        if model is None:
            continue
        load_hf_checkpoint(model, folder)
        outs = TrainEngine(model).forward([{"input_ids": ids}], with_logits=True,
                                          temperature=1.0)
        if model.is_last:
            v_local = CFG.vocab_size // layout[1]
            start = model.coords.tp * v_local
            torch.testing.assert_close(outs[0]["logits"], hf_logits[..., start:start + v_local],
                                       atol=ATOL, rtol=1e-5,
                                       msg=lambda m: f"{layout} logits: {m}")
            ref_lp = torch.log_softmax(hf_logits[:, :-1], -1)
            torch.testing.assert_close(outs[0]["log_probs"],
                                       ref_lp.gather(-1, ids[:, 1:, None]).squeeze(-1),
                                       atol=ATOL, rtol=1e-5,
                                       msg=lambda m: f"{layout} log_probs: {m}")
            checks += 2
        if layout == (2, 2, 1):
            save_hf_checkpoint(model, out_folder)
    return checks


def test_hf_checkpoint_any_layout(pool4, tmp_path):
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config_to_hf(CFG)).eval()
    folder, out_folder = str(tmp_path / "in"), str(tmp_path / "out")
    hf.save_pretrained(folder)
    ids = torch.randint(0, CFG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits
    layouts = [(2, 2, 1), (1, 4, 1), (1, 2, 2), (4, 1, 1)]
    counts = pool4.run(hf_layouts, layouts, folder, ids, hf_logits, out_folder)
    assert counts[1] > 0
    back = load_file(f"{out_folder}/model.safetensors")
    want = hf.state_dict()
    assert set(back) == set(want)
    assert all(torch.equal(back[k], v) for k, v in want.items())
