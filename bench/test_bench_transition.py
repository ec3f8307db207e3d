"""pytest-benchmark cases for the transition (``make bench``; not part of ``make test``).

Each case starts its own 4 ranks and reports every method's median time and the ratios in
``extra_info``; the benchmarked call is one whole run of ``bench/transition.py``.
"""

import pytest

from bench import transition_fsdp
from bench.transition import llama_like_specs, run

CASES = [((1, 4, 1), (1, 2)), ((1, 2, 2), (1, 1)), ((2, 2, 1), (1, 1))]


@pytest.mark.parametrize("train, gen", CASES, ids=lambda c: ",".join(map(str, c)))
def test_transition(benchmark, train, gen):
    result = benchmark.pedantic(run, args=(4, train, gen, 64.0, 3), rounds=1, iterations=1)
    for name, m in result["methods"].items():
        benchmark.extra_info[f"{name}_time_s"] = m["time_s"]
        benchmark.extra_info[f"{name}_ratio_vs_ds_chat"] = m["ratio_vs_ds_chat"]
        assert m["comm_bytes_per_rank"] > 0
    benchmark.extra_info["raw_allgather_time_s"] = result["raw_allgather_time_s"]


@pytest.mark.parametrize("gen", [(1, 2), (2, 2)], ids=lambda g: ",".join(map(str, g)))
def test_transition_fsdp(benchmark, gen):
    """``--source fsdp``: an FSDP2 model on 4 ranks against the full state-dict gather."""
    specs = llama_like_specs(32.0, gen[0])
    result = benchmark.pedantic(transition_fsdp.run, args=(4, gen, specs, 32.0, 3), rounds=1,
                                iterations=1)
    for key in ("ratio_vs_full_gather", "ratio_vs_raw", "bytes_vs_minimum"):
        benchmark.extra_info[key] = result[key]
    assert result["bytes_vs_minimum"] == 1.0
