"""The prepared GPU check: its runner keeps every step's record whatever the others do, and its
CPU dry run (the same steps as on a GPU, shrunk) writes one JSON per step."""

import json
import os
import subprocess
import sys

import torch

from bench import gpu_check
from bench.gpu_check import KEYS, Step, run_steps

PY = sys.executable


def _records(out_dir):
    """The step records (``NN_name.json``) of a run's folder, in order."""
    names = sorted(n for n in os.listdir(out_dir) if n[:2].isdigit() and n[2] == "_")
    return names, [json.load(open(os.path.join(out_dir, n))) for n in names]


def test_a_failing_step_is_recorded_and_the_rest_still_run(tmp_path):
    steps = [Step("fails", [PY, "-c", "import sys; print('boom'); sys.exit(3)"], 30),
             Step("hangs", [PY, "-c", "import time; print('started', flush=True); "
                                      "time.sleep(60)"], 5),
             Step("skipped", [PY, "-c", "raise SystemExit(9)"], 30, skip="not here"),
             Step("figures", [PY, "-c", "print('{\"x\": 2}')"], 30,
                  gpu_check._last_json_line)]
    run_steps(steps, str(tmp_path), budget_s=60)
    names, recs = _records(tmp_path)
    assert names == ["00_fails.json", "01_hangs.json", "02_skipped.json", "03_figures.json"]
    assert all(set(r) == set(KEYS) for r in recs)
    fails, hangs, skipped, figures = recs
    assert fails["rc"] == 3 and "boom" in fails["tail"] and not fails["timed_out"]
    assert hangs["timed_out"] and hangs["rc"] == 124 and "started" in hangs["tail"]
    assert hangs["seconds"] < 30  # killed at its own limit, not the budget's
    assert skipped["rc"] is None and skipped["skipped"] == "not here"
    assert figures["rc"] == 0 and figures["figures"] == {"x": 2}


def test_steps_past_the_budget_are_recorded_as_skipped(tmp_path):
    run_steps([Step("late", [PY, "-c", "pass"], 30)], str(tmp_path), budget_s=0)
    _, (late,) = _records(tmp_path)
    assert late["rc"] is None and "budget" in late["skipped"]


def test_pytest_counts_and_held_out_parsers():
    out = "== 3 passed, 2 skipped, 1 failed, 9 deselected in 4.1s =="
    assert gpu_check._pytest_counts(out, 1) == {"passed": 3, "skipped": 2, "failed": 1,
                                                "deselected": 9}
    printed = "decode tokens/s at batch 128 (H100): eager 9000, graphs 30000"
    assert gpu_check._pytest_counts(f"PASSED x\n{printed}\n{out}", 0)["printed"] == [printed]
    line = "[main_job] held-out greedy accuracy: SFT 0.605 -> final 0.980 (+0.375); ..."
    assert gpu_check._held_out(line, 0) == {"sft_accuracy": 0.605, "final_accuracy": 0.98}


def test_bench_parser_keeps_the_headline_figures(tmp_path):
    path = tmp_path / "generation.json"
    parse = gpu_check._bench_json(str(path), ("ratio", "device", "sampled_ratio"))
    assert parse("", 1) == {}  # the bench wrote nothing
    path.write_text(json.dumps({"ratio": 2.5, "device": "cpu", "config": {"batch": 2}}))
    assert parse("", 0) == {"json": "generation.json", "ratio": 2.5, "device": "cpu"}


