"""Smoke case of the roofline bench (``make bench``; not part of ``make test``).

One whole run of ``bench/roofline.py --shape tiny --no-reshard``: checks that every figure is
there and every fraction of a limit is a plausible measurement, not the goals (those are for
``--shape small`` on a quiet machine, reported by the bench itself).  And the decode step's
formula on a stand-in engine and clock: every call's graph warm-ups and captures left out.
"""

import json
import types

import pytest

from bench import roofline, timing
from bench.shapes import get_shape

FRACTIONS = ("train_flops_fraction", "decode_b1_limit_fraction", "decode_b32_limit_fraction",
             "decode_limit_fraction")



def test_roofline_tiny(benchmark, tmp_path, keep_threads):
    path = tmp_path / "roofline.json"
    argv = ["--shape", "tiny", "--no-reshard", "--repeat", "2", "--device", "cpu",
            "--json", str(path)]
    assert benchmark.pedantic(roofline.main, args=(argv,), rounds=1, iterations=1) == 0
    result = json.loads(path.read_text())
    assert result["peak_matmul_flops"] > 0 and result["memcpy_bytes_per_s"] > 0
    assert result["reshard_vs_raw"] is None and result["reshard"] is None
    assert result["shape"]["name"] == "tiny" and result["argv"] == argv
    assert result["threads"] >= 1 and result["device"] == "cpu"
    for key in FRACTIONS:
        # a fraction of a FLOP limit cannot beat the measured matmul peak by much; one of a
        # bytes limit can: the tiny shape's weights (17 MB) fit in a 32 MB L3 and are read
        # faster than the memory's read rate the limit assumes (a fraction above 1).  The
        # bound only catches a unit error.
        b = key.removeprefix("decode_").removesuffix("_limit_fraction")
        bytes_bound = b in ("b1", "b32") and result["decode"][b]["bound"] == "bytes"
        assert 0 < result[key] <= (10 if bytes_bound else 1.5), (key, result[key])
        benchmark.extra_info[key] = result[key]
    assert result["decode_limit_fraction"] == min(result["decode_b1_limit_fraction"],
                                                  result["decode_b32_limit_fraction"])
    assert result["train"]["flops_per_step"] == roofline.train_flops(
        get_shape("tiny"), result["train"]["sequences"], result["train"]["seq"],
        result["train"]["head_from"])


class _Clock:
    """A stand-in for ``time.perf_counter``: advanced by hand."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_decode_step_leaves_each_calls_warm_ups_and_captures_out(monkeypatch):
    """A stand-in engine whose call of k tokens takes prefill + (k - 1) steps plus, for each
    key bucket its decode steps meet, a capture (2 eager warm-up steps and the recording):
    the measured step is the step, though only the N-token calls capture and the first,
    untimed call also compiles."""
    import engine.generation

    clock, shape = _Clock(), get_shape("tiny")
    prefill, step, capture, compile_s, key_step = 0.03, 0.002, 0.05, 4.0, 8

    class Engine:
        fused_decode, compile_decode, cuda_graphs, calls = False, True, True, 0

        def __init__(self, *args, **kwargs):
            pass

        def set_weights(self, params):
            pass

        def generate(self, ids, mask, sampling):
            k = sampling.max_new_tokens
            graphs = -(-(shape.prompt_len + k - 1) // key_step) - shape.prompt_len // key_step
            graphs = graphs if k > 1 else 0
            captures = graphs * (capture + 2 * step)
            Engine.calls += 1
            clock.now += prefill + (k - 1) * step + captures + compile_s * (Engine.calls == 1)
            return types.SimpleNamespace(stats={"capture_s": captures, "graphs_captured": graphs})

    monkeypatch.setattr(timing, "time", clock)
    model = types.SimpleNamespace(params={})
    monkeypatch.setattr(roofline, "_model", lambda shape, device: (None, None, model))
    monkeypatch.setattr(engine.generation, "GenerationEngine", Engine)
    out = roofline.measure_decode(shape, (1,), repeat=3, new_tokens=40)[1]
    assert out["graphs_captured"] >= 4 and out["step_from"] == "difference"
    assert out["step_s"] == pytest.approx(step, rel=1e-9)
    assert out["prefill_s"] == pytest.approx(prefill) and out["capture_s"] > 39 * step
    assert out["generate_s"] == pytest.approx(prefill + 39 * step)


def test_decode_step_time_formula():
    assert roofline.decode_step_time(0.5, 0.1, 5) == (0.1, "difference")
    assert roofline.decode_step_time(0.1, 0.12, 5) == (0.02, "whole call / N")  # noise
    with pytest.raises(ValueError, match="tokens=1"):
        roofline.decode_step_time(0.1, 0.1, 1)
