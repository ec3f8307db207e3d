"""GRPO (Shao et al. 2024): advantages normalised within the group of samples of one prompt
(``norm_adv_by_std=False``: Dr. GRPO's mean-only baseline); no critic."""

from __future__ import annotations

from rlhf.algos import grpo as grpo_estimator
from rlhf.programs.common import Iteration, critic_free, field_of, register_algorithm


def grpo_advantage(batch, it: Iteration) -> dict:
    a = it.algo
    adv, ret = grpo_estimator(field_of(batch, "token_level_rewards", a.name),
                              field_of(batch, "response_mask", a.name),
                              field_of(batch, "uid", a.name), a.norm_adv_by_std)
    return {"advantages": adv, "returns": ret}


register_algorithm("grpo", advantage=grpo_advantage, grouped=True)(critic_free)
