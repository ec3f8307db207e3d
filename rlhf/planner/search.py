"""The auto-mapping search (paper, Algorithms 1 and 2).

::

    for placement in set_partitions(models):                 # 15 for PPO
        mins = [min_devices(set) for set in placement]       # smallest count that fits memory
        for alloc in allocations(N, mins):                   # device count per set, sum N
            cost = sum over stages of  max over sets of  sum over the set's models
                   of stage_time(model, best strategy on the set's devices)

Per ``(model, device count)`` the valid strategies and their memory and stage times are
computed once (:meth:`Planner.candidates`); per ``(set, device count)`` the strategies of the
set's models are chosen together once (:meth:`Planner.set_plan`): start from each model's
fastest, trade time for memory until the set fits, then improve one model at a time.  The
actor's generation time depends on the set: its KV cache gets what the colocated models leave.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhf.planner import memory as mem
from rlhf.planner import simulator as sim
from rlhf.planner.dataflow import STAGES, Dataflow, RoleSpec, Workload
from rlhf.planner.partitions import allocations, device_counts, set_partitions, sorted_partition
from rlhf.planner.profile import DeviceProfile
from rlhf.planner.strategy import Strategy, enumerate_strategies

StrategyFilter = Callable[[RoleSpec, Strategy], bool]
PlacementFilter = Callable[[tuple[tuple[str, ...], ...], tuple[int, ...]], bool]


@dataclass(frozen=True)
class Candidate:
    """One strategy of one model on ``n`` devices, with what the set search needs."""

    strategy: Strategy
    resident: float
    """Bytes per device for the whole run."""
    transient: float
    """Peak bytes per device of training / forward passes."""
    gen_min: float
    """Transient bytes of generation with one-sequence waves (0 unless generating)."""
    prep: float
    """Preparation-stage seconds."""
    train: float
    """Training-stage seconds."""


@dataclass(frozen=True)
class SetPlan:
    """A colocated set on its devices, each model with its chosen strategy."""

    models: tuple[str, ...]
    devices: int
    strategies: dict[str, Strategy]
    times: dict[str, dict[str, float]]
    """Model -> stage -> seconds."""
    peak_bytes: float
    """Peak memory per device: resident of all models + the largest transient (KV included)."""
    all_to_all_bytes: dict[str, float] = field(default_factory=dict)
    """Model -> bytes one device sends by expert-parallel all-to-alls per iteration (0 without
    ``ep``; :func:`rlhf.planner.simulator.all_to_all_volume`)."""

    def stage_time(self, stage: str) -> float:
        """Costs of colocated models add (they take turns on the same devices)."""
        return sum(t[stage] for t in self.times.values())

    @property
    def total(self) -> float:
        return sum(self.stage_time(s) for s in STAGES)


@dataclass(frozen=True, order=True)
class Mapping:
    """A placement, an allocation and every model's strategy, with predicted times."""

    total: float
    sets: tuple[SetPlan, ...] = field(compare=False)
    stages: dict[str, float] = field(compare=False)
    """Stage -> seconds: the slowest set bounds a stage."""

    def set_of(self, model: str) -> SetPlan:
        return next(s for s in self.sets if model in s.models)

    @property
    def placement(self) -> tuple[tuple[str, ...], ...]:
        return tuple(s.models for s in self.sets)

    def label(self) -> str:
        return " | ".join(f"{'+'.join(s.models)}:{s.devices}" for s in self.sets)


def compose(sets: tuple[SetPlan, ...], concurrent: bool = True) -> tuple[float, dict[str, float]]:
    """Iteration time of a mapping: sum over stages of the max over sets of the set's sum.

    ``concurrent=False`` models a controller that waits for each call before the next, so
    sets never overlap and a stage costs the sum over sets."""
    agg = max if concurrent else sum
    stages = {st: agg(s.stage_time(st) for s in sets) for st in STAGES}
    return sum(stages.values()), stages


