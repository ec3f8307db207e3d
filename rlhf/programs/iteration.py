"""What a program takes besides the worker groups and the prompts: :class:`Iteration`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf.algos import LagrangeMultiplier
from rlhf.controller import Batch
from rlhf.metrics import PhaseTimer

if TYPE_CHECKING:  # names of annotations only
    from engine.sampling import SamplingParams


@dataclass(frozen=True)
class Iteration:
    """What a program needs besides the roles and prompts (build it with named fields)."""

    algo: Any
    """The run's :class:`rlhf.config.AlgoConfig` (read by field name)."""
    sampling: SamplingParams
    """Rollout sampling of this iteration."""
    greedy: SamplingParams
    """Greedy decoding with the same limits (ReMax's baseline)."""
    timer: PhaseTimer
    """Per-phase timings."""
    kl_ctrl: Any
    """Fixed or adaptive KL controller (``.value``, ``.update``)."""
    lagrange: LagrangeMultiplier
    """Safe-RLHF multiplier (unused by the other algorithms)."""
    mini_batch_size: int
    """Sequences per optimizer step (``data.mini_batch_size``): a batch a program trains on is
    a whole number of them."""
    more_prompts: Callable[[], Batch] | None
    """The next ``data.prompts_per_iter`` prompts of the run's stream, encoded as the
    iteration's own (DAPO's dynamic sampling draws more); None outside a run."""

