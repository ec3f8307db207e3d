"""``bench/transition.py --source fsdp``: an FSDP2-sharded model -> generation layout, against
the full state-dict gather FSDP users do today and a raw all-to-all of the minimum bytes.

    python bench/transition.py --nproc 4 --source fsdp --gen 1,2 --size-mb 128 --json PATH

Every rank builds the same model from the given specs (``bench/transition.py`` passes its
Llama-shaped bf16 ``llama_like_specs``), ``fully_shard`` s it on a 1-D gloo mesh and times,
interleaved round by round (slowest rank, median over ``repeat``):

* ``fsdp``: ``from_fsdp(...).to_generation()`` (then ``to_training()``);
* ``full_gather``: ``get_model_state_dict(model, StateDictOptions(full_state_dict=True))``;
* ``raw``: one ``all_to_all_single`` of exactly the plan's bytes per pair, preallocated, no
  packing: the practical limit.

JSON keys: ``ratio_vs_full_gather`` and ``ratio_vs_raw`` (time ratios), ``bytes_vs_minimum``
(received / minimum, the largest over ranks) and the per-method details.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch import nn

from bench.ranks import launch, max_over_ranks, timed_over_ranks
from hybridflow_comm.interop.fsdp import from_fsdp
from hybridflow_comm.shard_spec import ShardSpec


def _model(specs: list[ShardSpec]) -> nn.Module:
    """The specs as one module of parameters (one FSDP group: one dtype)."""
    model = nn.Module()
    model.params = nn.ParameterDict()
    g = torch.Generator().manual_seed(0)
    for s in specs:
        model.params[s.name.replace(".", "_")] = nn.Parameter(
            torch.randn(s.shape, generator=g).to(s.dtype))
    return model


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    specs = cfg["specs"]
    model = _model(specs)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(model, mesh=mesh)
    params = {s.name: model.params[s.name.replace(".", "_")] for s in specs}
    tr = from_fsdp(params, tuple(cfg["gen"]), tp_dims={s.name: s.partition_dim for s in specs},
                   fusions={s.name: s.fusion for s in specs if s.fusion is not None},
                   gen_stages={s.name: s.stage for s in specs},
                   bucket_bytes=cfg["bucket_mb"] << 20)
    send_b, recv_b = tr.exchange_bytes()
    raw_in, raw_out = torch.ones(sum(send_b), dtype=torch.uint8), torch.empty(sum(recv_b),
                                                                              dtype=torch.uint8)
    opts = StateDictOptions(full_state_dict=True)

    def fsdp():
        tr.to_generation()
        tr.to_training(release=not cfg["keep_pages"])

    def full_gather():
        get_model_state_dict(model, options=opts)

    def raw():
        dist.all_to_all_single(raw_out, raw_in, recv_b, send_b)

    fns = {"fsdp": fsdp, "full_gather": full_gather, "raw": raw}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for it in range(cfg["repeat"] + 1):
        for name, fn in fns.items():
            t = timed_over_ranks(fn)
            if it:
                times[name].append(t)
    # Correctness once: the generation shards against the gathered full state dict.
    full = get_model_state_dict(model, options=opts)
    tr.to_generation()
    stage, t_g_rank = tr.placement.coord(rank)
    for s in (s for s in specs if s.stage == stage):
        want = full[f"params.{s.name.replace('.', '_')}"]
        if s.partition_dim is not None:
            want = want.chunk(tr.placement.tp_g, s.partition_dim)[t_g_rank]
        assert torch.equal(tr.generation_params()[s.name], want), s.name
    stats = tr.accounting()
    tr.to_training()
    model_bytes = sum(s.nbytes for s in specs)
    return {
        "times": {k: statistics.median(v) for k, v in times.items()},
        "received": max_over_ranks(stats.received_bytes),
        "minimum": max_over_ranks(tr.minimum_received_bytes()),
        "bytes_vs_minimum": max_over_ranks(stats.received_bytes
                                           / max(1, tr.minimum_received_bytes())),
        "peak": max_over_ranks(stats.peak_weight_bytes), "calls": stats.calls,
        "model_bytes": model_bytes, "tp_groups": tr.placement.tp_groups(),
    }


def run(nproc: int, gen: tuple[int, int], specs: list[ShardSpec], size_mb: float,
        repeat: int = 5, bucket_mb: int = 32, keep_pages: bool = False) -> dict:
    """Run the FSDP benchmark of the model ``specs`` (about ``size_mb`` MiB; ``spec.stage`` is
    the generation stage) on ``nproc`` fresh ranks; returns the JSON-ready result."""
    if nproc % (gen[0] * gen[1]):
        raise ValueError(f"generation pp_g={gen[0]} x tp_g={gen[1]} must divide --nproc={nproc}")
    cfg = {"gen": gen, "specs": specs, "size_mb": size_mb, "repeat": repeat, "bucket_mb": bucket_mb,
           "keep_pages": keep_pages}
    r = launch(_rank_main, nproc, cfg, timeout_s=600)
    t, m = r["times"], r["model_bytes"]
    return {
        "config": {"source": "fsdp", "nproc": nproc, "gen": list(gen), "size_mb": size_mb,
                   "model_bytes": m, "repeat": repeat, "bucket_mb": bucket_mb,
                   "keep_pages": keep_pages, "gen_tp_groups": r["tp_groups"]},
        "ratio_vs_full_gather": t["fsdp"] / t["full_gather"],
        "ratio_vs_raw": t["fsdp"] / t["raw"] if t["raw"] > 0 else float("nan"),
        "bytes_vs_minimum": r["bytes_vs_minimum"],
        "methods": {
            "fsdp": {"time_s": t["fsdp"], "comm_bytes_per_rank": r["received"],
                     "minimum_bytes_per_rank": r["minimum"], "peak_weight_bytes": r["peak"],
                     "collective_calls": r["calls"]},
            "full_gather": {"time_s": t["full_gather"],
                            "comm_bytes_per_rank": (nproc - 1) * m / nproc},
            "raw": {"time_s": t["raw"], "comm_bytes_per_rank": r["minimum"]},
        },
    }


def print_table(result: dict) -> None:
    c = result["config"]
    print(f"fsdp over {c['nproc']} ranks -> gen {c['gen']} (TP groups {c['gen_tp_groups']}), "
          f"model {c['model_bytes'] / 2**20:.1f} MiB")
    print(f"{'method':<13}{'time_s':>9}{'recv MiB':>10}")
    for name, m in result["methods"].items():
        print(f"{name:<13}{m['time_s']:>9.4f}{m['comm_bytes_per_rank'] / 2**20:>10.2f}")
    print(f"fsdp / full gather = {result['ratio_vs_full_gather']:.3f}, fsdp / raw = "
          f"{result['ratio_vs_raw']:.2f}, bytes / minimum = {result['bytes_vs_minimum']:.4f}")
