"""From a run config to a plan and back: ``placement.mode=auto`` resolved by the planner.

:func:`plan_for_config` searches only mappings the runtime can run: the placements
:mod:`rlhf.config` knows (``colocated``, ``split`` = actor + reference | the rest,
``standalone``), pools of consecutive ranks, and layouts that pass :func:`validate_for_world`
(batch sizes divisible by every dp and dp_g).  It returns dotted overrides::

    {"placement.mode": "split", "placement.pool_sizes": {"actor": 2, "critic": 2},
     "actor.layout.pp": 1, "actor.layout.tp": 2, "actor.layout.dp": 1,
     "actor.layout.gen_pp": 1, "actor.layout.gen_tp": 1, "critic.layout.pp": 1, ...}
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.planner.dataflow import RoleSpec, dataflow_from_config
from rlhf.planner.profile import DeviceProfile, load_profile
from rlhf.planner.report import placement_kind
from rlhf.planner.search import Mapping, Planner
from rlhf.planner.strategy import Strategy
from rlhf.programs import algorithm


@dataclass(frozen=True)
class ConfigPlan:
    """The planner's choice for a config, as overrides and as the mapping it came from."""

    overrides: dict
    """Dotted config keys -> values (placement and every active role's layout)."""
    mapping: Mapping
    """The chosen mapping with its predicted stage times."""
    candidates: tuple[Mapping, ...]
    """Runnable mappings, fastest predicted first (``candidates[0]`` is ``mapping``)."""


def _runnable_kind(roles: tuple[str, ...]):
    def ok(part, alloc) -> bool:
        kind = placement_kind(part)
        if kind == "split":                    # actor + reference | everything else
            return "reference" in roles and len(part) == 2
        if kind == "mixed" and "reference" not in roles and len(part) == 2 \
                and ("actor",) in part:        # no reference: split is actor | the rest
            return True
        return kind in ("colocated", "standalone")
    return ok


def _batch_filter(cfg):
    d, greedy_baseline = cfg.data, algorithm(cfg.algo.name).greedy_baseline

    def ok(role: RoleSpec, s: Strategy) -> bool:
        if d.rollout_batch_size % s.dp:
            return False
        if role.trained and d.mini_batch_size % (s.dp * d.micro_batch_size):
            return False
        if role.generations:
            if d.rollout_batch_size % s.dp_g:
                return False
            if greedy_baseline and d.prompts_per_iter % s.dp_g:
                return False
        return True
    return ok


def mapping_overrides(mapping: Mapping, roles: tuple[str, ...]) -> dict:
    """Config overrides (dotted keys) that run ``mapping``; ``roles`` in config order."""
    kind = placement_kind(mapping.placement)
    if kind == "colocated":
        out: dict = {"placement.mode": "colocated", "placement.pool_sizes": {}}
    elif kind == "standalone":
        out = {"placement.mode": "standalone",
               "placement.pool_sizes": {r: mapping.set_of(r).devices for r in roles}}
    else:
        actor = mapping.set_of("actor")
        other = next(s for s in mapping.sets if s is not actor)
        out = {"placement.mode": "split",
               "placement.pool_sizes": {"actor": actor.devices, "critic": other.devices}}
    for r in roles:
        s = mapping.set_of(r).strategies[r]
        out.update({f"{r}.layout.pp": s.pp, f"{r}.layout.tp": s.tp, f"{r}.layout.dp": s.dp,
                    f"{r}.layout.ep": s.ep})
        if r == "actor":
            out.update({"actor.layout.gen_pp": s.pp_g, "actor.layout.gen_tp": s.tp_g,
                        "actor.layout.gen_ep": s.gen_ep})
    return out


def apply_overrides(cfg, overrides: dict):
    """A new validated Config with ``overrides`` (dotted keys) applied."""
    from rlhf.config import config_from_dict

    return config_from_dict({**cfg.to_dict(), **overrides})


def plan_for_config(cfg, world_size: int, profile: DeviceProfile | str = "cpu",
                    top: int = 20, concurrent: bool = False) -> ConfigPlan:
    """Best runnable mapping of ``cfg``'s roles on ``world_size`` ranks.

    Args:
        cfg: an :class:`rlhf.config.Config` (its placement and layouts are ignored).
        world_size: ranks of the job.
        profile: a :class:`DeviceProfile`, a shipped profile name or a JSON path.
        top: candidates to rank before checking each against :func:`validate_for_world`.
        concurrent: whether sets overlap in time; False matches :mod:`rlhf.programs`, whose
            controller programs wait on every worker call.

    Raises:
        ValueError if no mapping fits the memory or passes the config's checks.
    """
    from rlhf.world_plan import validate_for_world

    prof = load_profile(profile) if isinstance(profile, str) else profile
    flow, work = dataflow_from_config(cfg)
    planner = Planner(flow, work, world_size, prof, strategy_filter=_batch_filter(cfg),
                      placement_filter=_runnable_kind(cfg.roles),
                      counts=list(range(1, world_size + 1)) if world_size <= 16 else None,
                      concurrent=concurrent)
    found = []
    for m in planner.search(top=top):
        overrides = mapping_overrides(m, cfg.roles)
        try:
            validate_for_world(apply_overrides(cfg, overrides), world_size)
        except ValueError:
            continue
        found.append((m, overrides))
    if not found:
        raise ValueError(f"no runnable mapping of roles {cfg.roles} on world_size={world_size} "
                         f"with profile {prof.name!r} (memory {prof.memory_gb} GiB): check the "
                         f"batch sizes (rollout {cfg.data.rollout_batch_size}, mini "
                         f"{cfg.data.mini_batch_size}, micro {cfg.data.micro_batch_size})")
    return ConfigPlan(found[0][1], found[0][0], tuple(m for m, _ in found))


def predict_config(cfg, world_size: int, profile: DeviceProfile | str = "cpu",
                   concurrent: bool = False) -> Mapping:
    """Predicted stage times of the mapping ``cfg`` already describes (placement, layouts)."""
    from rlhf.world_plan import validate_for_world

    prof = load_profile(profile) if isinstance(profile, str) else profile
    plan = validate_for_world(cfg, world_size)
    flow, work = dataflow_from_config(cfg)
    pools: dict[tuple[int, ...], list[str]] = {}
    for r in cfg.roles:
        pools.setdefault(plan.roles[r].pool, []).append(r)
    sets = [(tuple(rs), {r: Strategy(plan.roles[r].pp, plan.roles[r].tp, plan.roles[r].dp,
                                     plan.roles[r].gen_pp, plan.roles[r].gen_tp, plan.roles[r].ep,
                                     plan.roles[r].gen_ep)
                         for r in rs})
            for rs in pools.values()]
    planner = Planner(flow, work, world_size, prof, counts=list(range(1, world_size + 1)),
                      concurrent=concurrent)
    return planner.evaluate(sets)


def resolve_config(cfg, world_size: int, profile: DeviceProfile | str | None = None):
    """``cfg`` with ``placement.mode=auto`` replaced by the planner's choice (else unchanged).

    The profile defaults to ``cfg.placement.profile``.
    """
    if cfg.placement.mode != "auto":
        return cfg
    plan = plan_for_config(cfg, world_size, profile or cfg.placement.profile)
    return apply_overrides(cfg, plan.overrides)


__all__ = ["ConfigPlan", "apply_overrides", "mapping_overrides", "plan_for_config", "predict_config",
           "resolve_config"]
