"""Run configuration: frozen dataclasses (the only place a default lives, one docstring per
field), YAML recipes and ``key=value`` overrides through OmegaConf structured configs, and
:func:`validate_for_world`, which checks every size against the world before any rank starts.

Loading::

    cfg = load_config(["algo=grpo", "actor.optim.lr=1e-5", "data.prompts_per_iter=32"])
    plan = validate_for_world(cfg, world_size=4)     # ValueError naming the values and the fix
    plan.roles["actor"].layout, plan.roles["actor"].pool

``algo=NAME`` picks the shipped recipe ``rlhf/recipes/NAME.yaml`` (default ``ppo``);
``recipe=PATH`` picks any YAML file.  Every other argument is a dotted key into the config,
type-checked against the dataclasses (an unknown key names the nearest valid one).

Sections and who reads them (each worker gets its own typed section, see :mod:`rlhf.builders`)::

    actor        model, layout, optim (engine.train.OptimConfig), loss (PolicyLossConfig)
    critic, cost_critic    model, layout, optim, loss (ValueLossConfig)
    reference, reward_model, cost_model    model, layout
    algo         registry name, epochs, advantage and KL settings (the controller program)
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

import math
import os
from dataclasses import dataclass, field
from typing import Any

from engine.train import OptimConfig
from rlhf.config_io import from_args, from_dict, save_yaml, to_dict
from rlhf.programs import algorithm, algorithm_names
from rlhf.programs.common import ROLES, TRAINED_ROLES, load_algorithm_module

PLACEMENTS = ("colocated", "split", "standalone", "disaggregated", "auto")
RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")


MAX_COUNT = 10**7
"""Largest batch size, length, model dimension, layer, iteration or step count a config
accepts: a typo such as ``data.prompts_per_iter=99999999999999999999`` stops at validation
instead of allocating (or looping) for ever."""
MAX_ROLLOUT_TOKENS = 2**31
"""Largest rollout batch in tokens, ``prompts_per_iter x samples_per_prompt x
(max_prompt_len + max_response_len)``: beyond it the batch's ids alone need 16 GiB."""
MAX_MODEL_PARAMS = 2**40
"""Largest model a config accepts, in parameters estimated from its architecture."""
SEED_LIMIT = 2**32
"""Seeds lie in ``[0, SEED_LIMIT)`` (a run's seed; the sampling streams are hashed from it,
:func:`engine.sampling.derive_seed`)."""


