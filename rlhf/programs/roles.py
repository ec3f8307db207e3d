"""The worker groups of one run, as the programs see them (:class:`Roles`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhf.programs.rollout_sources import ActorRollouts, Rollouts

if TYPE_CHECKING:  # names of annotations only
    from rlhf.controller import WorkerGroup


@dataclass
class Roles:
    """The worker groups of one run (None for a role the algorithm does not use)."""

    actor: WorkerGroup
    """The policy (HybridEngine)."""
    reward: WorkerGroup
    """Reward model and/or rule functions."""
    reference: WorkerGroup | None = None
    """Frozen initial policy (KL term)."""
    critic: WorkerGroup | None = None
    """Value model."""
    cost_critic: WorkerGroup | None = None
    """Cost value model (Safe-RLHF)."""
    cost: WorkerGroup | None = None
    """Cost model or cost rule (Safe-RLHF)."""
    rollout: Rollouts | None = None
    """Where rollouts come from: the rollout pool of a disaggregated run
    (:class:`rlhf.programs.async_rl.RolloutPool`); None = the actor generates them
    (:class:`ActorRollouts`, set on construction)."""

    def __post_init__(self) -> None:
        if self.rollout is None:
            self.rollout = ActorRollouts(self.actor)

    def checkpointed(self) -> dict[str, WorkerGroup]:
        """Role name -> group, for every role with weights (not the rollout pool: its
        weights are the actor's, pushed again when a run starts or resumes)."""
        groups = {}
        for k, v in vars(self).items():  # a group serving two roles (a LoRA actor that is its
            if v is not None and k != "rollout" and all(v is not g for g in groups.values()):
                groups[k] = v  # own reference) is saved once, under its first role
        return groups

