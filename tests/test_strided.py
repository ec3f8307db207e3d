"""Stacked <-> logical copies: the C++ path (CPU) and torch's strided copy (CUDA) against
torch.cat."""

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_against_cat():
    g = torch.Generator().manual_seed(1)
    slots = [torch.randn(3, 5, 7, generator=g).to(torch.bfloat16).cuda() for _ in range(4)]
    logical = logical_from_stacked(torch.stack(slots), 1)
    assert logical.is_cuda and torch.equal(logical, torch.cat(slots, dim=1))
    assert torch.equal(stacked_from_logical(logical, 1, 4), torch.stack(slots))
