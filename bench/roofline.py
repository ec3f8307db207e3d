"""This machine's limits and our fractions of them, measured side by side in one run.

    python bench/roofline.py [--shape small] [--threads N] [--repeat 3] [--micro-batch 8]
                             [--no-reshard] [--reshard-mb 1024] [--decode-tokens N]
                             [--device cpu|cuda] [--precision fp32|bf16] [--json PATH]

``--device cuda`` (``--precision`` bf16 by default there, :func:`bench.timing.bench_device`):
the model, the training step, the generations and the limits all on the GPU, in the run's
dtype, each timed call between ``torch.cuda.synchronize`` calls; ``peak_matmul_flops`` is the
best of a ``CUDA_GEMM_SIZE``^3 product and the model's products in that dtype (cuBLAS), the
bandwidth a ``CUDA_STREAM_BYTES`` device copy and sum and a GEMV over the weights' bytes; decode
is timed at batches ``CUDA_DECODE_BATCHES`` and the reshard part is not run (one device).
``--decode-tokens`` (default the shape's response_len) is N of the decode timing below,
``--sequences`` (default prompts x samples) the sequences of the timed training step.

Machine (all ``--threads`` intra-op threads, default every core; best time of ``repeat``,
measured before and after our code, the better run kept, ``limits_drift`` their ratio):
  ``peak_matmul_flops``   float32 GEMM FLOP/s: the best of a 2048^3 product and the forward
                          products the model makes (``x @ w.t()`` at the training micro-batch),
                          on MKL (``torch.matmul``) and on oneDNN (:mod:`engine.onednn`, which
                          the training products use); ``gemm_flops`` has each library's rate
  ``memcpy_bytes_per_s``  (read + write) bytes / s of a 256 MiB copy
  ``read_bytes_per_s``    the best read-only rate: a 256 MiB sum, or a GEMV over a matrix of
                          the model's matmul weight bytes (which may stay in the L3 cache
                          between decode steps, as the weights themselves may)

Model FLOPs and bytes (only real work; L layers, H hidden, Q/G query/KV heads of D dims,
F ffn, V vocab, ``W = L * ((Q + 2G) * D * H + Q * D * H + 3 * H * F) + V * H`` matrix
weights: the layers' and the LM head's, once even when tied; an untied input embedding is a
row lookup and norms and biases are elementwise, so none of them count)::

    forward of B sequences of S tokens, head from position h0 (the RL update's P - 1):
        2 * (W - V*H) * B*S            layer products
      + 2 * V*H * B*(S - 1 - h0)       LM head on the positions that predict a response token
      + 2 * L*Q*D * B*S*(S + 1)        attention, causal: query i sees i + 1 keys, and QK^T
                                       and AV each take 2*Q*D FLOPs per (query, key) pair
    training step = 3 x forward (the backward computes the input and the weight gradient
        of every product, twice the forward's FLOPs)
    decode step of B rows at context c (keys, the new one included):
        FLOPs = 2 * W * B + 4 * L*Q*D * c * B
        bytes = W * e + 2 * L*G*D * c * B * e       (matrix weights once, every K and V row;
                                                     e bytes per element)

A decode of N tokens after a prompt of P reads contexts P + 1 .. P + N - 1 in its N - 1 decode
steps (mean ``P + N/2``); the step time is ``(t(N tokens) - t(1 token)) / (N - 1)`` of greedy
generations on :class:`engine.generation.GenerationEngine` (its default path: the C++ decode
kernels where they apply, see ``decode_path``), each ``t`` without the call's CUDA graph
warm-ups and captures (``capture_s`` of its stats: a call captures the (batch bucket, key
bucket) steps no earlier call of the engine ran, and the engine keeps them), after an untimed
round that compiles.  Its limit
is ``max(FLOPs / peak, bytes / read_bytes_per_s)``: at batch 1 the weight bytes bind
(read-only bandwidth, since a decode step only reads them), at batch 32 usually the FLOPs.

Fractions (goals in the issue; reported, not asserted): ``train_flops_fraction`` = step FLOPs /
step time / peak (interleaved A/Bs of the same step: ``train.eager_step_s`` with nothing
compiled, :mod:`engine.inductor` off; ``train.eager_layers_step_s`` with the decoder layers
eager, where they are compiled (:mod:`engine.compiled_train`), and the LM head's vocabulary
log-softmax and the eager layers' SwiGLU still compiled above ``MIN_NUMEL``, so
``compiled_head_speedup`` counts both), for one
optimiser step over ``prompts x samples`` sequences of
``prompt_len + response_len`` tokens in micro-batches of ``--micro-batch`` (the RL update) on
:class:`engine.train.TrainEngine` at layout 1,1,1; ``decode_b{1,32}_limit_fraction`` = limit /
step time, ``decode_limit_fraction`` the lower; ``reshard_vs_raw`` = the 1,4,1 -> 1,2 reshard
of ``--reshard-mb`` MiB on 4 gloo ranks over one raw all-gather of the same bytes, read from
``bench/transition.py --json`` run as a subprocess.  ``compile_fallbacks`` and
``compile_counts`` (:mod:`engine.inductor`): the functions that ran eagerly where they were to
run compiled, and each compiled function's graphs, recompiles and eager calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import write_json  # noqa: E402
from bench.shapes import BenchShape, add_shape_argument, get_shape  # noqa: E402
from bench.timing import BenchDevice, add_device_arguments, bench_device, device_profile, \
    interleaved_median_times, synced  # noqa: E402
from rlhf.planner.calibrate import best_time  # noqa: E402

GEMM_SIZE = 2048
STREAM_BYTES = 256 << 20
DECODE_BATCHES = (1, 32)
CUDA_GEMM_SIZE = 8192
CUDA_STREAM_BYTES = 2 << 30
CUDA_DECODE_BATCHES = (1, 32, 128)
"""On a GPU the issue's decode goal is at batch 128."""
CPU = BenchDevice(torch.device("cpu"), "fp32")
MICRO_BATCH = 8
"""``--micro-batch``: sequences per training micro-batch."""


