"""RL algorithms as pure torch functions: advantage estimators, PPO losses, KL, Safe-RLHF.

Conventions: token-level tensors are ``[B, T]`` over response positions with a response mask
``[B, T]``; sequence-level tensors are ``[B]``.  Nothing here knows about ranks or workers.
"""

from rlhf.algos.advantages import (dr_grpo, gae, group_index, grpo, grpo_passk, grpo_scores, opo,
                                   reinforce_pp, reinforce_pp_baseline, remax, rloo, rloo_scores)
from rlhf.algos.kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, KLLossTerm,
                           kl_estimate, kl_loss, kl_penalty_rewards, make_kl_controller)
from rlhf.algos.losses import (actor_loss, entropy_from_logits, entropy_loss, policy_loss,
                               value_loss)
from rlhf.algos.masked import (LOSS_AGG_MODES, agg_count, agg_denominator, agg_loss, kept,
                               masked_mean, masked_sum, masked_var, masked_whiten,
                               scores_to_token_rewards)
from rlhf.algos.shaping import overlong_penalty, varied_groups
from rlhf.algos.offpolicy import rollout_mismatch, truncated_is_weights
from rlhf.algos.policy_losses import POLICY_LOSSES, get_policy_loss, register_policy_loss
from rlhf.algos.safe_rlhf import LagrangeMultiplier, combine_advantages, safe_rlhf_advantages

__all__ = ["dr_grpo", "gae", "group_index", "grpo", "grpo_passk", "grpo_scores", "opo",
           "reinforce_pp", "reinforce_pp_baseline", "remax", "rloo", "rloo_scores",
           "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "KLLossTerm",
           "kl_estimate", "kl_loss", "kl_penalty_rewards", "make_kl_controller", "actor_loss",
           "entropy_from_logits", "entropy_loss", "policy_loss", "value_loss", "LOSS_AGG_MODES",
           "agg_count", "agg_denominator", "agg_loss", "kept", "masked_mean", "masked_sum",
           "masked_var", "masked_whiten", "scores_to_token_rewards", "POLICY_LOSSES",
           "get_policy_loss", "register_policy_loss", "rollout_mismatch", "truncated_is_weights",
           "overlong_penalty", "varied_groups", "LagrangeMultiplier", "combine_advantages",
           "safe_rlhf_advantages"]
