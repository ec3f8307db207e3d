"""The settings of one model's LoRA adapters (:class:`LoraConfig`) and the HF module names
they may target (:mod:`engine.lora` builds and shards the adapters).

Pure dataclasses on the standard library only: the run config (:mod:`rlhf.config`) checks its
``actor.lora`` / ``critic.lora`` sections with :class:`LoraConfig` without torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION + MLP
"""Every module an adapter can target, in PEFT's order within a layer."""
ALL_LINEAR = "all-linear"


def resolve_targets(target_modules: str | Sequence[str]) -> tuple[str, ...]:
    """The targeted modules in :data:`MODULES` order: ``"all-linear"`` or HF module names
    (ValueError naming any other, or an empty list)."""
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            raise ValueError(f"lora.target_modules={target_modules!r}: use '{ALL_LINEAR}' or a "
                             f"list of {list(MODULES)}")
        return MODULES
    if not isinstance(target_modules, (list, tuple)):
        raise ValueError(f"lora.target_modules={target_modules!r}: use '{ALL_LINEAR}' or a "
                         f"list of {list(MODULES)}")
    names = list(target_modules)
    unknown = [n for n in names if n not in MODULES]
    if unknown or not names:
        raise ValueError(f"lora.target_modules={names}: {unknown or 'empty'}; the modules are "
                         f"{list(MODULES)} or '{ALL_LINEAR}'")
    return tuple(m for m in MODULES if m in names)


@dataclass(frozen=True)
class LoraConfig:
    """One model's adapters (``actor.lora.*`` / ``critic.lora.*``).

    Attributes:
        rank: ``r`` (> 0; a config's 0 means no LoRA and builds no LoraConfig).
        alpha: the delta is scaled by ``alpha / rank``.
        dropout: on the adapter's input while training (PEFT's ``lora_dropout``).
        target_modules: HF module names (:func:`resolve_targets`).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = MODULES

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank={self.rank!r} must be an int >= 1 (0 turns LoRA off)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not math.isfinite(self.alpha) or not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha!r} must be > 0")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        object.__setattr__(self, "target_modules", resolve_targets(self.target_modules))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
