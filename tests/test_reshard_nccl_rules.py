"""The resharding suite again, under NCCL's rules (hybridflow_comm/nccl_rules.py in every rank), and the
expert-parallel layer's all-to-alls.

Every multi-rank resharding test (the transitions of every layout and method, WeightSync,
FSDP2, DTensor, megatron, plain state dicts, the public entries) runs here with its own
assertions, on one 4-rank and one 2-rank pool whose ranks enforce the rules, so the
collectives NCCL would run (in-place region all-gathers, no host point-to-point path) are the
ones checked bit-exactly.  The examples run under ``torchrun -m hybridflow_comm.nccl_rules`` in
tests/test_examples_reshard.py.
``HYBRIDFLOW_TEST_NCCL_RULES=1 pytest ...`` runs any other multi-rank module the same way.
"""

import pytest

from tests import test_api as api
from tests import test_expert_parallel as expert_parallel
from tests import test_expert_reshard_multirank as experts
from tests import test_interop_fsdp as fsdp
from tests import test_interop_megatron as megatron
from tests import test_interop_megatron_moe as megatron_moe
from tests import test_interop_state as state
from tests import test_reshard_multirank as reshard
from tests import test_weight_sync as sync
from tests.multirank import RankPool

CHECKS = [(4, check) for check in (
    reshard.test_reshard_bit_exact_and_paper_bytes,
    reshard.test_all_gather_views_in_place,
    reshard.test_verify_names_corrupted_parameter_everywhere,
    experts.test_expert_transitions_bit_exact_at_the_formula,
    expert_parallel.compare_layer_cases,
    sync.test_weight_sync_bit_exact_2_plus_2,
    sync.test_verify_catches_corruption_and_stale_shards,
    fsdp.test_fsdp_state_dicts_reshard_bit_exact_with_minimum_bytes,
    megatron.test_megatron_linear_reshard_and_generation_forward,
    megatron_moe.test_megatron_mixture_of_experts_reshards_bit_exact,
    state.test_dtensor_state_dict_reshards_bit_exact,
    state.test_plain_state_dict_reshards_bit_exact,
)] + [(2, check) for check in (
    api.test_state_dict_entry_reshards_bit_exact_with_minimum_bytes,
    api.test_dtensor_entry,
    api.test_megatron_entry_copies_or_binds,
)]


def _rules_calls(rank, world):
    """Checked calls so far on this rank (raises when the rules are not installed)."""
    from hybridflow_comm import nccl_rules

    return nccl_rules.installed().calls


@pytest.fixture(scope="module")
def rules_pools():
    """A 2-rank and a 4-rank pool with the rules installed (each started on first use)."""
    pools = {n: RankPool(n, nccl_rules=True) for n in (2, 4)}
    try:
        yield pools
    finally:
        for pool in pools.values():
            pool.close()


@pytest.mark.parametrize("ranks,check", CHECKS,
                         ids=[f"{f.__module__[6:]}.{f.__name__}" for _, f in CHECKS])
def test_under_nccl_rules(rules_pools, ranks, check):
    pool = rules_pools[ranks]
    before = pool.run(_rules_calls)
    check(pool)
    after = pool.run(_rules_calls)
    assert all(a > b for a, b in zip(after, before)), (before, after)

