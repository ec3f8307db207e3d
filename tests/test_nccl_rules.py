"""hybridflow_comm/nccl_rules.py refuses what NCCL refuses: each rule fed its violation.

Single-process checks run in a gloo world of one (the rule raises before the real call); the
cross-rank comparison and the warm-up run on two ranks of a pool with the rules installed.
"""

import datetime

import pytest
import torch
import torch.distributed as dist

from hybridflow_comm import nccl_rules
from tests.multirank import RankPool
from hybridflow_comm.nccl_rules import NcclRuleError


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """A gloo world of one in this process, with the rules installed (both undone after)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl_rules") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    rules = nccl_rules.install("cpu")
    try:
        yield rules
    finally:
        nccl_rules.uninstall()
        dist.destroy_process_group()


def _strided():
    return torch.zeros(4, 4).t()[0]  # stride 4


REFUSED = {
    "non-contiguous all_reduce": (lambda: dist.all_reduce(_strided()), "non-contiguous"),
    "non-contiguous all_gather input": (
        lambda: dist.all_gather([torch.zeros(4)], _strided()), "non-contiguous"),
    "meta tensor in a cpu group": (
        lambda: dist.broadcast(torch.zeros(3, device="meta"), 0), "on meta"),
    "mixed dtypes": (lambda: dist.all_gather_single(torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
                     "mixed dtypes"),
    "output != world x input": (
        lambda: dist.all_gather_single(torch.zeros(3), torch.zeros(2)), "world x input"),
    "deprecated name, same rule": (
        lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(2)), "world x input"),
    "reduce_scatter input != world x output": (
        lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.zeros(3)), "world x output"),
    "uneven all_gather parts": (
        lambda: dist.all_gather([torch.zeros(3)], torch.zeros(2)), "equal parts"),
    "all_to_all_single of unequal sizes": (
        lambda: dist.all_to_all_single(torch.zeros(3), torch.zeros(2)), "elements"),
    "gloo-only monitored_barrier": (lambda: dist.monitored_barrier(), "no monitored_barrier"),
    "all_gather_coalesced": (
        lambda: dist.all_gather_coalesced([[torch.zeros(1)]], [torch.zeros(1)]), "gloo only"),
    "tag": (lambda: dist.isend(torch.zeros(2), 0, tag=3), "tag=3"),
    "tag in a batch": (lambda: dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.zeros(2), 0, tag=1)]), "tag=1"),
    "recv from any source": (lambda: dist.recv(torch.zeros(2)), "any source"),
    "strided p2p": (lambda: dist.send(_strided(), 0), "non-contiguous"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_rule_refuses(world1, case):
    call, words = REFUSED[case]
    with pytest.raises(NcclRuleError, match=words):
        call()


def test_p2p_before_any_collective_is_refused(world1):
    group = dist.new_group([0])
    with pytest.raises(NcclRuleError, match="warm-up"):
        dist.isend(torch.zeros(2), 0, group=group)
    dist.all_reduce(torch.zeros(1), group=group)  # the warm-up
    assert nccl_rules._key(group) in world1.warm


def test_legal_calls_pass_and_are_counted(world1):
    before = world1.calls
    out = torch.zeros(4)
    out[:2] = torch.tensor([1.0, 2.0])
    dist.all_gather_single(out[:2], out[:2].clone())
    dist.all_reduce(torch.ones(3))
    dist.broadcast(torch.ones(2), 0)
    assert world1.calls - before == 3
    assert out[:2].tolist() == [1.0, 2.0]


def test_device_is_declared_not_guessed():
    rules = nccl_rules.Rules("cuda:1", cross_check=False)
    with pytest.raises(NcclRuleError, match="on cpu in a group for cuda:1"):
        rules.tensors("all_reduce", [torch.zeros(1)])
    with pytest.raises(NcclRuleError, match="not a tensor"):
        rules.tensors("all_reduce", [[1.0]])


def test_uninstall_restores_torch():
    original = getattr(dist.all_reduce, "nccl_rules_original", dist.all_reduce)
    nccl_rules.install("cpu")
    assert dist.all_reduce is not original and dist.isend is dist.distributed_c10d.isend
    nccl_rules.uninstall()
    assert dist.all_reduce is original and dist.isend is dist.distributed_c10d.isend


def _two_rank_rules(rank, world):
    """A mismatched collective pair and a p2p before warm-up, under the installed rules."""
    seen = []
    big = 4 if rank == 0 else 2  # uneven per-rank sizes
    try:
        dist.all_reduce(torch.zeros(big))
    except NcclRuleError as exc:
        seen.append(str(exc))
    group = dist.new_group([0, 1])
    try:
        dist.batch_isend_irecv([dist.P2POp(dist.isend if rank == 0 else dist.irecv,
                                           torch.zeros(2), 1 - rank, group)])
    except NcclRuleError as exc:
        seen.append(str(exc))
    dist.barrier(group=group)  # warm: now p2p is accepted, matched by order with tag 0
    got = torch.zeros(3)
    sends = [torch.full((3,), 10.0 * rank + k) for k in range(2)]
    ops = [dist.P2POp(dist.isend, t, 1 - rank, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, got if k == 1 else torch.zeros(3), 1 - rank, group)
            for k in range(2)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return seen, got.tolist()


def test_cross_rank_rules_on_two_ranks():
    pool = RankPool(2, timeout_s=120, nccl_rules=True)
    try:
        results = pool.run(_two_rank_rules)
    finally:
        pool.close()
    for rank, (seen, got) in enumerate(results):
        assert len(seen) == 2, seen
        assert "disagree" in seen[0] and "all_reduce" in seen[0]
        assert "warm-up" in seen[1]
        assert got == [10.0 * (1 - rank) + 1] * 3
