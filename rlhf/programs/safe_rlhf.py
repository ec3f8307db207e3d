"""Safe-RLHF (Dai et al. 2023): PPO plus a cost source, a cost critic and a Lagrange
multiplier on ``E[cost] <= cost_limit``."""

from __future__ import annotations

from rlhf.algos import safe_rlhf_advantages
from rlhf.controller import Batch
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.roles import Roles
from rlhf.programs.steps import (advantages, field_of, gather, means, old_log_probs, ref_log_probs,
                                 rollouts, shape_rewards, wait_phases)


def safe_rlhf_advantage(batch, it: Iteration) -> dict:
    a = it.algo
    return safe_rlhf_advantages(token_rewards=field_of(batch, "token_level_rewards", a.name),
                                values=field_of(batch, "values", a.name),
                                token_costs=field_of(batch, "token_level_costs", a.name),
                                cost_values=field_of(batch, "cost_values", a.name),
                                mask=field_of(batch, "response_mask", a.name),
                                lagrange=it.lagrange.value, gamma=a.gamma, lam=a.lam,
                                whiten=a.whiten_advantages)


@register_algorithm("safe_rlhf", advantage=safe_rlhf_advantage,
                    critics=("critic", "cost_critic"), cost=True)
def safe_rlhf(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    gen, m0 = rollouts(r, prompts, it)
    old, ref = old_log_probs(r, gen, it), ref_log_probs(r, gen)
    values, cost_values = r.critic.compute_values(gen), r.cost_critic.compute_values(gen)
    scores, costs = r.reward.compute_reward(gen), r.cost.compute_cost(gen)
    wait_phases(t, old_log_prob=old, ref=ref, values=values, cost_values=cost_values,
                reward=scores, cost=costs)
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, values, cost_values, scores, costs), it)
        batch = advantages(batch, it)
        mean_cost = float(batch["costs"].mean())
        m |= m0 | {"cost/mean": mean_cost, "cost/lagrange": it.lagrange.value}
        it.lagrange.update(mean_cost)
    critic, cost_critic = r.critic.update_critic(batch), r.cost_critic.update_critic(batch)
    actor = r.actor.update_actor(batch)
    wait_phases(t, update_critic=critic, update_cost_critic=cost_critic, update_actor=actor)
    return batch, (m | means("actor", actor.get()) | means("critic", critic.get())
                   | means("cost_critic", cost_critic.get()))
