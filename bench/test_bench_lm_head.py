"""bench/lm_head.py: a smoke run at ``tiny`` (``make bench``): both sides give the same loss and
gradients and every figure is there.  No timing or memory is asserted."""

import json

from bench import lm_head


def test_lm_head_bench_sides_agree(tmp_path):
    path = tmp_path / "lm_head.json"
    assert lm_head.main(["--shape", "tiny", "--tokens", "16", "--repeat", "1",
                         "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["loss_rel_diff"] < 1e-5 and r["grad_w_norm_rel_diff"] < 1e-4
    for side in lm_head.SIDES:
        assert r[side]["time_s"] > 0 and "peak_extra_bytes" in r[side]
    assert r["memory_ratio"] > 0 and r["time_ratio"] > 0
