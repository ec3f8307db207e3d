"""The step loop of both SFT runs (:mod:`rlhf.sft` on a user's model, :mod:`rlhf.sft_builtin`
on the built-in task): AdamW without weight decay, the global gradient norm clipped to 1, a
learning rate decaying linearly to 10% of its peak, one micro-batch a step, the model saved in
HF format at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.hf_interop import save_hf_checkpoint
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.devices import Precision
from hybridflow_comm.groups import Group, build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.workers.common import build_model
from rlhf.workers.specs import ModelSpec

META = "sft_meta.json"
"""The file an SFT run writes beside its checkpoint: its settings and losses."""
LOG_EVERY = 100
"""Steps between two printed losses (the last step is always printed)."""

Loss = Callable[[dict, dict], torch.Tensor]
"""``(model outputs, micro-batch) -> loss``, as :meth:`TrainEngine.train_step` takes it."""


def decayed_lr(lr: float, step: int, steps: int) -> float:
    """Linear decay from ``lr`` to 10% of it over the run."""
    return lr * (1 - 0.9 * step / steps)


def train_steps(spec: ModelSpec, *, world: int, steps: int, lr: float,
                batch_at: Callable[[int, Group], dict[str, torch.Tensor]], loss_fn: Loss,
                out: str, device: torch.device, precision: Precision) -> dict:
    """Train ``spec``'s model for ``steps`` steps and save it to ``out``.

    Every rank of the world (one process, or every rank of an initialized process group) is a
    data-parallel replica; the engine all-reduces the gradients.  Saving is collective: rank 0
    writes.

    Args:
        spec: the model and the weights it starts from (its config in ``precision``).
        world: ranks taking part, all data parallel.
        steps, lr: steps and the peak learning rate (:func:`decayed_lr`).
        batch_at: ``(step, dp group) -> this rank's micro-batch`` of that step.
        loss_fn: the loss of a micro-batch (the model's mean NLL on its loss tokens).
        out: folder of the HF checkpoint.
        device: where the model lives; each micro-batch is moved there once.
        precision: the run's resolved precision, which the training engine takes.
    Returns:
        ``first_loss`` (step 0, before any update), ``loss`` (last step), ``time_s``.
    """
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, world), 1, 1))
    model = build_model(spec, groups, device)
    engine = TrainEngine(model, OptimConfig(lr=lr, weight_decay=0.0, max_grad_norm=1.0),
                         precision=precision)
    t0, first, loss = time.perf_counter(), float("nan"), float("nan")
    for step in range(steps):
        mb = {k: v.to(device) for k, v in batch_at(step, groups.train_dp).items()}
        for g in engine.optimizer.param_groups:
            g["lr"] = decayed_lr(lr, step, steps)
        loss = engine.train_step([mb], loss_fn, temperature=1.0)["loss"]  # the model's NLL
        if step == 0:
            first = loss
        if groups.rank == 0 and (step % LOG_EVERY == 0 or step == steps - 1):
            print(f"[sft] step {step} loss {loss:.4f}", flush=True)
    save_hf_checkpoint(model, out)  # collective; rank 0 writes
    return {"first_loss": first, "loss": loss, "time_s": time.perf_counter() - t0}