def _positive(**values: int | float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not v > 0:
            raise ValueError(f"{name}={v!r} must be > 0")


def _at_most(limit: int, **values: int | None) -> None:
    """ValueError naming the first value above ``limit`` (None is skipped)."""
    for name, v in values.items():
        if v is not None and v > limit:
            raise ValueError(f"{name}={v!r} is larger than the sane maximum {limit:_}; use a "
                             f"smaller value")


def _seed(name: str, v: int) -> None:
    if not 0 <= v < SEED_LIMIT:
        raise ValueError(f"{name}={v!r} must be in [0, 2**32)")


def _path(name: str, v: str | None) -> None:
    if v is not None and not v.strip():
        raise ValueError(f"{name}={v!r} is empty; give a path, or null for the default")


def _one_of(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {choices}")


def _check_token_budget(section: str, max_tokens: int) -> None:
    key = f"{section}max_token_len_per_micro_batch"
    _positive(**{key: max_tokens})
    _at_most(MAX_COUNT, **{key: max_tokens})


# Sections ----------------------------------------------------------------------------------
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "tie_word_embeddings")
# The built-in task's tiny Llama: the architecture when a model has no init_from checkpoint.
BUILTIN_ARCH = dict(vocab_size=24, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, tie_word_embeddings=False, max_seq_len=64)


@dataclass(frozen=True)
class ModelConfig:
    """A model: an HF checkpoint folder (``init_from``; the architecture then comes from its
    ``config.json``), or the built-in task's tiny Llama (:data:`BUILTIN_ARCH`).  A size field
    given together with ``init_from`` must agree with the checkpoint."""

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
    max_seq_len: int | None = None
    """Longest prompt + response the run uses (None: the checkpoint's max_position_embeddings,
    or 64)."""

    def __post_init__(self) -> None:
        _path("model.init_from", self.init_from)
        for name in (*ARCH_FIELDS[:-1], "max_seq_len"):
            v = getattr(self, name)
            if v is not None:
                _positive(**{name: v})
                _at_most(MAX_COUNT, **{name: v})

    def llama(self):
        """The engine's :class:`LlamaConfig`: the checkpoint's (``init_from``) or the built-in
        architecture, with this section's explicit fields; ValueError naming both values of
        any field that disagrees with the checkpoint."""
        from engine.hf_interop import read_hf_config
        from engine.llama_spec import LlamaConfig

        explicit = {k: getattr(self, k) for k in ARCH_FIELDS if getattr(self, k) is not None}
        if self.init_from is None:
            arch = {k: BUILTIN_ARCH[k] for k in ARCH_FIELDS} | explicit
            return LlamaConfig(**arch, max_position_embeddings=self.seq_len)
        if not os.path.isfile(os.path.join(self.init_from, "config.json")):
            raise ValueError(f"model init_from={self.init_from!r} is not an HF-format folder (no "
                             f"config.json); create it with rlhf.sft / rlhf.train_rm or "
                             f"save_pretrained")
        try:
            hf = read_hf_config(self.init_from, max_position_embeddings=self.max_seq_len)
        except ValueError as e:  # an unsupported architecture, a bad value, not JSON
            raise ValueError(f"model init_from={self.init_from!r}: {e}") from None
        except (KeyError, TypeError, AttributeError, OSError) as e:
            raise ValueError(f"model init_from={self.init_from!r}: its config.json is not a "
                             f"usable HF config ({type(e).__name__}: {e})") from None
        clash = {k: (v, getattr(hf, k)) for k, v in explicit.items() if getattr(hf, k) != v}
        if clash:
            raise ValueError(f"model init_from={self.init_from!r}: the config sets " + ", ".join(
                f"{k}={mine} but its config.json has {k}={theirs}"
                for k, (mine, theirs) in clash.items()) + "; drop them or make them agree")
        return hf

    @property
    def seq_len(self) -> int:
        """max_seq_len, resolved (the checkpoint's max_position_embeddings when None)."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        if self.init_from is None:
            return BUILTIN_ARCH["max_seq_len"]
        return self.llama().max_position_embeddings


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

    def __post_init__(self) -> None:
        _positive(pp=self.pp, tp=self.tp)
        for name in ("dp", "gen_pp", "gen_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}={v!r} must be >= 0 (0 = derive it)")
        _at_most(MAX_COUNT, pp=self.pp, tp=self.tp, dp=self.dp, gen_pp=self.gen_pp,
                 gen_tp=self.gen_tp)


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

        _one_of("loss.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.mode is not None and not self.mode.strip():
            raise ValueError("loss.mode='' is empty; name a registered policy loss, or null for "
                             "the algorithm's own")
        _positive(**{"loss.clip_cov_ub": self.clip_cov_ub, "loss.kl_cov_coef": self.kl_cov_coef,
                     "loss.gmpo_clip": self.gmpo_clip, "loss.sapo_tau_pos": self.sapo_tau_pos,
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

        _one_of("loss.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.value_clip is not None:
            _positive(value_clip=self.value_clip)


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

    def __post_init__(self) -> None:
        _check_token_budget("actor.", self.max_token_len_per_micro_batch)


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

    def __post_init__(self) -> None:
        _check_token_budget("", self.max_token_len_per_micro_batch)  # critic or cost_critic


@dataclass(frozen=True)
class FrozenModelConfig:
    """A model that is never trained (reference, reward model, cost model)."""

    model: ModelConfig | None = None
    """Architecture; None = the actor's (the reference must match the actor)."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """Layout inside the role's pool."""


@dataclass(frozen=True)
class DataConfig:
    """Prompts and every batch size (see the module docstring for their meaning)."""

    train_files: str | None = None
    """Training prompts: comma-separated .jsonl / .parquet files or saved ``datasets`` folders
    (rows: prompt, ground_truth, data_source, extra_info); None = the built-in addition task."""
    val_files: str | None = None
    """Held-out prompts in the same format, evaluated every ``eval_every`` iterations and at
    the end (rlhf.evaluation); None = the built-in task's held-out problems (val_size of
    them), or no evaluation with train_files."""
    val_size: int = 256
    """Built-in task: distinct held-out problems evaluated (never in training or SFT data);
    0 = no evaluation."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt (a string or a chat list of {role, content})."""
    ground_truth_key: str = "ground_truth"
    """Field of a row holding the ground truth passed to the reward."""
    min_digits: int = 1
    """Addition task: fewest digits per operand."""
    max_digits: int = 2
    """Addition task: most digits per operand."""
    num_operands: int = 2
    """Addition task: operands per problem."""
    prompts_per_iter: int = 16
    """Prompts drawn per iteration."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt (>= 2 for the grouped algorithms: grpo, rloo)."""
    mini_batch_size: int = 8
    """Sequences per optimizer step, over all DP ranks."""
    micro_batch_size: int = 2
    """Sequences per forward/backward on one DP rank."""
    max_prompt_len: int = 8
    """Prompt tokens (left-padded to this)."""
    max_response_len: int = 6
    """Generated tokens per response at most."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    min_new_tokens: int = 0
    """Rollouts cannot end (emit EOS) before this many tokens: HF ``min_new_tokens``, vLLM
    ``min_tokens`` (engine.sampling); 0 = off.  Training rollouts only (ReMax's greedy
    baseline included): evaluation (greedy and pass@k on held-out prompts) ignores it."""
    seed: int = 0
    """Seed of the prompt order and of the task's examples."""

    def __post_init__(self) -> None:
        sizes = {f"data.{k}": getattr(self, k) for k in (
            "prompts_per_iter", "samples_per_prompt", "mini_batch_size", "micro_batch_size",
            "max_prompt_len", "max_response_len")}
        _positive(**sizes, **{"data.temperature": self.temperature})
        # bounds first: the checks below compute with these sizes
        _at_most(MAX_COUNT, **sizes, **{"data.min_digits": self.min_digits,
                                        "data.max_digits": self.max_digits,
                                        "data.num_operands": self.num_operands})
        _seed("data.seed", self.seed)
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) \
                or not 0 <= self.min_new_tokens <= self.max_response_len:
            raise ValueError(f"data.min_new_tokens={self.min_new_tokens!r} must be an int in "
                             f"[0, data.max_response_len={self.max_response_len}] (0 = off)")
        if self.val_size < 0:
            raise ValueError(f"data.val_size={self.val_size} must be >= 0 (0 = no evaluation)")
        _at_most(MAX_COUNT, **{"data.val_size": self.val_size})
        for key in ("train_files", "val_files"):
            files = getattr(self, key)
            if files is not None and not any(p.strip() for p in files.split(",")):
                raise ValueError(f"data.{key}={files!r} names no file; give comma-separated "
                                 f"paths, or null for " + ("the built-in addition task"
                                                           if key == "train_files" else
                                                           "no evaluation"))
        for key in ("prompt_key", "ground_truth_key"):
            if not getattr(self, key):
                raise ValueError(f"data.{key} is empty; give the name of a field of the rows")
        if not 1 <= self.min_digits <= self.max_digits or self.num_operands < 2:
            raise ValueError(f"need 1 <= min_digits={self.min_digits} <= max_digits="
                             f"{self.max_digits} and num_operands={self.num_operands} >= 2")
        tokens = self.rollout_batch_size * (self.max_prompt_len + self.max_response_len)
        if tokens > MAX_ROLLOUT_TOKENS:
            raise ValueError(
                f"a rollout batch of data.prompts_per_iter={self.prompts_per_iter} x "
                f"samples_per_prompt={self.samples_per_prompt} sequences of max_prompt_len="
                f"{self.max_prompt_len} + max_response_len={self.max_response_len} tokens is "
                f"{tokens:_} tokens, more than {MAX_ROLLOUT_TOKENS:_}; use smaller values")
        rollout = self.rollout_batch_size
        if rollout % self.mini_batch_size:
            raise ValueError(
                f"rollout batch prompts_per_iter={self.prompts_per_iter} x samples_per_prompt="
                f"{self.samples_per_prompt} = {rollout} is not a multiple of mini_batch_size="
                f"{self.mini_batch_size}; choose mini_batch_size from {_divisors(rollout)}")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(f"mini_batch_size={self.mini_batch_size} is not a multiple of "
                             f"micro_batch_size={self.micro_batch_size}; choose micro_batch_size "
                             f"from {_divisors(self.mini_batch_size)}")

    @property
    def rollout_batch_size(self) -> int:
        """prompts_per_iter * samples_per_prompt."""
        return self.prompts_per_iter * self.samples_per_prompt

    @property
    def num_mini_batches(self) -> int:
        """rollout_batch_size / mini_batch_size (optimizer steps per epoch)."""
        return self.rollout_batch_size // self.mini_batch_size


