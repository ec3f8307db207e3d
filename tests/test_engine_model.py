"""Single-process tests of the native engine: specs, layer maths, schedules, HF interop."""

from __future__ import annotations

import os

import pytest
import torch

from engine.hf_interop import gather_full_state_dict, load_hf_checkpoint, read_hf_config, \
    save_hf_checkpoint, config_to_hf
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from engine.model import ParallelLlama, load_full_state_dict
from engine.pipeline import gpipe_schedule, one_f_one_b_schedule
from engine.tp_ops import linear_log_prob_entropy, row_linear, row_linear_pieces, \
    vocab_log_prob_entropy
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, tie_word_embeddings=False)


def single_groups():
    return build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


# Config and specs ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    (dict(num_heads=4, num_kv_heads=3), ["num_heads=4", "num_kv_heads=3"]),
    (dict(hidden_size=30), ["hidden_size=30", "num_heads=4"]),
    (dict(vocab_size=0), ["vocab_size=0"]),
])
def test_config_validation(kwargs, words):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
    with pytest.raises(ValueError) as e:
        LlamaConfig(**(base | kwargs))
    assert all(w in str(e.value) for w in words)


def test_bad_layout_raises_before_collectives():
    with pytest.raises(ValueError, match="tp=4 must divide num_kv_heads=2"):
        CFG.check_parallel(1, 4)
    with pytest.raises(ValueError, match="pp=3 must divide num_layers=2"):
        llama_shard_specs(CFG, 3)
    with pytest.raises(ValueError, match="head='x'"):
        llama_shard_specs(CFG, 1, head="x")


def test_specs_shapes_and_stages():
    specs = {s.name: s for s in llama_shard_specs(CFG, 2)}
    assert specs["layers.0.qkv"].shape == ((4 + 2 * 2) * 8, 32)
    assert specs["layers.0.qkv"].partition_dim == 0 and specs["layers.0.qkv"].fusion.units == 2
    assert specs["layers.1.o_proj"].partition_dim == 1 and specs["layers.1.o_proj"].stage == 1
    assert specs["layers.0.down_proj"].shape == (32, 48)
    assert specs["embed_tokens"].stage == 0 and specs["lm_head"].stage == 1
    assert specs["norm"].partition_dim is None and specs["norm"].stage == 1
    tied = replace_cfg(tie_word_embeddings=True)
    assert "lm_head" not in {s.name for s in llama_shard_specs(tied, 1)}
    assert llama_shard_specs(tied, 2)[-1].hf_names == ("model.embed_tokens.weight",)
    value = {s.name: s for s in llama_shard_specs(CFG, 1, head="value")}
    assert value["value_head"].shape == (1, 32) and value["value_head"].partition_dim is None


def replace_cfg(**kw) -> LlamaConfig:
    return LlamaConfig(**({k: v for k, v in CFG.__dict__.items()} | kw))


# Layer maths ---------------------------------------------------------------------------------
def test_row_linear_stacked_form_equals_plain():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 8, generator=g)  # [out, in]
    x = torch.randn(3, 5, 8, generator=g)
    stacked = w.unflatten(1, (2, 4)).transpose(0, 1).contiguous()  # [m=2, out, in/2]
    torch.testing.assert_close(row_linear(x, stacked, None), row_linear(x, w, None))
    with pytest.raises(ValueError, match="expects 8"):
        row_linear(x[..., :6], stacked, None)


