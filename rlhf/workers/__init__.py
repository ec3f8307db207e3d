"""Role workers of the RLHF runtime: actor (HybridEngine), critic, reference, reward, cost.

Each is a :class:`rlhf.controller.Worker` whose data methods carry a transfer protocol; each
constructor takes its own typed section (:mod:`rlhf.workers.specs`, filled from the run config
by :mod:`rlhf.builders`) and reads it by field name.
"""

from rlhf.workers.actor import ActorWorker, ReferenceWorker
from rlhf.workers.critic import CriticWorker
from rlhf.workers.reward import CostWorker, RewardWorker
from rlhf.workers.specs import (ActorSpec, CriticSpec, ModelSpec, OverlongShaping, ReferenceSpec,
                                ScoreSpec, UpdateSpec)

__all__ = ["ActorWorker", "ReferenceWorker", "CriticWorker", "CostWorker", "RewardWorker",
           "ActorSpec", "CriticSpec", "ModelSpec", "OverlongShaping", "ReferenceSpec",
           "ScoreSpec", "UpdateSpec"]