@dataclass(frozen=True)
class AlgoConfig:
    """Algorithm (a registry entry, :mod:`rlhf.programs`) and the controller's settings."""

    name: str = "ppo"
    """A registered algorithm: ppo, remax, safe_rlhf, grpo, rloo, reinforce_pp, ..."""
    epochs: int = 1
    """Passes over each rollout batch (every trained role)."""
    recompute_log_prob: bool = True
    """Recompute the rollout's log-probs with a training forward (compute_log_prob); False
    uses the generation engine's own (the same weights, equal to ~1e-6 with the native
    engine; keep True for a backend with other numerics, e.g. vLLM)."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda (1: Monte-Carlo return minus the critic's baseline; docs/algorithms.md)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch (ppo, safe_rlhf)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    kl_mode: str = "reward"
    """Where the KL to the reference goes: reward (penalty), loss, or none."""
    kl_estimator: str = "k1"
    """k1, k2 or k3 (Schulman)."""
    kl_log_ratio_clamp: float = 20.0
    """Every KL estimator sees log pi - log pi_ref clamped to +- this (exp(20) stays finite)."""
    kl_k3_clamp: float = 10.0
    """k3 (unbounded, ~exp(-log ratio)) is clamped to +- this per token, as in verl."""
    kl_coef: float = 0.05
    """KL coefficient (initial value if adaptive)."""
    kl_ctrl: str = "fixed"
    """fixed or adaptive (Ziegler et al.; kl_mode=reward only)."""
    kl_target: float = 0.1
    """Adaptive controller: target KL per token (the measured KL is a per-token mean)."""
    kl_horizon: float = 10000.0
    """Adaptive controller: horizon in samples."""
    pass_k: int = 4
    """grpo_passk: the k of the pass@k objective (1 <= k <= data.samples_per_prompt; k = 1
    is GRPO with the population std)."""
    max_gen_rounds: int = 4
    """dapo: generation rounds per iteration at most while dynamic sampling fills the batch
    with groups whose rewards differ (then it trains on the groups it has)."""
    tis_cap: float | None = None
    """Truncated importance sampling between the rollout's log-probs and the recomputed old
    policy's: each token's advantage times min(pi_old / pi_rollout, tis_cap) (needs
    recompute_log_prob); None = off."""
    max_staleness: int = 0
    """placement.mode=disaggregated: the rollout pool generates up to this many iterations
    ahead of the actor, so a sample may come from weights this many updates old (0 =
    synchronous; > 0 needs tis_cap, the off-policy correction, and drops older samples)."""
    module: str | None = None
    """A user's Python file (``my_algo.py``) imported before ``name`` is looked up: it
    registers algorithms, policy losses or estimators (README: "Your own algorithm")."""
    cost_limit: float = 0.0
    """Safe-RLHF: the constraint E[cost] <= cost_limit."""
    lagrange_init: float = 1.0
    """Safe-RLHF: initial multiplier (>= 0)."""
    lagrange_lr: float = 0.1
    """Safe-RLHF: multiplier step size."""
    lagrange_max: float | None = None
    """Safe-RLHF: upper bound of the multiplier; None = unbounded."""

    def __post_init__(self) -> None:
        from rlhf.algos import KL_ESTIMATORS

        if self.module is not None:  # a user's file registers algorithms before the lookup
            load_algorithm_module(self.module)
        _one_of("algo.name", self.name, algorithm_names())
        _one_of("algo.kl_mode", self.kl_mode, ("reward", "loss", "none"))
        _one_of("algo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of("algo.kl_ctrl", self.kl_ctrl, ("fixed", "adaptive"))
        _positive(**{"algo.pass_k": self.pass_k, "algo.max_gen_rounds": self.max_gen_rounds})
        _at_most(MAX_COUNT, **{"algo.pass_k": self.pass_k,
                               "algo.max_gen_rounds": self.max_gen_rounds})
        _positive(epochs=self.epochs, kl_target=self.kl_target, kl_horizon=self.kl_horizon,
                  lagrange_lr=self.lagrange_lr, kl_log_ratio_clamp=self.kl_log_ratio_clamp,
                  kl_k3_clamp=self.kl_k3_clamp)
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"algo.{name}={getattr(self, name)} must be in [0, 1]")
        _at_most(MAX_COUNT, **{"algo.epochs": self.epochs})
        k = self.max_staleness
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"algo.max_staleness={k!r} must be an int >= 0 (0 = synchronous)")
        _at_most(MAX_COUNT, **{"algo.max_staleness": k})
        if self.tis_cap is not None:
            _positive(**{"algo.tis_cap": self.tis_cap})
            if not self.recompute_log_prob:
                raise ValueError("algo.tis_cap corrects the rollout's log-probs against the "
                                 "recomputed old policy's: it needs algo.recompute_log_prob=true")
        if self.kl_coef < 0 or self.lagrange_init < 0:
            raise ValueError(f"kl_coef={self.kl_coef} and lagrange_init={self.lagrange_init} "
                             f"must be >= 0")
        if self.lagrange_max is not None and not self.lagrange_max >= self.lagrange_init:
            raise ValueError(f"algo.lagrange_max={self.lagrange_max} must be >= lagrange_init="
                             f"{self.lagrange_init} (or null: unbounded)")
        if self.kl_ctrl == "adaptive" and self.kl_mode != "reward":
            raise ValueError(f"algo.kl_ctrl='adaptive' needs algo.kl_mode='reward', got "
                             f"kl_mode={self.kl_mode!r}")

    @property
    def kl_loss_coef(self) -> float | None:
        """The actor's KL-loss coefficient: kl_coef with kl_mode=loss, else None."""
        return self.kl_coef if self.kl_mode == "loss" else None
