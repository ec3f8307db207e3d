"""Stacked <-> logical copies: C++ path against torch, Triton kernel (TRITON_INTERPRET=1)
against the C++ path."""

import os
import subprocess
import sys

import pytest
import torch

from hybridflow_comm.strided import logical_from_stacked, stacked_from_logical


@pytest.mark.parametrize("shape, dim, m", [((6, 4), 1, 2), ((3, 4, 5), 1, 3), ((3, 4, 5), 2, 4),
                                           ((2, 3, 4, 5), 3, 2), ((7, 9), 0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cpp_path_against_cat(shape, dim, m, dtype):
    g = torch.Generator().manual_seed(0)
    slots = [torch.randint(-100, 100, shape, generator=g).to(dtype) for _ in range(m)]
    stacked = torch.stack(slots)
    logical = logical_from_stacked(stacked, dim)
    assert torch.equal(logical, torch.cat(slots, dim=dim))  # independent reference
    assert torch.equal(stacked_from_logical(logical, dim, m), stacked)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dim=2"):
        logical_from_stacked(torch.zeros(2, 3, 4), 2)
    with pytest.raises(ValueError, match="m=3"):
        stacked_from_logical(torch.zeros(4, 4), 1, 3)


TRITON_CHECK = r"""
import torch, hybridflow_comm._C as C
from hybridflow_comm.gpu import triton_pack
assert triton_pack.AVAILABLE
for d0, d1, length, dtype in [(3, 5, 7, torch.float32), (4, 2, 5000, torch.bfloat16), (2, 6, 1, torch.int32)]:
    src = torch.randn(d0, d1, length).to(dtype)
    ours = torch.empty(d1, d0, length, dtype=dtype)
    triton_pack.swap_leading_dims(src, ours, block=4096)
    ref = torch.empty_like(ours)
    C.unstack_to_logical(src, ref)
    assert torch.equal(ours, ref), (d0, d1, length)
print("triton ok")
"""


def test_triton_kernel_interpreted_matches_cpp():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton ok" in out.stdout
