"""Smoke case of the roofline bench (``make bench``; not part of ``make test``).

One whole run of ``bench/roofline.py --shape tiny --no-reshard``: checks that every figure is
there and every fraction of a limit is a plausible measurement, not the goals (those are for
``--shape small`` on a quiet machine, reported by the bench itself).
"""

import json

from bench import roofline
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
