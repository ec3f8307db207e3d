"""The run-wide sections of the config (:mod:`rlhf.config`): data and batch sizes, the
algorithm, rewards, rollouts, placement, logging and checkpoints (one of each per run, beside the
per-role sections of :mod:`rlhf.config_roles`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hybridflow_comm.sizes import divisors
from rlhf.config_checks import (MAX_COUNT, MAX_ROLLOUT_TOKENS, check_at_most, check_one_of,
                                check_path, check_positive, check_seed)

PLACEMENTS = ("colocated", "split", "standalone", "disaggregated", "auto")


@dataclass(frozen=True)
class DataConfig:
    """Prompts and every batch size (their meaning: the docstring of :mod:`rlhf.config`)."""

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
        check_positive(**sizes, **{"data.temperature": self.temperature})
        # bounds first: the checks below compute with these sizes
        check_at_most(MAX_COUNT, **sizes, **{"data.min_digits": self.min_digits,
                                             "data.max_digits": self.max_digits,
                                             "data.num_operands": self.num_operands})
        check_seed("data.seed", self.seed)
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) \
                or not 0 <= self.min_new_tokens <= self.max_response_len:
            raise ValueError(f"data.min_new_tokens={self.min_new_tokens!r} must be an int in "
                             f"[0, data.max_response_len={self.max_response_len}] (0 = off)")
        if self.val_size < 0:
            raise ValueError(f"data.val_size={self.val_size} must be >= 0 (0 = no evaluation)")
        check_at_most(MAX_COUNT, **{"data.val_size": self.val_size})
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
                f"{self.mini_batch_size}; choose mini_batch_size from {divisors(rollout)}")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(f"mini_batch_size={self.mini_batch_size} is not a multiple of "
                             f"micro_batch_size={self.micro_batch_size}; choose micro_batch_size "
                             f"from {divisors(self.mini_batch_size)}")

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
    registers algorithms, policy losses or estimators (README: "From a file of your own")."""
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
        from rlhf.programs import algorithm_names
        from rlhf.programs.registry import load_algorithm_module

        if self.module is not None:  # a user's file registers algorithms before the lookup
            load_algorithm_module(self.module)
        check_one_of("algo.name", self.name, algorithm_names())
        check_one_of("algo.kl_mode", self.kl_mode, ("reward", "loss", "none"))
        check_one_of("algo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_one_of("algo.kl_ctrl", self.kl_ctrl, ("fixed", "adaptive"))
        check_positive(**{"algo.pass_k": self.pass_k, "algo.max_gen_rounds": self.max_gen_rounds})
        check_at_most(MAX_COUNT, **{"algo.pass_k": self.pass_k,
                                    "algo.max_gen_rounds": self.max_gen_rounds})
        check_positive(epochs=self.epochs, kl_target=self.kl_target, kl_horizon=self.kl_horizon,
                       lagrange_lr=self.lagrange_lr, kl_log_ratio_clamp=self.kl_log_ratio_clamp,
                       kl_k3_clamp=self.kl_k3_clamp)
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"algo.{name}={getattr(self, name)} must be in [0, 1]")
        check_at_most(MAX_COUNT, **{"algo.epochs": self.epochs})
        k = self.max_staleness
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"algo.max_staleness={k!r} must be an int >= 0 (0 = synchronous)")
        check_at_most(MAX_COUNT, **{"algo.max_staleness": k})
        if self.tis_cap is not None:
            check_positive(**{"algo.tis_cap": self.tis_cap})
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

        check_one_of("reward.kind", self.kind, ("rule", "model", "both", "function"))
        check_one_of("reward.cost_kind", self.cost_kind, ("rule", "model"))
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
        check_at_most(MAX_COUNT, **{"reward.overlong_buffer": self.overlong_buffer})
        if self.max_answer_len is not None:
            check_positive(**{"reward.max_answer_len": self.max_answer_len})
            check_at_most(MAX_COUNT, **{"reward.max_answer_len": self.max_answer_len})


