"""Placements and allocations as pure enumeration.

A *placement* is a set partition of the models into colocated sets (Bell(n) of them: 15 for
PPO's 4 models, 52 for Safe-RLHF's 5).  An *allocation* gives every set a device count; the
counts sum to the total.  Device counts are drawn from :func:`device_counts` so that the search
stays small at 128 devices: every count up to a node, then whole nodes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache


def set_partitions(items: Sequence) -> Iterator[tuple[tuple, ...]]:
    """Every partition of ``items`` into non-empty blocks, each block in input order and the
    blocks ordered by their first item (so each partition appears once)."""
    items = tuple(items)
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        # first item alone, or joined to the front of one existing block
        yield ((first,),) + part
        for i in range(len(part)):
            yield part[:i] + ((first,) + part[i],) + part[i + 1:]


def sorted_partition(part: tuple[tuple, ...], order: Sequence) -> tuple[tuple, ...]:
    """Canonical form: items in ``order`` inside each block, blocks by their first item."""
    pos = {x: i for i, x in enumerate(order)}
    blocks = [tuple(sorted(b, key=pos.__getitem__)) for b in part]
    return tuple(sorted(blocks, key=lambda b: pos[b[0]]))


@lru_cache(maxsize=None)
def bell(n: int) -> int:
    """Bell number: the count of set partitions of ``n`` items (Bell triangle)."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    row = [1]
    for _ in range(n):
        nxt = [row[-1]]
        for v in row:
            nxt.append(nxt[-1] + v)
        row = nxt
    return row[0]


def device_counts(total: int, per_node: int) -> list[int]:
    """Device counts a set may get: 1..per_node (powers of two only when per_node >= 8, as
    tensor parallel sizes are), then multiples of per_node, up to ``total``."""
    if total < 1 or per_node < 1:
        raise ValueError(f"total={total} and per_node={per_node} must be >= 1")
    small = range(1, min(total, per_node) + 1)
    if per_node >= 8:
        small = [n for n in small if n & (n - 1) == 0]
    return sorted(set(small) | set(range(per_node, total + 1, per_node)))


def allocations(total: int, mins: Sequence[int], counts: Sequence[int]) -> Iterator[tuple]:
    """Every tuple ``(n_0, ..., n_k-1)`` with ``n_i`` in ``counts``, ``n_i >= mins[i]`` and
    ``sum == total`` (sets are told apart by their models, so order matters)."""
    counts = sorted(set(counts))

    def rec(i: int, left: int) -> Iterator[tuple]:
        if i == len(mins) - 1:
            if left >= mins[i] and left in counts_set:
                yield (left,)
            return
        need_after = sum(mins[i + 1:])
        for n in counts:
            if n < mins[i]:
                continue
            if n > left - need_after:
                break
            for tail in rec(i + 1, left - n):
                yield (n,) + tail

    counts_set = set(counts)
    if not mins:
        return iter(())
    return rec(0, total)