def test_row_linear_pieces_equals_the_whole_weight_with_gradients():
    """A weight kept as its column pieces ``[m, out, in/m]``: outputs and the gradients of
    input and pieces equal the whole weight's, in float64 and at oneDNN's float32 sizes."""
    for dtype, (n, out, k), tol in ((torch.float64, (3, 6, 4), 1e-12),
                                    (torch.float32, (64, 96, 128), 1e-4)):
        g = torch.Generator().manual_seed(1)
        whole = torch.randn(out, 2 * k, generator=g, dtype=dtype, requires_grad=True)
        pieces = whole.detach().unflatten(1, (2, k)).transpose(0, 1).contiguous()
        pieces.requires_grad_()
        x = torch.randn(n, 2 * k, generator=g, dtype=dtype, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        dy = torch.randn(n, out, generator=g, dtype=dtype)
        y, y2 = row_linear_pieces(x, pieces), x2 @ whole.T
        torch.testing.assert_close(y, y2, atol=tol, rtol=tol)
        (y * dy).sum().backward()
        (y2 * dy).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, atol=tol, rtol=tol)
        torch.testing.assert_close(pieces.grad, whole.grad.unflatten(1, (2, k)).transpose(0, 1),
                                   atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="expect 8"):
        row_linear_pieces(torch.zeros(2, 6), torch.zeros(2, 3, 4))


