"""Dataflow descriptions: which models an RLHF algorithm runs, in which stage, and the workload.

Every algorithm runs the same three stages per iteration, in order (the paper's PPO graph)::

    generation    actor generates responses (3D-HybridEngine: train -> gen reshard first)
    preparation   one forward pass per model: actor old log-probs, reference log-probs,
                  critic values, reward / cost scores
    training      actor and critic updates (epochs x optimizer steps)

Dataflows of the registered algorithms (:mod:`rlhf.programs`; the paper's four shown)::

    ppo        actor, critic, reference, reward
    safe_rlhf  actor, critic, reference, reward, cost
    remax      actor (two generations: sampled + greedy baseline), reference, reward (scores both)
    grpo       actor, reference, reward (no critic; samples_per_prompt responses per prompt)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.planner.models import ModelShape, shape_from_model_config
from rlhf.programs import TRAINED_ROLES, algorithm, algorithm_names

STAGES = ("generation", "preparation", "training")


@dataclass(frozen=True)
class RoleSpec:
    """One model of the dataflow and what it does per iteration."""

    name: str
    """Role name (actor, critic, reference, reward, cost, ...)."""
    shape: ModelShape
    """Architecture and size."""
    trained: bool = False
    """Updated in the training stage (holds gradients and optimizer states)."""
    generations: int = 0
    """Generation passes per iteration (actor only: 1, ReMax: 2)."""
    forwards: int = 1
    """Forward passes over the rollout batch in the preparation stage."""


@dataclass(frozen=True)
class Workload:
    """What one iteration processes (the paper's batch, prompt and response lengths)."""

    prompts: int = 1024
    """Prompts per iteration."""
    prompt_len: int = 1024
    """Prompt tokens."""
    response_len: int = 1024
    """Generated tokens per response."""
    samples_per_prompt: int = 1
    """Responses per prompt."""
    epochs: int = 1
    """Training passes over the rollout batch."""
    mini_batch: int = 0
    """Sequences per optimizer step (all DP ranks together); 0 = the whole rollout batch."""
    micro_batch: int = 8
    """Sequences per forward/backward on one device."""

    def __post_init__(self) -> None:
        for f in ("prompts", "prompt_len", "response_len", "samples_per_prompt", "epochs",
                  "micro_batch"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"workload {f}={v!r} must be a positive int")
        if isinstance(self.mini_batch, bool) or not isinstance(self.mini_batch, int) \
                or self.mini_batch < 0:
            raise ValueError(f"workload mini_batch={self.mini_batch!r} must be an int >= 0")

    @property
    def sequences(self) -> int:
        """Rollout batch: prompts x samples_per_prompt."""
        return self.prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per iteration and trained model."""
        per_step = self.mini_batch or self.sequences
        return self.epochs * max(1, self.sequences // per_step)


@dataclass(frozen=True)
class Dataflow:
    """An algorithm's models (the planner places and parallelizes each)."""

    algo: str
    roles: tuple[RoleSpec, ...]

    def __post_init__(self) -> None:
        names = [r.name for r in self.roles]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"dataflow {self.algo!r} needs unique role names, got {names}")
        if sum(r.generations for r in self.roles) and self.roles[0].generations == 0:
            raise ValueError(f"dataflow {self.algo!r}: the generating role must come first")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.roles)

    def role(self, name: str) -> RoleSpec:
        for r in self.roles:
            if r.name == name:
                return r
        raise ValueError(f"role={name!r} is not in dataflow {self.algo!r} ({self.names})")


DATAFLOWS = algorithm_names()


def build_dataflow(algo: str, actor: ModelShape, critic: ModelShape | None = None,
                   reward: ModelShape | None = None) -> Dataflow:
    """The built-in dataflow of ``algo`` (see the module docstring).

    Args:
        algo: a registered algorithm (``DATAFLOWS``).
        actor: actor (and reference) architecture.
        critic: critic architecture; default = the actor's, with a value head.
        reward: reward (and cost) model architecture; default = the critic's.
    """
    if algo not in DATAFLOWS:
        raise ValueError(f"algo={algo!r} has no built-in dataflow; choose from {DATAFLOWS}")
    spec = algorithm(algo)
    critic = (critic or actor).as_value_model()
    reward = (reward or critic).as_value_model()
    roles = [RoleSpec("actor", actor, trained=True, generations=spec.generations)]
    if "critic" in spec.critics:
        roles.append(RoleSpec("critic", critic, trained=True))
    roles.append(RoleSpec("reference", actor))
    roles.append(RoleSpec("reward", reward, forwards=spec.generations))
    if spec.cost:
        roles.append(RoleSpec("cost", reward))
    return Dataflow(algo, tuple(roles))


def dataflow_from_config(cfg) -> tuple[Dataflow, Workload]:
    """The dataflow and workload of an :class:`rlhf.config.Config` (its active roles, their
    architectures and the data section).  Rule-based rewards are no model and take no devices.
    """
    roles = []
    for name in cfg.roles:
        shape = shape_from_model_config(cfg.model_of(name), name)
        if name not in ("actor", "reference"):
            shape = shape.as_value_model()
        gens = algorithm(cfg.algo.name).generations if name == "actor" else 0
        roles.append(RoleSpec(name, shape, trained=name in TRAINED_ROLES, generations=gens))
    d = cfg.data
    work = Workload(prompts=d.prompts_per_iter, prompt_len=d.max_prompt_len,
                    response_len=d.max_response_len, samples_per_prompt=d.samples_per_prompt,
                    epochs=cfg.algo.epochs, mini_batch=d.mini_batch_size,
                    micro_batch=d.micro_batch_size)
    return Dataflow(cfg.algo.name, tuple(roles)), work
