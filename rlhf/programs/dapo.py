"""DAPO (Yu et al. 2025): GRPO's group advantages with dynamic sampling.

The recipe (``rlhf/recipes/dapo.yaml``) sets the rest of DAPO: decoupled clip
(``actor.loss.clip_ratio_low`` 0.2 / ``clip_ratio_high`` 0.28), the token-level loss
(``token-mean``), no KL, and the overlong penalty (``reward.overlong_buffer``).

Dynamic sampling: a group whose samples all score the same has advantage 0 everywhere and
only dilutes the batch, so each round's groups are filtered (:func:`rlhf.algos.varied_groups`)
and more prompts are generated until ``data.prompts_per_iter`` varied groups are kept, at most
``algo.max_gen_rounds`` rounds.  The update then runs on the largest whole number of
mini-batches of kept groups (fewer only when the rounds ran out; none: no update this
iteration).  Log-probs are computed for the kept rows only.

On a disaggregated run the first round is the rollout pool's generation of this step (up to
``algo.max_staleness`` versions old) and the refills are generated there with the newest
weights, queued behind the generations in flight.
"""

from __future__ import annotations

import dataclasses
import math

from engine.seeds import derive_seed
from rlhf.algos import varied_groups
from rlhf.controller import Batch
from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import register_algorithm
from rlhf.programs.roles import Roles
from rlhf.programs.steps import (advantages, gather, means, more_rollouts, old_log_probs,
                                 ref_log_probs, rollouts, shape_rewards, wait_phases)
from rlhf.programs.grpo import grpo_advantage


def _uids(batch: Batch) -> list:
    return list(batch["uid"])


def _rounds(r: Roles, prompts: Batch, it: Iteration, target: int
            ) -> tuple[list[Batch], Batch, dict]:
    """Generate and score rounds of prompts until ``target`` varied groups are kept; returns
    the kept rows of each round, the first round's scored batch and the round metrics."""
    t = it.timer
    kept: list[Batch] = []
    first = None
    n_kept = dropped = rounds = 0
    metrics: dict[str, float] = {}
    while n_kept < target and rounds < it.algo.max_gen_rounds:
        if rounds == 0:
            gen, metrics = rollouts(r, prompts, it)
        else:  # a fresh stream per round: the same step's seed would repeat round 0's draws
            sampling = dataclasses.replace(
                it.sampling, seed=derive_seed(it.sampling.seed, "dapo_round", rounds))
            gen = more_rollouts(r, it.more_prompts(), sampling, it)
        scores = r.reward.compute_reward(gen)
        wait_phases(t, reward=scores)
        scored = gather(gen, scores)
        first = scored if first is None else first
        uids = _uids(scored)
        keep = varied_groups(scored["scores"], uids)
        n_varied = len({u for u, k in zip(uids, keep.tolist()) if k})
        dropped += len(set(uids)) - n_varied
        if n_varied:
            kept.append(scored.rows(keep.nonzero().squeeze(1)))
        n_kept += n_varied
        rounds += 1
    return kept, first, metrics | {"dapo/gen_rounds": float(rounds),
                                   "dapo/dropped_groups": float(dropped),
                                   "dapo/kept_groups": float(n_kept)}


def _trainable(kept: list[Batch], target: int, samples: int, mini_batch: int) -> Batch | None:
    """The first ``target`` kept groups, cut to a whole number of mini-batches (None: not
    even one)."""
    if not kept:
        return None
    batch = Batch.concat(kept)
    uids = list(dict.fromkeys(_uids(batch)))
    granule = math.lcm(samples, mini_batch) // samples  # groups per whole mini-batches
    n = min(len(uids), target) // granule * granule
    if n == 0:
        return None
    chosen = set(uids[:n])
    return batch.rows([i for i, u in enumerate(_uids(batch)) if u in chosen])


@register_algorithm("dapo", advantage=grpo_advantage, grouped=True)
def dapo(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    t = it.timer
    target = len(set(_uids(prompts)))
    kept, scored, metrics = _rounds(r, prompts, it, target)
    gen = _trainable(kept, target, len(prompts) // target, it.mini_batch_size)
    if gen is None:  # every group of every round scored alike: nothing to learn from
        return scored, metrics | {"dapo/trained_groups": 0.0}
    old, ref = old_log_probs(r, gen, it), ref_log_probs(r, gen)
    wait_phases(t, old_log_prob=old, ref=ref)
    with t("adv"):
        batch, m = shape_rewards(gather(gen, old, ref), it)
        batch = advantages(batch, it)
    with t("update_actor"):
        actor = r.actor.update_actor(batch).get()
    trained = float(len(set(_uids(batch))))
    return batch, metrics | m | means("actor", actor) | {"dapo/trained_groups": trained}
