"""The public entries of hybridflow_comm (reshard_from_state_dict, from_dtensor, from_megatron):
each returns a Transition whose generation tensors are bit-exact and whose received bytes are
the minimum; bad calls raise locally, before any collective (2 gloo ranks, started once; one
case without torch.distributed at all)."""

import pytest
import torch

import hybridflow_comm as hc

H = 8


def _full(seed):
    g = torch.Generator().manual_seed(seed)
    return {"s0.col": torch.randn(4 * H, H, generator=g),
            "s0.row": torch.randn(H, 4 * H, generator=g), "s0.norm": torch.randn(H, generator=g),
            "s1.col": torch.randn(2 * H, H, generator=g),
            "s1.norm": torch.randn(H, generator=g).double()}


DIMS = {"col": 0, "row": 1, "norm": None}


def _specs(full, pp):
    return [hc.ShardSpec(n, t.shape, dtype=t.dtype, partition_dim=DIMS[n.split(".")[1]],
                         stage=int(n[1]) if pp > 1 else 0) for n, t in full.items()]


def _local(full, specs, train, rank):
    c = train.coords(rank)
    return {s.name: full[s.name] if s.partition_dim is None
            else full[s.name].chunk(train.tp, s.partition_dim)[c.tp]
            for s in specs if s.stage == c.pp}


