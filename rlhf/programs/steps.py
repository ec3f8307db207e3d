"""The steps the controller programs share: rollouts, log-probs, rewards, advantages, updates.

Each program takes the worker groups (:class:`rlhf.programs.roles.Roles`), this iteration's
prompts and an :class:`rlhf.programs.iteration.Iteration` and returns ``(batch, metrics)``.
Calls return futures at once; ``.wait()`` inside a timed phase makes the per-phase timings
honest (colocated roles share the ranks, so phases run one after the other anyway).
Advantages are plain arithmetic on the controller (:mod:`rlhf.algos`).  Rollouts come from
``Roles.rollout`` (:mod:`rlhf.programs.rollout_sources`) through :func:`rollouts`,
:func:`greedy_rollouts` and :func:`more_rollouts`, never from the actor directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.algos import (kl_estimate, kl_penalty_rewards, masked_mean, rollout_mismatch,
                        scores_to_token_rewards, truncated_is_weights)
from rlhf.controller import Batch
from rlhf.metrics import PhaseTimer
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import algorithm
from rlhf.programs.roles import Roles

if TYPE_CHECKING:  # names of annotations only
    from engine.sampling import SamplingParams
    from rlhf.controller import Future


def field_of(batch: Any, key: str, algo: str):
    """``batch[key]``, or a ValueError naming the algorithm and the fields present."""
    try:
        return batch[key]
    except KeyError:
        keys = list(batch.keys()) if hasattr(batch, "keys") else "?"
        raise ValueError(f"algo={algo!r} needs batch field {key!r}; the batch has {keys}") \
            from None


def outcome_fields(batch: Any, it: Iteration) -> tuple:
    """``(token_level_rewards, response_mask, uid)``: what the group estimators (GRPO, RLOO,
    OPO, REINFORCE++ baseline, ...) take, each via :func:`field_of`."""
    name = it.algo.name
    return (field_of(batch, "token_level_rewards", name), field_of(batch, "response_mask", name),
            field_of(batch, "uid", name))


def gather(*futures: Future | Batch | None) -> Batch:
    """The union of the results of several calls (or batches) over the same rows (controller
    side)."""
    out = None
    for f in futures:
        if f is None:
            continue
        b = f if isinstance(f, Batch) else f.get()
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
    if it.algo.recompute_log_prob and "rollout_log_probs" in batch.tensors:
        gap = rollout_mismatch(batch["old_log_probs"], batch["rollout_log_probs"], mask)
        metrics["actor/rollout_logprob_diff"] = gap["mean"]
        metrics["actor/rollout_logprob_diff_max"] = gap["max"]
    if "ref_log_probs" in batch.tensors:
        bounds = {"log_ratio_clamp": it.algo.kl_log_ratio_clamp,
                  "k3_clamp": it.algo.kl_k3_clamp}
        kl = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], "k1", **bounds)
        metrics["actor/kl"] = float(masked_mean(kl, mask, dim=-1).mean())
        if it.algo.kl_mode == "reward":
            token, m = kl_penalty_rewards(token, batch["old_log_probs"], batch["ref_log_probs"],
                                          mask, it.kl_ctrl.value, it.algo.kl_estimator,
                                          **bounds)
            metrics["actor/kl_coef"] = float(m["kl_coef"])
            it.kl_ctrl.update(float(m["kl"]), len(batch))
    out = Batch({**batch.tensors, "token_level_rewards": token}, batch.non_tensors, batch.meta)
    if "costs" in batch.tensors:
        out.tensors["token_level_costs"] = scores_to_token_rewards(batch["costs"], mask)
    return out, metrics


def advantages(batch: Batch, it: Iteration) -> Batch:
    """``batch`` plus the fields of the registered estimator of ``it.algo.name``; with
    ``algo.tis_cap`` the advantages carry the truncated importance weights between the
    rollout's and the recomputed old policy's log-probs (:func:`rlhf.algos.truncated_is_weights`)."""
    adv = algorithm(it.algo.name).advantage(batch, it)
    if it.algo.tis_cap is not None and "rollout_log_probs" in batch.tensors:
        w = truncated_is_weights(batch["old_log_probs"], batch["rollout_log_probs"],
                                 batch["response_mask"], it.algo.tis_cap)
        adv = adv | {"advantages": adv["advantages"] * w.to(adv["advantages"].dtype)}
    return Batch({**batch.tensors, **adv}, batch.non_tensors, batch.meta)


def old_log_probs(r: Roles, gen: Future, it: Iteration) -> Future | None:
    """The rollout policy's log-probs: a training forward, or (None) the generation's own."""
    return r.actor.compute_log_prob(gen) if it.algo.recompute_log_prob else None


def ref_log_probs(r: Roles, gen: Future) -> Future | None:
    return r.reference.compute_ref_log_prob(gen) if r.reference is not None else None


def wait_phases(timer: PhaseTimer, **calls: Future | None) -> None:
    """Wait for calls issued together, in order, timing each wait as its phase.  Colocated
    roles run them one after the other (each phase = its own time); on disjoint pools they
    overlap, and a phase shows only the time it added to the iteration."""
    for phase, fut in calls.items():
        with timer(phase):
            if fut is not None:
                fut.wait()


_RENAME = {"kl_loss": "kl_loss", "approx_kl": "ppo_kl"}


def means(prefix: str, rows: Batch) -> dict[str, float]:
    """Per-DP-replica metric rows -> ``prefix/name`` means."""
    return {f"{prefix}/{_RENAME.get(k, k)}": float(v.float().mean())
            for k, v in rows.tensors.items()}


def rollouts(r: Roles, prompts: Batch, it: Iteration) -> tuple[Future | Batch, dict]:
    """This iteration's rollouts of ``prompts`` (phase ``gen``) and their ``rollout/``
    metrics: generated by the actor now, or on a disaggregated run taken from the rollout
    pool (sampled up to ``algo.max_staleness`` weight versions ago)."""
    with it.timer("gen"):
        ro = r.rollout.take(prompts, it, greedy=False)
    return ro.batch, ro.metrics


def greedy_rollouts(r: Roles, prompts: Batch, it: Iteration
                    ) -> tuple[Future | Batch, Future | Batch, dict]:
    """:func:`rollouts` plus a greedy response to each prompt group (its first row), from
    the same weights as the sampled ones (ReMax's baseline)."""
    with it.timer("gen"):
        ro = r.rollout.take(prompts, it, greedy=True)
    return ro.batch, ro.greedy, ro.metrics


def more_rollouts(r: Roles, prompts: Batch, sampling: SamplingParams, it: Iteration
                  ) -> Future | Batch:
    """Rollouts of more prompts in the same iteration, with the newest weights (DAPO's
    dynamic sampling; on a disaggregated run they queue behind the generations in flight)."""
    with it.timer("gen"):
        return r.rollout.generate(prompts, sampling)


def critic_free(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    """The program of the outcome-advantage algorithms (GRPO, RLOO, REINFORCE++): rollout,
    log-probs and scores, advantages from the scores alone, actor update; no critic."""
    gen, m = rollouts(r, prompts, it)
    batch, metrics = outcome_update(r, gen, it)
    return batch, m | metrics


def outcome_update(r: Roles, gen: Future | Batch, it: Iteration) -> tuple[Batch, dict]:
    """:func:`critic_free` after its rollout: log-probs and scores of the generated rows,
    advantages from the scores alone, actor update."""
    t = it.timer
    old, ref = old_log_probs(r, gen, it), ref_log_probs(r, gen)
    scores = r.reward.compute_reward(gen)
    wait_phases(t, old_log_prob=old, ref=ref, reward=scores)
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref, scores), it)
        batch = advantages(batch, it)
    with t("update_actor"):
        actor = r.actor.update_actor(batch).get()
    return batch, m | means("actor", actor)
