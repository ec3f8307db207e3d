"""megatron-core GPT actor on 4 gloo ranks: logits, loss and gradients equal a single-process
transformers Llama with the same weights; its parameters alias the Resharder's flat buffer and
the generation shards (Hugging Face names) equal the reference cut of the full weights, also
after an optimizer step.  megatron's parallel_state is re-initialised per layout."""

import pytest
import torch
import torch.nn.functional as F

from engine.hf_interop import config_to_hf, full_to_hf_state_dict
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=2,
                     num_heads=8, num_kv_heads=4, max_position_embeddings=64,
                     tie_word_embeddings=False)
CASES = [((1, 2, 2), (1,)), ((1, 4, 1), (2, 1))]
BATCH, SEQ, LR = 4, 8, 0.5


def _hf_dim(name):
    """Partition dim of a Hugging Face Llama weight (independent of our specs)."""
    if "norm" in name:
        return None
    return 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0


def _reference(full, tokens, labels):
    """Single-process transformers model: logits, mean loss, HF weights and grads."""
    import transformers

    hf = transformers.LlamaForCausalLM(config_to_hf(CONFIG)).float()
    sd = full_to_hf_state_dict(full, llama_shard_specs(CONFIG, 1))
    hf.load_state_dict(sd, strict=True)
    logits = hf(tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    return logits.detach(), float(loss), sd, grads


def check_backend(rank, world, cases):
    import torch.distributed as dist

    from engine.megatron_backend import MegatronActor, megatron_name

    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g)
    full = init_full_state_dict(CONFIG, seed=3)
    ref_logits, ref_loss, ref_sd, ref_grads = _reference(full, tokens, labels)
    out = []
    for (pp, tp, dp), tp_gs in cases:
        train = ParallelLayout(pp, tp, dp)
        c = train.coords(rank)
        actor = MegatronActor(CONFIG, train, seed=0)
        actor.load_full_state_dict(full)
        rows = slice(c.dp * BATCH // dp, (c.dp + 1) * BATCH // dp)
        v = CONFIG.vocab_size // tp
        with torch.no_grad():
            logits = actor.forward(tokens[rows])
        assert torch.allclose(logits, ref_logits[rows, :, c.tp * v:(c.tp + 1) * v],
                              atol=1e-5), (train, (logits - ref_logits[rows, :, :v]).abs().max())
        loss = actor.forward_backward(tokens[rows], labels[rows])
        assert abs(loss - ref_loss) < 1e-5, (train, loss, ref_loss)
        params = actor.named_parameters()
        for spec in llama_shard_specs(CONFIG, 1):
            parts = [ref_grads[n] for n in spec.hf_names]
            want = spec.fusion.fuse(*parts) if spec.fusion is not None else parts[0]
            if spec.partition_dim is not None:
                want = want.chunk(tp, spec.partition_dim)[c.tp]
            got = params[megatron_name(spec.name)].grad
            assert torch.allclose(got, want, atol=1e-5), (train, spec.name)

        for tp_g in tp_gs:
            hl = HybridLayout(train, pp_g=1, tp_g=tp_g)
            groups = build_hybrid_groups(hl)
            actor.load_full_state_dict(full)  # reset weights for this generation layout
            rs = actor.resharder(groups)
            for name, p in actor.named_parameters().items():
                assert p.data_ptr() == rs.buffer.train_view(name).data_ptr(), name
                assert (p.untyped_storage().data_ptr()
                        == rs.buffer.storage(p.dtype).untyped_storage().data_ptr())
            with torch.no_grad():
                assert torch.equal(actor.forward(tokens[rows]), logits)
            gtp = next(gr for gr in hl.gen_tp_groups() if rank in gr).index(rank)
            for step in range(2):
                rs.to_generation()
                gen = dict(rs.named_generation_weights(hf_names=True))
                assert sorted(gen) == sorted(ref_sd), sorted(set(gen) ^ set(ref_sd))
                for name, w in ref_sd.items():
                    if step == 1:
                        w = w - LR * ref_grads[name]
                    d = _hf_dim(name)
                    want = w if d is None else w.chunk(tp_g, d)[gtp]
                    ok = torch.equal(gen[name], want) if step == 0 else torch.allclose(
                        gen[name], want, atol=1e-5)
                    assert ok, (train, tp_g, step, name)
                rs.verify()
                rs.to_training()
                with torch.no_grad():  # an SGD step through the megatron parameters
                    for p in actor.model.parameters():
                        p.add_(p.grad, alpha=-LR)
            out.append((train.tp, tp_g, rs.last_stats.received_bytes))
        dist.barrier()
    return out


def test_megatron_actor_matches_reference_and_reshards(pool4):
    reports = pool4.run(check_backend, CASES, timeout_s=400)
    assert all(len(r) == 3 for r in reports)
    for r in reports:
        # micro-TP gather: tp 4 -> tp_g 2 receives 1 shard per tensor, tp 4 -> 1 receives 3.
        assert 0 < r[1][2] and 3 * r[1][2] == r[2][2], r


def check_backend_pp(rank, world, gen_layouts):
    """pp = 2: each stage names its layers globally; the micro-PP broadcast builds the
    generation shards of the whole model (no forward: pp > 1 forward is not wired)."""
    from engine.megatron_backend import MegatronActor

    train = ParallelLayout(2, 2, 1)
    full = init_full_state_dict(CONFIG, seed=5)
    ref_sd = full_to_hf_state_dict(full, llama_shard_specs(CONFIG, 1))
    actor = MegatronActor(CONFIG, train, seed=0)
    actor.load_full_state_dict(full)
    names = sorted(actor.named_parameters())
    out = [names]
    for pp_g, tp_g in gen_layouts:
        hl = HybridLayout(train, pp_g=pp_g, tp_g=tp_g)
        rs = actor.resharder(build_hybrid_groups(hl))
        rs.to_generation()
        gen = dict(rs.named_generation_weights(hf_names=True))
        g = hl.gen_coords(rank)
        for name, w in ref_sd.items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            stage = (layer if layer is not None else
                     0 if "embed" in name else CONFIG.num_layers - 1) // (2 // pp_g)
            if stage != g.pp_g:
                assert name not in gen, name
                continue
            d = _hf_dim(name)
            assert torch.equal(gen[name], w if d is None else w.chunk(tp_g, d)[g.tp_g]), name
        rs.verify()
        out.append(len(gen))
    return out


def test_megatron_actor_pipeline_stages_reshard(pool4):
    reports = pool4.run(check_backend_pp, [(1, 1), (1, 2), (2, 1)], timeout_s=300)
    assert reports[0][0] == [
        "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight", "embedding.word_embeddings.weight"]
    stage1 = reports[2][0]  # stage 1 names its only layer by its global index
    assert any(n.startswith("decoder.layers.1.") for n in stage1), stage1
    assert not any(n.startswith("decoder.layers.0.") for n in stage1), stage1
    assert "output_layer.weight" in reports[2][0]
    n_hf = 3 + CONFIG.num_layers * 9
    assert all(r[1] == n_hf and r[2] == n_hf for r in reports)  # pp_g = 1: the whole model


def test_megatron_backend_refuses_layers_it_cannot_build():
    from engine.llama_spec import LlamaConfig
    from engine.megatron_backend import transformer_config
    from hybridflow_comm.layout import ParallelLayout

    qwen3 = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                        model_type="qwen3", qk_norm=True)
    with pytest.raises(ValueError, match=r"plain Llama layers; this qwen3 config also has "
                                         r"\{'qk_norm': True\}"):
        transformer_config(qwen3, ParallelLayout(1, 1, 1))