def test_gpu_bench_commands_are_the_gpu_shape_and_parse(tmp_path):
    """On a GPU the benches run Qwen2.5-0.5B's shape on CUDA (and generation and e2e also
    SmolLM2-135M's, before the main job), write into the output folder, and every option they
    get is one their parser takes."""
    from bench import e2e, generation, roofline

    parsers = {"generation": generation.parse_args, "roofline": roofline.parse_args,
               "e2e": e2e.parse_args}
    steps = {s.name: s for s in gpu_check.plan("cuda", False, str(tmp_path / "scratch"),
                                              str(tmp_path / "out"))}
    for name, parse in parsers.items():
        argv = steps[f"bench_{name}"].argv
        assert argv[1:3] == ["-m", f"bench.{name}"]
        a = parse(argv[3:])
        assert (a.device, a.shape) == ("cuda", "qwen2.5-0.5b")
        assert a.json == str(tmp_path / "out" / f"{name}.json")
    quick = {s.name: s for s in gpu_check.plan("cpu", True, str(tmp_path))}
    for name, parse in parsers.items():
        a = parse(quick[f"bench_{name}"].argv[3:])
        assert (a.device, a.shape) == ("cpu", "tiny")
    # the real checkpoint's rows: the same two benches at its shape on a GPU, skipped --quick
    for name in ("generation", "e2e"):
        step = steps[f"bench_{name}_smollm2"]
        assert step.argv[1:3] == ["-m", f"bench.{name}"] and step.skip is None
        a = parsers[name](step.argv[3:])
        assert (a.device, a.shape) == ("cuda", "smollm2-135m")
        assert a.json == str(tmp_path / "out" / f"{name}_smollm2.json")
        assert quick[f"bench_{name}_smollm2"].skip == gpu_check.QUICK_SKIP
    names = list(steps)
    assert names.index("bench_e2e_smollm2") < names.index("main_job") == len(names) - 1


def test_cpu_dry_run_writes_one_json_per_step(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.gpu_check", "--device", "cpu", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=900, cwd=gpu_check.ROOT)
    names, recs = _records(tmp_path)
    want = [s.name for s in gpu_check.plan("cpu", True, str(tmp_path))]
    assert names == [f"{i:02d}_{n}.json" for i, n in enumerate(want)], proc.stdout[-2000:]
    assert all(set(r) == set(KEYS) for r in recs)
    env = recs[0]
    assert env["rc"] == 0 and env["figures"]["torch"] == torch.__version__
    assert env["figures"]["cuda_available"] == torch.cuda.is_available()
    by_name = {r["name"]: r for r in recs}
    assert by_name["build"]["rc"] == 0, by_name["build"]["tail"]
    assert by_name["pytest_gpu"]["rc"] == 0, by_name["pytest_gpu"]["tail"]
    assert by_name["main_job"]["rc"] == 0, by_name["main_job"]["tail"]
    counts = by_name["pytest_gpu"]["figures"]
    assert counts.get("skipped", 0) + counts.get("passed", 0) >= 1
    # the benches ran on CPU and their figures reached the step records
    for name, keys in (("generation", ("ratio", "ours_tokens_per_s", "greedy_match",
                                       "sampled_ratio")),
                       ("roofline", ("train_flops_fraction", "decode_limit_fraction")),
                       ("e2e", ("ratio", "ours_tokens_per_s", "trl_tokens_per_s"))):
        rec = by_name[f"bench_{name}"]
        assert rec["rc"] == 0 and rec["skipped"] is None, rec["tail"]
        figures = rec["figures"]
        assert figures["device"] == "cpu" and figures["json"] == f"{name}.json"
        bench = json.load(open(tmp_path / f"{name}.json"))
        assert {k: bench[k] for k in keys} == {k: figures[k] for k in keys}
        assert all(figures[k] > 0 for k in keys if not isinstance(figures[k], bool))
    for name in ("bench_generation_smollm2", "bench_e2e_smollm2"):  # GPU rows only
        assert by_name[name]["skipped"] == gpu_check.QUICK_SKIP and by_name[name]["rc"] is None


def test_pack_keeps_the_folder_under_its_path_from_the_root(tmp_path, monkeypatch):
    import tarfile
    root, ret = tmp_path / "repo", tmp_path / "out"
    run_dir = root / "bench" / "results" / "gpu" / "d-gpu"
    run_dir.mkdir(parents=True)
    ret.mkdir()
    (run_dir / "00_env.json").write_text("{}")
    monkeypatch.setattr(gpu_check, "ROOT", str(root))
    with tarfile.open(gpu_check.pack(str(run_dir), str(ret))) as tar:
        assert "bench/results/gpu/d-gpu/00_env.json" in tar.getnames()
    elsewhere = tmp_path / "scratch"
    elsewhere.mkdir()
    (elsewhere / "01_build.json").write_text("{}")
    with tarfile.open(gpu_check.pack(str(elsewhere), str(ret))) as tar:
        assert "scratch/01_build.json" in tar.getnames()