# ------------------------------------------------------------------------------ formulas
def layer_matrix_params(shape: BenchShape) -> int:
    """Weights of one decoder layer that take part in a product: qkv, o, gate/up, down."""
    h, d = shape.hidden, shape.head_dim
    return (shape.heads + 2 * shape.kv_heads) * d * h + shape.heads * d * h + 3 * h * shape.ffn


def matrix_params(shape: BenchShape) -> int:
    """``W``: every layer's matrices and the LM head (once, tied or not)."""
    return shape.layers * layer_matrix_params(shape) + shape.vocab * shape.hidden


def attention_flops(shape: BenchShape, batch: int, seq: int) -> int:
    """Causal attention forward FLOPs of ``batch`` sequences of ``seq`` tokens (QK^T and AV)."""
    return 2 * shape.layers * shape.heads * shape.head_dim * batch * seq * (seq + 1)


def forward_flops(shape: BenchShape, batch: int, seq: int, head_from: int) -> int:
    """Forward FLOPs of ``batch`` sequences of ``seq`` tokens, the head from ``head_from``."""
    if not 0 <= head_from < seq - 1:
        raise ValueError(f"head_from={head_from} must be in [0, seq - 1 = {seq - 1})")
    head = shape.vocab * shape.hidden
    return (2 * (matrix_params(shape) - head) * batch * seq
            + 2 * head * batch * (seq - 1 - head_from) + attention_flops(shape, batch, seq))


def train_flops(shape: BenchShape, batch: int, seq: int, head_from: int) -> int:
    """Forward + backward FLOPs: three forwards."""
    return 3 * forward_flops(shape, batch, seq, head_from)


def decode_step_flops(shape: BenchShape, batch: int, context: float) -> float:
    """One decode step of ``batch`` rows whose new token attends ``context`` keys."""
    return (2 * matrix_params(shape) * batch
            + 4 * shape.layers * shape.heads * shape.head_dim * context * batch)


def decode_step_bytes(shape: BenchShape, batch: int, context: float) -> float:
    """Bytes a decode step must read: every matrix weight once, every cached K and V row."""
    e = torch.empty((), dtype=shape.dtype).element_size()
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * context * batch
    return (matrix_params(shape) + kv) * e