def _check(t, full, specs, layout, rank):
    """Generation tensors against the full ones; received bytes against the minimum."""
    assert isinstance(t, hc.Transition) and isinstance(t, hc.Resharder)
    stats = t.to_generation()
    g = layout.gen_coords(rank)
    want = {s.name: full[s.name] if s.partition_dim is None
            else full[s.name].chunk(layout.tp_g, s.partition_dim)[g.tp_g]
            for s in specs if s.stage // layout.micro_pp == g.pp_g}
    got = dict(t.named_generation_weights(hf_names=False))
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    assert stats.received_bytes == t.minimum_received_bytes() == t.accounting().received_bytes
    t.to_training()
    return stats.received_bytes


def check_state_dict_layouts(rank, world):
    out = []
    for (pp, tp, dp), (pp_g, tp_g) in [((1, 2, 1), (1, 1)), ((2, 1, 1), (1, 1)),
                                       ((1, 1, 2), (1, 1))]:
        layout = hc.HybridLayout(hc.ParallelLayout(pp, tp, dp), pp_g=pp_g, tp_g=tp_g)
        full = _full(pp * 10 + tp)
        specs = _specs(full, pp)
        local = _local(full, specs, layout.train, rank)
        t = hc.reshard_from_state_dict(local, specs, layout)
        # One copy: the flat buffer does not alias the caller's tensors.
        for name, v in local.items():
            assert t.buffer.train_view(name).data_ptr() != v.data_ptr()
        out.append(_check(t, full, specs, layout, rank))
        # groups= reuses groups built elsewhere (no new process groups).
        t2 = hc.reshard_from_state_dict(local, specs, layout, groups=t.weights.groups)
        assert t2.weights.groups is t.weights.groups
        _check(t2, full, specs, layout, rank)
    return out


def check_dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    layout = hc.HybridLayout(hc.ParallelLayout(1, 2, 1), pp_g=1, tp_g=1)
    full = {n: t for n, t in _full(3).items() if n.startswith("s0")}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    sd = {n: t if DIMS[n[3:]] is None else distribute_tensor(t, mesh, [Shard(DIMS[n[3:]])])
          for n, t in full.items()}
    t = hc.from_dtensor(sd, layout, hf_names={"s0.col": ("model.col.weight",)})
    received = _check(t, full, _specs(full, 1), layout, rank)
    t.to_generation()
    assert sorted(n for n, _ in t.named_generation_weights()) == ["model.col.weight", "s0.norm",
                                                                  "s0.row"]
    return received


def check_megatron_bind(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                            use_cpu_initialization=True)
    layout = hc.HybridLayout(hc.ParallelLayout(1, 2, 1), pp_g=1, tp_g=1)
    out = []
    for bind in (False, True):
        block = torch.nn.Module()
        block.col = ColumnParallelLinear(H, 4 * H, config=cfg, init_method=torch.nn.init.normal_,
                                         bias=False, gather_output=False)
        block.row = RowParallelLinear(4 * H, H, config=cfg, init_method=torch.nn.init.normal_,
                                      bias=False, input_is_parallel=True, skip_bias_add=False)
        before = {n: p.detach().clone() for n, p in block.named_parameters()}
        t = hc.from_megatron(block, layout, bind=bind)
        for name, p in block.named_parameters():
            view = t.buffer.train_view(name)
            assert torch.equal(view, before[name])
            assert (p.data_ptr() == view.data_ptr()) == bind, (name, bind)
        with torch.no_grad():  # an optimizer step: seen by the transition only when bound
            block.col.weight.add_(1.0)
        t.to_generation()
        col = t.generation_params()["col.weight"]  # [4H, H]
        mine = col.chunk(2, 0)[ps.get_tensor_model_parallel_rank()]
        out.append(bool(torch.equal(mine, before["col.weight"] + (1.0 if bind else 0.0))))
        t.to_training()
    ps.destroy_model_parallel()
    return out


def check_bad_calls(rank, world):
    """Every error is raised on every rank before any collective (a hang would time out)."""
    layout = hc.HybridLayout(hc.ParallelLayout(1, 2, 1), pp_g=1, tp_g=1)
    full = _full(0)
    specs = _specs(full, 1)
    local = _local(full, specs, layout.train, rank)
    wrong = dict(local, **{"s0.col": full["s0.col"]})
    big = hc.HybridLayout(hc.ParallelLayout(1, 4, 1), pp_g=1, tp_g=2)
    other = hc.HybridLayout(hc.ParallelLayout(1, 1, 2), pp_g=1, tp_g=1)
    t = hc.reshard_from_state_dict(local, specs, layout)
    calls = [lambda: hc.reshard_from_state_dict(wrong, specs, layout),
             lambda: hc.reshard_from_state_dict(local, specs, big),
             lambda: hc.reshard_from_state_dict(local, specs, layout.train),
             lambda: hc.reshard_from_state_dict(local, specs, other, groups=t.weights.groups),
             lambda: hc.reshard_from_state_dict(local, specs, layout, bucket_bytes=10),
             lambda: hc.from_dtensor({"x": "not a tensor"}, layout)]
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except (ValueError, TypeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    return msgs


def test_state_dict_entry_reshards_bit_exact_with_minimum_bytes(pool2):
    for received in pool2.run(check_state_dict_layouts, timeout_s=240):
        assert received[0] > 0 and received[1] > 0 and received[2] == 0, received


def test_dtensor_entry(pool2):
    assert all(r > 0 for r in pool2.run(check_dtensor, timeout_s=120))


def test_megatron_entry_copies_or_binds(pool2):
    # bind=False: a copy, the step is not seen; bind=True: the parameters are the buffer.
    assert pool2.run(check_megatron_bind, timeout_s=180) == [[True, True], [True, True]]


def test_bad_calls_raise_before_any_collective(pool2):
    for m in pool2.run(check_bad_calls, timeout_s=120):
        assert m[0].startswith("ValueError: 's0.col': local shape (32, 8) != training shard"), m[0]
        assert m[1].startswith("ValueError: layout pp=1 x tp=4 x dp=1 covers 4 ranks"), m[1]
        assert m[2].startswith("TypeError: layout must be a HybridLayout"), m[2]
        assert m[3].startswith("ValueError: groups were built for"), m[3]
        assert m[4].startswith("ValueError: bucket_bytes=10"), m[4]
        assert m[5].startswith("TypeError: x: expected a DTensor or torch.Tensor"), m[5]


def test_single_process_without_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("another test left torch.distributed initialized in this process")
    layout = hc.HybridLayout(hc.ParallelLayout(1, 1, 1), pp_g=1, tp_g=1)
    full = _full(1)
    specs = _specs(full, 1)
    t = hc.reshard_from_state_dict(dict(full), specs, layout)
    assert _check(t, full, specs, layout, 0) == 0


@pytest.mark.parametrize("name", ["reshard_from_state_dict", "from_dtensor", "from_megatron",
                                  "from_fsdp", "Resharder", "Transition", "TransitionStats",
                                  "ShardSpec", "load_local_tensors"])
def test_public_names_are_exported(name):
    assert name in hc.__all__ and getattr(hc, name).__doc__