@dataclass(frozen=True)
class RewardConfig:
    """Where rewards (and Safe-RLHF costs) come from."""

    kind: str = "rule"
    """rule (the built-in rule functions), model (reward model), both (rules + model, summed),
    or function (a user's ``compute_score`` in ``reward.function``)."""
    function: str | None = None
    """kind=function: ``path/to/file.py:name`` of ``compute_score(data_source, solution_str,
    ground_truth, extra_info=None) -> float | dict`` (verl's signature; a dict carries
    ``score`` plus fields logged as ``reward/<field>``)."""
    rule_weights: dict[str, float] = field(default_factory=lambda: {"exact": 1.0})
    """Weights of the built-in rule functions: exact, partial, format."""
    model_weight: float = 1.0
    """Weight of the reward model's score when kind=both."""
    cost_kind: str = "rule"
    """Safe-RLHF cost source: rule (:class:`rlhf.task.CostRule`) or model (cost model)."""
    forbidden_digit: str = "7"
    """Cost rule: every occurrence of this digit in a response costs 1."""
    max_answer_len: int | None = None
    """Cost rule: every character beyond this length costs 1; None = no length term."""
    overlong_buffer: int = 0
    """DAPO's overlong shaping: a penalty ramping linearly to -overlong_penalty_factor over
    the last this many tokens before data.max_response_len (rlhf.algos.overlong_penalty);
    0 = off."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the length limit when overlong_buffer > 0."""

    def __post_init__(self) -> None:
        from rlhf.task.rewards import REWARD_FUNCTIONS

        _one_of("reward.kind", self.kind, ("rule", "model", "both", "function"))
        _one_of("reward.cost_kind", self.cost_kind, ("rule", "model"))
        if (self.kind == "function") != (self.function is not None):
            raise ValueError(f"reward.kind={self.kind!r} and reward.function={self.function!r}: "
                             f"a reward function needs both kind=function and "
                             f"function=path/to/file.py:name")
        unknown = sorted(set(self.rule_weights) - set(REWARD_FUNCTIONS))
        if unknown:
            raise ValueError(f"reward.rule_weights has unknown components {unknown}; valid: "
                             f"{sorted(REWARD_FUNCTIONS)}")
        if self.kind in ("rule", "both") and not any(self.rule_weights.values()):
            raise ValueError(f"reward.kind={self.kind!r} but every rule weight is 0: "
                             f"{self.rule_weights}")
        if self.forbidden_digit not in "0123456789" or len(self.forbidden_digit) != 1:
            raise ValueError(f"reward.forbidden_digit={self.forbidden_digit!r} must be one digit")
        if self.overlong_buffer < 0 or self.overlong_penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer={self.overlong_buffer} and "
                             f"overlong_penalty_factor={self.overlong_penalty_factor} must be "
                             f">= 0 (buffer 0 = off)")
        _at_most(MAX_COUNT, **{"reward.overlong_buffer": self.overlong_buffer})
        if self.max_answer_len is not None:
            _positive(**{"reward.max_answer_len": self.max_answer_len})
            _at_most(MAX_COUNT, **{"reward.max_answer_len": self.max_answer_len})


