"""The per-role sections of the config (:mod:`rlhf.config`): a model and its parallel layout,
the actor's policy loss, a critic's value loss, and the sections of the actor, of a critic and
of a frozen model that hold them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.lora_config import LoraConfig
from engine.optim_config import OptimConfig
from rlhf.config_checks import (MAX_COUNT, check_at_most, check_one_of, check_path,
                                check_positive, check_token_budget)

ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "tie_word_embeddings", "num_experts", "num_experts_per_tok")
# The built-in task's tiny Llama: the architecture when a model has no init_from checkpoint
# (with num_experts > 0 a Mixtral-style mixture of experts).
BUILTIN_ARCH = dict(vocab_size=24, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, tie_word_embeddings=False, num_experts=0,
                    num_experts_per_tok=2, max_seq_len=64)
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "num_experts_per_tok", "max_seq_len")


@dataclass(frozen=True)
class ModelConfig:
    """A model: an HF checkpoint folder (``init_from``; the architecture then comes from its
    ``config.json``), or the built-in task's tiny Llama (:data:`BUILTIN_ARCH`).  A size field
    given together with ``init_from`` must agree with the checkpoint.  The section is data:
    :mod:`rlhf.model_arch` reads the checkpoint and resolves the engine's architecture."""

    init_from: str | None = None
    """HF checkpoint folder (config.json + safetensors, e.g. the SFT warm start); None = random
    init of the architecture below."""
    vocab_size: int | None = None
    """Token count (None: the checkpoint's, or 24, the built-in tokenizer's)."""
    hidden_size: int | None = None
    """Model width (None: the checkpoint's, or 64)."""
    intermediate_size: int | None = None
    """SwiGLU width; divisible by every tp used (None: the checkpoint's, or 128)."""
    num_layers: int | None = None
    """Decoder layers; divisible by every pp used (None: the checkpoint's, or 2)."""
    num_heads: int | None = None
    """Query heads (None: the checkpoint's, or 4)."""
    num_kv_heads: int | None = None
    """Key/value heads; divisible by tp (None: the checkpoint's, or 2)."""
    tie_word_embeddings: bool | None = None
    """Share the embedding with the LM head (None: the checkpoint's, or false)."""
    num_experts: int | None = None
    """Experts of every layer's MLP, each of width intermediate_size (None: the
    checkpoint's, or 0: a dense MLP; the built-in model with experts is a Mixtral)."""
    num_experts_per_tok: int | None = None
    """Experts each token is routed to (None: the checkpoint's, or 2)."""
    max_seq_len: int | None = None
    """Longest prompt + response the run uses (None: the checkpoint's max_position_embeddings,
    or 64)."""

    def __post_init__(self) -> None:
        check_path("model.init_from", self.init_from)
        for name in SIZE_FIELDS:
            v = getattr(self, name)
            if v is not None:
                check_positive(**{name: v})
                check_at_most(MAX_COUNT, **{name: v})
        if self.num_experts is not None and (isinstance(self.num_experts, bool)
                                             or not isinstance(self.num_experts, int)
                                             or self.num_experts < 0):
            raise ValueError(f"model.num_experts={self.num_experts!r} must be an int >= 0 (0 = "
                             f"a dense MLP)")
        check_at_most(MAX_COUNT, num_experts=self.num_experts)


