"""RL algorithms as pure torch functions: advantage estimators, PPO losses, KL, Safe-RLHF.

Conventions: token-level tensors are ``[B, T]`` over response positions with a response mask
``[B, T]``; sequence-level tensors are ``[B]``.  Nothing here knows about ranks or workers.
"""

from rlhf.algos.advantages import (gae, group_index, grpo, grpo_scores, reinforce_pp, remax,
                                   rloo, rloo_scores)
from rlhf.algos.kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimate,
                           kl_loss, kl_penalty_rewards, make_kl_controller)
from rlhf.algos.losses import (actor_loss, entropy_from_logits, entropy_loss, policy_loss,
                               value_loss)
from rlhf.algos.masked import (LOSS_AGG_MODES, agg_count, agg_denominator, agg_loss, kept,
                               masked_mean, masked_sum, masked_var, masked_whiten,
                               scores_to_token_rewards)
from rlhf.algos.safe_rlhf import LagrangeMultiplier, combine_advantages, safe_rlhf_advantages

__all__ = ["gae", "group_index", "grpo", "grpo_scores", "reinforce_pp", "remax", "rloo",
           "rloo_scores", "KL_ESTIMATORS", "AdaptiveKLController",
           "FixedKLController", "kl_estimate", "kl_loss", "kl_penalty_rewards",
           "make_kl_controller", "actor_loss", "entropy_from_logits", "entropy_loss", "policy_loss",
           "value_loss", "LOSS_AGG_MODES", "agg_count", "agg_denominator", "agg_loss", "kept",
           "masked_mean", "masked_sum", "masked_var", "masked_whiten", "scores_to_token_rewards",
           "LagrangeMultiplier", "combine_advantages", "safe_rlhf_advantages"]
