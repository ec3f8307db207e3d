"""What each role worker is built from: one typed section per worker, read by field name.

The builders (:mod:`rlhf.builders`) fill these from the run config; no field has a default
here, so every hyperparameter's default lives in :mod:`rlhf.config` (or in the engine's own
dataclass that the config embeds, :class:`engine.optim_config.OptimConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.llama_spec import LlamaConfig
from engine.lora import LoraConfig
from engine.train import OptimConfig
from hybridflow_comm.devices import Precision
from rlhf.algos.kl import KLLossTerm
from rlhf.config import PolicyLossConfig, RolloutConfig, ValueLossConfig
from rlhf.task import CostRule


@dataclass(frozen=True)
class ModelSpec:
    """A model to build on the worker's layout."""

    config: LlamaConfig
    """Architecture."""
    head: str
    """``"lm"`` (actor, reference) or ``"value"`` (critic, reward and cost models)."""
    init_from: str | None
    """HF-format folder to load; None = :func:`engine.llama_spec.init_full_state_dict`."""
    seed: int
    """Initialisation seed (also of a value head missing from ``init_from``)."""
    fresh_head: bool
    """Keep the initialised value head even when ``init_from`` has one (a critic started from
    a reward model's checkpoint takes its backbone only)."""
    lora: LoraConfig | None
    """LoRA adapters on the frozen model (None: the whole model is trained)."""
    lora_init_from: str | None
    """A PEFT adapter folder the adapters start from (None: fresh, ``B = 0``)."""


@dataclass(frozen=True)
class UpdateSpec:
    """How a trained role walks one rollout batch."""

    epochs: int
    """Passes over the batch."""
    mini_batch_rows: int
    """Rows per optimizer step on one DP rank (mini_batch_size / dp)."""
    micro_batch_size: int
    """Rows per forward/backward (fixed micro-batches)."""
    max_tokens: int | None
    """Real tokens per micro-batch, padding removed (the role's use_dynamic_bsz and
    max_token_len_per_micro_batch); None = fixed micro-batches of micro_batch_size rows."""


@dataclass(frozen=True)
class ActorSpec:
    """The actor: model, optimizer, policy loss, update walk and the KL-loss term."""

    model: ModelSpec
    precision: Precision
    """The run's resolved precision (:func:`rlhf.builders.run_precision`): the model's
    parameter dtype and whether the training engine keeps float32 master weights."""
    optim: OptimConfig
    loss: PolicyLossConfig
    update: UpdateSpec
    algo: str
    """Registered algorithm: its ``policy_loss`` is the actor's loss."""
    kl_loss: KLLossTerm | None
    """The KL-as-loss term (coefficient, estimator, bounds); None = no KL loss term (KL in the
    reward, or none)."""
    temperature: float
    """Rollout sampling temperature (data.temperature): log-probs and entropy are of
    ``softmax(logits / temperature)``, the distribution the rollouts were drawn from."""
    offload_during_generation: bool
    """actor.offload_during_generation: the training state in host memory while generating
    (:class:`engine.hybrid_engine.HybridEngine`)."""
    rollout: RolloutConfig
    """The generation engine and its limits (:func:`rlhf.workers.rollout_engine.
    build_rollout`)."""
    router_replay: bool
    """actor.router_replay: rollouts carry their ``routes``, the passes replay them."""


@dataclass(frozen=True)
class ReferenceSpec:
    """The frozen reference policy."""

    model: ModelSpec
    precision: Precision
    """As the actor's: the run's resolved precision, which its forward-only engine takes."""
    temperature: float
    """As the actor's: the KL compares the two policies' distributions at one temperature."""
    max_tokens: int | None
    """As the actor's ``update.max_tokens``, for the log-prob pass (the same sequences)."""
    micro_batch_size: int
    """Rows per forward of the log-prob pass without ``max_tokens`` (data.micro_batch_size)."""


@dataclass(frozen=True)
class CriticSpec:
    """A value model (critic or Safe-RLHF cost critic)."""

    model: ModelSpec
    precision: Precision
    """As the actor's: the run's resolved precision, which its training engine takes."""
    optim: OptimConfig
    loss: ValueLossConfig
    update: UpdateSpec
    algo: str
    """Registered algorithm: its ``value_loss`` is the critic's loss."""
    value_key: str
    """Batch field of the values (``cost_values`` for the cost critic)."""
    return_key: str
    """Batch field of the value targets (``cost_returns`` for the cost critic)."""


@dataclass(frozen=True)
class ScoreSpec:
    """Where a reward or cost score comes from (a model, rules, or both, summed)."""

    model: ModelSpec | None
    """Scalar model (reward or cost model); None = rules only."""
    precision: Precision
    """As the actor's: the run's resolved precision, which the model's forward-only engine
    takes (unused without a model)."""
    model_weight: float
    """Weight of the model's score."""
    rule_weights: dict[str, float]
    """Reward rules by name (``exact``, ``partial``, ``format``); empty = none."""
    cost_rule: CostRule | None
    """Cost rule (cost worker)."""
    function: str | None
    """A user's ``compute_score`` (``path.py:name``, :mod:`rlhf.task.reward_fn`); None = none."""
    tokenizer: str | None
    """Tokenizer folder that decodes the responses (None: the built-in character tokenizer)."""
    overlong: OverlongShaping | None
    """DAPO's overlong penalty added to the score; None = off (and for costs)."""


@dataclass(frozen=True)
class OverlongShaping:
    """:func:`rlhf.algos.overlong_penalty`'s settings (``reward.overlong_*``)."""

    max_len: int
    """``data.max_response_len``."""
    buffer: int
    """Ramp length in tokens (> 0)."""
    factor: float
    """Penalty at the limit."""