@dataclass(frozen=True)
class PlacementConfig:
    """How the roles share the ranks (see the module docstring)."""

    mode: str = "colocated"
    """colocated, split, standalone, disaggregated, or auto (the planner picks one and every
    layout)."""
    pool_sizes: dict[str, int] = field(default_factory=dict)
    """split: {actor: a, critic: c}; standalone: {role: n} per active role; disaggregated:
    {actor: a, rollout: r}; colocated: unused."""
    profile: str = "cpu"
    """auto: device profile of the planner's simulator (shipped name or JSON path)."""

    def __post_init__(self) -> None:
        _one_of("placement.mode", self.mode, PLACEMENTS)
        for k, v in self.pool_sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"placement.pool_sizes.{k}={v!r} must be a positive int")
            _at_most(MAX_COUNT, **{f"placement.pool_sizes.{k}": v})


@dataclass(frozen=True)
class LogConfig:
    """Metrics and progress output."""

    run_name: str = "run"
    """Name of the run; output goes to ``<runs_dir>/<run_name>/``."""
    runs_dir: str = "runs"
    """Parent folder of all runs."""
    tensorboard: bool = True
    """Write TensorBoard event files beside metrics.jsonl."""
    progress: bool = True
    """Show a progress bar with reward and tokens/s."""
    plot: bool = True
    """Write reward and timing curves to a PNG at the end."""

    def __post_init__(self) -> None:
        if not self.run_name or "/" in self.run_name or self.run_name in (".", ".."):
            raise ValueError(f"log.run_name={self.run_name!r} must be a plain folder name")
        if not self.runs_dir.strip():
            raise ValueError(f"log.runs_dir={self.runs_dir!r} is empty; give a folder (the "
                             f"default is 'runs')")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.run_name)


