"""The algorithm registry: one :class:`AlgorithmSpec` per algorithm (:func:`register_algorithm`),
the role names, and the loading of a user's algorithm file.

Light on purpose: the config reads the registry (names, active roles, checks) and loads no
program step, worker group or rollout source through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf.algos import value_loss

if TYPE_CHECKING:  # names of annotations only: the registry loads without them
    import torch

    from rlhf.controller import Batch
    from rlhf.programs.iteration import Iteration
    from rlhf.programs.roles import Roles

    Program = Callable[[Roles, Batch, Iteration], tuple[Batch, dict]]
    """A controller program: one RL iteration, ``(roles, prompts, it) -> (batch, metrics)``."""
    Advantage = Callable[[Any, Iteration], dict[str, torch.Tensor]]
    """An advantage estimator: ``(batch, it) -> {"advantages", "returns", ...}``."""

# Roles of a run, in config order; the trained ones hold optimizer state.
ROLES = ("actor", "critic", "cost_critic", "reference", "reward_model", "cost_model")
TRAINED_ROLES = ("actor", "critic", "cost_critic")
VALUE_ROLES = ("critic", "cost_critic")


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

