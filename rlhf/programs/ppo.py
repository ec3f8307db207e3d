"""PPO (Ouyang et al. 2022): actor, critic, reference and reward; GAE advantages.

On a disaggregated run the rollouts may come from older weights (``algo.max_staleness``); the
values, log-probs and rewards are computed on them at train time, so GAE uses the current
critic and the actor's loss carries the truncated importance weight (``algo.tis_cap``)."""

from __future__ import annotations

from rlhf.algos import gae
from rlhf.controller import Batch
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.roles import Roles
from rlhf.programs.steps import (advantages, field_of, gather, means, old_log_probs, ref_log_probs,
                                 rollouts, shape_rewards, wait_phases)


def gae_advantage(batch, it: Iteration) -> dict:
    a = it.algo
    adv, ret = gae(field_of(batch, "token_level_rewards", a.name),
                   field_of(batch, "values", a.name), field_of(batch, "response_mask", a.name),
                   a.gamma, a.lam, a.whiten_advantages)
    return {"advantages": adv, "returns": ret}


@register_algorithm("ppo", advantage=gae_advantage, critics=("critic",))
def ppo(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    gen, m0 = rollouts(r, prompts, it)
    # Issued together: roles on disjoint pools (split, standalone) compute at the same time.
    old, ref = old_log_probs(r, gen, it), ref_log_probs(r, gen)
    values, scores = r.critic.compute_values(gen), r.reward.compute_reward(gen)
    wait_phases(t, old_log_prob=old, ref=ref, values=values, reward=scores)
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, values, scores), it)
        batch = advantages(batch, it)
    critic, actor = r.critic.update_critic(batch), r.actor.update_actor(batch)
    wait_phases(t, update_critic=critic, update_actor=actor)
    return batch, m0 | m | means("actor", actor.get()) | means("critic", critic.get())
