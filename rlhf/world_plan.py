"""World planning: :func:`validate_for_world` checks every layout and batch size of a
:class:`rlhf.config.Config` against the world size and resolves where each role runs (its
pool of ranks, ``dp`` when 0, its generation layout) into a :class:`WorldPlan`.  Call it
before any rank starts work::

    plan = validate_for_world(cfg, world_size=4)     # ValueError naming the values and the fix
    plan.roles["actor"].layout, plan.roles["actor"].pool

Pools are consecutive rank ranges, one per placement pool (``placement.mode``, see
:mod:`rlhf.config`).  The rollout batch must split evenly over every role's training replicas
and over the generation replicas that produce it (the actor's own, or a disaggregated run's
rollout pool), a greedy baseline's prompts over the latter: :func:`_check_rollout_split` and
:func:`_check_generation_split` hold these checks, one place each.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.sizes import divisors
from rlhf.config import Config
from rlhf.model_arch import llama_config, seq_len
from rlhf.programs import algorithm
from rlhf.programs.registry import TRAINED_ROLES


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
    ep: int = 1
    """Expert-parallel ranks of a mixture of experts (1: none)."""
    gen_ep: int = 1
    """Generation expert-parallel ranks."""

    @property
    def layout(self):
        """The role's :class:`hybridflow_comm.layout.HybridLayout`."""
        return HybridLayout(ParallelLayout(self.pp, self.tp, self.dp), self.gen_pp, self.gen_tp)

    def experts(self, num_experts: int) -> ExpertLayout | None:
        """The role's :class:`hybridflow_comm.expert_layout.ExpertLayout` for a mixture of
        ``num_experts`` experts when it splits them over EP ranks (``ep > 1``), else None."""
        if self.ep == 1:
            return None
        return ExpertLayout(self.layout, num_experts, ep=self.ep, gen_ep=self.gen_ep)

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
                             f"its pool of {size} ranks; choose pp*tp from {divisors(size)}")
        dp = lay.dp or size // mp
        if mp * dp != size:
            raise ValueError(f"{role}.layout pp={lay.pp} x tp={lay.tp} x dp={lay.dp} = "
                             f"{mp * dp} ranks but its pool has {size}; set {role}.layout.dp="
                             f"{size // mp} (or 0 to fill the pool)")
        try:
            llama_config(config.model_of(role)).check_parallel(lay.pp, lay.tp)
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
        ep, gen_ep = _check_experts(config, role, dp, gen_pp, gen_tp)
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
        _check_rollout_split(config, dp, role, f"dp={dp} replicas")
        plans[role] = RolePlan(pool=pools[of_role[role]], pp=lay.pp, tp=lay.tp, dp=dp,
                               gen_pp=gen_pp, gen_tp=gen_tp, grad_accum=accum, ep=ep,
                               gen_ep=gen_ep)
    rollout = _rollout_plan(config, pools["rollout"]) if "rollout" in pools else None
    if rollout is None:  # the actor generates: its own generation replicas take the batch
        _check_generation_split(config, plans["actor"].dp_g)
    need = d.max_prompt_len + d.max_response_len
    for role in config.roles:
        if seq_len(config.model_of(role)) < need:
            raise ValueError(f"{role}: model max_seq_len={seq_len(config.model_of(role))} < "
                             f"max_prompt_len + max_response_len = {need}")
    return WorldPlan(world_size, pools, plans, rollout)


def _check_experts(config: Config, role: str, dp: int, gen_pp: int, gen_tp: int
                   ) -> tuple[int, int]:
    """``(ep, gen_ep)`` of the role, checked against its model and layout (ValueError naming
    the values): a mixture of experts whose experts ``ep`` splits evenly, over ranks its
    ``tp x dp`` folds, with what is wired for expert parallelism."""
    lay = config.role(role).layout
    if lay.gen_ep != 1 and role != "actor":
        raise ValueError(f"{role}.layout.gen_ep={lay.gen_ep}: only the actor generates; "
                         f"leave it at 1")
    if lay.ep == 1 and lay.gen_ep == 1:
        return 1, 1
    experts = llama_config(config.model_of(role)).num_experts
    if not experts:
        raise ValueError(f"{role}.layout.ep={lay.ep}, gen_ep={lay.gen_ep} but the model has no "
                         f"experts (num_experts=0); leave them at 1")
    if lay.gen_ep > 1 and config.placement.mode == "disaggregated":
        raise ValueError(f"{role}.layout.gen_ep={lay.gen_ep} with placement.mode="
                         f"disaggregated: the rollout pool generates, every expert split over "
                         f"its gen_tp; leave gen_ep at 1")
    if lay.gen_ep > 1 and config.rollout.engine == "vllm":
        raise ValueError(f"{role}.layout.gen_ep={lay.gen_ep} with rollout.engine=vllm: vLLM "
                         f"takes every expert whole and places them itself; leave gen_ep at 1")
    try:
        hybrid = HybridLayout(ParallelLayout(lay.pp, lay.tp, dp), gen_pp, gen_tp)
        ExpertLayout(hybrid, experts, ep=lay.ep, gen_ep=lay.gen_ep)
    except ValueError as e:
        raise ValueError(f"{role}.layout: {e}") from None
    return lay.ep, lay.gen_ep


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
    _check_generation_split(config, dp_g, rollout_pool=(size, gen_pp, gen_tp))
    return RolePlan(pool=pool, pp=gen_pp, tp=gen_tp, dp=dp_g, gen_pp=gen_pp,
                    gen_tp=gen_tp, grad_accum=0)


def _check_generation_split(config: Config, dp_g: int,
                            rollout_pool: tuple[int, int, int] | None = None) -> None:
    """The rollout batch, and a greedy baseline's batch (one response per prompt), split evenly
    over the ``dp_g`` generation replicas that produce them: the actor's own, or, with
    ``rollout_pool = (size, gen_pp, gen_tp)``, a disaggregated run's rollout pool (the messages
    then name its sizes).

    Raises:
        ValueError naming the batch, the replicas and the multiple to use.
    """
    prompts, name = config.data.prompts_per_iter, config.algo.name
    if rollout_pool is None:
        who, fix, baseline = "actor", " (or change gen_tp/gen_pp)", f"{name}: the"
        replicas = baseline_replicas = f"{dp_g} generation replicas"
    else:
        size, gen_pp, gen_tp = rollout_pool
        who, fix, baseline = "rollout pool", "", f"rollout pool: {name}'s"
        its = f"its {dp_g} generation replicas (placement.pool_sizes.rollout={size}"
        replicas, baseline_replicas = f"{its} / (gen_pp={gen_pp} x gen_tp={gen_tp}))", f"{its})"
    _check_rollout_split(config, dp_g, who, replicas, fix)
    if algorithm(name).greedy_baseline and prompts % dp_g:
        raise ValueError(f"{baseline} greedy baseline batch prompts_per_iter={prompts} does not "
                         f"split over {baseline_replicas}; use a multiple of {dp_g}")


def _check_rollout_split(config: Config, n: int, who: str, replicas: str, fix: str = "") -> None:
    """The rollout batch splits evenly over ``n`` replicas; ``who`` and ``replicas`` name them
    in the message, ``fix`` adds a remedy to it."""
    rows = config.data.rollout_batch_size
    if rows % n:
        raise ValueError(f"{who}: rollout batch {rows} does not split over {replicas}; make "
                         f"prompts_per_iter x samples_per_prompt a multiple of {n}{fix}")
