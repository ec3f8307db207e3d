"""The controller programs: one RL iteration per algorithm, as plain sequential code.

Each program takes the worker groups, this iteration's prompts and an :class:`Iteration`
(settings, KL controller, Lagrange multiplier, phase timer) and returns
``(batch, metrics)``.  Calls return futures at once; ``.wait()`` inside a timed phase makes
the per-phase timings honest (colocated roles share the ranks, so phases run one after the
other anyway).  Advantages are plain arithmetic on the controller (:mod:`rlhf.algos`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.sampling import SamplingParams
from rlhf.algos import (LagrangeMultiplier, compute_advantage, kl_estimate, kl_penalty_rewards,
                        masked_mean, scores_to_token_rewards)
from rlhf.builders import Roles
from rlhf.controller import Batch, Future
from rlhf.metrics import PhaseTimer


@dataclass
class Iteration:
    """What a program needs besides the roles and prompts (plain values + controllers)."""

    algo: str
    sampling: SamplingParams
    greedy: SamplingParams
    timer: PhaseTimer
    kl_ctrl: object
    kl_mode: str
    kl_estimator: str
    gamma: float
    lam: float
    whiten: bool
    norm_adv_by_std: bool
    recompute_log_prob: bool = True
    lagrange: LagrangeMultiplier | None = None


def gather(*futures: Future | None) -> Batch:
    """The union of the results of several calls over the same rows (controller side)."""
    out = None
    for f in futures:
        if f is None:
            continue
        b = f.get()
        out = b if out is None else out.union(b)
    return out


def shape_rewards(batch: Batch, it: Iteration) -> tuple[Batch, dict]:
    """Token rewards: the sequence score on the last response token, minus the KL penalty
    when ``kl_mode == "reward"`` (the adaptive controller then takes the measured KL)."""
    if "old_log_probs" not in batch.tensors:  # not recomputed: the generation's own
        batch = Batch({**batch.tensors, "old_log_probs": batch["rollout_log_probs"]},
                      batch.non_tensors, batch.meta)
    mask = batch["response_mask"].float()
    token = scores_to_token_rewards(batch["scores"], mask)
    metrics = {}
    if "ref_log_probs" in batch.tensors:
        kl = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], "k1")
        metrics["actor/kl"] = float(masked_mean(kl, mask, dim=-1).mean())
        if it.kl_mode == "reward":
            token, m = kl_penalty_rewards(token, batch["old_log_probs"], batch["ref_log_probs"],
                                          mask, it.kl_ctrl.value, it.kl_estimator)
            metrics["actor/kl_coef"] = float(m["kl_coef"])
            it.kl_ctrl.update(float(m["kl"]), len(batch))
    out = Batch({**batch.tensors, "token_level_rewards": token}, batch.non_tensors, batch.meta)
    if "costs" in batch.tensors:
        out.tensors["token_level_costs"] = scores_to_token_rewards(batch["costs"], mask)
    return out, metrics


def advantages(batch: Batch, it: Iteration, **extra) -> Batch:
    adv = compute_advantage(batch, it.algo, gamma=it.gamma, lam=it.lam, whiten=it.whiten,
                            norm_adv_by_std=it.norm_adv_by_std, **extra)
    return Batch({**batch.tensors, **adv}, batch.non_tensors, batch.meta)


def _old(r: Roles, gen: Future, it: Iteration) -> Future | None:
    """The rollout policy's log-probs: a training forward, or (None) the generation's own."""
    return r.actor.compute_log_prob(gen) if it.recompute_log_prob else None


def _ref(r: Roles, gen: Future) -> Future | None:
    return r.reference.compute_ref_log_prob(gen) if r.reference is not None else None


def _wait(timer: PhaseTimer, **calls: Future | None) -> None:
    """Wait for calls issued together, in order, timing each wait as its phase.  Colocated
    roles run them one after the other (each phase = its own time); on disjoint pools they
    overlap, and a phase shows only the time it added to the iteration."""
    for phase, fut in calls.items():
        with timer(phase):
            if fut is not None:
                fut.wait()


# PPO -------------------------------------------------------------------------------------------
def ppo(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    with t("gen"):
        gen = r.actor.generate_sequences(prompts, it.sampling).wait()
    # Issued together: roles on disjoint pools (split, standalone) compute at the same time.
    old, ref = _old(r, gen, it), _ref(r, gen)
    values, scores = r.critic.compute_values(gen), r.reward.compute_reward(gen)
    _wait(t, old_log_prob=old, ref=ref, values=values, reward=scores)
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, values, scores), it)
        batch = advantages(batch, it)
    critic, actor = r.critic.update_critic(batch), r.actor.update_actor(batch)
    _wait(t, update_critic=critic, update_actor=actor)
    return batch, m | _means("actor", actor.get()) | _means("critic", critic.get())


# Safe-RLHF: PPO + a cost model, a cost critic and the Lagrange multiplier -------------------------
def safe_rlhf(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    with t("gen"):
        gen = r.actor.generate_sequences(prompts, it.sampling).wait()
    old, ref = _old(r, gen, it), _ref(r, gen)
    values, cost_values = r.critic.compute_values(gen), r.cost_critic.compute_values(gen)
    scores, costs = r.reward.compute_reward(gen), r.cost.compute_cost(gen)
    _wait(t, old_log_prob=old, ref=ref, values=values, cost_values=cost_values, reward=scores,
          cost=costs)
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, values, cost_values, scores, costs), it)
        batch = advantages(batch, it, lagrange=it.lagrange.value)
        mean_cost = float(batch["costs"].mean())
        m |= {"cost/mean": mean_cost, "cost/lagrange": it.lagrange.value}
        it.lagrange.update(mean_cost)
    critic, cost_critic = r.critic.update_critic(batch), r.cost_critic.update_critic(batch)
    actor = r.actor.update_actor(batch)
    _wait(t, update_critic=critic, update_cost_critic=cost_critic, update_actor=actor)
    return batch, (m | _means("actor", actor.get()) | _means("critic", critic.get())
                   | _means("cost_critic", cost_critic.get()))


# ReMax: a greedy response per prompt is the baseline; no critic ---------------------------------
def remax(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    n = len(prompts) // len(set(prompts["uid"]))  # samples per prompt
    with t("gen"):
        gen = r.actor.generate_sequences(prompts, it.sampling).wait()
        greedy = r.actor.generate_sequences(prompts.rows(slice(0, len(prompts), n)),
                                            it.greedy).wait()
    old, ref = _old(r, gen, it), _ref(r, gen)
    scores, base = r.reward.compute_reward(gen), r.reward.compute_reward(greedy)
    _wait(t, old_log_prob=old, ref=ref, reward=scores)
    with t("reward"):
        baseline = base.get()["scores"]
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, scores), it)
        batch.tensors["reward_baselines"] = baseline.repeat_interleave(n)
        batch = advantages(batch, it)
        m["reward/greedy_baseline"] = float(baseline.mean())
    with t("update_actor"):
        actor = r.actor.update_actor(batch).get()
    return batch, m | _means("actor", actor)


# GRPO, RLOO, REINFORCE++: outcome advantages from the scores alone; no critic -------------------
def critic_free(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    with t("gen"):
        gen = r.actor.generate_sequences(prompts, it.sampling).wait()
    old, ref = _old(r, gen, it), _ref(r, gen)
    scores = r.reward.compute_reward(gen)
    _wait(t, old_log_prob=old, ref=ref, reward=scores)
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, scores), it)
        batch = advantages(batch, it)
    with t("update_actor"):
        actor = r.actor.update_actor(batch).get()
    return batch, m | _means("actor", actor)


PROGRAMS: dict[str, Callable[[Roles, Batch, Iteration], tuple[Batch, dict]]] = {
    "ppo": ppo, "safe_rlhf": safe_rlhf, "remax": remax, "grpo": critic_free,
    "rloo": critic_free, "reinforce_pp": critic_free}

_RENAME = {"kl_loss": "kl_loss", "approx_kl": "ppo_kl"}


def _means(prefix: str, rows: Batch) -> dict[str, float]:
    """Per-DP-replica metric rows -> ``prefix/name`` means."""
    return {f"{prefix}/{_RENAME.get(k, k)}": float(v.float().mean())
            for k, v in rows.tensors.items()}
