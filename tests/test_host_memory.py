"""engine.host_memory: freed blocks are reused without new page faults once it is applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import host_memory
from engine.host_memory import KEEP_FREED_MEMORY_ENV, keep_freed_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process per setting (mallopt changes the whole process): three rounds of a step-like
# pattern, three 24 MiB blocks (under glibc's largest mmap threshold) and one of 48 MiB (above
# it, as the LM head's logits at the `small` shape) malloc'ed, written and freed: minor page
# faults per round, whether the blocks came from the heap, and whether the heap top was given
# back to the kernel after the frees.
PROBE = """
import ctypes, json, resource
from engine.host_memory import keep_freed_memory
applied = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
sizes = [24 << 20] * 3 + [48 << 20]
rounds = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for size in sizes]
    for b, size in zip(blocks, sizes):
        ctypes.memset(b, 1, size)
    top = libc.sbrk(0)
    on_heap = all(b < top for b in blocks)
    for b in blocks:
        libc.free(b)
    rounds.append({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                   "on_heap": on_heap, "trimmed": libc.sbrk(0) < top})
print(json.dumps({"applied": applied, "rounds": rounds}))
"""

PAGES = (3 * (24 << 20) + (48 << 20)) // 4096


def probe(setting: str) -> dict:
    env = dict(os.environ, **{KEEP_FREED_MEMORY_ENV: setting}, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                    reason="the setting is glibc's")
def test_freed_blocks_are_reused_without_page_faults():
    kept, default = probe("1"), probe("0")
    assert kept["applied"] and not default["applied"]
    # glibc's default: the first round's blocks are mmap'ed and unmapped; later 24 MiB ones
    # come from the heap, whose top is given back after the frees, the 48 MiB one is always
    # mmap'ed: every round faults again
    assert all(r["faults"] >= PAGES // 2 for r in default["rounds"]), default
    assert all(r["trimmed"] and not r["on_heap"] for r in default["rounds"][1:]), default
    # kept: heap blocks from the start (the 48 MiB one too), never trimmed, faulted in once
    assert all(r["on_heap"] and not r["trimmed"] for r in kept["rounds"]), kept
    assert kept["rounds"][0]["faults"] >= PAGES // 2, kept
    assert all(r["faults"] < PAGES // 100 for r in kept["rounds"][1:]), kept


def test_switch_and_bad_values(monkeypatch):
    assert keep_freed_memory({KEEP_FREED_MEMORY_ENV: "0"}) is False
    for bad in ("yes", "", "2"):
        with pytest.raises(ValueError, match=f"{KEEP_FREED_MEMORY_ENV}={bad!r}"):
            keep_freed_memory({KEEP_FREED_MEMORY_ENV: bad})
    monkeypatch.setattr(os, "confstr", lambda name: "musl 1.2")  # not glibc: nothing to set
    assert host_memory._glibc() is None and keep_freed_memory({}) is False
