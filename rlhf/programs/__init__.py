"""The algorithm registry: one entry per RL algorithm, the only list of algorithms.

An algorithm is one module of this package that calls :func:`register_algorithm` with its
controller program and advantage estimator, and declares which roles it needs; the config
(names, active roles, checks), the planner and the workers read everything from here::

    @register_algorithm("grpo", advantage=grpo_advantage, grouped=True)
    def grpo(r: Roles, prompts: Batch, it: Iteration) -> tuple[Batch, dict]:
        ...

Adding an algorithm is one new file in this package plus a recipe ``rlhf/recipes/NAME.yaml``
(every module here is imported when the package is).  Beside the algorithms: the registry
(:mod:`.registry`), what a program takes (:mod:`.roles`, :mod:`.iteration`), where rollouts
come from (:mod:`.rollout_sources`) and the steps programs share (:mod:`.steps`).
"""

from __future__ import annotations

import importlib
import pkgutil

from rlhf.programs.iteration import Iteration
from rlhf.programs.registry import (ALGORITHMS, ROLES, TRAINED_ROLES, VALUE_ROLES, AlgorithmSpec,
                                    algorithm, algorithm_names, register_algorithm)
from rlhf.programs.roles import Roles

for _m in pkgutil.iter_modules(__path__):  # the algorithms register themselves on import
    importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["ALGORITHMS", "ROLES", "TRAINED_ROLES", "VALUE_ROLES", "AlgorithmSpec", "Iteration",
           "Roles", "algorithm", "algorithm_names", "register_algorithm"]
