"""pytest-benchmark cases for pack/unpack (run with ``make bench``; not part of ``make test``)."""

import torch

from bench.pack import make_tensors
from hybridflow_comm.pack import pack_tensors, plan_pack, unpack_tensors

TENSORS = make_tensors(2000, 256 << 20)
OFFSETS, TOTAL = plan_pack(TENSORS)


def test_memcpy(benchmark):
    src = torch.ones(TOTAL, dtype=torch.uint8)
    dst = torch.empty(TOTAL, dtype=torch.uint8)
    benchmark(dst.copy_, src)


def test_pack(benchmark):
    flat = torch.empty(TOTAL, dtype=torch.uint8)
    benchmark(pack_tensors, TENSORS, flat, OFFSETS)


def test_unpack(benchmark):
    flat = torch.ones(TOTAL, dtype=torch.uint8)
    outs = [torch.empty_like(t) for t in TENSORS]
    benchmark(unpack_tensors, flat, outs, OFFSETS)
