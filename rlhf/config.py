"""Run configuration: frozen dataclasses (the only place a default lives, one docstring per
field), YAML recipes and ``key=value`` overrides through OmegaConf structured configs.  The
sections live in :mod:`rlhf.config_roles` (per role) and :mod:`rlhf.config_run` (run-wide) and
are importable from here; :func:`rlhf.world_plan.validate_for_world` checks every size against
the world before any rank starts.

Loading::

    cfg = load_config(["algo=grpo", "actor.optim.lr=1e-5", "data.prompts_per_iter=32"])
    plan = rlhf.world_plan.validate_for_world(cfg, world_size=4)   # ValueError naming the fix
    plan.roles["actor"].layout, plan.roles["actor"].pool

Importing this module loads neither torch nor the engines, the controller or the C++
extensions (of :mod:`engine`, only the settings dataclasses the sections embed or build:
:mod:`engine.optim_config`, :mod:`engine.lora_config`), so that a mistyped key is reported at
once (``tests/test_config_import.py``).  The registries a section is checked against (the
algorithms of :mod:`rlhf.programs`, the losses of :mod:`rlhf.algos`, the rule rewards, the
device names) live beside torch code: each check imports the registry it reads, when a config
is built.

``algo=NAME`` picks the shipped recipe ``rlhf/recipes/NAME.yaml`` (default ``ppo``);
``recipe=PATH`` picks any YAML file.  Every other argument is a dotted key into the config,
type-checked against the dataclasses (an unknown key names the nearest valid one).

Sections and who reads them (each worker gets its own typed section, see :mod:`rlhf.builders`)::

    actor        model, layout, optim (engine.optim_config.OptimConfig), loss (PolicyLossConfig)
    critic, cost_critic    model, layout, optim, loss (ValueLossConfig)
    reference, reward_model, cost_model    model, layout
    algo         registry name, epochs, advantage and KL settings (the controller program)
    rollout      generation engine (native or vllm), rows per wave, KV-cache memory budget
    data, reward, placement, log, checkpoint

Batch sizes, one meaning each (all counted in sequences except ``prompts_per_iter``)::

    rollout_batch_size = prompts_per_iter * samples_per_prompt     sequences generated per iteration
    mini_batch_size    = sequences per optimizer step (global, all DP ranks together)
    micro_batch_size   = sequences per forward/backward on one DP rank (unless the role's
                         use_dynamic_bsz forms them by max_token_len_per_micro_batch tokens)
    grad_accum         = mini_batch_size / (dp * micro_batch_size)  per trained role (derived)
    optimizer steps per iteration = epochs * rollout_batch_size / mini_batch_size

Placement of the roles on the ranks ``0..W-1`` (pools are consecutive rank ranges)::

    colocated   every role on all W ranks (default)
    split       pool "actor" = actor + reference, pool "critic" = every other role;
                sizes in placement.pool_sizes = {actor: a, critic: c}, a + c = W
    standalone  one pool per active role, sizes in placement.pool_sizes = {role: n}, sum = W
    disaggregated  pool "actor" = every role (training), pool "rollout" = generation only (a
                GenerationEngine fed by WeightSync after every update, algo.max_staleness
                iterations ahead); placement.pool_sizes = {actor: a, rollout: r}, a + r = W
    auto        chosen by the planner: rlhf.planner.config_bridge.resolve_config(cfg, W)
                replaces it (and every layout) with one of the above before validate_for_world
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlhf.config_checks import (MAX_COUNT, MAX_MODEL_PARAMS, MAX_ROLLOUT_TOKENS, SEED_LIMIT,
                                check_at_most, check_path, check_positive, check_seed)
from rlhf.config_io import from_args, from_dict, save_yaml, to_dict
from rlhf.config_roles import (ARCH_FIELDS, BUILTIN_ARCH, ActorConfig, CriticConfig,
                               FrozenModelConfig, LayoutConfig, ModelConfig, PolicyLossConfig,
                               ValueLossConfig)
from rlhf.config_run import (PLACEMENTS, ROLLOUT_ENGINES, AlgoConfig, CheckpointConfig,
                             DataConfig, LogConfig, PlacementConfig, RewardConfig, RolloutConfig)

if TYPE_CHECKING:  # an annotation only: importing this module loads no torch
    import torch

__all__ = [
    "ARCH_FIELDS", "BUILTIN_ARCH", "MAX_COUNT", "MAX_MODEL_PARAMS", "MAX_ROLLOUT_TOKENS",
    "PLACEMENTS", "RECIPES_DIR", "ROLLOUT_ENGINES", "SEED_LIMIT", "ActorConfig", "AlgoConfig",
    "CheckpointConfig", "Config", "CriticConfig", "DataConfig", "FrozenModelConfig",
    "LayoutConfig", "LogConfig", "ModelConfig", "PlacementConfig", "PolicyLossConfig",
    "RewardConfig", "RolloutConfig", "ValueLossConfig",
    "config_from_dict", "load_config", "recipe_names", "resolve_devices", "save_config",
]

RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")


@dataclass(frozen=True)
class Config:
    """A whole run."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm and the controller's settings."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and batch sizes."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy (trained; generates with the HybridEngine)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (algorithms with a critic: ppo, safe_rlhf)."""
    cost_critic: CriticConfig = field(default_factory=CriticConfig)
    """Cost value model (safe_rlhf)."""
    reference: FrozenModelConfig = field(default_factory=FrozenModelConfig)
    """Frozen initial policy for the KL term (unless algo.kl_mode=none)."""
    reward_model: FrozenModelConfig = field(default_factory=FrozenModelConfig)
    """Reward model (reward.kind = model or both)."""
    cost_model: FrozenModelConfig = field(default_factory=FrozenModelConfig)
    """Cost model (safe_rlhf with reward.cost_kind = model)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward and cost sources."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engine and its limits (the actor's and the rollout pool's)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Role placement on the ranks."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics output."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    iterations: int = 20
    """RL iterations (one rollout batch each)."""
    eval_every: int = 0
    """Evaluate on the held-out prompts every this many iterations (and always at the start and
    the end); 0 = only at the start and the end."""
    eval_pass_k: int = 4
    """Samples per held-out prompt at the rollout temperature for val/pass@k (a prompt passes
    when one of them is right); 0 = greedy metrics only."""
    tokenizer: str | None = None
    """Tokenizer folder (HF files); None = the actor's init_from folder when it has tokenizer
    files, else the built-in character tokenizer."""
    seed: int = 0
    """Seed of model init and sampling (the data has its own, data.seed)."""
    device: str = "auto"
    """Where every role computes: ``cuda`` (rank r on GPU ``LOCAL_RANK``, NCCL for device
    tensors), ``cpu`` (gloo), or ``auto`` (cuda when available)."""
    precision: str = "auto"
    """``fp32``, ``bf16`` (bf16 parameters and compute; trained roles keep fp32 master
    weights, gradients and Adam state), or ``auto`` (bf16 on cuda, fp32 on cpu)."""

    def __post_init__(self) -> None:
        from hybridflow_comm.devices import DEVICES, PRECISIONS
        from rlhf.algos import POLICY_LOSSES
        from rlhf.programs import algorithm

        check_positive(iterations=self.iterations)
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} must be one of {DEVICES}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {PRECISIONS}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every={self.eval_every} must be >= 0 (0 = at the end only)")
        if self.eval_pass_k < 0:
            raise ValueError(f"eval_pass_k={self.eval_pass_k} must be >= 0 (0 = off)")
        check_at_most(MAX_COUNT, iterations=self.iterations, eval_every=self.eval_every,
                      eval_pass_k=self.eval_pass_k)
        check_seed("seed", self.seed)
        check_path("tokenizer", self.tokenizer)
        spec = algorithm(self.algo.name)
        if spec.name == "grpo_passk" and self.algo.pass_k > self.data.samples_per_prompt:
            raise ValueError(f"algo.pass_k={self.algo.pass_k} is more than the "
                             f"data.samples_per_prompt={self.data.samples_per_prompt} samples of "
                             f"a group; choose k <= samples_per_prompt")

        loss_mode = self.actor.loss.mode or spec.policy_loss
        if loss_mode not in POLICY_LOSSES:
            raise ValueError(f"actor.loss.mode={loss_mode!r} is not a registered policy loss; "
                             f"choose from {sorted(POLICY_LOSSES)} (a user's own: register it "
                             f"in the file given as algo.module)")
        if spec.grouped and self.data.samples_per_prompt < 2:
            raise ValueError(f"algo={spec.name} compares samples of one prompt: set "
                             f"data.samples_per_prompt >= 2 (got {self.data.samples_per_prompt})")
        if self.reward.overlong_buffer > self.data.max_response_len:
            raise ValueError(f"reward.overlong_buffer={self.reward.overlong_buffer} is longer "
                             f"than data.max_response_len={self.data.max_response_len}")
        if self.reference.model not in (None, self.actor.model):
            raise ValueError("reference.model must equal actor.model (leave it null)")
        longest = self.data.max_prompt_len + self.data.max_response_len
        for role in ("actor", "critic", "cost_critic"):
            section = getattr(self, role)
            if section.use_dynamic_bsz and section.max_token_len_per_micro_batch < longest:
                raise ValueError(
                    f"{role}.max_token_len_per_micro_batch={section.max_token_len_per_micro_batch}"
                    f" is shorter than the longest sequence, data.max_prompt_len="
                    f"{self.data.max_prompt_len} + max_response_len={self.data.max_response_len}"
                    f" = {longest}; raise it to at least {longest}")
        _check_async(self)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles this algorithm and reward setup use, in ROLES order (from the registry)."""
        from rlhf.programs import algorithm

        roles = algorithm(self.algo.name).roles(kl_mode=self.algo.kl_mode,
                                                reward_kind=self.reward.kind,
                                                cost_kind=self.reward.cost_kind)
        # with LoRA the actor is its own reference (the base with the adapters off)
        return tuple(r for r in roles if r != "reference" or not self.actor.lora.rank)

    def role(self, name: str) -> ActorConfig | CriticConfig | FrozenModelConfig:
        from rlhf.programs.registry import ROLES

        if name not in ROLES:
            raise ValueError(f"role={name!r} is not one of {ROLES}")
        return getattr(self, name)

    def model_of(self, name: str) -> ModelConfig:
        """The architecture of role ``name`` (the actor's unless the role sets its own)."""
        return self.role(name).model or self.actor.model

    def to_dict(self) -> dict:
        """Plain nested dict (loads back with :func:`config_from_dict`)."""
        return to_dict(self)