@dataclass(frozen=True)
class CheckpointConfig:
    """Atomic checkpoints and resume."""

    save_every: int = 0
    """Save every this many iterations; 0 = only at the end."""
    keep_last: int = 2
    """Complete checkpoints to keep (older ones are deleted); 0 = keep all."""
    resume: str = "auto"
    """auto (latest complete checkpoint, if any), never, or the path of one checkpoint."""
    dir: str | None = None
    """Checkpoint root; None = ``<run_dir>/checkpoints``."""

    def __post_init__(self) -> None:
        if self.save_every < 0 or self.keep_last < 0:
            raise ValueError(f"checkpoint.save_every={self.save_every} and keep_last="
                             f"{self.keep_last} must be >= 0")
        _at_most(MAX_COUNT, **{"checkpoint.save_every": self.save_every,
                               "checkpoint.keep_last": self.keep_last})
        _path("checkpoint.dir", self.dir)
        if not self.resume:
            raise ValueError("checkpoint.resume must be 'auto', 'never' or a checkpoint path")


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

    def __post_init__(self) -> None:
        _positive(iterations=self.iterations)
        if self.eval_every < 0:
            raise ValueError(f"eval_every={self.eval_every} must be >= 0 (0 = at the end only)")
        if self.eval_pass_k < 0:
            raise ValueError(f"eval_pass_k={self.eval_pass_k} must be >= 0 (0 = off)")
        _at_most(MAX_COUNT, iterations=self.iterations, eval_every=self.eval_every,
                 eval_pass_k=self.eval_pass_k)
        _seed("seed", self.seed)
        _path("tokenizer", self.tokenizer)
        spec = algorithm(self.algo.name)
        from rlhf.algos import POLICY_LOSSES

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
        return algorithm(self.algo.name).roles(kl_mode=self.algo.kl_mode,
                                               reward_kind=self.reward.kind,
                                               cost_kind=self.reward.cost_kind)

    def role(self, name: str) -> ActorConfig | CriticConfig | FrozenModelConfig:
        if name not in ROLES:
            raise ValueError(f"role={name!r} is not one of {ROLES}")
        return getattr(self, name)

    def model_of(self, name: str) -> ModelConfig:
        """The architecture of role ``name`` (the actor's unless the role sets its own)."""
        return self.role(name).model or self.actor.model

    def to_dict(self) -> dict:
        """Plain nested dict (loads back with :func:`config_from_dict`)."""
        return to_dict(self)


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


# World checks ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolePlan:
    """Where one role runs, resolved against the world."""

    pool: tuple[int, ...]
    """Global ranks of the role's pool (layout rank i = pool[i])."""
    pp: int
    """Training pipeline stages."""
    tp: int
    """Training tensor shards."""
    dp: int
    """Training data replicas (resolved, never 0)."""
    gen_pp: int
    """Generation pipeline stages (= pp except for an actor that generates: a disaggregated
    run's actor does not, the rollout pool does)."""
    gen_tp: int
    """Generation tensor shards (= tp except for an actor that generates)."""
    grad_accum: int
    """Micro-batches per optimizer step on one DP rank (trained roles with fixed micro-batches;
    0 otherwise: none, or set per mini-batch by the token budget with use_dynamic_bsz)."""

    @property
    def layout(self):
        """The role's :class:`hybridflow_comm.layout.HybridLayout`."""
        from hybridflow_comm.layout import HybridLayout, ParallelLayout

        return HybridLayout(ParallelLayout(self.pp, self.tp, self.dp), self.gen_pp, self.gen_tp)

    @property
    def dp_g(self) -> int:
        """Generation replicas (the layout's ``dp_g``)."""
        return self.layout.dp_g


