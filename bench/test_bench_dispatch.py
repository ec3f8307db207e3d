"""pytest-benchmark cases for the controller's dispatch path (run with ``make bench``).

In one process, without torch.distributed: the wire codec for a 1 MiB batch, the protocol plan
and row plan, and a no-op call through a one-rank controller (a worker thread behind a
socketpair, as rank 0's own worker runs).  ``bench/dispatch.py`` measures 4 ranks.
"""

import socket
import threading

import pytest
import torch

from hybridflow_comm import _C
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.controller import DP_PROTO, Batch, Controller, Worker, protocol, wire
from rlhf.controller.worker import WorkerRuntime

PAYLOAD = Batch({"x": torch.randn(256, 1024)})  # 1 MiB


class Echo(Worker):
    @protocol(DP_PROTO)
    def noop(self) -> None:
        return None

    @protocol(DP_PROTO)
    def echo(self, batch: Batch) -> Batch:
        return batch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as each torchrun rank has (OMP_NUM_THREADS=1): on 2 busy cores
    a 2-thread copy of 1 MiB can take 100x longer and would hide the dispatch cost."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_rank_group():
    a, b = socket.socketpair()
    runtime = WorkerRuntime(0, b, None, 60.0)
    thread = threading.Thread(target=runtime.serve, daemon=True)
    thread.start()
    ctl = Controller({0: a}, {})
    group = ctl.group(Echo, HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    yield group
    ctl.shutdown()
    thread.join(timeout=10)


def test_wire_roundtrip_1mib(benchmark):
    out = benchmark(lambda: wire.loads(wire.dumps(PAYLOAD)))
    assert out.equal(PAYLOAD)


def test_protocol_plan_and_rows(benchmark):
    def plan():
        _C.protocol_plan("3D_PROTO", 2, 4, 8, 1, 2)
        return _C.transfer_segments([13] * 8, 100, 37, 61)

    assert benchmark(plan)


def test_noop_call_one_rank(benchmark, one_rank_group):
    benchmark(one_rank_group.execute, Echo.noop)


def test_echo_1mib_one_rank(benchmark, one_rank_group):
    out = benchmark(one_rank_group.execute, Echo.echo, PAYLOAD)
    assert out.equal(PAYLOAD)