def reshard_ratio(transition: dict) -> tuple[float, str]:
    """HybridFlow's reshard time over the raw all-gather from ``bench/transition.py``'s JSON,
    and where it was read: the top-level ``ratio_vs_raw``, the method's, or computed from
    ``methods.hybridflow.time_s / raw_allgather_time_s``."""
    if "ratio_vs_raw" in transition:
        return float(transition["ratio_vs_raw"]), "ratio_vs_raw"
    hf = transition["methods"]["hybridflow"]
    if "ratio_vs_raw" in hf:
        return float(hf["ratio_vs_raw"]), "methods.hybridflow.ratio_vs_raw"
    return (hf["time_s"] / transition["raw_allgather_time_s"],
            "methods.hybridflow.time_s / raw_allgather_time_s")


# ------------------------------------------------------------------------------ machine
def model_products(shape: BenchShape, rows: int, head_rows: int) -> dict[str, tuple]:
    """The forward products of a training micro-batch: name -> (M, N, K) of ``[M, K] @ [K, N]``."""
    h, d = shape.hidden, shape.head_dim
    return {"qkv": (rows, (shape.heads + 2 * shape.kv_heads) * d, h),
            "o_proj": (rows, h, shape.heads * d), "gate_up": (rows, 2 * shape.ffn, h),
            "down_proj": (rows, h, shape.ffn), "lm_head": (head_rows, shape.vocab, h)}


def measure_matmul(products: dict[str, tuple], repeat: int, bd: BenchDevice = CPU) -> dict:
    """FLOP/s of a ``GEMM_SIZE``^3 product and of each product ``(M, N, K)`` (as the model's
    ``x @ w.t()``), on each GEMM this torch has for ``bd``: on CPU (float32) ``blas``
    (``torch.matmul``, MKL) and ``onednn`` (:mod:`engine.onednn`, where available), on CUDA
    ``cublas`` in ``bd.dtype`` with a ``CUDA_GEMM_SIZE``^3 product; ``peak`` is the best of
    them all."""
    from engine import onednn

    dev, dtype = bd.device, bd.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    size = CUDA_GEMM_SIZE if bd.is_cuda else GEMM_SIZE
    backends = {"cublas" if bd.is_cuda else "blas": lambda x, w: torch.matmul(x, w.t())}
    if onednn.enabled() and not bd.is_cuda:
        backends["onednn"] = onednn.mm_t
    rates: dict[str, dict[str, float]] = {b: {} for b in backends}
    for name, (m, n, k) in {"gemm": (size,) * 3, **products}.items():
        x = torch.randn(m, k, generator=g, device=dev, dtype=dtype)
        w = torch.randn(n, k, generator=g, device=dev, dtype=dtype)
        for b, fn in backends.items():
            rates[b][name] = 2 * m * n * k / best_time(synced(lambda: fn(x, w), dev), repeat)
    return {"peak": max(r for by_name in rates.values() for r in by_name.values()),
            "gemm_flops": {b: r.pop("gemm") for b, r in rates.items()},
            "model_products_flops": rates, "model_products_mnk": products}


def measure_bandwidth(weight_numel: int, hidden: int, repeat: int, bd: BenchDevice = CPU
                      ) -> dict:
    """Copy (read + write), sum (read) and GEMV (read, ``weight_numel`` elements of
    ``bd.dtype``) rates on ``bd.device`` (a ``CUDA_STREAM_BYTES`` buffer on CUDA)."""
    dev, dtype = bd.device, bd.dtype
    nbytes = CUDA_STREAM_BYTES if bd.is_cuda else STREAM_BYTES
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.zeros_like(src)  # touched: no page faults in the timed copies
    copy = 2 * src.nbytes / best_time(synced(lambda: dst.copy_(src), dev), repeat)
    total = src.nbytes / best_time(synced(src.sum, dev), repeat)
    mat = torch.ones(weight_numel // hidden, hidden, device=dev, dtype=dtype)
    vec = torch.ones(hidden, device=dev, dtype=dtype)
    gemv = mat.nbytes / best_time(synced(lambda: torch.mv(mat, vec), dev), repeat)
    return {"copy": copy, "sum": total, "gemv": gemv, "read": max(total, gemv)}


# ------------------------------------------------------------------------------ our code
def _model(shape: BenchShape, device: torch.device):
    from engine.llama_spec import init_full_state_dict
    from engine.model import ParallelLlama, load_full_state_dict
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    cfg = shape.llama_config()
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups, device=device)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=0))
    return cfg, groups, model