@dataclass(frozen=True)
class PlacementConfig:
    """How the roles share the ranks (the modes: the docstring of :mod:`rlhf.config`)."""

    mode: str = "colocated"
    """colocated, split, standalone, disaggregated, or auto (the planner picks one and every
    layout)."""
    pool_sizes: dict[str, int] = field(default_factory=dict)
    """split: {actor: a, critic: c}; standalone: {role: n} per active role; disaggregated:
    {actor: a, rollout: r}; colocated: unused."""
    profile: str = "cpu"
    """auto: device profile of the planner's simulator (shipped name or JSON path)."""

    def __post_init__(self) -> None:
        check_one_of("placement.mode", self.mode, PLACEMENTS)
        for k, v in self.pool_sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"placement.pool_sizes.{k}={v!r} must be a positive int")
            check_at_most(MAX_COUNT, **{f"placement.pool_sizes.{k}": v})


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
    rollouts_every: int = 0
    """Every this many iterations, write the iteration's samples to
    ``<run_dir>/rollouts/iter_<k>.jsonl`` (decoded conversation, reward, turns, tool calls,
    token counts); 0 = never."""
    export_merged: bool = False
    """With LoRA (``actor.lora.rank > 0``): beside the PEFT adapter in ``<run_dir>/hf/actor``,
    also the base with the adapters merged as a plain HF checkpoint in
    ``<run_dir>/hf/actor_merged``."""

    def __post_init__(self) -> None:
        if isinstance(self.rollouts_every, bool) or not isinstance(self.rollouts_every, int) \
                or self.rollouts_every < 0:
            raise ValueError(f"log.rollouts_every={self.rollouts_every!r} must be an int >= 0")
        check_at_most(MAX_COUNT, **{"log.rollouts_every": self.rollouts_every})
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
        check_at_most(MAX_COUNT, **{"checkpoint.save_every": self.save_every,
                                    "checkpoint.keep_last": self.keep_last})
        check_path("checkpoint.dir", self.dir)
        if not self.resume:
            raise ValueError("checkpoint.resume must be 'auto', 'never' or a checkpoint path")



ROLLOUT_ENGINES = ("native", "vllm")
SANDBOX_BACKENDS = ("local", "sandbox_fusion")
SANDBOX_ISOLATIONS = ("namespaces", "none")


@dataclass(frozen=True)
class SandboxConfig:
    """Where and within which limits the built-in ``python`` tool runs model-written code
    (:mod:`rlhf.tools.sandbox`)."""

    backend: str = "local"
    """``local``: a child process on this host, isolated by Linux namespaces (``unshare``);
    ``sandbox_fusion``: a SandboxFusion service at ``url`` (what verl users run)."""
    isolation: str = "namespaces"
    """``local`` backend: ``namespaces`` (no network, a private writable /tmp and nothing else
    writable, no view of the host's files or processes); ``none`` runs the code as a plain
    child process with the limits below only (logged as a warning)."""
    url: str | None = None
    """``sandbox_fusion`` backend: the service's base URL (``http://host:8080``)."""
    wall_time_s: float = 10.0
    """Wall-clock seconds before the snippet is killed."""
    cpu_time_s: float = 5.0
    """CPU seconds (RLIMIT_CPU) of each process of the snippet."""
    memory_mb: int = 512
    """Address space of each process, MiB (RLIMIT_AS)."""
    max_processes: int = 16
    """Processes and threads the snippet may run at once (RLIMIT_NPROC, counted inside its
    own user namespace)."""
    max_output_bytes: int = 65536
    """Bytes of stdout and of stderr kept; a snippet writing more is killed."""
    max_file_mb: int = 16
    """Largest file the snippet may write (RLIMIT_FSIZE) and the size of its /tmp, MiB."""

    def __post_init__(self) -> None:
        check_one_of("rollout.sandbox.backend", self.backend, SANDBOX_BACKENDS)
        check_one_of("rollout.sandbox.isolation", self.isolation, SANDBOX_ISOLATIONS)
        if self.backend == "sandbox_fusion" and not self.url:
            raise ValueError("rollout.sandbox.backend=sandbox_fusion needs rollout.sandbox.url "
                             "(the service's base URL, e.g. http://localhost:8080)")
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes",
                     "max_output_bytes", "max_file_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"rollout.sandbox.{name}={value!r} must be a positive number")
            if isinstance(value, int):
                check_at_most(MAX_COUNT, **{f"rollout.sandbox.{name}": value})


@dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are generated: the engine and its batch and memory limits (verl's
    ``actor_rollout_ref.rollout`` knobs under the same names)."""

    engine: str = "native"
    """``native`` (:class:`engine.generation.GenerationEngine`) or ``vllm`` (the adapter
    :class:`engine.vllm_rollout.VLLMRollout`; needs vllm installed, requirements-vllm.txt)."""
    max_num_seqs: int | None = None
    """Rows decoded at once: a larger batch is generated in waves of at most this many rows
    (the same tokens as one call; vLLM schedules its own); None = every row at once."""
    gpu_memory_utilization: float = 0.5
    """In (0, 1].  vLLM: the fraction of the GPU's memory it may take (weights and KV cache).
    native on a GPU: the fraction of free device memory one wave's KV cache may take (waves
    shrink until theirs fits); unused on the CPU."""
    free_cache_engine: bool = True
    """The actor gives its generation memory back when training starts: native, the KV cache
    and the decode graphs (made again at the next iteration's first call); vLLM, it sleeps.
    False keeps them across iterations (memory to spare: no re-allocation, no re-capture).
    A rollout pool, which never trains, always keeps them."""

    tools: str | None = None
    """Tools of multi-turn rollouts, comma-separated: files whose ``@rlhf.tools.tool``
    functions and ``@rlhf.tools.environment`` classes are tools, and ``builtin:<name>``
    (``builtin:python``: run code in the sandbox); None = one-turn rollouts."""
    max_turns: int = 4
    """Assistant turns per trajectory at most (multi-turn rollouts)."""
    tool_format: str = "hermes"
    """How the model writes tool calls, a name in :data:`rlhf.tools.formats.TOOL_FORMATS`
    (checked when the tools load): ``hermes`` is ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>``, as Qwen2.5/Qwen3 emit."""
    max_tool_response_tokens: int = 256
    """A tool result longer than this many tokens is cut in the middle (marked)."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call may take; then its result is a timeout error."""
    max_parallel_tool_calls: int = 8
    """Tool calls running at once, over every trajectory of a turn."""
    overlap_tools: bool = False
    """Multi-turn rollouts in two halves whose turns alternate, so that one half's tool calls
    run while the other half generates (slow tools; each generation call has half the
    rows)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The built-in ``python`` tool's sandbox."""

    def __post_init__(self) -> None:
        check_one_of("rollout.engine", self.engine, ROLLOUT_ENGINES)
        for name in ("max_turns", "max_tool_response_tokens", "max_parallel_tool_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name}={value!r} must be a positive int")
            check_at_most(MAX_COUNT, **{f"rollout.{name}": value})
        if not self.tool_timeout_s > 0:
            raise ValueError(f"rollout.tool_timeout_s={self.tool_timeout_s!r} must be > 0")
        if self.tools is not None and not str(self.tools).strip():
            raise ValueError("rollout.tools='' names no tool; give files and/or builtin:python "
                             "(or null for one-turn rollouts)")
        n = self.max_num_seqs
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"rollout.max_num_seqs={n!r} must be a positive int (or null: "
                                 f"every row at once)")
            check_at_most(MAX_COUNT, **{"rollout.max_num_seqs": n})
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization!r} "
                             f"must be in (0, 1]")
        if not isinstance(self.free_cache_engine, bool):
            raise ValueError(f"rollout.free_cache_engine={self.free_cache_engine!r} must be "
                             f"true or false")
