"""Smoke case of the kernels-vs-torch.compile bench (``make bench``; not part of ``make test``).

One whole run of ``bench/kernels_vs_compile.py --shape tiny --repeat 1``: every operation has
its row, every contender was checked against the eager reference before timing, and the ratios
and verdicts follow from the times; plus the check itself on a contender that is wrong.  Which
kernels are kept is for ``--shape small`` on a quiet machine (the bench reports it).
"""

import json

import pytest
import torch

pytest.importorskip("engine._kernels")

from bench import kernels_vs_compile as kvc  # noqa: E402

# (operation, kernel) rows, written out here rather than read from the bench
EXPECTED = [("train_rms_norm", "kernel"), ("train_swiglu", "kernel"), ("train_layer+bias", None),
            ("train_attention+bias", None), ("prefill+bias", None),
            ("decode_b1", "kernel_stage"), ("decode_b1", "kernel_layers"), ("decode_b1+bias", None),
            ("decode_b32", "kernel_stage"), ("decode_b32", "kernel_layers"),
            ("decode_b32+bias", None)]



def test_kernels_vs_compile_tiny(benchmark, tmp_path, keep_threads):
    path = tmp_path / "kvc.json"
    argv = ["--shape", "tiny", "--repeat", "1", "--threads", "2", "--json", str(path)]
    assert benchmark.pedantic(kvc.main, args=(argv,), rounds=1, iterations=1) == 0
    result = json.loads(path.read_text())
    assert result["shape"]["name"] == "tiny" and result["argv"] == argv
    assert result["threads"] == 2 and result["torch"] == torch.__version__
    rows = result["rows"]
    assert [(r["operation"], r["kernel"]) for r in rows] == EXPECTED
    compared = 0
    for r in rows:
        contenders = {"eager", "compiled"} | ({r["kernel"]} if r["kernel"] else set())
        assert set(r["max_rel_err"]) == contenders, r
        assert r["max_rel_err"]["eager"] == 0.0  # the reference against itself
        assert all(e <= result["tolerance"] for e in r["max_rel_err"].values()), r
        assert r["checked"] and r["correct"]
        compared += len(contenders)
        assert r["eager_ms"] > 0 and r["compiled_ms"] > 0 and r["compile_s"] > 0
        if r["kernel"] is None:
            assert r["verdict"] == "n/a" and r["kernel_ms"] is None
            continue
        ratio = r["compiled_ms"] / r["kernel_ms"]
        assert r["kernel_vs_compiled"] == pytest.approx(ratio)
        assert r["kernel_vs_eager"] == pytest.approx(r["eager_ms"] / r["kernel_ms"])
        assert r["verdict"] == ("keep" if ratio >= 1.3 else "delete")
        benchmark.extra_info[f"{r['operation']}/{r['kernel']}"] = ratio
    assert result["checks"] == {"ran": compared, "failed": []}


def test_wrong_contender_is_reported_not_timed_as_a_win():
    """The check before timing: a kernel off by more than the tolerance is ``WRONG``, however
    fast; one within rounding passes."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    want = torch.softmax(x, -1)

    def exact():
        return [torch.softmax(x, -1)]

    def rounded():
        return [want * (1 + 1e-6)]

    def wrong():
        return [want + 1e-3]

    fns = {"fast_wrong": wrong, "ok": rounded, "eager": exact, "compiled": exact}
    rows = kvc.measure("softmax", fns, 1, {"fast_wrong": "kernel", "ok": "kernel"})
    verdicts = {r["kernel"]: r for r in rows}
    assert verdicts["fast_wrong"]["verdict"] == "WRONG" and not verdicts["fast_wrong"]["correct"]
    assert verdicts["fast_wrong"]["max_rel_err"]["fast_wrong"] == pytest.approx(1e-3, rel=1e-3)
    assert verdicts["ok"]["correct"] and verdicts["ok"]["verdict"] in ("keep", "delete")
