"""Per-model parallel strategies: training ``(pp, tp, dp)`` and generation ``(pp_g, tp_g)``.

On ``n`` devices a model runs ``pp * tp * dp = n``; a generating model (the actor) also picks
``pp_g | pp`` and ``tp_g | tp`` (the 3D-HybridEngine's requirement), giving
``dp_g = n / (pp_g * tp_g)`` generation replicas.  Models that do not generate keep
``pp_g = pp``, ``tp_g = tp``.  A mixture of experts also picks its expert parallelism
``ep | tp * dp`` (and ``ep | E``; :mod:`hybridflow_comm.expert_layout`): ``ep > 1`` trains
``E / ep`` whole experts per rank, and its generation EP ``gen_ep | gcd(ep, tp_g)`` splits
the experts of each generation TP group ``gen_ep`` ways (1: every expert split over
``tp_g``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.sizes import divisors
from rlhf.planner.models import ModelShape


@dataclass(frozen=True, order=True)
class Strategy:
    """One model's parallel layout on its devices."""

    pp: int
    tp: int
    dp: int
    pp_g: int
    tp_g: int
    ep: int = 1
    gen_ep: int = 1

    def __post_init__(self) -> None:
        if min(self.pp, self.tp, self.dp, self.pp_g, self.tp_g, self.ep, self.gen_ep) < 1:
            raise ValueError(f"every size of {self} must be >= 1")
        if self.pp % self.pp_g or self.tp % self.tp_g:
            raise ValueError(f"{self}: pp_g={self.pp_g} must divide pp={self.pp} and "
                             f"tp_g={self.tp_g} must divide tp={self.tp}")
        if (self.tp * self.dp) % self.ep:
            raise ValueError(f"{self}: ep={self.ep} must divide tp*dp={self.tp * self.dp}")
        if self.gen_ep > 1 and (self.ep % self.gen_ep or self.tp_g % self.gen_ep):
            raise ValueError(f"{self}: gen_ep={self.gen_ep} must divide ep={self.ep} and "
                             f"tp_g={self.tp_g}")

    @property
    def devices(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def dp_g(self) -> int:
        """Generation replicas."""
        return self.devices // (self.pp_g * self.tp_g)

    @property
    def micro_dp(self) -> int:
        """Generation replicas per training replica (the micro-DP group size)."""
        return (self.pp * self.tp) // (self.pp_g * self.tp_g)

    @property
    def expert_split(self) -> int:
        """Training ranks one stage's experts are divided over: ``ep`` whole-expert blocks,
        or with ``ep = 1`` every expert cut ``tp`` ways like the dense MLP."""
        return self.ep if self.ep > 1 else self.tp

    @property
    def expert_dp(self) -> int:
        """Training ranks holding the same expert shard (the experts' gradient all-reduce)."""
        return self.tp * self.dp // self.ep if self.ep > 1 else self.dp

    @property
    def ep_span(self) -> int:
        """Consecutive devices the widest EP group spans: an EP group is ``ep`` consecutive
        ``j = dp_rank * tp + tp_rank`` of a stage (:mod:`hybridflow_comm.expert_layout`), and
        devices run ``tp`` fastest, then ``pp``, then ``dp`` (e.g. ``ep = 2 tp``: two DP
        replicas ``pp * tp`` apart)."""
        def device(j: int) -> int:
            return j // self.tp * self.pp * self.tp + j % self.tp
        return max(device(a + self.ep - 1) - device(a) + 1
                   for a in range(0, self.tp * self.dp, self.ep))

    def short(self) -> str:
        train = f"{self.pp}-{self.tp}-{self.dp}" + (f" ep{self.ep}" if self.ep > 1 else "")
        if (self.pp_g, self.tp_g, self.gen_ep) == (self.pp, self.tp, 1):
            return train
        return f"{train} -> {self.pp_g}-{self.tp_g}" + \
            (f" ep{self.gen_ep}" if self.gen_ep > 1 else "")


def enumerate_strategies(shape: ModelShape, n: int, generates: bool,
                         max_tp: int | None = None) -> Iterator[Strategy]:
    """Every valid strategy of ``shape`` on ``n`` devices.

    Args:
        shape: the model (its head, layer and width counts decide which splits are valid).
        n: devices of the model's set.
        generates: also enumerate ``(pp_g, tp_g)``; otherwise they equal ``(pp, tp)``.
        max_tp: largest tensor-parallel size (a node's device count; None = no limit).

    A mixture of experts also enumerates ``ep``: the divisors of ``tp * dp`` that divide its
    expert count; a generating one with ``ep > 1`` also each ``gen_ep`` dividing ``ep`` and
    ``tp_g`` whose expert sets pack (:class:`hybridflow_comm.expert_layout.ExpertLayout`).
    """
    experts = shape.config.num_experts
    for pp in divisors(n):
        for tp in divisors(n // pp):
            if (max_tp and tp > max_tp) or not shape.check_parallel(pp, tp):
                continue
            dp = n // (pp * tp)
            eps = [e for e in divisors(tp * dp) if experts % e == 0] if experts else [1]
            gens = [(pp_g, tp_g) for pp_g in divisors(pp) for tp_g in divisors(tp)] \
                if generates else [(pp, tp)]
            for ep in eps:
                for pp_g, tp_g in gens:
                    for gen_ep in _gen_eps(experts, pp, tp, dp, pp_g, tp_g, ep, generates):
                        yield Strategy(pp, tp, dp, pp_g, tp_g, ep, gen_ep)


def _gen_eps(experts: int, pp: int, tp: int, dp: int, pp_g: int, tp_g: int, ep: int,
             generates: bool) -> list[int]:
    """The generation EP sizes of one layout: 1, and with ``ep > 1`` on a generating model
    every common divisor of ``ep`` and ``tp_g`` the expert layout accepts."""
    if ep == 1 or not generates:
        return [1]
    hybrid = HybridLayout(ParallelLayout(pp, tp, dp), pp_g, tp_g)
    out = []
    for gen_ep in divisors(math.gcd(ep, tp_g)):
        try:
            ExpertLayout(hybrid, experts, ep=ep, gen_ep=gen_ep)
        except ValueError:  # no packing of the blocks for this gen_ep
            continue
        out.append(gen_ep)
    return out