def update_sequences(shape: BenchShape, micro_batch: int, sequences: int | None = None) -> int:
    """Sequences of the timed training step: ``sequences``, by default one RL update at
    ``shape`` (prompts x samples); ValueError unless ``micro_batch`` divides them."""
    seqs = shape.prompts * shape.samples if sequences is None else sequences
    if micro_batch < 1 or seqs < 1 or seqs % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} must divide the step's sequences = {seqs}")
    return seqs


def measure_train(shape: BenchShape, micro_batch: int, repeat: int,
                  device: torch.device = CPU.device, sequences: int | None = None) -> dict:
    """Median time of one optimiser step over an RL iteration's sequences (all tokens real)."""
    from engine import inductor
    from engine.train import OptimConfig, TrainEngine

    seqs = update_sequences(shape, micro_batch, sequences)
    seq = shape.prompt_len + shape.response_len
    _, _, model = _model(shape, device)
    engine = TrainEngine(model, OptimConfig(lr=1e-5))
    g = torch.Generator(device=device).manual_seed(1)
    mbs = [{"input_ids": torch.randint(0, shape.vocab, (micro_batch, seq), generator=g,
                                       device=device)}
           for _ in range(seqs // micro_batch)]
    head_from = shape.prompt_len - 1

    def step():
        return engine.train_step(mbs, lambda out, mb: -out["log_probs"].mean(), head_from,
                                 temperature=1.0)

    def without(switch):  # the A/Bs: the same step with part of the compiled code eager
        def run():
            previous = switch(False)
            try:
                return step()
            finally:
                switch(previous)
        return run

    def layers_switch(on):
        previous, model.compile_layers = model.compile_layers, on
        return previous

    variants = {"step": step, "eager": without(inductor.set_enabled)}
    if model.compile_layers:
        variants["eager_layers"] = without(layers_switch)
    t, _ = interleaved_median_times(variants, repeat, device=device)
    eager_layers = t.get("eager_layers", t["step"])
    flops = train_flops(shape, seqs, seq, head_from)
    # what bounds the step on a GPU: kernels per micro-batch, the GPU's busy share
    profile = device_profile(step, len(mbs), device) if device.type == "cuda" else None
    return {"step_s": t["step"], "eager_step_s": t["eager"], "profile": profile,
            "eager_layers_step_s": t.get("eager_layers"),
            "compiled_head_speedup": t["eager"] / eager_layers,
            "compiled_layers_speedup": eager_layers / t["step"],
            "compiled_head": inductor.enabled(), "compiled_layers": model.compile_layers,
            "sequences": seqs, "micro_batch": micro_batch, "seq": seq,
            "head_from": head_from, "flops_per_step": flops, "flops_per_token": flops / seqs / seq,
            "tokens_per_s": seqs * seq / t["step"], "flops_per_s": flops / t["step"]}


def decode_step_time(t_n: float, t_1: float, n: int) -> tuple[float, str]:
    """The decode step from the time ``t_n`` of a call of ``n`` new tokens and ``t_1`` of one
    of 1 (the prefill alone), both without warm-ups and captures (pure): ``(t_n - t_1) /
    (n - 1)``, or ``t_n / n`` where noise makes the difference <= 0 (an upper bound); and
    which of the two (``step_from``)."""
    if n < 2:
        raise ValueError(f"decode tokens={n} must be >= 2 to time a decode step")
    step = (t_n - t_1) / (n - 1)
    if step > 0:
        return step, "difference"
    return t_n / n, "whole call / N"  # a loaded machine's noise outweighed n - 1 steps


def measure_decode(shape: BenchShape, batches: tuple[int, ...], repeat: int,
                   device: torch.device = CPU.device, new_tokens: int | None = None) -> dict:
    """Greedy decode step time per batch size (:func:`decode_step_time`), N = ``new_tokens``
    (default the shape's response_len); every call's time without its CUDA graph warm-ups and
    captures (``capture_s``, recorded with ``graphs_captured`` of the last N-token call)."""
    from engine.generation import GenerationEngine
    from engine.sampling import SamplingParams

    n = shape.response_len if new_tokens is None else new_tokens
    if n < 2:
        raise ValueError(f"decode tokens={n} must be >= 2 to time a decode step")
    cfg, groups, model = _model(shape, device)
    engine = GenerationEngine(cfg, groups, device=device)
    engine.set_weights(model.params)
    g = torch.Generator(device=device).manual_seed(2)
    fns = {}
    for b in batches:
        ids = torch.randint(0, shape.vocab, (b, shape.prompt_len), generator=g, device=device)
        for k in (1, n):
            fns[(b, k)] = (lambda ids=ids, k=k:
                           engine.generate(ids, None, SamplingParams(max_new_tokens=k,
                                                                     temperature=0.0)))
    t, last = interleaved_median_times({f"{b},{k}": f for (b, k), f in fns.items()}, repeat,
                                       device=device, untimed=lambda o: o.stats["capture_s"])
    out = {}
    for b in batches:
        step, step_from = decode_step_time(t[f"{b},{n}"], t[f"{b},1"], n)
        stats = last[f"{b},{n}"].stats
        out[b] = {"step_s": step, "step_from": step_from, "generate_s": t[f"{b},{n}"],
                  "prefill_s": t[f"{b},1"], "capture_s": stats["capture_s"],
                  "graphs_captured": stats["graphs_captured"],
                  "new_tokens": n, "context_mean": shape.prompt_len + n / 2,
                  "decode_path": "c++ kernels" if engine.fused_decode else "python layers",
                  "compiled_layers": engine.compile_decode, "cuda_graphs": engine.cuda_graphs}
    if device.type == "cuda":  # what bounds the steps: kernels per step, the GPU's busy share
        for b in batches:
            out[b]["profile"] = device_profile(fns[(b, n)], n, device)
    return out


def measure_reshard(size_mb: float, repeat: int) -> dict:
    """``bench/transition.py`` 1,4,1 -> 1,2 on 4 ranks, run through its CLI."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "transition.json")
        cmd = [sys.executable, os.path.join(ROOT, "bench", "transition.py"), "--size-mb",
               str(size_mb), "--train", "1,4,1", "--gen", "1,2", "--nproc", "4", "--repeat",
               str(repeat), "--json", path]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(path, encoding="utf-8") as f:
            transition = json.load(f)
    ratio, key = reshard_ratio(transition)
    return {"ratio_vs_raw": ratio, "read_from": key, "size_mb": size_mb, "command": cmd[1:],
            "transition": transition}


# ------------------------------------------------------------------------------ the run
def decode_limits(shape: BenchShape, decode: dict, peak: float, read_bw: float) -> dict:
    """Each batch size's step FLOPs, bytes, limit time and fraction (limit / measured)."""
    out = {}
    for b in decode:
        d, c = decode[b], decode[b]["context_mean"]
        flops, nbytes = decode_step_flops(shape, b, c), decode_step_bytes(shape, b, c)
        limit = max(flops / peak, nbytes / read_bw)
        out[f"b{b}"] = {**d, "flops": flops, "bytes": nbytes, "flop_limit_s": flops / peak,
                        "bytes_limit_s": nbytes / read_bw, "limit_s": limit,
                        "bound": "flops" if flops / peak >= nbytes / read_bw else "bytes",
                        "limit_fraction": limit / d["step_s"] if d["step_s"] > 0 else None}
    return out


def run(shape: BenchShape, repeat: int, micro_batch: int, reshard_mb: float | None,
        bd: BenchDevice = CPU, decode_tokens: int | None = None,
        sequences: int | None = None) -> dict:
    """Every measurement of the module docstring on ``bd`` (``shape`` in its dtype); JSON-ready."""
    shape = dataclasses.replace(shape, dtype=bd.dtype)
    seq = shape.prompt_len + shape.response_len
    products = model_products(shape, micro_batch * seq, micro_batch * shape.response_len)
    batches = CUDA_DECODE_BATCHES if bd.is_cuda else DECODE_BATCHES

    def limits():
        return (measure_matmul(products, max(3, repeat), bd),
                measure_bandwidth(matrix_params(shape), shape.hidden, max(3, repeat), bd))

    before = limits()
    train = measure_train(shape, micro_batch, repeat, bd.device, sequences)
    decode = measure_decode(shape, batches, repeat, bd.device, decode_tokens)
    after = limits()
    # the limits are the better of the two (on a shared machine the load drifts: the
    # fractions stay conservative, and the drift is recorded)
    mm, bw = max(before[0], after[0], key=lambda m: m["peak"]), \
        max(before[1], after[1], key=lambda b: b["read"])
    drift = {"peak_after_over_before": after[0]["peak"] / before[0]["peak"],
             "read_after_over_before": after[1]["read"] / before[1]["read"]}
    decode = decode_limits(shape, decode, mm["peak"], bw["read"])
    reshard = None if reshard_mb is None else measure_reshard(reshard_mb, repeat)
    fractions = {f"decode_b{b}_limit_fraction": decode[f"b{b}"]["limit_fraction"]
                 for b in batches}
    goals = ({"train_flops_fraction": ">= 0.45", "decode_limit_fraction": ">= 0.6 at batch 128"}
             if bd.is_cuda else
             {"train_flops_fraction": ">= 0.70", "decode_limit_fraction": ">= 0.70",
              "reshard_vs_raw": "<= 1.3 at 1024 MiB"})
    return {
        "peak_matmul_flops": mm["peak"], "memcpy_bytes_per_s": bw["copy"],
        "read_bytes_per_s": bw["read"],
        "train_flops_fraction": train["flops_per_s"] / mm["peak"],
        "train_eager_flops_fraction": train["flops_per_step"] / train["eager_step_s"] / mm["peak"],
        "train_eager_layers_flops_fraction": (
            None if train["eager_layers_step_s"] is None
            else train["flops_per_step"] / train["eager_layers_step_s"] / mm["peak"]),
        **fractions,
        "decode_limit_fraction": (min(fractions.values())
                                  if None not in fractions.values() else None),
        "reshard_vs_raw": None if reshard is None else reshard["ratio_vs_raw"],
        "goals": goals,
        "matmul": mm, "bandwidth_bytes_per_s": bw, "limits_drift": drift,
        "matrix_params": matrix_params(shape),
        "train": train, "decode": decode, "reshard": reshard,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(p, default="small", rl=True)
    add_device_arguments(p)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH,
                   help="sequences per micro-batch")
    p.add_argument("--no-reshard", action="store_true",
                   help="skip the 4-rank reshard part (never run with --device cuda)")
    p.add_argument("--reshard-mb", type=float, default=1024.0)
    p.add_argument("--sequences", type=int, default=None,
                   help="sequences of the timed training step (default prompts x samples)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="N of the decode-step timing (default the shape's response_len)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from engine.host_memory import keep_freed_memory

    keep_freed_memory()  # the allocator setting the RL ranks run with (rlhf/train.py)
    shape = get_shape(a.shape, rl=True)
    if a.threads < 1 or a.repeat < 1 or a.reshard_mb <= 0:
        print(f"error: threads={a.threads} and repeat={a.repeat} must be >= 1 and reshard_mb="
              f"{a.reshard_mb} > 0", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    try:
        bd = bench_device(a)
        reshard_mb = None if a.no_reshard or bd.is_cuda else a.reshard_mb
        result = run(shape, a.repeat, a.micro_batch, reshard_mb, bd, a.decode_tokens,
                     a.sequences)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from engine import inductor

    result.update(compile_fallbacks=inductor.fallbacks(), compile_counts=inductor.compile_counts(),
                  shape=dataclasses.replace(shape, dtype=bd.dtype).describe(),
                  argv=sys.argv if argv is None else argv, threads=torch.get_num_threads(),
                  repeat=a.repeat, device=bd.describe())
    r = result
    reshard = ("skipped" if r["reshard_vs_raw"] is None
               else f"{r['reshard_vs_raw']:.2f}x raw all-gather at {a.reshard_mb:g} MiB")
    decode = ", ".join(f"{b} " + ("n/a" if d["limit_fraction"] is None
                                  else f"{d['limit_fraction']:.2f}")
                       for b, d in r["decode"].items())
    print(f"roofline {shape.name} on {r['device']} ({r['threads']} threads): peak "
          f"{r['peak_matmul_flops'] / 1e9:.0f} GFLOP/s, copy "
          f"{r['memcpy_bytes_per_s'] / 1e9:.1f} GB/s, read {r['read_bytes_per_s'] / 1e9:.1f} GB/s"
          f" | train {r['train_flops_fraction']:.2f} of peak (nothing compiled "
          f"{r['train_eager_flops_fraction']:.2f}) | decode {decode} of limit "
          f"({r['decode']['b1']['decode_path']}) | reshard {reshard}")
    write_json(result, a.json, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
