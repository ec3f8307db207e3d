"""What every controller program shares: the registry entry type, the worker groups of a run
(:class:`Roles`), the per-iteration inputs (:class:`Iteration`) and the reward/advantage steps.

Each program takes the worker groups, this iteration's prompts and an :class:`Iteration` and
returns ``(batch, metrics)``.  Calls return futures at once; ``.wait()`` inside a timed phase
makes the per-phase timings honest (colocated roles share the ranks, so phases run one after
the other anyway).  Advantages are plain arithmetic on the controller (:mod:`rlhf.algos`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling import SamplingParams
from rlhf.algos import (LagrangeMultiplier, kl_estimate, kl_penalty_rewards, masked_mean,
                        rollout_mismatch, scores_to_token_rewards, truncated_is_weights,
                        value_loss)
from rlhf.controller import Batch, Future, WorkerGroup
from rlhf.metrics import PhaseTimer

# Roles of a run, in config order; the trained ones hold optimizer state.
ROLES = ("actor", "critic", "cost_critic", "reference", "reward_model", "cost_model")
TRAINED_ROLES = ("actor", "critic", "cost_critic")
VALUE_ROLES = ("critic", "cost_critic")


@dataclass
class Roles:
    """The worker groups of one run (None for a role the algorithm does not use)."""

    actor: WorkerGroup
    """The policy (HybridEngine)."""
    reward: WorkerGroup
    """Reward model and/or rule functions."""
    reference: WorkerGroup | None = None
    """Frozen initial policy (KL term)."""
    critic: WorkerGroup | None = None
    """Value model."""
    cost_critic: WorkerGroup | None = None
    """Cost value model (Safe-RLHF)."""
    cost: WorkerGroup | None = None
    """Cost model or cost rule (Safe-RLHF)."""
    rollout: Any = None
    """placement.mode=disaggregated: the rollout pool (:class:`rlhf.programs.async_rl.
    RolloutPool`); None = the actor generates."""

    def checkpointed(self) -> dict[str, WorkerGroup]:
        """Role name -> group, for every role with weights (not the rollout pool: its
        weights are the actor's, pushed again when a run starts or resumes)."""
        return {k: v for k, v in vars(self).items() if v is not None and k != "rollout"}


@dataclass(frozen=True)
class Iteration:
    """What a program needs besides the roles and prompts (build it with named fields)."""

    algo: Any
    """The run's :class:`rlhf.config.AlgoConfig` (read by field name)."""
    sampling: SamplingParams
    """Rollout sampling of this iteration."""
    greedy: SamplingParams
    """Greedy decoding with the same limits (ReMax's baseline)."""
    timer: PhaseTimer
    """Per-phase timings."""
    kl_ctrl: Any
    """Fixed or adaptive KL controller (``.value``, ``.update``)."""
    lagrange: LagrangeMultiplier
    """Safe-RLHF multiplier (unused by the other algorithms)."""
    mini_batch_size: int
    """Sequences per optimizer step (``data.mini_batch_size``): a batch a program trains on is
    a whole number of them."""
    more_prompts: Callable[[], Batch] | None
    """The next ``data.prompts_per_iter`` prompts of the run's stream, encoded as the
    iteration's own (DAPO's dynamic sampling draws more); None outside a run."""


Program = Callable[[Roles, Batch, Iteration], tuple[Batch, dict]]
Advantage = Callable[[Any, Iteration], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class AlgorithmSpec:
    """One registered algorithm: its program, estimator, losses and the roles it needs."""

    name: str
    """Registry key (``algo.name`` / ``algo=NAME``)."""
    program: Program
    """One RL iteration on the controller."""
    advantage: Advantage
    """``(batch, iteration) -> {"advantages", "returns", ...}`` from the batch's fields."""
    critics: tuple[str, ...]
    """Trained value roles (``critic``, ``cost_critic``)."""
    cost: bool
    """Scores a cost per response (Safe-RLHF): a cost rule, or the ``cost_model`` role."""
    grouped: bool
    """Compares the samples of one prompt (needs ``data.samples_per_prompt >= 2``)."""
    greedy_baseline: bool
    """Generates a second, greedy response per prompt (ReMax)."""
    policy_loss: str
    """The actor's registered policy loss (:mod:`rlhf.algos.policy_losses`; ``actor.loss.mode``
    overrides it), inside :func:`rlhf.algos.actor_loss`."""
    value_loss: Callable
    """The critics' loss (:func:`rlhf.algos.value_loss` signature)."""
    recipe: str | None
    """The shipped recipe ``algo=NAME`` starts from when there is no ``recipes/NAME.yaml``
    (a user's algorithm: ``recipe="grpo"``); None = its own."""

    @property
    def generations(self) -> int:
        """Generation passes of the actor per iteration."""
        return 2 if self.greedy_baseline else 1

    def roles(self, *, kl_mode: str, reward_kind: str, cost_kind: str) -> tuple[str, ...]:
        """The active roles, in :data:`ROLES` order."""
        active = {"actor", *self.critics}
        if kl_mode != "none":
            active.add("reference")
        if self.cost and cost_kind == "model":
            active.add("cost_model")
        if reward_kind in ("model", "both"):
            active.add("reward_model")
        return tuple(r for r in ROLES if r in active)


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register_algorithm(name: str, *, advantage: Advantage, critics: tuple[str, ...] = (),
                       cost: bool = False, grouped: bool = False,
                       greedy_baseline: bool = False, policy_loss: str = "ppo",
                       value_loss: Callable = value_loss, recipe: str | None = None
                       ) -> Callable[[Program], Program]:
    """Decorator registering a controller program as algorithm ``name`` (the keywords are the
    fields of :class:`AlgorithmSpec`)."""
    unknown = [c for c in critics if c not in VALUE_ROLES]
    if unknown:
        raise ValueError(f"algorithm {name!r}: critics {unknown} are not value roles "
                         f"{VALUE_ROLES}")

    def add(program: Program) -> Program:
        if name in ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is registered twice")
        ALGORITHMS[name] = AlgorithmSpec(
            name=name, program=program, advantage=advantage, critics=tuple(critics), cost=cost,
            grouped=grouped, greedy_baseline=greedy_baseline, policy_loss=policy_loss,
            value_loss=value_loss, recipe=recipe)
        return program
    return add


def algorithm_names() -> tuple[str, ...]:
    return tuple(ALGORITHMS)


def algorithm(name: str) -> AlgorithmSpec:
    """The registry entry of ``name``; ValueError listing the registered ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algo={name!r} is not a registered algorithm; choose from "
                         f"{sorted(ALGORITHMS)}") from None


_USER_MODULES: dict[str, Any] = {}


def load_algorithm_module(path: str) -> Any:
    """Import a user's algorithm file (``algo.module``) once per process: its
    :func:`register_algorithm` / :func:`rlhf.algos.register_policy_loss` calls add entries that
    ``algo.name`` and ``actor.loss.mode`` can then name.  The same file given again (every
    config of a run is built once per rank, and again in tests) is not re-imported.

    Raises:
        ValueError: the file does not exist, is not ``.py``, or raises when imported (the
            message names the file and the exception).
    """
    import os

    from rlhf.user_files import import_file

    if not str(path).endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"algo.module={path!r} must be an existing .py file")
    key = os.path.realpath(path)
    if key not in _USER_MODULES:
        _USER_MODULES[key] = import_file(path, "hybridflow_user_algo_", f"algo.module={path!r}")
    return _USER_MODULES[key]


# Steps shared by the programs -------------------------------------------------------------
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


def critic_free(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
    """The program of the outcome-advantage algorithms (GRPO, RLOO, REINFORCE++): rollout,
    log-probs and scores, advantages from the scores alone, actor update; no critic."""
    with it.timer("gen"):
        gen = r.actor.generate_sequences(prompts, it.sampling).wait()
    return outcome_update(r, gen, it)


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
