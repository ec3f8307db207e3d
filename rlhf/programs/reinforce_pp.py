"""REINFORCE++ (Hu 2025): discounted returns whitened over the batch; no critic.  Also
``reinforce_pp_baseline``: each score minus its group's mean, then whitened over the batch
(REINFORCE++ with the group baseline)."""

from __future__ import annotations

from rlhf.algos import reinforce_pp, reinforce_pp_baseline
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.steps import critic_free, field_of, outcome_fields


def reinforce_pp_advantage(batch, it: Iteration) -> dict:
    a = it.algo
    adv, ret = reinforce_pp(field_of(batch, "token_level_rewards", a.name),
                            field_of(batch, "response_mask", a.name), a.gamma)
    return {"advantages": adv, "returns": ret}


def reinforce_pp_baseline_advantage(batch, it: Iteration) -> dict:
    adv, ret = reinforce_pp_baseline(*outcome_fields(batch, it))
    return {"advantages": adv, "returns": ret}


register_algorithm("reinforce_pp", advantage=reinforce_pp_advantage)(critic_free)
register_algorithm("reinforce_pp_baseline", advantage=reinforce_pp_baseline_advantage,
                   grouped=True)(critic_free)
