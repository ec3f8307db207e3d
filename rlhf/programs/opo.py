"""OPO (Hao et al. 2025, On-Policy RL with Optimal reward baseline): the group baseline is the
length-weighted mean score, the variance-minimising baseline for sequence-level rewards; no
critic."""

from __future__ import annotations

from rlhf.algos import opo as opo_estimator
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.steps import critic_free, outcome_fields


def opo_advantage(batch, it: Iteration) -> dict:
    adv, ret = opo_estimator(*outcome_fields(batch, it))
    return {"advantages": adv, "returns": ret}


register_algorithm("opo", advantage=opo_advantage, grouped=True)(critic_free)
