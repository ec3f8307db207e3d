"""Metrics writer: jsonl records, TensorBoard events, resume truncation, phase timer, plot."""

import json
import os
import time

import pytest
import torch

from hybridflow_comm import cuda_vmm
from rlhf.metrics import (MetricsLogger, PhaseTimer, memory_metrics, memory_sample, peak_rss_gb,
                          plot_metrics, read_metrics)


def test_phase_timer_accumulates():
    timer = PhaseTimer()
    with timer("gen"):
        time.sleep(0.01)
    with timer("gen"):
        time.sleep(0.01)
    with timer("adv"):
        pass
    m = timer.metrics()
    assert set(m) == {"timing_s/gen", "timing_s/adv"} and m["timing_s/gen"] >= 0.02
    with pytest.raises(RuntimeError):
        with timer("update_actor"):
            raise RuntimeError("boom")
    assert "timing_s/update_actor" in timer.metrics()       # timed even when it raises
    timer.reset()
    assert timer.metrics() == {}
    with pytest.raises(ValueError, match="phase='a/b'"):
        with timer("a/b"):
            pass


def test_peak_rss_is_plausible():
    x = torch.ones(64 * 2**20 // 4)                          # touch 64 MiB
    assert 64 / 1024 < peak_rss_gb() < 24
    del x


def test_cuda_memory_sample_counts_the_mapped_virtual_memory(monkeypatch):
    """torch.cuda.memory_allocated does not see the flat buffers' cuMemCreate mappings; the
    sample's vmm_mapped does (cuda_vmm's tally of map/unmap; the driver calls stubbed here,
    tests/test_gpu_memory.py reads it on a device)."""
    monkeypatch.setattr(cuda_vmm, "_call", lambda *args: None)
    monkeypatch.setattr(cuda_vmm, "_contexts", {})  # no stub context left for a real driver
    monkeypatch.setattr(cuda_vmm, "granularity", lambda device: 2 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 9)
    start = cuda_vmm.mapped_bytes(0)
    r = cuda_vmm.Reservation(8 << 20, 0)
    r.map(0, 4 << 20)
    r.map(4 << 20, 6 << 20)
    r.map(0, 4 << 20)  # already mapped: counted once
    sample = memory_sample(torch.device("cuda", 0))
    assert sample == {"allocated": 7, "peak_allocated": 9, "vmm_mapped": start + (6 << 20)}
    assert memory_metrics({"update": sample})["memory/update/vmm_mapped_gb"] == \
        sample["vmm_mapped"] / 2**30
    r.unmap(0, 4 << 20)
    assert cuda_vmm.mapped_bytes(0) == start + (2 << 20) and cuda_vmm.mapped_bytes(1) == 0
    r.close()
    assert cuda_vmm.mapped_bytes(0) == start


def _iteration(step):
    return {"reward/mean": 0.1 * step, "reward/exact/mean": 0.05 * step,
            "timing_s/gen": 1.0, "timing_s/update_actor": torch.tensor(0.5),
            "timing_s/step": 1.5, "perf/throughput_tokens_per_s": 100.0 + step,
            "actor/pg_loss": -0.1}


def test_logger_writes_jsonl_tensorboard_plot_and_resumes(tmp_path):
    run = str(tmp_path / "runs" / "t")
    log = MetricsLogger(run, total_steps=4, tensorboard=True, progress=True)
    for step in range(4):
        rec = log.log(step, _iteration(step))
        assert rec["timing_s/update_actor"] == 0.5 and rec["memory/peak_rss_gb"] > 0
    png = log.close()
    records = read_metrics(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["reward/mean"] == pytest.approx(0.2)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run))
    assert png == os.path.join(run, "metrics.png") and os.path.getsize(png) > 1000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # a kill after step 3 was logged, then resume from the checkpoint of step 2:
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "rew')                           # torn line
    log = MetricsLogger(run, total_steps=4, start_step=2, tensorboard=False, progress=False)
    log.log(2, _iteration(2))
    log.close(plot=False)
    assert [r["step"] for r in read_metrics(os.path.join(run, "metrics.jsonl"))] == [0, 1, 2]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run)
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1, 2, 3]
    assert acc.Scalars("perf/throughput_tokens_per_s")[3].value == 103.0


def test_logger_rejects_non_scalars(tmp_path):
    with MetricsLogger(str(tmp_path), tensorboard=False, progress=False) as log:
        with pytest.raises(ValueError, match="'actor/x'"):
            log.log(0, {"actor/x": [1, 2]})


def test_plot_of_empty_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n")
    assert os.path.isfile(plot_metrics(str(path), str(tmp_path / "p.png")))


def test_without_tensorboard_and_matplotlib_the_jsonl_is_written_and_a_line_says_so(
        tmp_path, monkeypatch, capsys):
    """The GPU image has neither package (bench/gpu_image.py): no event files, no PNG, one
    line each on stderr, the records as always."""
    import sys

    for name in ("torch.utils.tensorboard", "tensorboard", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ModuleNotFoundError
    run = str(tmp_path / "run")
    log = MetricsLogger(run, total_steps=1, tensorboard=True, progress=False)
    log.log(0, {"reward/mean": 0.5})
    assert log.close(plot=True) is None
    assert [r["step"] for r in read_metrics(os.path.join(run, "metrics.jsonl"))] == [0]
    assert os.listdir(run) == ["metrics.jsonl"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert "no TensorBoard event files" in err[0] and "is not installed" in err[0]
    assert "no metrics.png" in err[1] and "matplotlib is not installed" in err[1]
