"""ReMax (Li et al. 2023): the score of a greedy response per prompt is the baseline; no
critic.  On a disaggregated run the greedy response comes from the same weights as the
sampled ones (the rollout pool generates it right after them)."""

from __future__ import annotations

from rlhf.algos import remax as remax_estimator
from rlhf.controller import Batch
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.roles import Roles
from rlhf.programs.steps import (advantages, field_of, gather, greedy_rollouts, means,
                                 old_log_probs, ref_log_probs, shape_rewards, wait_phases)


def remax_advantage(batch, it: Iteration) -> dict:
    name = it.algo.name
    adv, ret = remax_estimator(field_of(batch, "token_level_rewards", name),
                               field_of(batch, "reward_baselines", name),
                               field_of(batch, "response_mask", name))
    return {"advantages": adv, "returns": ret}


@register_algorithm("remax", advantage=remax_advantage, greedy_baseline=True)
def remax(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    n = len(prompts) // len(set(prompts["uid"]))  # samples per prompt
    gen, greedy, m0 = greedy_rollouts(r, prompts, it)
    old, ref = old_log_probs(r, gen, it), ref_log_probs(r, gen)
    scores, base = r.reward.compute_reward(gen), r.reward.compute_reward(greedy)
    wait_phases(t, old_log_prob=old, ref=ref, reward=scores)
    with t("reward"):
        baseline = base.get()["scores"]
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, scores), it)
        batch.tensors["reward_baselines"] = baseline.repeat_interleave(n)
        batch = advantages(batch, it)
        m |= m0 | {"reward/greedy_baseline": float(baseline.mean())}
    with t("update_actor"):
        actor = r.actor.update_actor(batch).get()
    return batch, m | means("actor", actor)
