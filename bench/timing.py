"""Median wall time of repeated calls, the one timing loop the benchmarks share, and the
``--device`` / ``--precision`` options of the benches that run on a GPU."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BenchDevice:
    """Where a bench computes and in which precision (resolved from its options)."""

    device: torch.device
    precision: str
    """``fp32`` or ``bf16``."""

    @property
    def dtype(self) -> torch.dtype:
        from hybridflow_comm.devices import precision_dtype

        return precision_dtype(self.precision)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        """The JSON's ``device``: ``cpu``, or ``cuda:<name of the card>``."""
        if not self.is_cuda:
            return self.device.type
        return f"cuda:{torch.cuda.get_device_name(self.device)}"


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device cpu|cuda`` (default cpu) and ``--precision fp32|bf16`` (default fp32 on CPU,
    bf16 on CUDA)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both contenders run (default %(default)s)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="weights and compute (default fp32 on cpu, bf16 on cuda)")


def bench_device(args: argparse.Namespace) -> BenchDevice:
    """The options of :func:`add_device_arguments`, resolved (ValueError when CUDA is asked
    for and absent, or bf16 on a card without it)."""
    from hybridflow_comm.devices import resolve_device, resolve_precision

    device = resolve_device(args.device)
    return BenchDevice(device, resolve_precision(args.precision or "auto", device).name)


def sync(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device`` (a CUDA device's stream; nothing on CPU), so that
    a host clock read next covers it."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn, device: torch.device | str | None):
    """``fn`` followed by :func:`sync`: a callable whose return marks the end of its device
    work (for timers that do not sync themselves, e.g. :func:`rlhf.planner.calibrate.best_time`,
    whose warm-up call then also syncs before the first timed one)."""
    def call():
        out = fn()
        sync(device)
        return out
    return call


def median_time(fn, repeat: int, warmup: int = 1,
                device: torch.device | str | None = None) -> tuple[float, object]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times timed.

    Returns:
        ``(median seconds, result of the last call)``.
    """
    times, results = interleaved_median_times({"fn": fn}, repeat, warmup, device)
    return times["fn"], results["fn"]


def interleaved_median_times(fns: dict, repeat: int, warmup: int = 1,
                             device: torch.device | str | None = None,
                             untimed: Callable[[object], float] | None = None
                             ) -> tuple[dict[str, float], dict[str, object]]:
    """Time several callables side by side: each round calls every one once, in turn.

    Interleaving spreads slow phases of a shared, noisy machine over all contenders instead of
    charging them to whichever ran at that moment, so the ratios of the medians are stable.
    On a CUDA ``device`` the clock is read after :func:`sync` on both sides of each call, so a
    call's time is its device work, not the time to queue it.  ``untimed(result)``: seconds
    of a call's own work that are not what is timed (a generation's CUDA graph captures),
    taken out of that call's time.

    Returns:
        ``({name: median seconds}, {name: result of its last call})``.
    """
    results = {name: None for name in fns}
    for _ in range(warmup):
        for name, fn in fns.items():
            results[name] = fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            results[name] = fn()
            sync(device)
            elapsed = time.perf_counter() - t0
            times[name].append(elapsed - (untimed(results[name]) if untimed else 0.0))
    return {name: statistics.median(t) for name, t in times.items()}, results


def device_profile(fn, steps: int, device: torch.device | str, top: int = 8) -> dict:
    """Where one call of ``fn`` (already warmed up) spends its time, per step of ``steps``:
    the device's kernels (CUDA) or the host's operators (CPU) under ``torch.profiler``.

    Returns ``ops_per_step`` (kernels or operators launched per step), ``busy_fraction``
    (their summed time over the call's wall time: near 1, the device is the limit; far below,
    the host is, launching and deciding between them), ``wall_s`` and ``top`` (the ``top``
    names by summed time, with their share of it).  The profiler's own cost is in the wall
    time, so the fraction errs low.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    kind = DeviceType.CUDA if on_cuda else DeviceType.CPU
    sync(device)
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    # on the host only top-level operators (those inside another are in its time)
    events = [e for e in prof.events() if e.device_type == kind
              and (on_cuda or e.cpu_parent is None)]
    spans = {}
    for e in events:
        spans[e.name] = spans.get(e.name, 0.0) + (e.device_time if on_cuda else e.cpu_time)
    busy = sum(spans.values()) / 1e6  # microseconds
    ranked = sorted(spans.items(), key=lambda kv: -kv[1])[:top]
    return {"ops_per_step": len(events) / steps, "busy_fraction": busy / wall,
            "wall_s": wall, "top": [{"name": n[:120], "share": t / 1e6 / busy if busy else 0.0}
                                    for n, t in ranked]}
