"""``bench/transition.py --shape qwen3-30b-a3b-layers``: a mixture of experts' transition under
expert parallelism, against a gather of the full expert set and a raw all-gather of the same
bytes, measured in one run.

    python bench/transition.py --shape qwen3-30b-a3b-layers [--layers N] [--repeat 3] --json PATH

The model is Qwen3-30B-A3B's layers (the planner's ``qwen3-30b-a3b`` preset: hidden 2048,
32/4 heads of 128, 128 experts of width 768, bf16; ``tiny-moe-layers`` for CI) without the
embedding and head, for
``--layers`` layers (default: as many as :func:`layers_that_fit` finds room for in the
memory available now; the JSON records the number).  Two layouts on 4 ranks (:data:`LAYOUTS`),
both training 1,2,2 with EP 4 and generating at 1,2: EP 4 -> gen EP 2 (the experts split two
ways inside each generation TP group) and EP 4 -> gen TP 2 (every expert split over it).

Per layout, interleaved round by round after one warm-up (slowest rank, median over
``repeat``; peak resident set per rank in ``peak_rss_bytes``):

* ``hybridflow``: the experts' :class:`~hybridflow_comm.expert_reshard.ExpertResharder` (the
  attention, norms and routers move by the dense :class:`~hybridflow_comm.reshard.Resharder`
  just before, timed apart as ``dense_time_s``);
* ``full_gather``: every rank all-gathers its stage's whole expert set in its EP group, one
  layer at a time (what streaming full tensors per parameter amounts to);
* ``raw``: ``all_gather_into_tensor`` over the 4 ranks that brings each rank exactly
  hybridflow's received bytes (chunks of at most ``RAW_CHUNK_BYTES`` per rank).

JSON keys per run: ``ratio_vs_full_gather``, ``ratio_vs_raw`` (time ratios),
``bytes_vs_formula`` (received over :meth:`ExpertLayout.received_fraction` times the experts'
bytes, the largest over ranks), ``redundant_bytes``, the methods' details and ``dense``.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import zlib

import torch
import torch.distributed as dist

from bench.ranks import launch, max_over_ranks, mem_available, timed_over_ranks
from engine.llama_spec import LlamaConfig, llama_shard_specs
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.expert_reshard import ExpertResharder
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder
from hybridflow_comm.shard_spec import ShardSpec
from rlhf.planner.models import PRESETS

SHAPES = {
    "qwen3-30b-a3b-layers": PRESETS["qwen3-30b-a3b"].config,
    "tiny-moe-layers": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=32,
                                   num_layers=8, num_heads=4, num_kv_heads=2, qk_norm=True,
                                   num_experts=8, num_experts_per_tok=2,
                                   model_type="qwen3_moe", tie_word_embeddings=False),
}
"""``--shape`` names of this bench -> the architecture whose layers they take (the planner's
``qwen3-30b-a3b`` preset; a tiny one for CI)."""

LAYOUTS = [((1, 2, 2), (1, 2), 4, 2), ((1, 2, 2), (1, 2), 4, 1)]
"""``(train PP,TP,DP, gen PP_G,TP_G, ep, gen_ep)``: EP 4 -> gen EP 2, EP 4 -> gen TP 2."""

RAW_CHUNK_BYTES = 64 * 2**20
MEMORY_SHARE = 0.75
"""Share of MemAvailable the default ``--layers`` may fill."""
RANK_BASE_BYTES = 512 * 2**20
"""A rank's Python and torch runtime (its resident set before any weight)."""


def layer_config(shape: str, layers: int):
    """The preset's :class:`~engine.llama_spec.LlamaConfig` with ``layers`` layers, in bf16."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is not one of {sorted(SHAPES)}")
    return dataclasses.replace(SHAPES[shape], num_layers=layers, dtype=torch.bfloat16)


def layer_specs(shape: str, layers: int) -> list[ShardSpec]:
    """Every layer's specs of the shape (the engine's builder), embedding and head left out."""
    return [s for s in llama_shard_specs(layer_config(shape, layers), 1)
            if s.name.startswith("layers.")]


def layers_that_fit(shape: str, nproc: int, avail: int) -> int:
    """Layers whose transitions fit in :data:`MEMORY_SHARE` of ``avail`` bytes over ``nproc``
    ranks.  Per rank: the runtime (:data:`RANK_BASE_BYTES`), its training experts,
    hybridflow's received experts, and the larger of the full gather of one layer (with gloo's
    staged copy of it) and the raw all-gather's output and staged chunks."""
    one = sum(s.nbytes for s in layer_specs(shape, 1) if s.expert is not None)
    experts = layer_config(shape, 1).num_experts
    most = float(max(ExpertLayout(HybridLayout(ParallelLayout(*t), *g), experts, ep, gen_ep)
                     .received_fraction() for t, g, ep, gen_ep in LAYOUTS))
    for layers in range(SHAPES[shape].num_layers, 0, -1):
        received = layers * one * most
        raw = received * nproc / (nproc - 1) + nproc * min(RAW_CHUNK_BYTES, received)
        per_rank = RANK_BASE_BYTES + layers * one / 4 + received + max(2 * one, raw)
        if nproc * per_rank <= MEMORY_SHARE * avail:
            return layers
    raise ValueError(f"one layer of {shape} does not fit in {MEMORY_SHARE:.0%} of the "
                     f"{avail / 2**30:.1f} GiB available over {nproc} ranks")


