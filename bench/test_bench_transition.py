"""pytest-benchmark cases for the transition (``make bench``; not part of ``make test``).

Each case starts its own 4 ranks and reports every method's median time and the ratios in
``extra_info``; the benchmarked call is one whole run of ``bench/transition.py``.  Byte counts
are checked against the paper's formula (Table 2); times are reported, never asserted.
"""

import pytest

from bench import transition_ep, transition_fsdp
from bench.transition import llama_like_specs, run

CASES = [((1, 4, 1), (1, 2)), ((1, 2, 2), (1, 1)), ((2, 2, 1), (1, 1))]


def _report(benchmark, result):
    for name, m in result["methods"].items():
        benchmark.extra_info[f"{name}_time_s"] = m["time_s"]
        benchmark.extra_info[f"{name}_ratio_vs_ds_chat"] = m["ratio_vs_ds_chat"]
        # Replicated norms count in the formula's model bytes but are not moved: within 0.1%.
        assert abs(m["volume_vs_formula"] - 1) < 1e-3, (name, m["volume_vs_formula"])
    for key in ("ratio_vs_ds_chat", "ratio_vs_raw", "ratio_vs_raw_p2p", "volume_vs_formula",
                "raw_allgather_time_s", "raw_p2p_time_s"):
        benchmark.extra_info[key] = result[key]
    benchmark.extra_info["skipped"] = result["skipped"]


@pytest.mark.parametrize("train, gen", CASES, ids=lambda c: ",".join(map(str, c)))
def test_transition(benchmark, train, gen):
    result = benchmark.pedantic(run, args=(4, train, gen, 64.0, 3), rounds=1, iterations=1)
    _report(benchmark, result)


@pytest.mark.slow
@pytest.mark.parametrize("train, gen", [((1, 4, 1), (1, 2)), ((2, 2, 1), (1, 1))],
                         ids=lambda c: ",".join(map(str, c)))
def test_transition_llama_1b(benchmark, train, gen):
    """Llama-3.2-1B's weights (2.5 GB bf16) on 4 ranks; a baseline that would not fit in the
    memory available is skipped and named in ``skipped``."""
    result = benchmark.pedantic(run, args=(4, train, gen, 0.0, 3),
                                kwargs=dict(shape="llama-1b"), rounds=1, iterations=1)
    assert result["shape"]["name"] == "llama-1b" and result["shape"]["params"] > 1.2e9
    _report(benchmark, result)


@pytest.mark.parametrize("gen", [(1, 2), (2, 2)], ids=lambda g: ",".join(map(str, g)))
def test_transition_fsdp(benchmark, gen):
    """``--source fsdp``: an FSDP2 model on 4 ranks against the full state-dict gather."""
    specs = llama_like_specs(32.0, gen[0])
    result = benchmark.pedantic(transition_fsdp.run, args=(4, gen, specs, 32.0, 3), rounds=1,
                                iterations=1)
    for key in ("ratio_vs_full_gather", "ratio_vs_raw", "bytes_vs_minimum"):
        benchmark.extra_info[key] = result[key]
    assert result["bytes_vs_minimum"] == 1.0


@pytest.mark.slow
def test_transition_qwen3_moe_layers(benchmark):
    """Qwen3-30B-A3B's layers (as many as fit) on 4 ranks: EP 4 -> gen EP 2 and -> gen TP 2."""
    result = benchmark.pedantic(transition_ep.run, args=("qwen3-30b-a3b-layers",),
                                kwargs=dict(repeat=3), rounds=1, iterations=1)
    benchmark.extra_info["layers"] = result["shape"]["layers"]
    for r in result["runs"]:
        c = r["config"]
        key = f"ep{c['ep']}_to_{'ep' if c['gen_ep'] > 1 else 'tp'}{max(c['gen_ep'], c['gen'][1])}"
        for name in ("ratio_vs_full_gather", "ratio_vs_raw", "redundant_bytes"):
            benchmark.extra_info[f"{key}_{name}"] = r[name]
        assert r["bytes_vs_formula"] == 1.0
