"""The optimizer settings of one trained model (:class:`OptimConfig`, read by
:class:`engine.train.TrainEngine`) and the pipeline schedules it may name.

Pure dataclasses on the standard library only: the run config (:mod:`rlhf.config`) embeds
:class:`OptimConfig` as ``actor.optim`` / ``critic.optim`` and is checked without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")
"""Pipeline schedules (:func:`engine.pipeline.make_schedule`)."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and gradient settings of one model."""

    lr: float = 1e-4
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay of matrices (norms are never decayed)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (over TP, PP and DP) to this; None disables clipping."""
    bucket_numel: int = 1 << 20
    """Elements per DP all-reduce bucket of the flat gradient buffer."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``"1f1b"`` or ``"gpipe"``."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(f"lr={self.lr} and eps={self.eps} must be > 0 and weight_decay="
                             f"{self.weight_decay} >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas} must be in [0, 1)")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 or None")
        if self.bucket_numel < 1:
            raise ValueError(f"bucket_numel={self.bucket_numel} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
