"""Baseline transitions and the registry of every transition by name.

:data:`TRANSITIONS` maps each ``method`` name to its class; every list of names (benchmarks,
tests) and every construction by name (:func:`make_transition`) reads it.  All of them
implement :class:`~hybridflow_comm.transition.Transition` and take the same arguments.
This package imports :mod:`hybridflow_comm.reshard`, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow_comm.baselines.gather_full import DsChat, HybridFlowV
from hybridflow_comm.groups import HybridGroups
from hybridflow_comm.reshard import Resharder
from hybridflow_comm.shard_spec import ShardSpec
from hybridflow_comm.transition import Transition

__all__ = ["TRANSITIONS", "DsChat", "HybridFlowV", "make_transition"]

TRANSITIONS: dict[str, Callable[..., Transition]] = {
    cls.method: cls for cls in (Resharder, HybridFlowV, DsChat)}


def make_transition(method: str, specs: list[ShardSpec], groups: HybridGroups,
                    **options) -> Transition:
    """Build the transition registered as ``method``.

    Args:
        method: a key of :data:`TRANSITIONS`.
        specs: the model's parameters (the same list on every rank of the layout).
        groups: this rank's groups for the model's HybridLayout.
        **options: keyword options of the constructors (``bucket_bytes``, ``verify_every``,
            ``ledger``, ``buffer``, ``backend``).

    Returns:
        The transition (construction is collective over the layout's ranks).
    """
    if method not in TRANSITIONS:
        raise ValueError(f"method={method!r} is not one of {tuple(TRANSITIONS)}")
    return TRANSITIONS[method](specs, groups, **options)