def _fill(t: torch.Tensor, name: str) -> None:
    """A value per tensor that names it (cheap to write, checked after the warm-up)."""
    t.fill_(zlib.crc32(name.encode()) % 251 - 125)


def _layer_blocks(ours: ExpertResharder, experts: list[ShardSpec]) -> list[torch.Tensor]:
    """Each layer's training experts, filled with :func:`_fill`, as one contiguous block of
    the expert buffer (what the full gather sends)."""
    buf, train = ours.buffer, ours.buffer.train_views()
    layers: dict[str, list[str]] = {}
    for s in experts:
        if s.name in train:
            _fill(train[s.name], s.name)
            layers.setdefault(s.name.split(".experts.")[0], []).append(s.name)
    blocks = []
    for names in layers.values():
        dtype = train[names[0]].dtype
        lo = buf.byte_offset(names[0]) // dtype.itemsize
        numel = sum(train[n].numel() for n in names)
        assert buf.byte_offset(names[-1]) // dtype.itemsize + train[names[-1]].numel() == \
            lo + numel, "expert regions padded apart"
        blocks.append(buf.storage(dtype)[lo:lo + numel])
    return blocks


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    (pp, tp, dp), (pp_g, tp_g), ep, gen_ep = cfg["layout"]
    hl = HybridLayout(ParallelLayout(pp, tp, dp), pp_g=pp_g, tp_g=tp_g)
    groups = build_hybrid_groups(hl)
    specs = layer_specs(cfg["shape"], cfg["layers"])
    experts = [s for s in specs if s.expert is not None]
    el = ExpertLayout(hl, layer_config(cfg["shape"], 1).num_experts, ep=ep, gen_ep=gen_ep)
    dense = Resharder([s for s in specs if s.expert is None], groups)
    ours = ExpertResharder(experts, el, groups.world, bucket_bytes=cfg["bucket_mb"] << 20)
    blocks = _layer_blocks(ours, experts)
    ep_group = next(g for g in el.ep_groups() if rank in g)
    ep_pgs = [dist.new_group(g) for g in el.ep_groups()]  # every rank, every group, one order
    ep_pg = ep_pgs[el.ep_groups().index(ep_group)]
    received = ours.minimum_received_bytes()
    piece = -(-received // (world - 1))  # raw: every rank receives ``received`` bytes (rounded up)

    def full_gather():
        for block in blocks:  # one layer at a time, dropped after use
            out = torch.empty(block.numel() * len(ep_group), dtype=block.dtype)
            dist.all_gather_into_tensor(out, block, group=ep_pg)
            del out

    def raw():
        mine = torch.ones(piece, dtype=torch.uint8)
        out = torch.empty(world * piece, dtype=torch.uint8)
        for lo in range(0, piece, RAW_CHUNK_BYTES):
            n = min(RAW_CHUNK_BYTES, piece - lo)
            dist.all_gather_into_tensor(out[world * lo:world * (lo + n)], mine[lo:lo + n])

    times = {"hybridflow": [], "dense": [], "full_gather": [], "raw": []}
    stats = dense_stats = None
    for it in range(cfg["repeat"] + 1):
        times["dense"].append(timed_over_ranks(dense.to_generation))
        times["hybridflow"].append(timed_over_ranks(ours.to_generation))
        stats, dense_stats = ours.accounting(), dense.accounting()
        if it == 0:
            for name, t in ours.generation_experts().items():
                want = float(zlib.crc32(name.encode()) % 251 - 125)
                assert float(t.flatten()[0]) == want == float(t.flatten()[-1]), name
        ours.to_training()
        dense.to_training()
        times["full_gather"].append(timed_over_ranks(full_gather))
        times["raw"].append(timed_over_ranks(raw))
    expert_bytes = sum(s.nbytes for s in experts)
    return {
        "times": {k: statistics.median(v[1:]) for k, v in times.items()},
        "received_bytes_per_rank": max_over_ranks(stats.received_bytes),
        "minimum_bytes_per_rank": max_over_ranks(received),
        "redundant_bytes": max_over_ranks(stats.redundant_bytes),
        "peak_weight_bytes": max_over_ranks(stats.peak_weight_bytes),
        "dense_received_bytes": max_over_ranks(dense_stats.received_bytes),
        "dense_minimum_bytes": max_over_ranks(dense.minimum_received_bytes()),
        "expert_bytes": expert_bytes, "dense_bytes": sum(s.nbytes for s in specs) - expert_bytes,
        "formula_bytes_per_rank": float(el.received_fraction() * expert_bytes),
        "full_gather_bytes_per_rank": expert_bytes * (len(ep_group) - 1) // len(ep_group) // pp,
        "raw_bytes_per_rank": (world - 1) * piece, "calls": stats.calls,
        "peak_rss_bytes": max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
    }


def run_layout(shape: str, layout, layers: int, repeat: int = 3, bucket_mb: int = 32) -> dict:
    """One layout of :data:`LAYOUTS` on 4 fresh ranks; returns the JSON-ready result."""
    (pp, tp, dp), gen, ep, gen_ep = layout
    nproc = pp * tp * dp
    cfg = {"shape": shape, "layout": layout, "layers": layers, "repeat": repeat,
           "bucket_mb": bucket_mb}
    out = launch(_rank_main, nproc, cfg, timeout_s=900)
    t = out["times"]
    return {"config": {"nproc": nproc, "train": [pp, tp, dp], "gen": list(gen), "ep": ep,
                       "gen_ep": gen_ep, "layers": layers, "repeat": repeat,
                       "bucket_mb": bucket_mb},
            "time_s": t["hybridflow"], "full_gather_time_s": t["full_gather"],
            "raw_time_s": t["raw"], "dense_time_s": t["dense"],
            "ratio_vs_full_gather": t["hybridflow"] / t["full_gather"],
            "ratio_vs_raw": t["hybridflow"] / t["raw"],
            "bytes_vs_formula": out["received_bytes_per_rank"] / out["formula_bytes_per_rank"],
            **{k: v for k, v in out.items() if k != "times"}}


def run(shape: str, layers: int | None = None, repeat: int = 3, bucket_mb: int = 32,
        argv: list[str] | None = None) -> dict:
    """Every layout of :data:`LAYOUTS`; ``layers`` None: :func:`layers_that_fit`."""
    if layers is None:
        layers = layers_that_fit(shape, 4, mem_available())
    cfg = layer_config(shape, layers)
    return {"shape": {"name": shape, "model_type": cfg.model_type, "layers": layers,
                      "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                      "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                      "experts": cfg.num_experts, "expert_ffn": cfg.intermediate_size,
                      "dtype": str(cfg.dtype).removeprefix("torch.")},
            "runs": [run_layout(shape, layout, layers, repeat, bucket_mb) for layout in LAYOUTS],
            "mem_available_bytes": mem_available(), "argv": argv}


def print_table(result: dict) -> None:
    s = result["shape"]
    print(f"{s['name']}: {s['layers']} layers of {s['experts']} experts on 4 ranks")
    print(f"{'layout':<26}{'time_s':>9}{'vs full':>9}{'vs raw':>8}{'recv MiB':>10}"
          f"{'formula':>10}{'redund MiB':>11}{'full_s':>8}{'raw_s':>8}")
    for r in result["runs"]:
        c = r["config"]
        name = f"{c['train']} ep{c['ep']} -> {c['gen']} ep{c['gen_ep']}"
        print(f"{name:<26}{r['time_s']:>9.3f}{r['ratio_vs_full_gather']:>9.3f}"
              f"{r['ratio_vs_raw']:>8.2f}{r['received_bytes_per_rank'] / 2**20:>10.1f}"
              f"{r['formula_bytes_per_rank'] / 2**20:>10.1f}"
              f"{r['redundant_bytes'] / 2**20:>11.2f}{r['full_gather_time_s']:>8.3f}"
              f"{r['raw_time_s']:>8.3f}")
