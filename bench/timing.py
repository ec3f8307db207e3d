"""Median wall time of repeated calls, the one timing loop the benchmarks share."""

from __future__ import annotations

import statistics
import time


def median_time(fn, repeat: int, warmup: int = 1) -> tuple[float, object]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times timed.

    Returns:
        ``(median seconds, result of the last call)``.
    """
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out
