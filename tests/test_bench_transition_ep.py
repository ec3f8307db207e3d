"""``bench/transition.py --shape ...-layers`` (bench/transition_ep.py) on its tiny shape: the
whole bench on 4 fresh ranks, bytes against the layout's formula; times are recorded, never
asserted."""

import json

from bench import transition
from bench.transition_ep import LAYOUTS, layer_specs, layers_that_fit
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.layout import HybridLayout, ParallelLayout


def test_bench_runs_both_layouts_at_the_formula(tmp_path):
    out = tmp_path / "ep.json"
    assert transition.main(["--shape", "tiny-moe-layers", "--layers", "2", "--repeat", "1",
                            "--bucket-mb", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    specs = layer_specs("tiny-moe-layers", 2)
    expert_bytes = sum(s.nbytes for s in specs if s.expert is not None)
    assert result["shape"]["layers"] == 2
    assert [r["config"]["ep"] for r in result["runs"]] == [4, 4]
    for run, (train, gen, ep, gen_ep) in zip(result["runs"], LAYOUTS):
        el = ExpertLayout(HybridLayout(ParallelLayout(*train), *gen), 8, ep, gen_ep)
        assert run["expert_bytes"] == expert_bytes
        assert run["received_bytes_per_rank"] == el.received_fraction() * expert_bytes
        assert run["bytes_vs_formula"] == 1.0
        assert run["dense_received_bytes"] == run["dense_minimum_bytes"]
        assert run["full_gather_bytes_per_rank"] == expert_bytes * 3 // 4
        assert run["raw_bytes_per_rank"] >= run["received_bytes_per_rank"]
        for key in ("time_s", "full_gather_time_s", "raw_time_s"):
            assert run[key] > 0
        assert run["redundant_bytes"] == 0  # every message straight from the training tensors


def test_layers_that_fit_grows_with_memory():
    one = sum(s.nbytes for s in layer_specs("qwen3-30b-a3b-layers", 1) if s.expert is not None)
    small, large = (layers_that_fit("qwen3-30b-a3b-layers", 4, m * one) for m in (32, 128))
    assert 1 <= small < large <= 48
    assert layers_that_fit("qwen3-30b-a3b-layers", 4, 10**15) == 48


def test_unknown_shape_is_refused(capsys):
    try:
        transition.main(["--shape", "no-such-moe"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "no-such-moe" in capsys.readouterr().err
