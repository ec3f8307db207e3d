"""RLOO (Ahmadian et al. 2024): each sample's baseline is the mean score of the other samples
of its prompt; no critic."""

from __future__ import annotations

from rlhf.algos import rloo as rloo_estimator
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.steps import critic_free, outcome_fields


def rloo_advantage(batch, it: Iteration) -> dict:
    adv, ret = rloo_estimator(*outcome_fields(batch, it))
    return {"advantages": adv, "returns": ret}


register_algorithm("rloo", advantage=rloo_advantage, grouped=True)(critic_free)