@dataclass(frozen=True)
class LayoutConfig:
    """Parallel layout of one role inside its pool (the paper's ``p-t-d``, ``p_g-t_g``)."""

    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor shards."""
    dp: int = 0
    """Data replicas; 0 = fill the pool (pool size / (pp * tp))."""
    gen_pp: int = 0
    """Generation pipeline stages (actor only); 0 = pp.  Must divide pp."""
    gen_tp: int = 0
    """Generation tensor shards (actor only); 0 = tp.  Must divide tp."""
    ep: int = 1
    """Expert-parallel ranks of a mixture of experts: each trains ``num_experts / ep`` whole
    experts, folded over the ``tp x dp`` ranks of its stage (tokens move by all-to-all)."""
    gen_ep: int = 1
    """Generation expert-parallel ranks (actor only; must divide ep).  1: every generation
    TP group holds every expert, split over gen_tp (the only value supported yet)."""

    def __post_init__(self) -> None:
        check_positive(pp=self.pp, tp=self.tp, ep=self.ep, gen_ep=self.gen_ep)
        for name in ("dp", "gen_pp", "gen_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}={v!r} must be >= 0 (0 = derive it)")
        check_at_most(MAX_COUNT, pp=self.pp, tp=self.tp, dp=self.dp, gen_pp=self.gen_pp,
                      gen_tp=self.gen_tp, ep=self.ep, gen_ep=self.gen_ep)


@dataclass(frozen=True)
class PolicyLossConfig:
    """The actor's clipped policy loss (:func:`rlhf.algos.actor_loss`)."""

    clip_ratio: float = 0.2
    """PPO clip epsilon."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon (DAPO); None = clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (DAPO clip-higher); None = clip_ratio."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound (> 1) for negative advantages (Ye et al. 2020); None disables it."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (formulas: rlhf.algos.agg_loss); over the whole mini-batch."""
    mode: str | None = None
    """A registered policy loss (rlhf.algos.POLICY_LOSSES: ppo, gspo, cispo, clip_cov, kl_cov,
    gmpo, sapo, gpg, or one a user's algo.module registers); None = the algorithm's own."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is cut (Cui et al. 2025)."""
    clip_cov_lb: float = 1.0
    """clip_cov: tokens are cut only with covariance in [clip_cov_lb, clip_cov_ub]."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper covariance bound."""
    kl_cov_ratio: float = 0.002
    """kl_cov: fraction of tokens (highest covariance) that get the KL penalty."""
    kl_cov_coef: float = 1.0
    """kl_cov: coefficient of |log pi - log pi_old| on those tokens."""
    gmpo_clip: float = 0.4
    """gmpo: per-token log-ratio clip range (+- this, in log space; Zhao et al. 2025)."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages (Gao et al. 2025)."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature for negative advantages."""

    def __post_init__(self) -> None:
        from rlhf.algos import LOSS_AGG_MODES

        check_one_of("loss.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.mode is not None and not self.mode.strip():
            raise ValueError("loss.mode='' is empty; name a registered policy loss, or null for "
                             "the algorithm's own")
        check_positive(**{"loss.clip_cov_ub": self.clip_cov_ub,
                          "loss.kl_cov_coef": self.kl_cov_coef, "loss.gmpo_clip": self.gmpo_clip,
                          "loss.sapo_tau_pos": self.sapo_tau_pos,
                          "loss.sapo_tau_neg": self.sapo_tau_neg})
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"loss.{name}={v} must be in [0, 1]")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"loss.clip_cov_lb={self.clip_cov_lb} must be < clip_cov_ub="
                             f"{self.clip_cov_ub}")
        for name in ("clip_ratio", "clip_ratio_low"):
            v = getattr(self, name)
            if v is not None and not 0 < v < 1:
                raise ValueError(f"loss.{name}={v} must be in (0, 1)")
        if self.clip_ratio_high is not None and not self.clip_ratio_high > 0:
            raise ValueError(f"loss.clip_ratio_high={self.clip_ratio_high} must be > 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"loss.clip_ratio_c={self.clip_ratio_c} must be > 1 (or null)")
        if self.entropy_coeff < 0:
            raise ValueError(f"loss.entropy_coeff={self.entropy_coeff} must be >= 0")


@dataclass(frozen=True)
class ValueLossConfig:
    """A critic's clipped value loss (:func:`rlhf.algos.value_loss`)."""

    value_clip: float | None = 0.2
    """Value clip range around the rollout's values; None disables it."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (formulas: rlhf.algos.agg_loss); over the whole mini-batch."""

    def __post_init__(self) -> None:
        from rlhf.algos import LOSS_AGG_MODES

        check_one_of("loss.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.value_clip is not None:
            check_positive(value_clip=self.value_clip)


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters on a frozen base (``actor.lora``, ``critic.lora``; :mod:`engine.lora`):
    the base weights get no gradient, no master copy and no optimizer state, and after the
    first transition only the adapters move to the generation side."""

    rank: int = 0
    """The adapters' rank r; 0 = no LoRA (the whole model is trained)."""
    alpha: float = 16.0
    """The delta is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    target_modules: Any = "all-linear"
    """'all-linear' (every linear layer but the LM head, as PEFT) or a list of HF module
    names, e.g. [q_proj, v_proj] (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)."""
    init_from: str | None = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue
    from; its rank, alpha and target modules must be this section's."""

    def __post_init__(self) -> None:
        check_path("lora.init_from", self.init_from)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank={self.rank!r} must be an int >= 0 (0: no LoRA)")
        check_at_most(MAX_COUNT, **{"lora.rank": self.rank})
        # alpha, dropout and the module names are checked whatever the rank
        LoraConfig(rank=max(self.rank, 1), alpha=self.alpha, dropout=self.dropout,
                   target_modules=self.target_modules)
        if not self.rank and self.init_from is not None:
            raise ValueError(f"lora.init_from={self.init_from!r} needs lora.rank > 0")

    def engine_config(self):
        """The engine's :class:`engine.lora_config.LoraConfig`, or None when rank is 0."""
        if not self.rank:
            return None
        return LoraConfig(rank=self.rank, alpha=float(self.alpha), dropout=float(self.dropout),
                          target_modules=self.target_modules)


@dataclass(frozen=True)
class ActorConfig:
    """The policy: trained, generates with the HybridEngine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture (also the reference's)."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """Training layout, and the generation layout (gen_pp, gen_tp)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, clipping and pipeline schedule (the engine's own dataclass)."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss."""
    use_dynamic_bsz: bool = False
    """Form the micro-batches by tokens, not rows: each holds sequences of at most
    max_token_len_per_micro_batch real tokens in total and runs as one packed row with the
    padding removed (engine.micro_batches); the loss and gradients are the padded path's.
    data.micro_batch_size is then unused by this role.  Also the actor's and the reference's
    log-prob passes."""
    max_token_len_per_micro_batch: int = 4096
    """use_dynamic_bsz: real tokens per micro-batch on one DP rank (>= max_prompt_len +
    max_response_len, the longest sequence)."""
    offload_during_generation: bool = False
    """Park the training state (fp32 masters, Adam moments, the gradient buffer) in host
    memory while the actor generates, so that generation's KV cache can use that device
    memory; it comes back bit for bit before the next log-prob pass.  Costs two host copies
    of that state per iteration.  Unused by a disaggregated actor (it does not generate)."""
    lora: LoraSection = field(default_factory=LoraSection)
    """LoRA adapters (rank 0: off).  With adapters the reference policy is the actor's own
    base with the adapters off: no reference model is built."""
    router_aux_loss_coef: float | None = None
    """A mixture of experts: weight of the routers' load-balancing loss in every update
    (engine.router_loss.RouterLoss, logged as actor/router_aux_loss); None = the checkpoint's
    ``router_aux_loss_coef``.  A dense model refuses a value."""
    router_replay: bool = False
    """A mixture of experts: generation records the experts every layer sent each token to,
    and the log-prob passes, the reference and the update replay them (engine.route_trace.
    RouteTrace): the experts of the rollout, the current router's probabilities of them."""

    def __post_init__(self) -> None:
        check_token_budget("actor.", self.max_token_len_per_micro_batch)
        coef = self.router_aux_loss_coef
        if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float))
                                 or not coef >= 0):
            raise ValueError(f"actor.router_aux_loss_coef={coef!r} must be a number >= 0 (or "
                             f"null: the checkpoint's)")


@dataclass(frozen=True)
class CriticConfig:
    """A value model (critic, Safe-RLHF cost critic): trained."""

    model: ModelConfig | None = None
    """Architecture; None = the actor's (with a value head)."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """Training layout inside the role's pool."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, clipping and pipeline schedule (the engine's own dataclass)."""
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    """Value loss."""
    use_dynamic_bsz: bool = False
    """As actor.use_dynamic_bsz, for this critic's updates and value passes."""
    max_token_len_per_micro_batch: int = 4096
    """As actor.max_token_len_per_micro_batch."""
    lora: LoraSection = field(default_factory=LoraSection)
    """LoRA adapters on the value model (rank 0: off; the value head is trained in full)."""

    def __post_init__(self) -> None:
        check_token_budget("", self.max_token_len_per_micro_batch)  # critic or cost_critic


@dataclass(frozen=True)
class FrozenModelConfig:
    """A model that is never trained (reference, reward model, cost model)."""

    model: ModelConfig | None = None
    """Architecture; None = the actor's (the reference must match the actor)."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """Layout inside the role's pool."""

