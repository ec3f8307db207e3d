"""Per-iteration metrics: ``runs/<name>/metrics.jsonl``, TensorBoard events beside it, a
progress bar with reward and tokens/s, and a PNG of the reward curve and per-phase timing
(the events and the PNG where ``tensorboard`` and ``matplotlib`` are installed; without one,
a line on stderr says what is not written).

One line of metrics.jsonl per iteration::

    {"step": 3, "reward/mean": 0.41, "timing_s/gen": 1.2, ..., "memory/peak_rss_gb": 0.9}

Memory per phase (:func:`memory_metrics`): every call of a phase (generation, the forward-only
log-prob/value/score passes, the update) reports its rank's device memory when it ends, the
largest over ranks and calls of the iteration is logged::

    CUDA  memory/<phase>/allocated_gb        torch.cuda.memory_allocated after the call
          memory/<phase>/peak_allocated_gb   torch.cuda.max_memory_allocated, reset before it
          memory/<phase>/vmm_mapped_gb       CUDA virtual memory mapped after the call (the flat
                                             weight buffers, hybridflow_comm.cuda_vmm: outside
                                             torch's allocator, so in neither reading above;
                                             their generation-only slots' release shows here)
    CPU   memory/<phase>/rss_gb              the process's resident memory after the call

Resume: a logger opened with ``start_step=k`` keeps only the lines with ``step < k`` (lines of
iterations that ran after the checkpoint are dropped), and TensorBoard purges events from
step ``k`` on, so a resumed run's files equal those of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from hybridflow_comm import cuda_vmm

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


def peak_rss_gb() -> float:
    """Peak resident set size of this process in GiB (``ru_maxrss``: KiB on Linux, bytes on
    macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def resident_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc/self/statm``; elsewhere the peak,
    ``ru_maxrss``)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return int(peak_rss_gb() * 2**30)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak of ``device``'s allocator (CUDA; nothing to reset on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_sample(device: torch.device) -> dict[str, int]:
    """Memory readings of ``device`` in bytes: on CUDA what the allocator holds for tensors
    now, its peak since :func:`reset_peak_memory`, and what the process has mapped through
    CUDA virtual memory (not the allocator's); on CPU the process's resident memory (which
    includes the flat buffers' pages)."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return {"allocated": torch.cuda.memory_allocated(device),
                "peak_allocated": torch.cuda.max_memory_allocated(device),
                "vmm_mapped": cuda_vmm.mapped_bytes(index)}
    return {"rss": resident_bytes()}


def memory_metrics(per_phase: dict[str, dict[str, int]]) -> dict[str, float]:
    """``memory/<phase>/<reading>_gb`` of phase -> reading -> bytes
    (:meth:`rlhf.controller.Controller.take_memory`)."""
    return {f"memory/{phase}/{key}_gb": value / 2**30
            for phase, readings in sorted(per_phase.items())
            for key, value in sorted(readings.items())}


def detached(metrics: dict[str, Any]) -> dict[str, Any]:
    """One micro-batch's metrics with their tensors cut from the autograd graph (so that
    keeping them until :func:`host_records` keeps no activations alive)."""
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def host_records(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per-micro-batch metric records as floats, their tensor values read to the host in one
    transfer: the one host synchronisation of a worker's metrics per call, after its last
    step is queued (plain numbers pass through)."""
    keys = [(i, k) for i, r in enumerate(records) for k, v in r.items()
            if isinstance(v, torch.Tensor)]
    out = [{k: float(v) for k, v in r.items() if not isinstance(v, torch.Tensor)}
           for r in records]
    if keys:
        values = torch.stack([records[i][k].detach().reshape(()).float() for i, k in keys])
        for (i, k), v in zip(keys, values.tolist()):
            out[i][k] = v
    return out


