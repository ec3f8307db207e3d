"""megatron-core Column/RowParallelLinear -> shard specs -> aliased flat buffer -> reshard ->
a forward pass on the generation shards equals the training model's output (4 gloo ranks,
started once; megatron's parallel_state is re-initialised per layout inside one call)."""

import torch
import torch.distributed as dist

from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder

H, F, BIAS_SEED = 8, 24, 7
LAYOUTS = [((1, 4, 1), 2), ((1, 4, 1), 1), ((1, 2, 2), 1), ((1, 1, 4), 1)]


def _full(seed):
    g = torch.Generator().manual_seed(seed)
    return {"col.weight": torch.randn(F, H, generator=g),
            "row.weight": torch.randn(H, F, generator=g),
            "row.bias": torch.randn(H, generator=g)}


def _block(tp_rank, tp, full):
    """Column(H->F) then Row(F->H, bias), weights cut from ``full`` by our own arithmetic."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                            use_cpu_initialization=True, perform_initialization=False)
    block = torch.nn.Module()
    block.col = ColumnParallelLinear(H, F, config=cfg, init_method=torch.nn.init.zeros_,
                                     bias=False, gather_output=False)
    block.row = RowParallelLinear(F, H, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                  input_is_parallel=True, skip_bias_add=False)
    n = F // tp
    with torch.no_grad():
        block.col.weight.copy_(full["col.weight"][tp_rank * n:(tp_rank + 1) * n])
        block.row.weight.copy_(full["row.weight"][:, tp_rank * n:(tp_rank + 1) * n])
        block.row.bias.copy_(full["row.bias"])
    return block


def _forward(block, x):
    y, _ = block.col(x)
    z, _ = block.row(y)
    return z


def _gen_forward(gen, x, gen_tp_pg):
    """The generation TP group's forward from generation shards: the column shard as one
    [F/tp_g, H] tensor, the row shard consumed in its stacked [m, H, F/tp] form."""
    y = x @ gen["col.weight"].T  # [s, b, F/tp_g]
    w = gen["row.weight"]  # [m, H, F/tp]
    part = torch.einsum("sbmf,mhf->sbh", y.unflatten(-1, (w.shape[0], -1)), w)
    if gen_tp_pg is not None:
        dist.all_reduce(part, group=gen_tp_pg)
    return part + gen["row.bias"]


def check_linear_layouts(rank, world, layouts):
    from megatron.core import parallel_state as ps

    from hybridflow_comm.interop.megatron import bind_megatron_params, from_megatron

    out = []
    for (pp, tp, dp), tp_g in layouts:
        train = ParallelLayout(pp, tp, dp)
        hl = HybridLayout(train, pp_g=1, tp_g=tp_g)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp, order="tp-pp-dp",
                                     create_gloo_process_groups=False)
        mtp = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
        mdp = dist.get_process_group_ranks(ps.get_data_parallel_group())
        ours_tp = next(g for g in train.tp_groups() if rank in g)
        ours_dp = next(g for g in train.dp_groups() if rank in g)
        assert sorted(mtp) == ours_tp and sorted(mdp) == ours_dp, (mtp, mdp, ours_tp, ours_dp)

        full = _full(seed=tp * 10 + tp_g)
        tp_rank = train.coords(rank).tp
        block = _block(tp_rank, tp, full)
        x = torch.randn(3, 2, H, generator=torch.Generator().manual_seed(5))
        z_train = _forward(block, x).detach()
        z_ref = (x @ full["col.weight"].T) @ full["row.weight"].T + full["row.bias"]
        assert torch.allclose(z_train, z_ref, atol=1e-5)

        groups = build_hybrid_groups(hl)
        specs, params = from_megatron(block, groups)
        kinds = {s.name: (s.shape, s.partition_dim) for s in specs}
        assert kinds == {"col.weight": ((F, H), 0), "row.weight": ((H, F), 1),
                         "row.bias": ((H,), None)}, kinds
        rs = Resharder(specs, groups)
        bind_megatron_params(params, rs.buffer)
        for name, p in params.items():  # zero-copy: the megatron params are the buffer
            assert p.data_ptr() == rs.buffer.train_view(name).data_ptr(), name
            assert (p.untyped_storage().data_ptr()
                    == rs.buffer.storage(p.dtype).untyped_storage().data_ptr())
        assert torch.equal(_forward(block, x), z_train)

        gtp = next(g for g in hl.gen_tp_groups() if rank in g).index(rank)
        for step in range(2):
            rs.to_generation()
            gen = rs.generation_params()
            for name, t in full.items():
                spec = next(s for s in specs if s.name == name)
                want = t if spec.partition_dim is None else t.chunk(tp_g, spec.partition_dim)[gtp]
                got = gen[name]
                if spec.partition_dim == 1:
                    got = got.movedim(0, 1).flatten(1, 2)
                assert torch.equal(got, want), (train, tp_g, step, name)
            z_gen = _gen_forward(gen, x, groups.gen_tp.pg)
            assert torch.allclose(z_gen, z_train, atol=1e-5), (train, tp_g, step)
            rs.to_training()
            # An "optimizer step" through the megatron parameters lands in the buffer.
            with torch.no_grad():
                for p in block.parameters():
                    p.mul_(0.5)
            full = {k: v * 0.5 for k, v in full.items()}
            z_train = _forward(block, x).detach()
        out.append((train.tp, tp_g, rs.last_stats.received_bytes))
    ps.destroy_model_parallel()
    return out


def check_bad_inputs(rank, world):
    """Every error is raised locally (no collective), naming the parameter."""
    from megatron.core import parallel_state as ps

    from hybridflow_comm.interop.megatron import stage_specs_from_megatron

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=4, order="tp-pp-dp",
                                 create_gloo_process_groups=False)
    block = _block(rank, 4, _full(0))
    errors = []
    for train, patch in ((ParallelLayout(1, 1, 4), None), (ParallelLayout(1, 4, 1), "stride")):
        if patch == "stride":
            block.row.weight.partition_stride = 2
        try:
            stage_specs_from_megatron(block, train, rank)
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    errors.append(_check_stock_glu(rank))
    ps.destroy_model_parallel()
    return errors


def _mlp(interleaved):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hybridflow_comm.interop.megatron import InterleavedSwiGLU

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                            ffn_hidden_size=F, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            bias_activation_fusion=False, use_te_activation_func=interleaved,
                            use_cpu_initialization=True)
    act = ModuleSpec(module=InterleavedSwiGLU) if interleaved else None
    return MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                  linear_fc2=RowParallelLinear, activation_func=act))


def _check_stock_glu(rank):
    """A stock megatron SwiGLU fc1 ([gate; up] per rank, stride 2) is refused by name; the
    same weights converted by fc1_to_interleaved give the same output in an interleaved MLP,
    whose fc1 gets a GateUpFusion spec."""
    from hybridflow_comm.interop.megatron import fc1_to_interleaved, stage_specs_from_megatron
    from hybridflow_comm.shard_spec import GateUpFusion

    train = ParallelLayout(1, 4, 1)
    stock, inter = _mlp(False), _mlp(True)
    with torch.no_grad():
        inter.linear_fc1.weight.copy_(fc1_to_interleaved(stock.linear_fc1.weight))
        inter.linear_fc2.weight.copy_(stock.linear_fc2.weight)
    x = torch.randn(3, 2, H, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(stock(x)[0], inter(x)[0], atol=1e-6)
    specs, _ = stage_specs_from_megatron(inter, train, rank)
    fc1 = next(s for s in specs if s.name == "linear_fc1.weight")
    assert fc1.fusion == GateUpFusion() and fc1.shape == (2 * F, H), fc1
    try:
        stage_specs_from_megatron(stock, train, rank)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_megatron_linear_reshard_and_generation_forward(pool4):
    reports = pool4.run(check_linear_layouts, LAYOUTS, timeout_s=300)
    for rank, report in enumerate(reports):
        for tp, tp_g, recv in report:
            m = tp // tp_g
            # micro-TP gather of the two partitioned weights: (m - 1) training shards each.
            assert recv == (m - 1) * (F * H // tp) * 2 * 4, (rank, tp, tp_g, recv)


def test_megatron_bad_inputs_raise_value_error(pool4):
    for tp_msg, stride_msg, glu_msg in pool4.run(check_bad_inputs, timeout_s=120):
        assert glu_msg.startswith("linear_fc1.weight: partition_stride=2 ([gate; up]"), glu_msg
        assert "col.weight" in tp_msg and "megatron TP group has size 4" in tp_msg, tp_msg
        assert "row.weight" in stride_msg and "partition_stride=2" in stride_msg, stride_msg
