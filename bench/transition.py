"""Training -> generation transition: hybridflow against its baselines, measured in one run.

    python bench/transition.py --nproc 4 --train 1,4,1 --gen 1,2 --size-mb 128 [--repeat 5]
                               [--bucket-mb 32] [--json PATH] [--source specs|fsdp]
    python bench/transition.py --shape llama-1b --layouts 1,4,1:1,2 2,2,1:1,1 --json PATH

Without ``--train``/``--gen`` the layout is :func:`default_layout`'s: training at the widest TP
the model's heads allow on ``--nproc`` ranks (the rest DP), generation at half that TP
(1,4,1 -> 1,2 on 4 ranks; 1,2,2 -> 1,1 for ``--shape small``, whose 2 KV heads split at most
in two).

Starts its own gloo ranks and builds the parameter set: with ``--shape`` exactly that model's
(``bench/shapes.py``; the engine's ``llama_shard_specs``), otherwise a synthetic Llama-shaped
set of about ``size-mb`` MiB (bf16).  Every method runs ``repeat`` times after one warm-up; a
method's time is the slowest rank's, median over repeats; ``user_s``/``sys_s`` are CPU seconds
per transition summed over the ranks.  Interleaved with hybridflow's repeats (same buffers
alive, same moment): ``raw_allgather_time_s``, ``all_gather_into_tensor`` of the same bytes in
the same micro-DP groups in chunks of at most :data:`RAW_CHUNK_BYTES` per rank (one call up to
256 MiB per rank; gloo stages ``micro-DP x chunk`` bytes per call, so ``llama-1b`` at
``2,2,1:1,1`` fits; torch's collective: the practical limit the issue names), and ``raw_p2p_time_s``, the same bytes as zero-copy point-to-point messages (the
transport's own limit, what hybridflow's gather does per slot).

JSON keys: ``ratio_vs_ds_chat`` and ``ratio_vs_raw`` (hybridflow's time over DS-Chat's and over
the raw all-gather's), ``ratio_vs_raw_p2p``, ``volume_vs_formula`` (received bytes over the
paper's Table 2 volume), per method the same, plus ``shape`` and ``argv``.  ``--layouts`` runs
several layouts in one invocation (``{"runs": [...]}``).  A method whose peak memory over all
ranks would not fit in 80% of MemAvailable is skipped and says so (DS-Chat at ``2,2,1:1,1`` on
``llama-1b`` holds two model copies per rank: 24 GB on 4 ranks).

``--source fsdp`` benchmarks the FSDP2 source instead (``--train`` is ignored: the model is
``fully_shard`` ed over all ``--nproc`` ranks); see :mod:`bench.transition_fsdp`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import zlib

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import transition_ep, transition_fsdp  # noqa: E402
from bench.ranks import launch, max_over_ranks, mem_available  # noqa: E402
from bench.shapes import BenchShape, add_shape_argument, get_shape, widest_tp  # noqa: E402
from engine.llama_spec import llama_shard_specs  # noqa: E402
from hybridflow_comm import comm  # noqa: E402
from hybridflow_comm.baselines import TRANSITIONS, make_transition
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout, parse_sizes
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec, check_specs

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 1024, 16, 8, 2816, 8192
NPROC, SIZE_MB = 4, 128
"""``--nproc`` (gloo ranks) and ``--size-mb`` (the synthetic set's size)."""


def llama_like_specs(size_mb: float, pp: int, dtype=torch.bfloat16) -> list[ShardSpec]:
    """A Llama-shaped parameter set of about ``size_mb`` MiB whose layers split over ``pp``."""
    hd = HIDDEN // HEADS
    item = dtype.itemsize
    layer_numel = ((HEADS + 2 * KV_HEADS) * hd * HIDDEN + HIDDEN * HIDDEN + 3 * FFN * HIDDEN
                   + 2 * HIDDEN)
    edge_numel = 2 * VOCAB * HIDDEN + HIDDEN
    layers = max(1, round((size_mb * 2**20 / item - edge_numel) / layer_numel))
    layers = max(pp, layers // pp * pp)
    per_stage = layers // pp
    specs = [ShardSpec("embed", (VOCAB, HIDDEN), dtype=dtype, partition_dim=0, stage=0,
                       hf_names=("model.embed_tokens.weight",))]
    for i in range(layers):
        st = i // per_stage
        p = f"model.layers.{i}."
        specs += [
            ShardSpec(p + "qkv", ((HEADS + 2 * KV_HEADS) * hd, HIDDEN), dtype=dtype,
                      partition_dim=0, stage=st, fusion=QKVFusion(HEADS, KV_HEADS, hd)),
            ShardSpec(p + "o_proj", (HIDDEN, HIDDEN), dtype=dtype, partition_dim=1, stage=st),
            ShardSpec(p + "gate_up", (2 * FFN, HIDDEN), dtype=dtype, partition_dim=0, stage=st,
                      fusion=GateUpFusion()),
            ShardSpec(p + "down_proj", (HIDDEN, FFN), dtype=dtype, partition_dim=1, stage=st),
            ShardSpec(p + "input_norm", (HIDDEN,), dtype=dtype, partition_dim=None, stage=st),
            ShardSpec(p + "post_norm", (HIDDEN,), dtype=dtype, partition_dim=None, stage=st),
        ]
    specs += [ShardSpec("final_norm", (HIDDEN,), dtype=dtype, partition_dim=None, stage=pp - 1),
              ShardSpec("lm_head", (VOCAB, HIDDEN), dtype=dtype, partition_dim=0, stage=pp - 1)]
    return specs


def shape_specs(shape: BenchShape, pp: int) -> list[ShardSpec]:
    """The shard specs of ``shape``'s model (the engine's own builder), layers over ``pp``."""
    return llama_shard_specs(shape.llama_config(max_positions=2048), pp)


def model_specs(shape: str | None, size_mb: float, pp: int) -> list[ShardSpec]:
    """``--shape``'s specs, or the synthetic set of about ``size_mb`` MiB when no shape."""
    return shape_specs(get_shape(shape), pp) if shape else llama_like_specs(size_mb, pp)


def default_layout(shape: str | None, size_mb: float, nproc: int,
                   train: tuple[int, int, int] | None = None
                   ) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """``(train, gen)`` where ``--train``/``--gen`` are not given.

    Args:
        shape / size_mb: the model (:func:`model_specs`).
        nproc: ranks.
        train: ``--train``, or None for ``(1, tp, nproc / tp)`` with ``tp`` the widest the
            model's parameters split over (:func:`bench.shapes.widest_tp`).
    Returns:
        ``train`` and the generation layout ``(1, max(1, tp / 2))``: each generation replica
        gathers from a micro-DP group of 2 where the training TP allows.
    """
    if train is None:
        tp = widest_tp(model_specs(shape, size_mb, 1), nproc)
        train = (1, tp, nproc // tp)
    return train, (1, max(1, train[1] // 2))


def describe_model(shape: str | None, size_mb: float, specs: list[ShardSpec]) -> dict:
    """What the JSON records as ``shape``: the table's row, or the synthetic set's sizes."""
    if shape:
        return get_shape(shape).describe()
    layers = sum(s.name.endswith(".qkv") for s in specs)
    return {"name": None, "size_mb": size_mb, "hidden": HIDDEN, "layers": layers,
            "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN, "vocab": VOCAB,
            "dtype": "bfloat16", "tied": False, "params": sum(s.numel for s in specs)}


def formula_bytes(method: str, hl: HybridLayout, model_bytes: int) -> float:
    """Paper, Table 2: communication volume per rank."""
    t, p, d = hl.train.tp, hl.train.pp, hl.train.dp
    tg, pg = hl.tp_g, hl.pp_g
    return {"ds_chat": (t * p * d - 1) / (t * p * d),
            "hybridflow_v": (t * p - 1) / (t * p),
            "hybridflow": (t * p - tg * pg) / (tg * pg * t * p)}[method] * model_bytes


def _timed(fn) -> tuple[object, float, float, float]:
    """``fn()`` between barriers: (its result, slowest rank's seconds, user and system CPU
    seconds summed over the ranks, gloo's threads included)."""
    dist.barrier()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn()
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = torch.tensor([r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime], dtype=torch.float64)
    dist.all_reduce(cpu)
    return out, max_over_ranks(dt), float(cpu[0]), float(cpu[1])


def _summary(samples: list[tuple[float, float, float]]) -> dict:
    """Median time and mean user/system seconds of the timed repeats (warm-up dropped)."""
    timed = samples[1:]
    return {"time_s": statistics.median(t for t, _, _ in timed),
            "user_s": statistics.fmean(u for _, u, _ in timed),
            "sys_s": statistics.fmean(y for _, _, y in timed)}


def _fill_training_shards(rs, hl: HybridLayout, rank: int) -> None:
    """Seeded training shards on which DP replicas (and TP ranks, for replicated) agree."""
    buf = rs.weights.buffer
    tp_rank = hl.train.coords(rank).tp
    for slot in buf.specs:
        if slot.own_slot is not None:
            piece = tp_rank if slot.num_slots > 1 else 0
            seed = zlib.crc32(f"{slot.name}:{piece}".encode())
            view = buf.train_view(slot.name)
            view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(seed),
                                   dtype=view.dtype))


RAW_CHUNK_BYTES = 256 * 2**20
"""Largest piece one rank contributes to one call of the raw all-gather."""


def _rank_main(rank: int, world: int, cfg: dict):
    hl = HybridLayout(ParallelLayout(*cfg["train"]), pp_g=cfg["gen"][0], tp_g=cfg["gen"][1])
    groups = build_hybrid_groups(hl)
    specs = model_specs(cfg["shape"], cfg["size_mb"], hl.train.pp)
    train_bytes = _train_bytes(specs, hl)
    micro_dp = groups.micro_dp
    limit_fns, limit_bytes = {}, []

    def limits_on(rs) -> None:
        """The limits gather into hybridflow's own generation storage (as much memory as it
        has, and resident when they run): in place, each rank's piece its own section."""
        storage = max((rs.weights.buffer.byte_storage(d) for d in rs.weights.buffer.dtypes),
                      key=lambda t: t.numel())
        # Every rank sends the largest stage's training bytes, or what fits every storage
        # (stages differ by a norm: a few KiB of a model); ranks agree on the smallest.
        fits = -max_over_ranks(-float(storage.numel() // micro_dp.size))
        piece = min(train_bytes, int(fits))
        out = storage[:micro_dp.size * piece]
        mine = out[micro_dp.rank * piece:(micro_dp.rank + 1) * piece]
        limit_bytes.append(piece)

        def raw():  # chunk c of every rank lands contiguously: out = [chunks][ranks][chunk]
            if micro_dp.pg is None:
                return
            for lo in range(0, piece, RAW_CHUNK_BYTES):
                n = min(RAW_CHUNK_BYTES, piece - lo)
                dist.all_gather_into_tensor(out[micro_dp.size * lo:micro_dp.size * (lo + n)],
                                            mine[lo:lo + n], group=micro_dp.pg)

        def raw_p2p():
            if micro_dp.pg is not None:
                comm.TORCH.all_gather_into(out, mine, micro_dp)

        if "raw" not in cfg["skip"]:
            limit_fns["raw"] = raw
        limit_fns["raw_p2p"] = raw_p2p

    out = {"methods": {}, "skipped": {}}
    limits = {"raw": [], "raw_p2p": []}
    for method in TRANSITIONS:
        if method in cfg["skip"]:  # (too big for the memory available now)
            continue
        rs = make_transition(method, specs, groups, bucket_bytes=cfg["bucket_mb"] << 20)
        _fill_training_shards(rs, hl, groups.rank)
        samples = []
        for it in range(cfg["repeat"] + 1):
            stats, *sample = _timed(rs.to_generation)
            samples.append(sample)
            if it == 0:
                rs.weights.verify()
            if method == "hybridflow":  # the limits, interleaved with hybridflow's repeats
                if it == 0:
                    limits_on(rs)  # (they overwrite the weights: timings only from here on)
                for name, fn in limit_fns.items():
                    limits[name].append(_timed(fn)[1:])
            rs.to_training(release=not cfg["keep_pages"])
        out["methods"][method] = {
            "comm_bytes_per_rank": max_over_ranks(stats.received_bytes),
            "peak_weight_bytes": max_over_ranks(stats.peak_weight_bytes),
            "redundant_bytes": max_over_ranks(stats.redundant_bytes),
            "collective_calls": stats.calls,
            **_summary(samples),
        }
        del rs, stats
        limit_fns.clear()
    for name, samples in limits.items():
        if samples:
            out[name] = _summary(samples)
    out["model_bytes"] = sum(s.nbytes for s in specs)
    out["limit_bytes_per_rank"] = limit_bytes[-1] if limit_bytes else None
    return out


def _train_bytes(specs: list[ShardSpec], hl: HybridLayout) -> int:
    """Training shard bytes of the largest stage: what every rank sends in the limits."""
    t = hl.train
    return max(sum(s.nbytes // (t.tp if s.partition_dim is not None else 1)
                   for s in specs if s.stage == stage) for stage in range(t.pp))


def _too_big(hl: HybridLayout, nproc: int, specs: list[ShardSpec]) -> dict[str, str]:
    """Methods whose weights over all ranks (generation shard, plus a whole-model copy for the
    gathering baselines) would not fit in 80% of the memory available now."""
    avail = mem_available()
    if not avail:
        return {}
    model = sum(s.nbytes for s in specs)
    gen = model / (hl.pp_g * hl.tp_g)
    # gloo's copy in the raw all-gather: one chunk per rank at a time
    staged = hl.micro_dp_size * min(_train_bytes(specs, hl), RAW_CHUNK_BYTES)
    needs = {method: gen + (model if method != "hybridflow" else 0) for method in TRANSITIONS}
    needs["raw"] = gen + staged  # (inside hybridflow's phase, into its buffer)
    return {name: (f"needs about {nproc * need / 2**30:.1f} GiB over {nproc} ranks, "
                   f"{avail / 2**30:.1f} GiB available")
            for name, need in needs.items() if nproc * need > 0.8 * avail}


def run(nproc: int, train: tuple[int, int, int], gen: tuple[int, int], size_mb: float,
        repeat: int = 5, bucket_mb: int = 32, keep_pages: bool = False,
        shape: str | None = None, argv: list[str] | None = None) -> dict:
    """Run the benchmark on ``nproc`` fresh ranks; returns the JSON-ready result.

    Args:
        shape: a ``bench/shapes.py`` name; None for the synthetic ``size_mb`` set.
        argv: the command line to record (``sys.argv`` from :func:`main`).
    """
    hl = HybridLayout(ParallelLayout(*train), pp_g=gen[0], tp_g=gen[1])
    hl.check_world_size(nproc)
    specs = model_specs(shape, size_mb, hl.train.pp)
    check_specs(specs, hl.train)  # a bad size says so here, not in every rank
    skipped = _too_big(hl, nproc, specs)
    if "hybridflow" in skipped:
        raise ValueError(f"hybridflow {skipped['hybridflow']}: use a smaller --shape/--size-mb")
    cfg = {"train": train, "gen": gen, "size_mb": size_mb, "repeat": repeat, "shape": shape,
           "bucket_mb": bucket_mb, "keep_pages": keep_pages, "skip": sorted(skipped)}
    out = launch(_rank_main, nproc, cfg, timeout_s=600)
    model_bytes = out["model_bytes"]
    methods = out["methods"]
    ds = methods["ds_chat"]["time_s"] if "ds_chat" in methods else None
    raw = out["raw"]["time_s"] if "raw" in out else None
    raw_p2p = out["raw_p2p"]["time_s"]
    for name, m in methods.items():
        m["formula_bytes_per_rank"] = formula_bytes(name, hl, model_bytes)
        m["volume_vs_formula"] = (m["comm_bytes_per_rank"] / m["formula_bytes_per_rank"]
                                  if m["formula_bytes_per_rank"] else None)
        m["ratio_vs_ds_chat"] = m["time_s"] / ds if ds else None
        m["ratio_vs_raw"] = m["time_s"] / raw if raw else None
        m["ratio_vs_raw_p2p"] = m["time_s"] / raw_p2p if raw_p2p > 0 else None
    hf = methods["hybridflow"]
    config = {"nproc": nproc, "train": list(train), "gen": list(gen), "size_mb": size_mb,
              "shape": shape, "model_bytes": model_bytes, "repeat": repeat,
              "bucket_mb": bucket_mb, "micro_dp_size": hl.micro_dp_size,
              "keep_pages": keep_pages}
    return {"config": config, "methods": methods, "skipped": skipped,
            "raw_allgather_time_s": raw, "raw_allgather": out.get("raw"),
            "raw_p2p_time_s": raw_p2p, "raw_p2p": out["raw_p2p"],
            "limit_bytes_per_rank": out["limit_bytes_per_rank"],
            "ratio_vs_ds_chat": hf["ratio_vs_ds_chat"], "ratio_vs_raw": hf["ratio_vs_raw"],
            "ratio_vs_raw_p2p": hf["ratio_vs_raw_p2p"],
            "volume_vs_formula": hf["volume_vs_formula"],
            "shape": describe_model(shape, size_mb, specs),
            "argv": list(argv) if argv is not None else None}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict) -> None:
    c = result["config"]
    print(f"train {c['train']} -> gen {c['gen']} on {c['nproc']} ranks, "
          f"{result['shape']['name'] or 'synthetic'} model {c['model_bytes'] / 2**20:.1f} MiB, "
          f"micro-DP {c['micro_dp_size']}")
    print(f"{'method':<14}{'time_s':>9}{'vs ds_chat':>11}{'vs raw':>8}{'recv MiB':>10}"
          f"{'formula':>10}{'peak MiB':>10}{'redund MiB':>11}{'calls':>6}{'user_s':>8}"
          f"{'sys_s':>7}")
    for name, m in result["methods"].items():
        print(f"{name:<14}{m['time_s']:>9.4f}{_fmt(m['ratio_vs_ds_chat'], '.3f'):>11}"
              f"{_fmt(m['ratio_vs_raw'], '.2f'):>8}{m['comm_bytes_per_rank'] / 2**20:>10.2f}"
              f"{m['formula_bytes_per_rank'] / 2**20:>10.2f}"
              f"{m['peak_weight_bytes'] / 2**20:>10.1f}{m['redundant_bytes'] / 2**20:>11.1f}"
              f"{m['collective_calls']:>6}{m['user_s']:>8.2f}{m['sys_s']:>7.2f}")
    for name, why in result["skipped"].items():
        print(f"{name:<14}skipped: {why}")
    for key, label in (("raw_allgather", "raw all_gather_into_tensor"),
                       ("raw_p2p", "raw zero-copy p2p")):
        r = result[key]
        if r is None:
            continue
        print(f"{label:<27}{r['time_s']:>9.4f} s  user {r['user_s']:.2f} sys {r['sys_s']:.2f}")
    print(f"hybridflow: {_fmt(result['ratio_vs_raw'], '.2f')}x raw all-gather, "
          f"{_fmt(result['ratio_vs_raw_p2p'], '.2f')}x raw p2p, "
          f"{_fmt(result['ratio_vs_ds_chat'], '.3f')}x ds_chat, received "
          f"{_fmt(result['volume_vs_formula'], '.4f')}x the paper's volume")


def _layout(text: str) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """``PP,TP,DP:PP_G,TP_G`` -> ((pp, tp, dp), (pp_g, tp_g))."""
    train, sep, gen = text.partition(":")
    if not sep:
        raise ValueError(f"layout {text!r} must read PP,TP,DP:PP_G,TP_G (e.g. 1,4,1:1,2)")
    return parse_sizes(train, ("pp", "tp", "dp")), parse_sizes(gen, ("pp_g", "tp_g"))


def _main_experts(a: argparse.Namespace, command: list[str]) -> int:
    """``--shape`` of a mixture of experts: :mod:`bench.transition_ep`'s layouts."""
    try:
        result = transition_ep.run(a.shape, a.layers, a.repeat, a.bucket_mb, argv=command)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    transition_ep.print_table(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=NPROC)
    p.add_argument("--train", default=None, help="PP,TP,DP (default: default_layout)")
    p.add_argument("--gen", default=None, help="PP_G,TP_G (default: default_layout)")
    p.add_argument("--layouts", nargs="+", default=None, metavar="PP,TP,DP:PP_G,TP_G",
                   help="several layouts in one invocation (instead of --train/--gen)")
    add_shape_argument(p, default=None, extra=tuple(transition_ep.SHAPES))
    p.add_argument("--layers", type=int, default=None,
                   help="layers of a mixture-of-experts shape (default: as many as fit)")
    p.add_argument("--size-mb", type=float, default=SIZE_MB,
                   help="size of the synthetic parameter set when no --shape is given")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=32)
    p.add_argument("--keep-pages", action="store_true",
                   help="keep generation-only pages between transitions (no release)")
    p.add_argument("--json", default=None)
    p.add_argument("--source", choices=("specs", "fsdp"), default="specs",
                   help="specs: training layout --train from shard specs; fsdp: an FSDP2 model")
    a = p.parse_args(argv)
    command = [sys.argv[0]] + (list(argv) if argv is not None else sys.argv[1:])
    if a.shape in transition_ep.SHAPES:
        return _main_experts(a, command)
    try:
        train = parse_sizes(a.train, ("pp", "tp", "dp")) if a.train else None
        train, gen = default_layout(a.shape, a.size_mb, a.nproc, train)
        gen = parse_sizes(a.gen, ("pp_g", "tp_g")) if a.gen else gen
        if a.source == "fsdp":
            results = [transition_fsdp.run(a.nproc, gen, model_specs(a.shape, a.size_mb, gen[0]),
                                           a.size_mb, a.repeat, a.bucket_mb, a.keep_pages)]
        else:
            layouts = [_layout(x) for x in a.layouts] if a.layouts else [(train, gen)]
            results = [run(a.nproc, train, gen, a.size_mb, a.repeat, a.bucket_mb, a.keep_pages,
                           shape=a.shape, argv=command) for train, gen in layouts]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for result in results:
        (transition_fsdp.print_table if a.source == "fsdp" else print_table)(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results[0] if len(results) == 1 and not a.layouts else
                      {"runs": results, "argv": command}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