class PhaseTimer:
    """Wall time per phase of an iteration; a phase entered twice accumulates.

    ::

        timer = PhaseTimer()
        with timer("gen"):
            ...
        timer.metrics()   # {"timing_s/gen": 1.23}
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not phase or "/" in phase:
            raise ValueError(f"phase={phase!r} must be a non-empty name without '/'")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.times.items()}

    def reset(self) -> None:
        self.times.clear()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a torn last line, from a kill, is skipped)."""
    out = []
    if not os.path.isfile(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class MetricsLogger:
    """Writes one record per iteration to jsonl (+ TensorBoard, + progress bar).

    Args:
        run_dir: ``runs/<name>``; created if missing.
        total_steps: iterations of the run (progress bar length).
        start_step: first step this process will log (0, or the resumed step).
        tensorboard, progress: enable the event files / the progress bar.
    """

    def __init__(self, run_dir: str, total_steps: int | None = None, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True) -> None:
        if start_step < 0:
            raise ValueError(f"start_step={start_step} must be >= 0")
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        kept = [r for r in read_metrics(self.path) if r.get("step", math.inf) < start_step]
        with open(self.path, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = _summary_writer(run_dir, start_step) if tensorboard else None
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="rlhf", unit="it",
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write one iteration's metrics; adds ``step`` and ``memory/peak_rss_gb``.

        Returns:
            The record as written.
        """
        record = {"step": int(step), **{k: _plain(k, v) for k, v in metrics.items()}}
        record.setdefault("memory/peak_rss_gb", peak_rss_gb())
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, global_step=step)
        if self._bar is not None:
            post = {}
            if "reward/mean" in record:
                post["reward"] = f"{record['reward/mean']:.3f}"
            if "perf/throughput_tokens_per_s" in record:
                post["tok/s"] = f"{record['perf/throughput_tokens_per_s']:.0f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        return record

    def close(self, plot: bool = True) -> str | None:
        """Flush and close everything; write the PNG if ``plot``.  Returns the PNG path (None:
        not written)."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if plot:
            return plot_metrics(self.path, os.path.join(self.run_dir, PLOT_FILE))
        return None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        if not self._file.closed:
            self.close(plot=False)


def _notice(what: str, error: ImportError) -> None:
    """One line on stderr for an optional package that is not installed."""
    print(f"[rlhf] {what}: {error.name or error} is not installed", file=sys.stderr, flush=True)


def _summary_writer(run_dir: str, start_step: int):
    """TensorBoard's writer for ``run_dir`` (purging events from ``start_step`` on), or None
    with a one-line notice where the ``tensorboard`` package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        _notice("no TensorBoard event files (log.tensorboard=false skips them)", e)
        return None
    return SummaryWriter(log_dir=run_dir, purge_step=start_step or None)


def _plain(key: str, v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):    # 0-d torch / numpy values
        v = v.item()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    raise ValueError(f"metric {key!r}={v!r} is not a number or string")


def plot_metrics(jsonl_path: str, png_path: str) -> str | None:
    """Reward and held-out (val/*) curves (left) and stacked per-phase time per iteration
    (right) as a PNG; its path, or None with a one-line notice where ``matplotlib`` is not
    installed."""
    try:
        import matplotlib
    except ImportError as e:
        _notice(f"no {os.path.basename(png_path)} (log.plot=false skips it)", e)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    steps = [r["step"] for r in records]
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({k for r in records for k in r if k.startswith(("reward/", "val/"))}):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if pts:  # held-out evaluations (val/*) are sparse: markers
            style = dict(marker="o", ls="--") if key.startswith("val/") else {}
            ax_r.plot(*zip(*pts), label=key, lw=2 if key == "reward/mean" else 1, **style)
    ax_r.set_xlabel("iteration")
    ax_r.set_ylabel("reward")
    ax_r.set_title("reward")
    if ax_r.lines:
        ax_r.legend(fontsize=7)
    phases = sorted({k for r in records for k in r
                     if k.startswith("timing_s/") and k != "timing_s/step"})
    bottom = [0.0] * len(records)
    for key in phases:
        vals = [float(r.get(key, 0.0)) for r in records]
        ax_t.bar(steps, vals, bottom=bottom, label=key.split("/", 1)[1])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_t.set_xlabel("iteration")
    ax_t.set_ylabel("seconds")
    ax_t.set_title("time per phase")
    if phases:
        ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
