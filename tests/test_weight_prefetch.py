"""The decode kernels' weight prefetch hint (csrc/engine/small_gemm.cpp): non-temporal on AMD
CPUs, into L2/L3 elsewhere, or as ``HYBRIDFLOW_WEIGHT_PREFETCH`` says; a hint never changes a
result, and a bad value is refused naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_kernels = pytest.importorskip("engine._kernels")

PRODUCT = """
import sys
import torch
from engine import _kernels
OUT = sys.argv[1]
g = torch.Generator().manual_seed(0)
w = torch.randn(300, 200, generator=g)
for rows in (1, 5, 32):
    x = torch.randn(rows, 200, generator=g)
    for lanes in (False, True):
        torch.save(_kernels.small_linear(x, w, row_lanes=lanes), f"{OUT}/{rows}-{lanes}.pt")
print(_kernels.weight_prefetch)
"""


def _vendor() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.split(":")[1].strip()
    return ""


def _run(tmp_path, hint: str | None) -> tuple[str, dict]:
    out = tmp_path / (hint or "default")
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDFLOW_WEIGHT_PREFETCH"}
    if hint is not None:
        env["HYBRIDFLOW_WEIGHT_PREFETCH"] = hint
    proc = subprocess.run([sys.executable, "-c", PRODUCT, str(out)], env=env,
                          capture_output=True, text=True, check=True)
    return proc.stdout.strip(), {p.name: torch.load(p) for p in out.iterdir()}


def test_hint_by_vendor_and_environment_and_never_in_the_results(tmp_path):
    default, base = _run(tmp_path, None)
    assert default == ("nta" if _vendor() == "AuthenticAMD" else "t1")
    for hint in ("nta", "t1"):
        got, products = _run(tmp_path, hint)
        assert got == hint
        assert products.keys() == base.keys()
        for name, y in products.items():
            assert torch.equal(y, base[name]), (hint, name)


def test_bad_hint_is_refused_naming_it():
    env = os.environ | {"HYBRIDFLOW_WEIGHT_PREFETCH": "t0"}
    proc = subprocess.run([sys.executable, "-c", "import engine.generation"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "HYBRIDFLOW_WEIGHT_PREFETCH='t0'" in proc.stderr