@dataclass(frozen=True)
class WorldPlan:
    """Every active role resolved against the world (from :func:`validate_for_world`)."""

    world_size: int
    """Ranks of the job."""
    pools: dict[str, tuple[int, ...]]
    """Pool name -> global ranks."""
    roles: dict[str, RolePlan]
    """Active role -> its plan."""
    rollout: RolePlan | None = None
    """placement.mode=disaggregated: the rollout pool, generation only (its training sizes
    are its generation layout ``gen_pp x gen_tp x dp_g``); None otherwise."""


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in ascending order (O(sqrt n): ``n`` may come straight from a user)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _pools(config: Config, world_size: int) -> tuple[dict[str, int], dict[str, str]]:
    """(pool name -> size, role -> pool name)."""
    mode, sizes, roles = config.placement.mode, config.placement.pool_sizes, config.roles
    if mode == "colocated":
        return {"all": world_size}, {r: "all" for r in roles}
    if mode == "auto":
        raise ValueError("placement.mode='auto' must be resolved before validate_for_world: "
                         "cfg = rlhf.planner.config_bridge.resolve_config(cfg, world_size)")
    if mode == "disaggregated":
        of_role = dict.fromkeys(roles, "actor")
        names = ["actor", "rollout"]
    elif mode == "split":
        of_role = {r: "actor" if r in ("actor", "reference") else "critic" for r in roles}
        names = ["actor", "critic"]
        if "critic" not in of_role.values():
            raise ValueError(f"placement.mode='split' needs a role besides actor/reference; "
                             f"algo={config.algo.name} uses {list(roles)}: use colocated")
    else:
        of_role = {r: r for r in roles}
        names = list(roles)
    if sorted(sizes) != sorted(names):
        raise ValueError(f"placement.mode={mode!r} needs placement.pool_sizes with keys "
                         f"{names}, got {sizes}")
    if sum(sizes.values()) != world_size:
        raise ValueError(f"placement.pool_sizes={sizes} sum to {sum(sizes.values())} but "
                         f"world_size={world_size}; make them sum to {world_size}")
    return {n: sizes[n] for n in names}, of_role