class Planner:
    """Search the mappings of one dataflow and workload on ``devices`` devices.

    Args:
        dataflow: the models and what each runs.
        workload: batch, prompt and response lengths.
        devices: total device count N.
        profile: simulator constants (memory per device included).
        strategy_filter: optional predicate that rejects strategies (e.g. batch divisibility
            required by the runtime).
        placement_filter: optional predicate on (placement, allocation).
        counts: device counts a set may get; default :func:`device_counts`.
        concurrent: sets run their stage work at the same time (the paper); False = one
            model call after another (a controller that waits on every call).
    """

    def __init__(self, dataflow: Dataflow, workload: Workload, devices: int,
                 profile: DeviceProfile, strategy_filter: StrategyFilter | None = None,
                 placement_filter: PlacementFilter | None = None,
                 counts: list[int] | None = None, concurrent: bool = True) -> None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} must be a positive int")
        self.dataflow, self.work, self.devices, self.prof = dataflow, workload, devices, profile
        self.concurrent = concurrent
        self.strategy_filter = strategy_filter
        self.placement_filter = placement_filter
        self.counts = sorted(counts) if counts else device_counts(devices, profile.per_node)
        self._cand: dict[tuple[str, int], list[Candidate]] = {}
        self._sets: dict[tuple[tuple[str, ...], int], SetPlan | None] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    # Per model ----------------------------------------------------------------------------
    def candidates(self, role: RoleSpec, n: int) -> list[Candidate]:
        """Valid strategies of ``role`` on ``n`` devices, cached per (model, device count).

        Non-generating models keep only the Pareto front over (time, resident, transient)."""
        key = (role.name, n)
        if key in self._cand:
            self.cache_hits += 1
            return self._cand[key]
        self.cache_misses += 1
        out = [c for c in self._all_candidates(role, n)
               if c.strategy.tp <= self.prof.per_node
               and not (self.strategy_filter and not self.strategy_filter(role, c.strategy))]
        if not role.generations:
            out = _pareto(out)
        self._cand[key] = out
        return out

    # Per colocated set --------------------------------------------------------------------
    def _set_cost(self, roles: list[RoleSpec], choice: list[Candidate]) -> tuple[float, float]:
        """(seconds, memory overflow in bytes) of one choice of strategies for a set."""
        usable = self.prof.usable_bytes
        resident = sum(c.resident for c in choice)
        transient = max(c.transient for c in choice)
        over = max(0.0, resident + transient - usable)
        t = 0.0
        for r, c in zip(roles, choice):
            t += c.prep + c.train
            if r.generations:
                extra = mem.gen_weight_extra_bytes(r, c.strategy, self.prof)
                budget = usable - resident - extra
                over += max(0.0, resident + c.gen_min - usable)
                t += sim.generation_time(r, c.strategy, self.work, self.prof, budget)
        return t, over

    def set_plan(self, models: tuple[str, ...], n: int) -> SetPlan | None:
        """Best strategies of a colocated set on ``n`` devices, or None if nothing fits."""
        key = (models, n)
        if key in self._sets:
            return self._sets[key]
        roles = [self.dataflow.role(m) for m in models]
        cands = [self.candidates(r, n) for r in roles]
        plan = None
        if all(cands):
            choice = [min(cs, key=lambda c: c.prep + c.train + c.resident * 1e-30) for cs in cands]
            choice = self._fit(roles, cands, choice)
            if choice is not None:
                choice = self._improve(roles, cands, choice)
                plan = self._make_plan(models, n, roles, choice)
        self._sets[key] = plan
        return plan

    def _fit(self, roles, cands, choice):
        """Trade time for memory, one model at a time, until the set fits (None if never)."""
        t, over = self._set_cost(roles, choice)
        while over > 0 or math.isinf(t):
            best = None
            for i, cs in enumerate(cands):
                for c in cs:
                    trial = choice[:i] + [c] + choice[i + 1:]
                    t2, over2 = self._set_cost(roles, trial)
                    if over2 < over or (over2 == over == 0 and t2 < t):
                        gain = (over - over2) or 1.0
                        score = (t2 - t) / gain if not math.isinf(t2) else math.inf
                        if best is None or (score, over2) < best[0]:
                            best = ((score, over2), trial, t2, over2)
            if best is None:
                return None
            _, choice, t, over = best
        return choice

    def _improve(self, roles, cands, choice, rounds: int = 3):
        """Coordinate descent: re-pick one model's strategy with the others fixed."""
        t, _ = self._set_cost(roles, choice)
        for _ in range(rounds):
            improved = False
            for i, cs in enumerate(cands):
                for c in cs:
                    trial = choice[:i] + [c] + choice[i + 1:]
                    t2, over2 = self._set_cost(roles, trial)
                    if over2 == 0 and t2 < t * (1 - 1e-9):
                        choice, t, improved = trial, t2, True
            if not improved:
                break
        return choice

    def _make_plan(self, models, n, roles, choice) -> SetPlan:
        usable, p = self.prof.usable_bytes, self.prof
        resident = sum(c.resident for c in choice)
        peak = resident + max(c.transient for c in choice)
        times = {}
        for r, c in zip(roles, choice):
            gen = 0.0
            if r.generations:
                extra = mem.gen_weight_extra_bytes(r, c.strategy, p)
                gen = sim.generation_time(r, c.strategy, self.work, p, usable - resident - extra)
                kv = mem.kv_bytes_per_sequence(r.shape, c.strategy, self.work, p)
                wave = min(math.ceil(self.work.sequences / c.strategy.dp_g),
                           int((usable - resident - extra) // kv))
                peak = max(peak, resident + extra + wave * kv)
            times[r.name] = {"generation": gen, "preparation": c.prep, "training": c.train}
        a2a = {r.name: sim.all_to_all_volume(r, c.strategy, self.work, p)
               for r, c in zip(roles, choice)}
        return SetPlan(models, n, {r.name: c.strategy for r, c in zip(roles, choice)}, times,
                       peak, a2a)

    def evaluate(self, sets: list[tuple[tuple[str, ...], dict[str, Strategy]]]) -> Mapping:
        """Predicted times of a given mapping: ``[(models, {model: strategy}), ...]``."""
        plans = []
        for models, strategies in sets:
            roles = [self.dataflow.role(m) for m in models]
            n = next(iter(strategies.values())).devices
            by_s = {r.name: {c.strategy: c for c in self._all_candidates(r, n)} for r in roles}
            try:
                choice = [by_s[r.name][strategies[r.name]] for r in roles]
            except KeyError as e:
                raise ValueError(f"strategy {e} of set {models} on {n} devices is not valid "
                                 f"for its model") from None
            plans.append(self._make_plan(models, n, roles, choice))
        total, stages = compose(tuple(plans), self.concurrent)
        return Mapping(total, tuple(plans), stages)

    def _all_candidates(self, role: RoleSpec, n: int) -> list[Candidate]:
        w, p = self.work, self.prof
        return [Candidate(s, mem.resident_bytes(role, s, p), mem.transient_bytes(role, s, w, p),
                          mem.min_generation_bytes(role, s, w, p) if role.generations else 0.0,
                          sim.infer_time(role, s, w, p),
                          sim.train_time(role, s, w, p) if role.trained else 0.0)
                for s in enumerate_strategies(role.shape, n, role.generations > 0)]

    def min_devices(self, models: tuple[str, ...]) -> int | None:
        """Fewest devices (from ``counts``) on which the set fits in memory."""
        for n in self.counts:
            if self.set_plan(models, n) is not None:
                return n
        return None

    # Whole search -------------------------------------------------------------------------
    def search(self, top: int = 10) -> list[Mapping]:
        """The ``top`` fastest mappings, fastest first (empty if nothing fits)."""
        best: list[tuple[float, int, Mapping]] = []
        tie = 0
        for part in set_partitions(self.dataflow.names):
            part = sorted_partition(part, self.dataflow.names)
            mins = [self.min_devices(block) for block in part]
            if None in mins:
                continue
            for alloc in allocations(self.devices, mins, self.counts):
                if self.placement_filter and not self.placement_filter(part, alloc):
                    continue
                sets = tuple(self.set_plan(b, n) for b, n in zip(part, alloc))
                if None in sets:
                    continue
                total, stages = compose(sets, self.concurrent)
                tie += 1
                item = (-total, -tie, Mapping(total, sets, stages))
                if len(best) < top:
                    heapq.heappush(best, item)
                elif item > best[0]:
                    heapq.heapreplace(best, item)
        return [m for _, _, m in sorted(best, key=lambda x: (-x[0], -x[1]))]


def _pareto(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates that another beats or ties on time, resident and transient memory."""
    keep = []
    for c in sorted(cands, key=lambda c: (c.prep + c.train, c.resident, c.transient)):
        if not any(k.resident <= c.resident and k.transient <= c.transient for k in keep):
            keep.append(c)
    return keep
