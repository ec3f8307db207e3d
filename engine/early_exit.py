"""Early exit: the rows of a generation call that are still computed.

A row finishes at EOS or at its own ``max_new_tokens``.  Between decode steps the running
batch is compacted to the rows still alive: the KV cache
(:meth:`engine.kv_cache.KVCache.keep_rows_`), the step tables (RoPE, key mask) and the step
input keep only those rows, and each step's tokens are scattered back to their rows of the
full output::

    full batch   0 1 2 3 4 5 6 7        run = [0 2 3 5 6 7]: the full row of each running row
    running      0 . 2 3 . 5 6 7        (rows 1 and 4 finished and were dropped)

What it changes in the results: a sampled row's random draw is made for its row id in the full
batch (:func:`engine.sampling.sample_next`'s ``rows``), so it does not depend on the running
rows.  The floats of a row depend on the running batch only through the products that compute
them: the decode kernels' small-M products sum every output by one fixed tree whatever rows
come with it (csrc/engine/small_gemm.cpp), so where a call runs only those (the kernel decode
paths up to ``small_gemm_max_rows`` rows) early exit is bit-identical to computing every row.
BLAS may round a row differently in batches of other sizes, so elsewhere (the Python layers,
BLAS blocks and heads) tokens agree up to near-ties and log-probs up to float rounding
(tests/test_generation_early_exit.py holds both).

When: a compaction copies the kept rows' filled KV cache (about what one decode step's
attention reads), so it is done for a real cut in compute, not for every finished row: once
the finished rows are at least 1/:data:`COMPACT_DIVISOR` of the running rows.  Each compaction
then shrinks the batch by 1/8 or more, so a call copies at most 8 batch-sized caches in all,
however its rows finish.
"""

from __future__ import annotations

import torch

COMPACT_DIVISOR = 8
"""Compact once the finished rows are at least 1/COMPACT_DIVISOR of the running rows."""
DEVICE_CHECK_EVERY = 4
"""On an accelerator, the finished rows are counted (a device-to-host sync) after every
DEVICE_CHECK_EVERY-th decode step only; on the CPU after every step, where counting costs no
sync.  Between counts the finished rows keep running and are recorded as padding."""


def check_every(device: torch.device) -> int:
    """Decode steps between two counts of the finished rows on ``device`` (pure)."""
    return 1 if device.type == "cpu" else DEVICE_CHECK_EVERY


def decode_rows(running: int, alive: int) -> int:
    """How many rows the next decode step runs (pure): ``alive`` (>= 1) when the finished
    ``running - alive`` rows are at least 1/:data:`COMPACT_DIVISOR` of the running ones, else
    ``running`` (no compaction)."""
    return alive if (running - alive) * COMPACT_DIVISOR >= running else running


class RunningRows:
    """The alive and running rows of one call, and the step counts of its stats.

    Args:
        limits: ``[B]`` each row's ``max_new_tokens`` (the rows' tensors live on its device).
        eos_token_id: the token that ends a row (None: none does).
    """

    def __init__(self, limits: torch.Tensor, eos_token_id: int | None) -> None:
        batch = limits.numel()
        self.limits, self.eos = limits, eos_token_id
        self.alive = torch.ones(batch, dtype=torch.bool, device=limits.device)
        self.run = torch.arange(batch, device=limits.device)
        """``[R]`` the full-batch row of each running row."""
        self.at: slice | torch.Tensor = slice(None)
        """``run`` as an index of the full batch: a slice (every row) until the first
        compaction, whose indexing costs nothing."""
        self.mask: torch.Tensor | None = None
        """``[B]`` bool, the running rows (the sampler's ``rows``); None while all run."""
        self.steps = self.row_steps = self.compactions = 0

    def count_steps(self, steps: int) -> None:
        """Count ``steps`` forward steps of every running row."""
        self.steps, self.row_steps = self.steps + steps, self.row_steps + steps * self.run.numel()

    def end_step(self, step: int, tokens: torch.Tensor) -> None:
        """After decode step ``step`` produced ``tokens [R]`` of the running rows: count it
        and mark the rows it ended (on the device, no sync)."""
        self.count_steps(1)
        if self.eos is not None:
            self.alive[self.at] = self.alive[self.at] & (tokens != self.eos)
        self.alive &= self.limits > step + 1

    def alive_count(self) -> int:
        """The rows still alive: a device-to-host sync off the CPU."""
        return int(self.alive.sum())

    def finish_step(self, step: int, tokens: torch.Tensor) -> int:
        """:meth:`end_step`, then the rows still alive (:meth:`alive_count`)."""
        self.end_step(step, tokens)
        return self.alive_count()

    def compact(self, alive: int) -> torch.Tensor | None:
        """Drop the finished rows when :func:`decode_rows` says so.  Returns the indices
        (ascending, into the running rows) of the rows kept, for the caller's cache and
        tables, or None when nothing changes."""
        if decode_rows(self.run.numel(), alive) == self.run.numel():
            return None
        keep = self.alive[self.run].nonzero().squeeze(1)
        self.run = self.at = self.run[keep]
        self.mask = torch.zeros_like(self.alive)
        self.mask[self.run] = True
        self.compactions += 1
        return keep
