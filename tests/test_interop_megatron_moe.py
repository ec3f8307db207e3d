"""A megatron-core 0.16.1 GPT mixture of experts (SequentialMLP experts, interleaved SwiGLU)
through ``hybridflow_comm.from_megatron``: experts named by global index, every expert's spec
on every rank, megatron's expert parallelism moved by the MoeResharder (4 gloo ranks, started
once; megatron's parallel_state re-initialised per layout inside one call).

The reference is our own arithmetic: every tensor is drawn from its (global) name, each
megatron parameter is set to this rank's part of it, and each generation tensor must be the
generation layout's part of the same full tensor, bit for bit.
"""

import zlib

import torch
import torch.distributed as dist

from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import gen_shard

H, HEADS, F, E, VOCAB, LAYERS = 16, 4, 32, 4, 64, 2
LAYOUTS = [((1, 1, 4), 1, 2), ((1, 2, 2), 2, 2), ((1, 2, 2), 1, 4), ((1, 2, 2), 1, 1)]
"""``(train pp, tp, dp), gen tp_g, ep``; ep=1: megatron splits the experts over tp."""


def _full(spec):
    g = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=g).to(spec.dtype)


def _gpt(ep, pp=1):
    import torch.nn.functional as F_
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hybridflow_comm.interop.megatron import interleaved_glu_layer_spec

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=F,
        num_moe_experts=E, moe_router_topk=2, moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1 if ep > 1 else None,
        gated_linear_unit=True, activation_func=F_.silu, use_te_activation_func=True,
        bias_activation_fusion=False, add_bias_linear=False, normalization="RMSNorm",
        use_cpu_initialization=True, perform_initialization=True,
        params_dtype=torch.float32, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32 if pp > 1 else None)
    from megatron.core import parallel_state as ps

    return GPTModel(config=cfg, transformer_layer_spec=interleaved_glu_layer_spec(num_experts=E),
                    vocab_size=VOCAB, max_sequence_length=32, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage())


def check_layouts(rank, world, layouts):
    from megatron.core import parallel_state as ps

    import hybridflow_comm as hc
    from hybridflow_comm.interop.megatron import gpt_hf_names, stage_specs_from_megatron

    out = []
    for train, tp_g, ep in layouts:
        train = ParallelLayout(*train)
        hl = HybridLayout(train, pp_g=1, tp_g=tp_g)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=train.tp,
                                     expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1 if ep > 1 else None,
                                     create_gloo_process_groups=False)
        model = _gpt(ep)
        specs, params = stage_specs_from_megatron(model, train, rank, gpt_hf_names)
        by_name = {s.name: s for s in specs}
        experts = sorted({s.expert for s in specs if s.expert is not None})
        assert experts == list(range(E)), experts  # every expert's spec, on every rank
        el = ExpertLayout(hl, E, ep=ep) if ep > 1 else None
        tp_rank = train.coords(rank).tp
        with torch.no_grad():  # this rank's part of every full tensor
            for name, p in params.items():
                s, full = by_name[name], _full(by_name[name])
                if s.expert is not None and ep > 1:
                    assert s.expert in el.train_experts(rank), (name, s.expert)
                    p.copy_(full)
                elif s.partition_dim is None:
                    p.copy_(full)
                else:
                    p.copy_(full.chunk(train.tp, s.partition_dim)[tp_rank])
        t = hc.from_megatron(model, hl, hf_names=gpt_hf_names)
        assert isinstance(t, hc.MoeResharder) == (ep > 1)
        stats = t.to_generation()
        got = dict(t.named_generation_weights(hf_names=False))
        for s in specs:
            if s.expert is not None and ep > 1:
                if s.expert not in el.gen_experts(rank):
                    assert s.name not in got
                    continue
                piece = el.gen_piece(rank)
                want = _full(s).chunk(piece.count, s.partition_dim)[piece.index]
            else:
                want = gen_shard(_full(s), s, hl, rank)
            assert torch.equal(got[s.name], want), (train, tp_g, ep, s.name)
        assert stats.received_bytes == t.minimum_received_bytes()
        hf = {n for n, _ in t.named_generation_weights()}
        assert "model.layers.1.mlp.gate.weight" in hf
        out.append(stats.received_bytes)
        t.to_training()
    ps.destroy_model_parallel()
    return out


def test_megatron_mixture_of_experts_reshards_bit_exact(pool4):
    for received in pool4.run(check_layouts, LAYOUTS):
        assert len(received) == len(LAYOUTS) and received[0] > 0


def check_refusals(rank, world):
    from megatron.core import parallel_state as ps

    import hybridflow_comm as hc

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1, create_gloo_process_groups=False)
    model = _gpt(2)
    msgs = []
    for kwargs in (dict(bind=True), {}):
        layout = HybridLayout(ParallelLayout(1, 2, 2), 1, 1)
        if not kwargs:  # megatron's EP groups are [0 1] [2 3]: ep 4 over these ranks differs
            for mod in model.modules():
                if hasattr(mod, "local_expert_indices"):
                    mod.ep_group = dist.group.WORLD
        try:
            hc.from_megatron(model, layout, **kwargs)
        except ValueError as exc:
            msgs.append(str(exc))
    # pp 2: megatron puts the pipeline stages outermost (its MoE layers require it), our
    # layouts the data-parallel replicas: the EP groups differ
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1, create_gloo_process_groups=False)
    try:
        hc.from_megatron(_gpt(2, pp=2), HybridLayout(ParallelLayout(2, 1, 2), 1, 1))
    except ValueError as exc:
        msgs.append(str(exc))
    ps.destroy_model_parallel()
    return msgs


def test_megatron_experts_refused_before_any_collective(pool4):
    for rank, msgs in enumerate(pool4.run(check_refusals)):
        assert len(msgs) == 3, msgs
        assert "bind=True with megatron's expert parallelism" in msgs[0]
        assert msgs[1].startswith(f"rank {rank}: megatron's expert-parallel group is [0, 1, 2, 3]"), \
            msgs[1]
        megatron_ep = [0, 1] if rank < 2 else [2, 3]  # ours: [0, 2] on stage 0, [1, 3] on 1
        ours = [0, 2] if rank % 2 == 0 else [1, 3]
        assert msgs[2].startswith(f"rank {rank}: megatron's expert-parallel group is "
                                  f"{megatron_ep}, the expert layout's (ep=2 over "), msgs[2]
        assert msgs[2].endswith(str(ours)), msgs[2]
