"""GRPO (Shao et al. 2024): advantages normalised within the group of samples of one prompt
(``norm_adv_by_std=False``: a mean-only baseline); no critic.  Also its estimator variants:

* ``dr_grpo`` (Liu et al. 2025): the group mean baseline without the std division; its recipe
  pairs it with the ``seq-mean-token-sum-norm`` aggregation, the other half of Dr. GRPO.
* ``grpo_passk`` (Chen et al. 2025): the analytic pass@k advantage of binary rewards
  (``algo.pass_k``), which optimises the chance that one of k samples is right.
"""

from __future__ import annotations

from rlhf.algos import dr_grpo, grpo, grpo_passk
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.steps import critic_free, outcome_fields


def grpo_advantage(batch, it: Iteration) -> dict:
    adv, ret = grpo(*outcome_fields(batch, it), it.algo.norm_adv_by_std)
    return {"advantages": adv, "returns": ret}


def dr_grpo_advantage(batch, it: Iteration) -> dict:
    adv, ret = dr_grpo(*outcome_fields(batch, it))
    return {"advantages": adv, "returns": ret}


def grpo_passk_advantage(batch, it: Iteration) -> dict:
    adv, ret = grpo_passk(*outcome_fields(batch, it), it.algo.pass_k)
    return {"advantages": adv, "returns": ret}


register_algorithm("grpo", advantage=grpo_advantage, grouped=True)(critic_free)
register_algorithm("dr_grpo", advantage=dr_grpo_advantage, grouped=True)(critic_free)
register_algorithm("grpo_passk", advantage=grpo_passk_advantage, grouped=True)(critic_free)
