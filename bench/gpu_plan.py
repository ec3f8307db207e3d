"""The GPU check's time plan: every step's time on one H100, its limit and its minimum, and the
arithmetic that shows the plan fits the check's budget.

A GPU machine is lent for 15 minutes counted from its start, and starting it takes minutes, so
the whole check (``bench/gpu_check.py``) gets :data:`BUDGET_S`.  The runner gives each step
its limit or what is left of the budget, whichever is less, and records a step as skipped
(with the reason, not as failed) when less than its minimum is left.  The steps run in the
order of :data:`STEP_TIMES`, the most informative first::

    |<------------------------------ BUDGET_S (480 s) ------------------------------>|
    | env | wheels | build | pytest_gpu | main_job | bench_generation |    | slack |
    |<---------- committed: their limits add up to BUDGET_S - SLACK_S ---------->|
                                          then, on what the committed ones leave:
                                          roofline, lm_head, e2e, the smollm2 rows

The committed steps (:func:`committed`) run to their full limits whatever the steps before
them do; a later step runs only on the time the committed ones leave unused, and is skipped
when that is under its minimum.  :data:`SLACK_S` is the check's own time between steps
(starting each command, writing its JSON, packing the folder).

Each step's time comes from the last run on a GPU (the H100's step JSONs in
``bench/results/gpu/2026-11-28-*``: ``measured_s``), adjusted by what the code does now that
it did not then (cold ``torch.compile`` of the training and decode layers and the sampler,
more GPU tests, a shorter main job: ``basis`` says how).  The compile times are estimates: the
next GPU run measures them, and its step JSONs are the next version of this table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BUDGET_S = 480.0
"""The whole check's limit: 15 minutes of device time less the machine's start and the
transfers."""
SLACK_S = 10.0
"""What the check itself spends between steps, kept out of the committed steps' limits."""


@dataclass(frozen=True)
class StepTime:
    """One step's time on one H100.

    Attributes:
        measured_s: its seconds in the 2026-11-28 run (None: it did not run then).
        expected_s: what it should take now.
        limit_s: its limit (its process group is interrupted, then killed, at this time).
        min_s: it is skipped when less than this is left of the budget.
        basis: how ``expected_s`` follows from ``measured_s``.
    """

    measured_s: float | None
    expected_s: float
    limit_s: float
    min_s: float
    basis: str

    def __post_init__(self):
        if not 0 < self.min_s <= self.expected_s <= self.limit_s:
            raise ValueError(f"a step needs 0 < min_s <= expected_s <= limit_s, got "
                             f"{self.min_s}, {self.expected_s}, {self.limit_s}")


STEP_TIMES = {
    "env": StepTime(5.48, 6, 10, 5, "measured"),
    "install_wheels": StepTime(0.97, 2, 10, 2, "measured with 5 wheels; xxhash is a sixth"),
    "build": StepTime(93.76, 50, 60, 40,
                      "measured for both extensions, 17 files in two ninja runs of one wave "
                      "each on 16 cores; a GPU builds hybridflow_comm._C alone (4 files, one "
                      "wave), not the CPU decode kernels engine._kernels"),
    "pytest_gpu": StepTime(39.55, 170, 190, 60,
                           "measured for 16 tests in 4 files; now 7 files: about 10 s of new "
                           "tests and 8-10 cold inductor/Triton compiles at about 8 s each, "
                           "and the fast-path cells' tests (LoRA and MoE compiled training, "
                           "MoE compiled decode, LoRA decode graphs): about 6 more compiles; "
                           "packed training through varlen (one compile) and the graphs of "
                           "an NCCL group's all-reduces (eager steps, no compile): 12 s, less "
                           "the printed decode throughput test (8 s then, now with its cold "
                           "compiled decode at a third model shape: about 20 s)"),
    "main_job": StepTime(163.01, 70, 80, 50,
                         "measured: SFT warm start 129 s, then 30 RL iterations 27 s; now the "
                         "warm start is carried (make gpu-sft-cache) and 10 iterations show "
                         "the learning (about 20 s), plus cold compiles of the training "
                         "layers (forward, backward), the decode layer and the sampler "
                         "(about 50 s); without the warm start, the RL job alone at a small "
                         "batch (less)"),
    "bench_generation": StepTime(76.84, 110, 120, 90,
                                 "measured, plus cold compiles of the decode layer for its "
                                 "key buckets and of the sampler (about 30 s)"),
    "bench_roofline": StepTime(32.04, 75, 90, 60,
                               "measured, plus cold compiles of the training layers (forward, "
                               "backward) and the decode layer (about 40 s)"),
    "bench_lm_head": StepTime(None, 20, 40, 15,
                              "not run then; its CPU run at tiny takes seconds, on a GPU "
                              "mostly the start and three timed calls"),
    "bench_e2e": StepTime(62.72, 150, 180, 120,
                          "62.72 s until our side's first run failed (TRL's side never ran); "
                          "both sides at about 60 s each, plus compiles (about 30 s)"),
    "bench_generation_smollm2": StepTime(None, 60, 90, 45,
                                         "not run then; the qwen2.5-0.5b row's time for a "
                                         "model a quarter its size and half the new tokens"),
    "bench_e2e_smollm2": StepTime(None, 120, 150, 100,
                                  "not run then; the qwen2.5-0.5b row's estimate for a smaller "
                                  "model"),
}
"""The GPU check's steps in their order, each with its time on one H100 (seconds)."""


def committed(names: Iterable[str], budget_s: float = BUDGET_S,
              table: dict[str, StepTime] = STEP_TIMES) -> list[str]:
    """The leading steps of ``names`` whose limits add up to at most ``budget_s - SLACK_S``:
    those that run to their full limits whatever the others do."""
    out, total = [], 0.0
    for name in names:
        total += table[name].limit_s
        if total > budget_s - SLACK_S:
            break
        out.append(name)
    return out


def admit(remaining_s: float, limit_s: float, min_s: float) -> tuple[float | None, str | None]:
    """The skip rule: ``(limit, None)`` for a step that runs, with its limit or what is left,
    whichever is less; ``(None, reason)`` for one skipped because less than its minimum is
    left."""
    if remaining_s < min_s:
        return None, (f"{max(remaining_s, 0):.0f} s of the check's budget left, under the "
                      f"step's minimum of {min_s:.0f} s")
    return min(limit_s, remaining_s), None


def simulate(names: Iterable[str], seconds: dict[str, float], budget_s: float = BUDGET_S,
             table: dict[str, StepTime] = STEP_TIMES) -> tuple[dict[str, float | None], float]:
    """The check run on paper: each step takes ``seconds[name]`` (cut at its limit), the skip
    rule as the runner applies it, :data:`SLACK_S` spent before the first step.

    Returns:
        ``({name: seconds it ran, None where skipped}, the total)``.
    """
    ran, used = {}, SLACK_S
    for name in names:
        t = table[name]
        limit, _ = admit(budget_s - used, t.limit_s, t.min_s)
        ran[name] = None if limit is None else min(seconds[name], limit)
        used += ran[name] or 0.0
    return ran, used
