"""The LM head and its log-softmax, whole against fused in chunks: peak memory and time of one
forward + backward over a micro-batch's tokens, side by side in one run.

    python -m bench.lm_head [--shape qwen2.5-0.5b] [--tokens 512] [--device cpu|cuda]
                            [--repeat 3] [--json out.json]

``whole``: the head's logits ``[tokens, V]`` (``ParallelLlama.local_logits``), then
``engine.tp_ops.vocab_log_prob_entropy`` over them (its float32 copy kept for backward).
``fused``: ``engine.tp_ops.linear_log_prob_entropy``, the training path, whose logits exist
a chunk of tokens at a time (``LOGITS_PER_CHUNK``), recomputed in backward.  Both in the
shape's dtype, one process; the same loss and the same gradients (checked).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above what the inputs take; on the
CPU each side runs in a fresh subprocess and reports its peak RSS above its RSS before the
pass (``ru_maxrss``), so the two do not share a high-water mark.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from bench.shapes import get_shape
from engine.tp_ops import linear_log_prob_entropy, vocab_log_prob_entropy

SIDES = ("whole", "fused")


def inputs(shape_name: str, tokens: int, device: str, seed: int = 0):
    s = get_shape(shape_name)
    g = torch.Generator().manual_seed(seed)
    # drawn in their dtype: no float32 temporary raises the CPU high-water mark first
    h = torch.randn(tokens, s.hidden, generator=g, dtype=s.dtype).to(device).requires_grad_()
    w = torch.randn(s.vocab, s.hidden, generator=g, dtype=s.dtype).to(device)
    w = w.mul_(s.hidden ** -0.5).requires_grad_()
    targets = torch.randint(0, s.vocab, (tokens,), generator=g).to(device)
    return h, w, targets


def step(side: str, h, w, targets) -> torch.Tensor:
    """One forward + backward; the loss (detached)."""
    if side == "whole":
        lp, ent = vocab_log_prob_entropy(h @ w.t(), targets, None)
    else:
        lp, ent = linear_log_prob_entropy(h, w, targets, None)
    loss = -lp.mean() - 0.01 * ent.mean()
    loss.backward()
    return loss.detach()


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_side(side: str, shape: str, tokens: int, device: str, repeat: int) -> dict:
    """This process: ``side``'s peak extra memory and median time, its loss and gradients'
    norms (for the cross-check)."""
    h, w, targets = inputs(shape, tokens, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    times = []
    for _ in range(repeat):
        h.grad = w.grad = None
        sync()
        t0 = time.perf_counter()
        loss = step(side, h, w, targets)
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda" else rss_bytes()) - base
    return {"peak_extra_bytes": peak, "time_s": sorted(times)[len(times) // 2],
            "loss": float(loss), "grad_h_norm": float(h.grad.float().norm()),
            "grad_w_norm": float(w.grad.float().norm())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side is not None:  # a CPU side in its own process
        print(json.dumps(run_side(a.side, a.shape, a.tokens, a.device, a.repeat)))
        return 0
    out = {"shape": a.shape, "tokens": a.tokens, "device": a.device,
           "vocab": get_shape(a.shape).vocab}
    for side in SIDES:
        if a.device == "cuda":
            out[side] = run_side(side, a.shape, a.tokens, a.device, a.repeat)
            continue
        res = subprocess.run([sys.executable, "-m", "bench.lm_head", "--side", side,
                              "--shape", a.shape, "--tokens", str(a.tokens), "--device",
                              a.device, "--repeat", str(a.repeat)],
                             capture_output=True, text=True, check=True)
        out[side] = json.loads(res.stdout.strip().splitlines()[-1])
    whole, fused = out["whole"], out["fused"]
    out["memory_ratio"] = whole["peak_extra_bytes"] / max(1, fused["peak_extra_bytes"])
    out["time_ratio"] = whole["time_s"] / fused["time_s"]
    for key in ("loss", "grad_h_norm", "grad_w_norm"):
        out[f"{key}_rel_diff"] = abs(whole[key] - fused[key]) / max(abs(whole[key]), 1e-12)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