def resolve_devices(cfg: Config) -> tuple[Config, torch.device]:
    """This rank's device and the config with ``device`` and ``precision`` resolved: the one
    place a run reads ``auto`` (no ``auto`` left: the builders take the precision's value,
    :func:`rlhf.builders.run_precision`, and the saved config says what ran).

    Raises:
        ValueError in one line when the machine cannot do what the config asks.
    """
    from hybridflow_comm.devices import resolve_device, resolve_precision

    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    return dataclasses.replace(cfg, device=device.type, precision=precision.name), device


def _check_async(cfg: Config) -> None:
    """``algo.max_staleness`` agrees with the placement (every registered algorithm runs
    disaggregated: its program takes its rollouts from the rollout pool)."""
    a, mode = cfg.algo, cfg.placement.mode
    if a.max_staleness and mode != "disaggregated":
        raise ValueError(f"algo.max_staleness={a.max_staleness} needs placement.mode="
                         f"disaggregated (a {mode} run generates and trains on the same ranks, "
                         f"one after the other); set algo.max_staleness=0 or the placement")
    if a.max_staleness and a.tis_cap is None:
        raise ValueError(f"algo.max_staleness={a.max_staleness} trains on samples of older "
                         f"weights: set algo.tis_cap (the cap of the importance weight "
                         f"pi_proximal / pi_behaviour that corrects them, e.g. 2.0)")


