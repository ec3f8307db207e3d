"""Integer maths of sizes shared by the layouts, the weight-sync plans, the planner and the
config checks.  Standard library only, so that a config check can name the valid sizes
without loading torch or the C++ extension that :mod:`hybridflow_comm.layout` needs."""

from __future__ import annotations

import math


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order (``[]`` for 0).

    O(sqrt n): ``n`` may come straight from a user.

    Args:
        n: a non-negative int.
    Returns:
        Every ``d`` in ``[1, n]`` with ``n % d == 0``, ascending.
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def check_sizes(**sizes: int) -> None:
    """TypeError naming a size that is not an int (a bool is not one here), ValueError naming
    one below 1."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value}")