def validate_for_world(config: Config, world_size: int) -> WorldPlan:
    """Check every layout and batch size of ``config`` against ``world_size``; resolve pools,
    ``dp`` (when 0) and the generation layout.  Call it before any rank starts work.

    Raises:
        ValueError naming the offending values and a fix.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    pool_sizes, of_role = _pools(config, world_size)
    pools, start = {}, 0
    for name, size in pool_sizes.items():
        pools[name] = tuple(range(start, start + size))
        start += size
    d = config.data
    plans = {}
    for role in config.roles:
        lay = config.role(role).layout
        size = pool_sizes[of_role[role]]
        mp = lay.pp * lay.tp
        if size % mp:
            raise ValueError(f"{role}.layout pp={lay.pp} x tp={lay.tp} = {mp} does not divide "
                             f"its pool of {size} ranks; choose pp*tp from {_divisors(size)}")
        dp = lay.dp or size // mp
        if mp * dp != size:
            raise ValueError(f"{role}.layout pp={lay.pp} x tp={lay.tp} x dp={lay.dp} = "
                             f"{mp * dp} ranks but its pool has {size}; set {role}.layout.dp="
                             f"{size // mp} (or 0 to fill the pool)")
        try:
            config.model_of(role).llama().check_parallel(lay.pp, lay.tp)
        except ValueError as e:
            raise ValueError(f"{role}: {e}") from None
        gen_pp, gen_tp = _generation_layout(config, role)
        try:
            _ = RolePlan(pool=pools[of_role[role]], pp=lay.pp, tp=lay.tp, dp=dp,
                         gen_pp=gen_pp, gen_tp=gen_tp, grad_accum=0).layout
        except ValueError as e:
            raise ValueError(f"{role}.layout: {e}") from None
        if role == "actor" and "rollout" in pools:  # the rollout pool generates: the actor
            gen_pp, gen_tp = lay.pp, lay.tp           # holds training state only (no gen slots)
        accum = 0
        if role in TRAINED_ROLES and config.role(role).use_dynamic_bsz:
            if d.mini_batch_size % dp:  # micro-batches by tokens: only the rows must split
                raise ValueError(
                    f"{role}: mini_batch_size={d.mini_batch_size} must be a multiple of dp={dp} "
                    f"(use_dynamic_bsz); change data.mini_batch_size (or the {role} layout)")
        elif role in TRAINED_ROLES:
            per_step = dp * d.micro_batch_size
            if d.mini_batch_size % per_step:
                raise ValueError(
                    f"{role}: mini_batch_size={d.mini_batch_size} must be a multiple of dp={dp} "
                    f"x micro_batch_size={d.micro_batch_size} = {per_step}; change "
                    f"data.micro_batch_size or data.mini_batch_size (or the {role} layout)")
            accum = d.mini_batch_size // per_step
        if d.rollout_batch_size % dp:
            raise ValueError(f"{role}: rollout batch {d.rollout_batch_size} does not split over "
                             f"dp={dp} replicas; make prompts_per_iter x samples_per_prompt a "
                             f"multiple of {dp}")
        plans[role] = RolePlan(pool=pools[of_role[role]], pp=lay.pp, tp=lay.tp, dp=dp,
                               gen_pp=gen_pp, gen_tp=gen_tp, grad_accum=accum)
    rollout = _rollout_plan(config, pools["rollout"]) if "rollout" in pools else None
    dp_g = plans["actor"].dp_g  # the actor's own generation replicas (none when disaggregated)
    if rollout is None and d.rollout_batch_size % dp_g:
        raise ValueError(f"actor: rollout batch {d.rollout_batch_size} does not split over "
                         f"{dp_g} generation replicas; make prompts_per_iter x "
                         f"samples_per_prompt a multiple of {dp_g} (or change gen_tp/gen_pp)")
    if rollout is None and algorithm(config.algo.name).greedy_baseline \
            and d.prompts_per_iter % dp_g:
        raise ValueError(f"{config.algo.name}: the greedy baseline batch prompts_per_iter="
                         f"{d.prompts_per_iter} does not split over {dp_g} generation replicas; "
                         f"use a multiple of {dp_g}")
    need = d.max_prompt_len + d.max_response_len
    for role in config.roles:
        if config.model_of(role).seq_len < need:
            raise ValueError(f"{role}: model max_seq_len={config.model_of(role).seq_len} < "
                             f"max_prompt_len + max_response_len = {need}")
    return WorldPlan(world_size, pools, plans, rollout)


def _generation_layout(config: Config, role: str) -> tuple[int, int]:
    """``(gen_pp, gen_tp)`` as configured: the actor's ``layout.gen_*`` (0 = its training
    value); a role that does not generate keeps its training layout."""
    lay = config.role(role).layout
    return (lay.gen_pp or lay.pp, lay.gen_tp or lay.tp) if role == "actor" else (lay.pp, lay.tp)


def _rollout_plan(config: Config, pool: tuple[int, ...]) -> RolePlan:
    """The rollout pool of a disaggregated run: the actor's configured generation layout
    (``actor.layout.gen_pp x gen_tp``) replicated over the pool; every generation replica
    takes an equal share.  (The actor's own plan there has no generation side: its
    ``gen_pp x gen_tp`` is its training ``pp x tp``, so its flat buffer holds its training
    shard only.)"""
    gen_pp, gen_tp = _generation_layout(config, "actor")
    mp, size = gen_pp * gen_tp, len(pool)
    if size % mp:
        raise ValueError(f"placement.pool_sizes.rollout={size} is not a multiple of the "
                         f"generation layout actor.layout.gen_pp={gen_pp} x gen_tp="
                         f"{gen_tp} = {mp}; choose a multiple of {mp} or change gen_tp")
    dp_g = size // mp
    rows = config.data.rollout_batch_size
    if rows % dp_g:
        raise ValueError(f"rollout pool: rollout batch {rows} does not split over its {dp_g} "
                         f"generation replicas (placement.pool_sizes.rollout={size} / (gen_pp="
                         f"{gen_pp} x gen_tp={gen_tp})); make prompts_per_iter x "
                         f"samples_per_prompt a multiple of {dp_g}")
    prompts = config.data.prompts_per_iter
    if algorithm(config.algo.name).greedy_baseline and prompts % dp_g:
        raise ValueError(f"rollout pool: {config.algo.name}'s greedy baseline batch "
                         f"prompts_per_iter={prompts} does not split over its {dp_g} generation "
                         f"replicas (placement.pool_sizes.rollout={size}); use a multiple of "
                         f"{dp_g}")
    return RolePlan(pool=pool, pp=gen_pp, tp=gen_tp, dp=dp_g, gen_pp=gen_pp,
                    gen_tp=gen_tp, grad_accum=0)
