"""The hand-written C++ kernels against ``torch.compile`` (inductor, CPU) of the reference layers.

    python bench/kernels_vs_compile.py [--shape small] [--threads N] [--repeat 10] [--json PATH]

Each operation's contenders run interleaved in one process (:func:`bench.timing.
interleaved_median_times`) on the same inputs, after a correctness check against the eager
reference (below).  Rows (``B x S`` tokens, the shape's sizes)::

    operation             kernel (engine._kernels)             reference (engine.layers)
    train_rms_norm        norm.rms_norm fwd+bwd (C++)          rms_norm_formula       [4, P+R, H]
    train_swiglu          mlp.swiglu fwd+bwd (C++)             swiglu_formula   [4, P+R, F, 2]
    decode_b{1,32}        KernelStage / KernelLayers           PythonLayers, one step of the
                                                               stage at a cache of P + R/2

``n = prompts x samples`` (one RL iteration's generation batch).  Each contender's time is the
median of ``--repeat`` interleaved rounds, ``kernel/compiled`` = compiled ms / kernel ms, and
the verdict is ``keep`` at >= 1.3x (:data:`KEEP_AT`), else ``delete``.  The kernel rows run
plain float32 Llama layers (``qkv_bias`` off); the ``+bias`` rows have no kernel contender and
time the eager reference against its compiled form with the q/k/v bias of the Qwen2-style
``small`` model, for the code that runs on the Python layers (every training layer and every
prefill): ``train_layer+bias`` (decoder_layer forward + backward, ``[4, P+R, H]``),
``train_attention+bias`` (attention_block), ``prefill+bias`` (PythonLayers, whole stage,
``[n, P]``), ``decode_b{1,32}+bias``.  Eager runs the engine's own code, RMSNorm on the C++
kernel included; ``torch.compile`` traces the formula instead (:func:`engine.norm.rms_norm`).
Weights are seeded (std ``1/sqrt(fan_in)``), the training mask is an RL micro-batch's
(left-padded prompts, right-padded responses).

Whole training layers, attention and MLP blocks and the prefill have no C++ kernel: they run
on the Python layers, which a fused kernel would have to beat by the same 1.3x over their
compiled form (the ``+bias`` rows time that form).

Compiled = ``torch.compile(fn, dynamic=False, fullgraph=True)`` (inductor, CPU), warmed up by
the check call outside the timing; its first call's wall time is ``compile_s``.  Training
rows compile the reference function under autograd (AOTAutograd: forward and backward graphs).
Prefill and decode compile the bound ``PythonLayers.forward`` *with* the KV cache writes: the
cache's hook assigns into ``cache.k`` / ``cache.v`` and hands the layers the values as a view
and the keys gathered out of their tiles (a copy of the filled keys per layer, which the
kernels do not make: part of what the Python path costs), which dynamo traces as
in-place mutations of graph inputs (inductor writes them inside its kernels); it specialises on
``cache.length`` (an int), so every timed call writes the same position, as every contender's
does here.  A real decode loop would recompile per cache length under ``dynamic=False`` (or
need dynamic shapes or a static full-length cache with a position mask): not measured here.

Correctness, before any timing: each contender's outputs (training: the layer output and the
gradients of the input and every weight; prefill/decode: the stage output and every layer's
KV cache at the step's positions) against the eager reference, with
``max|got - want| <= TOL * max(1, max|want|)`` (:data:`TOL`, float32 orders of summation).
A contender that fails is reported ``WRONG`` (and the exit code is 1), so a fast wrong kernel
cannot win.  JSON: ``rows`` (one per kernel, plus the ``+bias`` rows), ``shape``, ``argv``,
``torch``, ``threads``, ``repeat``, ``tolerance``, ``checks``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.report import emit_json  # noqa: E402
from bench.shapes import BenchShape, add_shape_argument, get_shape  # noqa: E402
from bench.timing import interleaved_median_times  # noqa: E402

KEEP_AT = 1.3
"""A kernel is kept where it beats the compiled reference by at least this factor."""
TOL = 1e-4
"""Correctness bound, relative to ``max(1, max|want|)`` of each compared tensor."""
TRAIN_BATCH = 4
"""Sequences of a training micro-batch (the RL update's)."""
DECODE_BATCHES = (1, 32)
KERNEL_CODE = {  # what a verdict keeps or deletes
    "train_rms_norm": "csrc/engine/rms_norm.cpp (engine.norm.rms_norm on float32 CPU)",
    "train_swiglu": "csrc/engine/swiglu.cpp (engine.mlp.swiglu on float32 CPU)",
    "kernel_stage": "decode_layer.cpp decode_layers (+ shared_step.cpp, kv_attention.cpp, "
                    "small_gemm.cpp)",
    "kernel_layers": "decode_layer.cpp decode_attention/decode_mlp (+ kv_attention.cpp, "
                     "small_gemm.cpp)",
}

Outputs = list[torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    """The shape's sizes as the layers take them (read once, :meth:`of`)."""

    shape: BenchShape
    h: int
    d: int
    f: int
    layers: int
    g: int
    qpg: int
    eps: float
    theta: float
    seq: int
    """A training row: prompt plus response tokens."""

    @classmethod
    def of(cls, shape: BenchShape) -> Sizes:
        cfg = shape.llama_config()
        return cls(shape, shape.hidden, cfg.head_dim, shape.ffn, shape.layers, shape.kv_heads,
                   cfg.q_per_group, cfg.rms_norm_eps, cfg.rope_theta,
                   shape.prompt_len + shape.response_len)


def layer_weights(s: Sizes, gen: torch.Generator, bias: bool) -> dict[str, torch.Tensor]:
    """One layer's weights (:mod:`engine.layers` names), std ``1/sqrt(fan_in)``."""
    def rnd(*size, fan_in=1):
        return torch.randn(*size, generator=gen) / fan_in ** 0.5

    qkv_rows = s.g * (s.qpg + 2) * s.d
    w = {"input_norm": 1 + 0.1 * rnd(s.h), "qkv": rnd(qkv_rows, s.h, fan_in=s.h),
         "o_proj": rnd(s.h, s.g * s.qpg * s.d, fan_in=s.g * s.qpg * s.d),
         "post_norm": 1 + 0.1 * rnd(s.h), "gate_up": rnd(2 * s.f, s.h, fan_in=s.h),
         "down_proj": rnd(s.h, s.f, fan_in=s.f)}
    if bias:
        w["qkv_bias"] = 0.1 * rnd(qkv_rows)
    return w


def max_rel_err(got: Outputs, want: Outputs) -> float:
    """The largest ``max|got - want| / max(1, max|want|)`` over the paired tensors."""
    assert len(got) == len(want), (len(got), len(want))
    return max(((a.double() - b.double()).abs().max()
                / b.double().abs().max().clamp(min=1.0)).item() for a, b in zip(got, want))


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True)


def measure(operation: str, fns: dict[str, Callable[[], Outputs]], repeat: int,
            roles: dict[str, str]) -> list[dict]:
    """Check every contender of ``operation`` against ``fns["eager"]``, then time them all
    interleaved; one row per kernel contender (or one ``kernel=None`` row without one)."""
    want = fns["eager"]()
    errors, compile_s = {}, None
    for name, fn in fns.items():
        t0 = time.perf_counter()
        got = fn()  # also the compiled one's compilation (its warm-up)
        if name == "compiled":
            compile_s = time.perf_counter() - t0
        errors[name] = max_rel_err(got, want)
    print(f"[{operation}] checked {', '.join(f'{n} {e:.1e}' for n, e in errors.items())}; "
          f"compile {compile_s:.1f} s; timing", file=sys.stderr, flush=True)
    # a recompilation inside the timing would charge compile time to the compiled contender
    with torch._dynamo.config.patch(error_on_recompile=True):
        times, _ = interleaved_median_times(fns, repeat, warmup=1)
    ms = {name: 1e3 * t for name, t in times.items()}
    kernels = [n for n in fns if roles.get(n) == "kernel"] or [None]
    rows = []
    for k in kernels:
        ok = all(errors[n] <= TOL for n in fns if n in (k, "eager", "compiled"))
        row = {"operation": operation, "kernel": k, "kernel_ms": ms.get(k),
               "eager_ms": ms["eager"], "compiled_ms": ms["compiled"], "compile_s": compile_s,
               "max_rel_err": {n: errors[n] for n in fns if n in (k, "eager", "compiled")},
               "checked": True, "correct": ok,
               "code": KERNEL_CODE.get(k) or KERNEL_CODE.get(operation) if k else None}
        if k is None:
            row.update(kernel_vs_compiled=None, kernel_vs_eager=None,
                       verdict="n/a" if ok else "WRONG")
        else:
            row.update(kernel_vs_compiled=ms["compiled"] / ms[k],
                       kernel_vs_eager=ms["eager"] / ms[k])
            row["verdict"] = ("WRONG" if not ok else
                              "keep" if row["kernel_vs_compiled"] >= KEEP_AT else "delete")
        rows.append(row)
    torch._dynamo.reset()  # drop this operation's compiled graphs
    return rows


# ------------------------------------------------------------------------------ training

def rl_attention_mask(s: Sizes, batch: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, P + R]``: left-padded prompts then right-padded responses (an RL row)."""
    p, r = s.shape.prompt_len, s.shape.response_len
    plen = torch.randint(max(1, p // 2), p + 1, (batch,), generator=gen)
    rlen = torch.randint(max(1, r // 2), r + 1, (batch,), generator=gen)
    pos = torch.arange(p + r)
    return ((pos >= p - plen[:, None]) & (pos < p + rlen[:, None])).long()


def train_step(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: dict[str, torch.Tensor],
               dy: torch.Tensor) -> Callable[[], Outputs]:
    """Forward + backward of ``fn(x, w)``: returns the output and the gradients of ``x`` and
    of every weight."""
    leaves = [x, *w.values()]

    def run() -> Outputs:
        for t in leaves:
            t.grad = None
        y = fn(x, w)
        y.backward(dy)
        return [y.detach(), *(t.grad for t in leaves)]
    return run


def training_rows(s: Sizes, gen: torch.Generator, repeat: int) -> list[dict]:
    from engine.attention import causal_mask
    from engine.layers import LayerSpec, attention_block, decoder_layer
    from engine.mlp import swiglu, swiglu_formula
    from engine.norm import rms_norm, rms_norm_formula
    from engine.rope import position_ids_from_mask, rope_tables

    batch = TRAIN_BATCH
    mask2d = rl_attention_mask(s, batch, gen)
    mask = causal_mask(mask2d, batch, s.seq)
    rope = rope_tables(position_ids_from_mask(mask2d), s.d, s.theta)
    spec = LayerSpec(s.qpg, s.d, s.eps)
    x = torch.randn(batch, s.seq, s.h, generator=gen).requires_grad_()
    dy = torch.randn(batch, s.seq, s.h, generator=gen)
    norm = {"input_norm": (1 + 0.1 * torch.randn(s.h, generator=gen)).requires_grad_()}
    wb = {k: t.requires_grad_() for k, t in layer_weights(s, gen, bias=True).items()}

    def ref_norm(x, w):
        return rms_norm_formula(x, w["input_norm"], s.eps)

    def kernel_norm(x, w):  # float32 CPU: the C++ kernel (an autograd Function)
        return rms_norm(x, w["input_norm"], s.eps)

    def ref_layer(x, w):
        return decoder_layer(x, w, rope, mask, spec)

    def ref_attn(x, w):
        return attention_block(x, w, rope, mask, spec)

    fns = {"kernel": train_step(kernel_norm, x, norm, dy),
           "eager": train_step(ref_norm, x, norm, dy),
           "compiled": train_step(compiled(ref_norm), x, norm, dy)}
    rows = measure("train_rms_norm", fns, repeat, {"kernel": "kernel"})
    gu = torch.randn(batch, s.seq, s.f, 2, generator=gen).requires_grad_()
    dgu = torch.randn(batch, s.seq, s.f, generator=gen)

    def ref_swiglu(gu, w):
        return swiglu_formula(gu)

    def kernel_swiglu(gu, w):  # float32 CPU: the C++ kernel (an autograd Function)
        return swiglu(gu)

    fns = {"kernel": train_step(kernel_swiglu, gu, {}, dgu),
           "eager": train_step(ref_swiglu, gu, {}, dgu),
           "compiled": train_step(compiled(ref_swiglu), gu, {}, dgu)}
    rows += measure("train_swiglu", fns, repeat, {"kernel": "kernel"})
    for op, ref in (("train_layer", ref_layer), ("train_attention", ref_attn)):
        keys = tuple(wb) if op == "train_layer" else ("qkv", "o_proj", "qkv_bias")
        ws = {k: wb[k] for k in keys}
        fns = {"eager": train_step(ref, x, ws, dy), "compiled": train_step(compiled(ref), x,
                                                                           ws, dy)}
        rows += measure(op + "+bias", fns, repeat, {})
    return rows


# ---------------------------------------------------------------------- prefill and decode

def stage_layers(s: Sizes, gen: torch.Generator, bias: bool):
    from engine.forward_paths import StageLayers
    return StageLayers(weights=tuple(layer_weights(s, gen, bias) for _ in range(s.layers)),
                       q_per_group=s.qpg, head_dim=s.d, eps=s.eps, tp_group=None,
                       dtype=torch.float32)


def stage_step(path_forward: Callable, cache, x: torch.Tensor, rope, attn: torch.Tensor,
               start: int, end: int) -> Callable[[], Outputs]:
    """One no-grad step of a layer path: writes ``[start, end)`` of its own cache (never
    advanced, so every call is the same step); returns the output and that slice of K and
    V."""
    def run() -> Outputs:
        with torch.no_grad():
            y = path_forward(x, cache, rope, attn)
        return [y, cache.keys(start, end), cache.v[:, :, :, start:end]]
    return run


def generation_rows(s: Sizes, gen: torch.Generator, repeat: int) -> list[dict]:
    from engine import _kernels
    from engine.forward_paths import LAYER_PATHS
    from engine.forward_paths import uses_row_lanes
    from engine.attention import causal_mask
    from engine.kv_cache import TiledKVCache, tile_keys
    from engine.rope import position_ids_from_mask, rope_tables

    p, r = s.shape.prompt_len, s.shape.response_len
    stages = {False: stage_layers(s, gen, bias=False), True: stage_layers(s, gen, bias=True)}
    rows = []
    # prefill: one iteration's generation batch, left-padded prompts
    n = s.shape.prompts * s.shape.samples
    plen = torch.randint(max(1, p // 2), p + 1, (n,), generator=gen)
    mask = (torch.arange(p) >= p - plen[:, None]).long()
    rope = rope_tables(position_ids_from_mask(mask), s.d, s.theta)
    attn = causal_mask(mask, n, p)
    x = torch.randn(n, p, s.h, generator=gen)
    eager = LAYER_PATHS["python"].build(stages[True])  # every prefill runs the Python layers
    fns = {name: stage_step(forward, TiledKVCache(s.layers, n, p, s.g, s.d, torch.float32), x,
                            rope, attn, 0, p)
           for name, forward in (("eager", eager.forward), ("compiled", compiled(eager.forward)))}
    rows += measure("prefill+bias", fns, repeat, {})
    # decode: one token per row after a cache of P + R/2 positions
    c = p + r // 2
    for batch in DECODE_BATCHES:
        pad = torch.randint(0, p // 2 + 1, (batch,), generator=gen)
        keys_ok = torch.arange(c + 1) >= pad[:, None]  # [B, c + 1]
        pos = (keys_ok.sum(-1, keepdim=True) - 1)  # [B, 1]: the new token's position
        rope = rope_tables(pos, s.d, s.theta)
        attn = keys_ok[:, None, None, :]  # [B, 1, 1, c + 1]
        x = torch.randn(batch, 1, s.h, generator=gen)
        k0 = torch.randn(s.layers, batch, s.g, s.d, c + 1, generator=gen)
        v0 = torch.randn(s.layers, batch, s.g, c + 1, s.d, generator=gen)

        def cache():
            kv = TiledKVCache(s.layers, batch, c + 1, s.g, s.d, torch.float32)
            kv.k.copy_(tile_keys(k0))
            kv.v.copy_(v0)
            kv.advance(c)
            return kv

        for bias, stage in stages.items():
            paths = {"eager": LAYER_PATHS["python"].build(stage)}
            if not bias:
                paths |= {k: LAYER_PATHS[k].build(stage) for k in ("kernel_stage",
                                                                   "kernel_layers")}
                # the product form a generation of this batch runs when its rows all run
                # every step (engine/generation.py)
                paths["kernel_stage"] = replace(
                    paths["kernel_stage"], row_lanes=uses_row_lanes(
                        batch, _kernels.small_gemm_max_rows, _kernels.row_lanes_supported,
                        rows_stay=True))
            fns = {name: stage_step(path.forward, cache(), x, rope, attn, c, c + 1)
                   for name, path in paths.items()}
            fns["compiled"] = stage_step(compiled(paths["eager"].forward), cache(), x, rope,
                                         attn, c, c + 1)
            rows += measure(f"decode_b{batch}" + ("+bias" if bias else ""), fns, repeat,
                            {"kernel_stage": "kernel", "kernel_layers": "kernel"})
    return rows


# ------------------------------------------------------------------------------ the run

def run(shape: BenchShape, repeat: int) -> dict:
    from engine.forward_paths import kernels_available

    if not kernels_available(torch.float32, ()):
        raise ValueError("the engine._kernels extension is not built (python setup.py "
                         "build_ext --inplace, or make setup)")
    s, gen = Sizes.of(shape), torch.Generator().manual_seed(0)
    rows = training_rows(s, gen, repeat) + generation_rows(s, gen, repeat)
    failed = [f"{r['operation']}/{r['kernel']}" for r in rows if not r["correct"]]
    return {"rows": rows, "tolerance": TOL, "keep_at": KEEP_AT,
            "checks": {"ran": sum(len(r["max_rel_err"]) for r in rows), "failed": failed}}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(rows: list[dict]) -> str:
    """The result as a fixed-width text table."""
    head = (f"{'operation':<21}{'kernel':<15}{'kernel ms':>11}{'eager ms':>11}"
            f"{'compiled ms':>13}{'kern/comp':>10}{'kern/eager':>11}{'compile s':>10}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['operation']:<21}{r['kernel'] or '-':<15}{_ms(r['kernel_ms']):>11}"
                     f"{_ms(r['eager_ms']):>11}{_ms(r['compiled_ms']):>13}"
                     f"{_ms(r['kernel_vs_compiled']):>10}{_ms(r['kernel_vs_eager']):>11}"
                     f"{r['compile_s']:>10.1f}  "
                     f"{r['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(p, default="small", rl=True)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads < 1 or a.repeat < 1:
        print(f"error: threads={a.threads} and repeat={a.repeat} must be >= 1", file=sys.stderr)
        return 2
    shape = get_shape(a.shape, rl=True)
    torch.set_num_threads(a.threads)
    try:
        result = run(shape, a.repeat)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result.update(shape=shape.describe(), argv=sys.argv if argv is None else argv,
                  torch=torch.__version__, threads=torch.get_num_threads(), repeat=a.repeat)
    print(f"kernels vs torch.compile, shape {shape.name}, {result['threads']} threads, "
          f"median of {a.repeat} (checks: {result['checks']['ran']} compared, tolerance "
          f"{TOL:g}, failed {result['checks']['failed'] or 'none'})", file=sys.stderr)
    print(table(result["rows"]), file=sys.stderr)
    emit_json(result, a.json)
    return 1 if result["checks"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
