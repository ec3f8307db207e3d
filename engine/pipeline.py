"""Pipeline schedules (pure lists of actions) and their executor over a PP group.

A schedule is the list of ``("F", i)`` / ``("B", i)`` actions one stage runs for micro-batches
``0..n-1``.  1F1B (PipeDream-flush, as Megatron) for stage ``s`` of ``p``::

    warm-up   F0 .. F(w-1)                      w = min(p - s - 1, n)
    steady    F(w) B0  F(w+1) B1 ...            one forward, one backward
    cool-down B(n-w) .. B(n-1)

so at most ``p - s`` micro-batches of activations are alive (GPipe keeps all ``n``).

The executor sends activations to the next stage and gradients to the previous one with
``isend`` (waited at the end of the step) and receives with blocking ``recv``; since every
receive only depends on earlier actions of the neighbour, any of these schedules is
deadlock-free.  torch.distributed.pipelining is not used: it owns the stage modules, the loss
and its own process-group handling, while our stages live in flat buffers, take their groups
from the layout and need caller-supplied per-token losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.optim_config import SCHEDULES
from hybridflow_comm.groups import Group

Action = tuple[str, int]


def gpipe_schedule(n: int) -> list[Action]:
    """All forwards, then all backwards (in order)."""
    return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]


def one_f_one_b_schedule(pp: int, stage: int, n: int) -> list[Action]:
    """1F1B actions of ``stage`` (see module docstring)."""
    warmup = min(pp - stage - 1, n)
    out: list[Action] = [("F", i) for i in range(warmup)]
    for j in range(n - warmup):
        out += [("F", warmup + j), ("B", j)]
    out += [("B", i) for i in range(n - warmup, n)]
    return out


def make_schedule(kind: str, pp: int, stage: int, n: int) -> list[Action]:
    if kind == "1f1b":
        return one_f_one_b_schedule(pp, stage, n)
    if kind == "gpipe":
        return gpipe_schedule(n)
    raise ValueError(f"schedule={kind!r} must be one of {SCHEDULES}")


class PipelineExecutor:
    """Runs a schedule for one stage.

    Args:
        pp_group: the stage's PP group (``rank`` = stage index).
        act_shape: ``fn(i) -> shape`` of the activation exchanged for micro-batch ``i``.
        dtype: activation element type.
        device: where the activations and gradients are received (the stage's weights'
            device; default CPU).
    """

    def __init__(self, pp_group: Group, act_shape: Callable[[int], tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.group = pp_group
        self.act_shape = act_shape
        self.dtype = dtype
        self.device = torch.device(device)
        self.stage = pp_group.rank
        self.is_first = self.stage == 0
        self.is_last = self.stage == pp_group.size - 1
        self._sends: list = []

    def _send(self, t: torch.Tensor, to_stage: int) -> None:
        t = t.detach().contiguous()
        work = dist.isend(t, dst=self.group.ranks[to_stage], group=self.group.pg)
        self._sends.append((work, t))  # keep the tensor alive until the send completes

    def _recv(self, i: int, from_stage: int) -> torch.Tensor:
        t = torch.empty(self.act_shape(i), dtype=self.dtype, device=self.device)
        dist.recv(t, src=self.group.ranks[from_stage], group=self.group.pg)
        return t

    def run(self, actions: list[Action], forward: Callable[[int, torch.Tensor | None], object],
            loss_of: Callable[[int, object], torch.Tensor] | None = None) -> dict[int, object]:
        """Execute ``actions``.

        Args:
            forward: ``forward(i, x)`` -> this stage's output for micro-batch ``i``; ``x`` is
                None on the first stage, else the previous stage's activation.
            loss_of: on the last stage, ``loss_of(i, output)`` -> scalar to backpropagate;
                None for forward-only runs (no "B" action allowed).

        Returns:
            Forward-only: the last stage's outputs by micro-batch (empty dict on other stages
            and when training; ``loss_of`` sees every output).
        """
        inputs: dict[int, torch.Tensor | None] = {}
        outputs: dict[int, object] = {}
        results: dict[int, object] = {}
        training = loss_of is not None
        for kind, i in actions:
            if kind == "F":
                x = None
                if not self.is_first:
                    x = self._recv(i, self.stage - 1).requires_grad_(training)
                with torch.set_grad_enabled(training):
                    out = forward(i, x)
                if not self.is_last:
                    self._send(out, self.stage + 1)
                inputs[i], outputs[i] = x, out
                if self.is_last and not training:
                    results[i] = out
            else:
                if not training:
                    raise ValueError("a backward action needs loss_of")
                x, out = inputs.pop(i), outputs.pop(i)
                if self.is_last:
                    loss_of(i, out).backward()
                else:
                    torch.autograd.backward(out, self._recv(i, self.stage + 1))
                if not self.is_first:
                    self._send(x.grad, self.stage - 1)
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        return results
