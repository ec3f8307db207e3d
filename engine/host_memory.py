"""Keep freed host memory in the process between steps (glibc's malloc settings).

glibc serves a block above ``M_MMAP_THRESHOLD`` (128 KiB at start; it rises to the size of the
largest block freed so far, up to 32 MiB) by a fresh ``mmap`` that is unmapped on free, and it
gives the top of the heap back to the kernel once more than ``M_TRIM_THRESHOLD`` (twice that)
lies free there.  A training step frees its activations, logits and gradients at the end, the
next phase (generation, the reference forward) frees its own, and so each phase gets fresh
pages that the kernel zeroes at their first touch (``perf`` of ``bench/e2e.py --shape small``
shows them as ``clear_page_erms``).

:func:`keep_freed_memory` starts the process where glibc's own adaptation ends
(``M_MMAP_THRESHOLD`` = 32 MiB), never trims the heap (``M_TRIM_THRESHOLD`` at its
maximum) and serves the blocks above 32 MiB from the heap too (``M_MMAP_MAX`` = 0: the
threshold cannot go higher), so freed blocks are reused by the next step, at the price that
the process keeps its peak heap until it exits (what a GPU framework's caching allocator does
with device memory).  The blocks above 32 MiB matter at the ``small`` shape: the LM head's
logits of a micro-batch (1,024 x 8,192 floats) and their gradient, whose fresh pages fault in
at a large share of the cost of the product that fills them.  Rank entry points call it; the
environment variable ``HYBRIDFLOW_KEEP_FREED_MEMORY=0`` leaves the allocator as it is.  On a
C library other than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Mapping

KEEP_FREED_MEMORY_ENV = "HYBRIDFLOW_KEEP_FREED_MEMORY"

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest (64-bit)
_INT_MAX = 2**31 - 1  # mallopt takes an int


def _glibc() -> ctypes.CDLL | None:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return None
    if not version or not version.startswith("glibc"):
        return None
    return ctypes.CDLL("libc.so.6")


def keep_freed_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Make this process's malloc keep what it frees (see the module docstring).

    Args:
        env: where ``HYBRIDFLOW_KEEP_FREED_MEMORY`` is read ("1", the default, or "0").

    Returns:
        True if the settings were applied; False when switched off or not on glibc.
    """
    value = env.get(KEEP_FREED_MEMORY_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{KEEP_FREED_MEMORY_ENV}={value!r} must be 0 (leave the allocator "
                         f"as it is) or 1 (keep freed memory, the default)")
    libc = _glibc() if value == "1" else None
    if libc is None:
        return False
    # mallopt returns 1 on success
    return (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
            and libc.mallopt(_M_MMAP_MAX, 0) == 1)