# Recipes and overrides ---------------------------------------------------------------------
def config_from_dict(data: dict) -> Config:
    """Build and validate a :class:`Config` from a nested dict (YAML layout)."""
    return from_dict(Config, data)


def recipe_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(RECIPES_DIR) if f.endswith(".yaml"))


def load_config(args: list[str] | None = None) -> Config:
    """Recipe + overrides -> validated Config.

    Args:
        args: ``key=value`` strings.  ``algo=NAME`` selects ``recipes/NAME.yaml`` (default
            ppo), ``recipe=PATH`` a YAML file; the rest are dotted keys such as
            ``actor.optim.lr=1e-5`` or ``data.prompts_per_iter=32``.
    Raises:
        ValueError naming the key, its type and the value (or the nearest valid key).
    """
    def recipe_of(algo: str | None) -> str:
        name = algo or "ppo"
        if name not in recipe_names():
            from rlhf.programs import algorithm, algorithm_names
            from rlhf.programs.registry import load_algorithm_module

            # a user's algorithm (algo.module) names the shipped recipe it starts from
            module = next((a.partition("=")[2] for a in args or []
                           if a.startswith("algo.module=")), None)
            if module:
                load_algorithm_module(module)
            base = algorithm(name).recipe if name in algorithm_names() else None
            if base is None:
                raise ValueError(f"algo={name!r} has no recipe; shipped recipes: "
                                 f"{recipe_names()} (or pass recipe=PATH, or register the "
                                 f"algorithm with recipe=<a shipped one>)")
            name = base
        return os.path.join(RECIPES_DIR, f"{name}.yaml")

    return from_args(Config, args or [], recipe_of)


def save_config(config: Config, path: str) -> None:
    save_yaml(config, path)

