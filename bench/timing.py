"""Median wall time of repeated calls, the one timing loop the benchmarks share."""

from __future__ import annotations

import statistics
import time


def median_time(fn, repeat: int, warmup: int = 1) -> tuple[float, object]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times timed.

    Returns:
        ``(median seconds, result of the last call)``.
    """
    times, results = interleaved_median_times({"fn": fn}, repeat, warmup)
    return times["fn"], results["fn"]


def interleaved_median_times(fns: dict, repeat: int, warmup: int = 1
                             ) -> tuple[dict[str, float], dict[str, object]]:
    """Time several callables side by side: each round calls every one once, in turn.

    Interleaving spreads slow phases of a shared, noisy machine over all contenders instead of
    charging them to whichever ran at that moment, so the ratios of the medians are stable.

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
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, results
