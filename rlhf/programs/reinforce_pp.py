"""REINFORCE++ (Hu 2025): discounted returns whitened over the batch; no critic."""

from __future__ import annotations

from rlhf.algos import reinforce_pp as reinforce_pp_estimator
from rlhf.programs.common import Iteration, critic_free, field_of, register_algorithm


def reinforce_pp_advantage(batch, it: Iteration) -> dict:
    a = it.algo
    adv, ret = reinforce_pp_estimator(field_of(batch, "token_level_rewards", a.name),
                                      field_of(batch, "response_mask", a.name), a.gamma)
    return {"advantages": adv, "returns": ret}


register_algorithm("reinforce_pp", advantage=reinforce_pp_advantage)(critic_free)