def test_vocab_log_prob_entropy_matches_softmax_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    lp, ent = vocab_log_prob_entropy(logits, targets, None)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref.gather(-1, targets[..., None]).squeeze(-1).float())
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1).float())
    f = lambda z: vocab_log_prob_entropy(z, targets, None)  # noqa: E731
    # the function returns float32; check the analytic backward against finite differences
    z = logits.detach().float().requires_grad_()
    w1, w2 = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    (f(z)[0] * w1 + f(z)[1] * w2).sum().backward()
    zd = logits.detach().requires_grad_()
    r = torch.log_softmax(zd, -1)
    ((r.gather(-1, targets[..., None]).squeeze(-1) * w1.double())
     + (-(r.exp() * r).sum(-1)) * w2.double()).sum().backward()
    torch.testing.assert_close(z.grad.double(), zd.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_in_chunks_equals_a_float64_log_softmax(temperature):
    """The LM head and log-softmax fused over chunks of 1 token, 4 tokens and all of them:
    log-probs, entropy and both gradients against float64 autograd of ``log_softmax(h @ W.T
    / T)``; a frozen head (LoRA) gets no gradient and the hidden states the same one."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64) / 4
    targets = torch.randint(0, 40, (3, 7), generator=g)
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    hd, wd = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.log_softmax(hd @ wd.t() / temperature, -1)
    lp_ref = ref.gather(-1, targets[..., None]).squeeze(-1)
    ent_ref = -(ref.exp() * ref).sum(-1)
    (lp_ref * w1.double() + ent_ref * w2.double()).sum().backward()
    for chunk_elems in (40, 160, 10 ** 6):
        hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
        lp, ent = linear_log_prob_entropy(hf, wf, targets, None, temperature, chunk_elems)
        assert lp.shape == ent.shape == (3, 7)
        torch.testing.assert_close(lp.double(), lp_ref.detach(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent.double(), ent_ref.detach(), atol=2e-5, rtol=1e-5)
        (lp * w1 + ent * w2).sum().backward()
        torch.testing.assert_close(hf.grad.double(), hd.grad, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(wf.grad.double(), wd.grad, atol=2e-5, rtol=1e-4)
    hf = h.float().requires_grad_()
    lp, ent = linear_log_prob_entropy(hf, w.float(), targets, None, temperature, 40)
    (lp * w1 + ent * w2).sum().backward()
    torch.testing.assert_close(hf.grad.double(), hd.grad, atol=2e-5, rtol=1e-4)


def test_schedules():
    assert gpipe_schedule(2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    for pp in (1, 2, 4):
        for stage in range(pp):
            for n in (1, 3, 6):
                acts = one_f_one_b_schedule(pp, stage, n)
                assert sorted(acts) == sorted(gpipe_schedule(n))
                alive, peak = set(), 0
                for kind, i in acts:
                    if kind == "F":
                        alive.add(i)
                    else:
                        assert i in alive
                        alive.remove(i)
                    peak = max(peak, len(alive))
                assert peak <= min(pp - stage, n)


# Single-process model vs transformers ----------------------------------------------------------
def _hf_model(cfg: LlamaConfig, seed: int):
    import transformers

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config_to_hf(cfg)).eval()
    with torch.no_grad():  # HF inits norms to 1: perturb them so the test sees their use
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_hf_roundtrip_logits_and_grads(tmp_path, tied):
    cfg = replace_cfg(tie_word_embeddings=tied)
    hf = _hf_model(cfg, seed=3)
    folder = str(tmp_path / "ckpt")
    hf.save_pretrained(folder)
    assert read_hf_config(folder) == cfg
    model = ParallelLlama(cfg, single_groups())
    load_hf_checkpoint(model, folder)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    out = model.head_outputs(model.stage_forward(ids, mask), ids, with_logits=True,
                             temperature=1.0)
    hf_logits = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(out["logits"][real], hf_logits[real], atol=1e-5, rtol=1e-5)
    ref_lp = torch.log_softmax(hf_logits[:, :-1], -1)
    q_real = real[:, :-1]  # outputs at padding queries are meaningless
    torch.testing.assert_close(out["log_probs"][q_real],
                               ref_lp.gather(-1, ids[:, 1:, None]).squeeze(-1)[q_real],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["entropy"][q_real],
                               -(ref_lp.exp() * ref_lp).sum(-1)[q_real], atol=1e-5, rtol=1e-5)
    # gradients of a masked mean log-prob loss equal transformers' autograd
    m = mask[:, 1:].float()
    ((out["log_probs"] * m).sum() / m.sum()).backward()
    ((ref_lp.gather(-1, ids[:, 1:, None]).squeeze(-1) * m).sum() / m.sum()).backward()
    hf_params = dict(hf.named_parameters())
    q, k, v = model.specs[2].fusion.split(model.params["layers.0.qkv"].grad)
    torch.testing.assert_close(q, hf_params["model.layers.0.self_attn.q_proj.weight"].grad,
                               atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(v, hf_params["model.layers.0.self_attn.v_proj.weight"].grad,
                               atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(model.params["embed_tokens"].grad,
                               hf_params["model.embed_tokens.weight"].grad, atol=1e-6, rtol=1e-4)
    # save back: the same tensors under the same names
    save_hf_checkpoint(model, str(tmp_path / "back"))
    from safetensors.torch import load_file

    back = load_file(os.path.join(tmp_path, "back", "model.safetensors"))
    want = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(back) == set(want)
    for k, v in want.items():
        assert torch.equal(back[k], v), k


def test_load_rejects_other_architecture(tmp_path):
    folder = str(tmp_path / "ckpt")
    _hf_model(replace_cfg(num_layers=4), seed=0).save_pretrained(folder)
    with pytest.raises(ValueError, match="num_layers"):
        load_hf_checkpoint(ParallelLlama(CFG, single_groups()), folder)


def test_single_process_storage_identity_and_step():
    model = ParallelLlama(CFG, single_groups())
    full = init_full_state_dict(CFG, seed=1)
    load_full_state_dict(model, full)
    for name, p in model.params.items():
        view = model.buffer.train_view(name)
        assert p.data_ptr() == view.data_ptr()
        assert (p.untyped_storage().data_ptr()
                == model.buffer.storage(p.dtype).untyped_storage().data_ptr())
    eng = TrainEngine(model, OptimConfig(lr=1e-2))
    ptrs = {n: (p.data_ptr(), p.grad.data_ptr()) for n, p in model.params.items()}
    ids = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    metrics = eng.train_step([{"input_ids": ids}], lambda o, mb: -o["log_probs"].mean(),
                             temperature=1.0)
    assert metrics["loss"] > 0 and metrics["grad_norm"] > 0
    assert {n: (p.data_ptr(), p.grad.data_ptr()) for n, p in model.params.items()} == ptrs
    grad_flat = eng.grads.flat[torch.float32]
    assert all(p.grad.untyped_storage().data_ptr() == grad_flat.untyped_storage().data_ptr()
               for p in model.params.values())
    assert not torch.equal(model.params["layers.0.qkv"], full["layers.0.qkv"])
    gathered = gather_full_state_dict(model)
    assert torch.equal(gathered["layers.1.gate_up"], model.params["layers.1.gate_up"])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        eng.train_step([], lambda o, mb: o, temperature=1.0)


def test_layer_functions_read_generation_forms_in_place():
    """A tp=2 training layout regrouped to tp_g=1: the generation region of one rank holds both
    training shards; the layer functions consume it as is (column weights concatenated on dim
    0, row weights stacked ``[m, out, in/m]``) and match the full weights."""
    from engine.layers import LayerSpec, decoder_layer
    from engine.rope import rope_tables
    from engine.model import LAYER_KEYS
    from hybridflow_comm.flat_buffer import FlatParamBuffer
    from hybridflow_comm.shard_spec import slot_specs, train_shard

    hybrid = HybridLayout(ParallelLayout(1, 2, 1), pp_g=1, tp_g=1)
    specs = llama_shard_specs(CFG, 1)
    full = init_full_state_dict(CFG, seed=2)
    buf = FlatParamBuffer(slot_specs(specs, hybrid, rank=0))
    for spec in specs:  # what the micro-DP all-gather leaves in the region
        region = buf.gen_view(spec.name)
        for slot in range(region.shape[0]):
            region[slot].copy_(train_shard(full[spec.name], spec, hybrid.train, rank=slot))
    gen_w, full_w = {}, {}
    for k in LAYER_KEYS:
        spec = next(s for s in specs if s.name == f"layers.1.{k}")
        region = buf.gen_view(spec.name)  # [m, *shard]
        gen_w[k] = region[0] if spec.partition_dim is None else (
            region.flatten(0, 1) if spec.partition_dim == 0 else region)
        full_w[k] = full[spec.name]
    assert gen_w["o_proj"].dim() == 3 and gen_w["o_proj"].data_ptr() == \
        buf.gen_view("layers.1.o_proj").data_ptr()
    x = torch.randn(2, 6, CFG.hidden_size, generator=torch.Generator().manual_seed(0))
    rope = rope_tables(torch.arange(6).expand(2, 6), CFG.head_dim, CFG.rope_theta)
    args = (rope, None, LayerSpec(CFG.q_per_group, CFG.head_dim, CFG.rms_norm_eps))
    torch.testing.assert_close(decoder_layer(x, gen_w, *args), decoder_layer(x, full_w, *args),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_head_from_a_later_position_equals_the_tail_of_the_full_head(head):
    """The RLHF roles run the head from the last prompt position only: same outputs as the
    full head's tail (values, grads through the train step) and a clear error outside."""
    model = ParallelLlama(CFG, single_groups(), head=head)
    load_full_state_dict(model, init_full_state_dict(CFG, seed=4, head=head, std=0.2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (3, 10), generator=g)
    with torch.no_grad():
        hidden = model.stage_forward(ids)
        full = model.head_outputs(hidden, ids, with_logits=head == "lm", temperature=1.0)
        part = model.head_outputs(hidden, ids, with_logits=head == "lm", start=6,
                                  temperature=1.0)
    assert sorted(part) == sorted(full)
    for k, v in full.items():
        assert part[k].shape[1] == v.shape[1] - 6
        torch.testing.assert_close(part[k], v[:, 6:], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="head start=10 outside"):
        model.head_outputs(hidden, ids, start=10, temperature=1.0)
    # a train step whose loss reads only positions >= 6 has the same gradients either way
    key = "log_probs" if head == "lm" else "values"
    results = []
    for start in (0, 6):
        load_full_state_dict(model, init_full_state_dict(CFG, seed=4, head=head, std=0.2))
        eng = TrainEngine(model, OptimConfig(lr=1e-2, max_grad_norm=None))

        def loss_fn(out, mb, start=start):
            return out[key][:, 6 - start:].float().pow(2).mean()

        eng.train_step([{"input_ids": ids}], loss_fn, head_from=start, temperature=1.0)
        results.append({n: p.grad.clone() for n, p in model.params.items()})
    for name, grad in results[0].items():
        tol = 1e-5 * max(grad.abs().max().item(), 1e-3)
        torch.testing.assert_close(results[1][name], grad, rtol=0, atol=tol)
