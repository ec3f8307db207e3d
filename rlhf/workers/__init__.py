"""Role workers of the RLHF runtime: actor (HybridEngine), critic, reference, reward, cost.

Each is a :class:`rlhf.controller.Worker` whose data methods carry a transfer protocol; their
constructors take plain arguments (built from the run config by :mod:`rlhf.builders`).
"""

from rlhf.workers.actor import ActorWorker, PolicyLossArgs, ReferenceWorker
from rlhf.workers.common import ModelArgs
from rlhf.workers.critic import CriticWorker, ValueLossArgs
from rlhf.workers.reward import CostWorker, RewardWorker, ScoreArgs

__all__ = ["ActorWorker", "PolicyLossArgs", "ReferenceWorker", "ModelArgs", "CriticWorker",
           "ValueLossArgs", "CostWorker", "RewardWorker", "ScoreArgs"]
