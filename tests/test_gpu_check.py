"""The prepared GPU check: its runner keeps every step's record whatever the others do, and its
CPU dry run (the same steps as on a GPU, shrunk) writes one JSON per step."""

import json
import os
import subprocess
import sys

import torch

from bench import gpu_check, gpu_plan
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


def test_a_step_with_less_than_its_minimum_left_is_skipped_not_failed(tmp_path, monkeypatch):
    """The second step needs 20 s and 10 s are left: recorded as skipped (rc None, not a
    failure of the check); the third, which needs 1 s, runs within what is left."""
    steps = [Step("first", [PY, "-c", "pass"], 30),
             Step("starved", [PY, "-c", "raise SystemExit(1)"], 30, min_s=20),
             Step("fits", [PY, "-c", "pass"], 30, min_s=1)]
    limits, real_run = [], gpu_check._run

    def run(argv, limit, env):
        limits.append(limit)
        return real_run(argv, limit, env)

    monkeypatch.setattr(gpu_check, "_run", run)
    run_steps(steps, str(tmp_path), budget_s=10)
    _, (first, starved, fits) = _records(tmp_path)
    assert first["rc"] == 0 and fits["rc"] == 0 and fits["skipped"] is None
    assert starved["rc"] is None and "minimum of 20 s" in starved["skipped"]
    assert len(limits) == 2 and all(limit <= 10 for limit in limits)


def test_pytest_cut_at_its_limit_keeps_the_counts_of_the_tests_it_ran(tmp_path):
    """At its limit the step's process group gets SIGINT first: pytest writes its junit XML
    with the tests done so far, and the counts come from there."""
    (tmp_path / "test_cut.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\n"
        "def test_hangs():\n    time.sleep(120)\n")
    xml = str(tmp_path / "report.xml")
    step = Step("pytest", [PY, "-m", "pytest", "-p", "no:cacheprovider", "-c", os.devnull,
                           f"--junitxml={xml}", str(tmp_path / "test_cut.py")], 12,
                gpu_check._pytest_results(xml))
    out_dir = tmp_path / "out"
    run_steps([step], str(out_dir), budget_s=60)
    _, (rec,) = _records(out_dir)
    assert rec["timed_out"] and rec["rc"] == 124 and rec["seconds"] < 30
    assert rec["figures"] == {"passed": 1, "failed": 0, "errors": 0, "skipped": 0,
                              "interrupted": 1, "counts_from": "junit"}, rec["tail"]


def test_junit_counts_and_the_summary_line_when_there_is_none(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase name="a"/><testcase name="b"><failure message="x"/></testcase>'
                   '<testcase name="c"><skipped/></testcase><testcase name="d"><error/>'
                   '</testcase><testcase name="e"/></testsuite></testsuites>')
    parse = gpu_check._pytest_results(str(xml))
    out = "decode tokens/s at batch 1: 10\n== 2 passed, 1 failed, 4 deselected in 1s =="
    assert parse(out, 1) == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1,
                             "deselected": 4, "printed": ["decode tokens/s at batch 1: 10"],
                             "counts_from": "junit"}
    missing = gpu_check._pytest_results(str(tmp_path / "none.xml"))
    assert missing(out, 1) == gpu_check._pytest_counts(out, 1) | {"counts_from": "summary"}


def test_the_gpu_main_job_needs_the_carried_warm_start_in_bf16(tmp_path, monkeypatch):
    from rlhf import main_job

    assert gpu_check.WARM_START == (main_job.SFT_BASE_DIR, main_job.SFT_DIR)
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    assert "make gpu-sft-cache" in gpu_check.warm_start_missing("bf16")
    # without it: the RL job alone, and its figures say why
    step = {s.name: s for s in gpu_check.plan("cuda", False, str(tmp_path / "s"))}["main_job"]
    assert step.skip is None and "rlhf.train" in step.argv and "device=cuda" in step.argv
    assert "make gpu-sft-cache" in step.parse("", 0)["no_warm_start"]
    for folder, dtype in zip(gpu_check.WARM_START, ("bfloat16", "float32")):
        os.makedirs(tmp_path / folder)
        (tmp_path / folder / "sft_meta.json").write_text(
            json.dumps({"settings": {"model": {"dtype": dtype}}}))
    assert gpu_check.WARM_START[1] in gpu_check.warm_start_missing("bf16")
    (tmp_path / gpu_check.WARM_START[1] / "sft_meta.json").write_text(
        json.dumps({"settings": {"model": {"dtype": "bfloat16"}}}))
    assert gpu_check.warm_start_missing("bf16") is None
    steps = {s.name: s for s in gpu_check.plan("cuda", False, str(tmp_path / "scratch"))}
    assert steps["main_job"].argv[1:3] == ["-m", "rlhf.main_job"]
    assert f"iterations={gpu_check.MAIN_JOB_ITERATIONS}" in steps["main_job"].argv
    line = "[main_job] held-out greedy accuracy: SFT 0.605 -> final 0.980 (+0.375)"
    assert steps["main_job"].parse(line, 0) == {"sft_accuracy": 0.605, "final_accuracy": 0.98}
    assert steps["build"].env["HYBRIDFLOW_CPU_KERNELS"] == "0"


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
    # the plan's order: the GPU tests, then the main job, then the benches
    names = list(steps)
    assert names == list(gpu_plan.STEP_TIMES)
    assert names.index("pytest_gpu") < names.index("main_job") < names.index("bench_generation")


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
    # every step saw the GPU image's packages and the carried wheels alone
    packages = env["figures"]["packages"]
    assert packages["tensorboard"] is None and packages["omegaconf"] is not None
    by_name = {r["name"]: r for r in recs}
    assert by_name["build"]["rc"] == 0, by_name["build"]["tail"]
    assert by_name["pytest_gpu"]["rc"] == 0, by_name["pytest_gpu"]["tail"]
    assert by_name["main_job"]["rc"] == 0, by_name["main_job"]["tail"]
    assert "no TensorBoard event files" in by_name["main_job"]["tail"]  # the ranks' too
    counts = by_name["pytest_gpu"]["figures"]
    assert counts["counts_from"] == "junit"
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
