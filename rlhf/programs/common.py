"""The former home of the registry, the rollout sources and the shared steps, kept so that a
user's algorithm file written against it still imports: each name resolves, with a
``DeprecationWarning`` naming its module now, to :mod:`.registry`, :mod:`.roles`,
:mod:`.iteration`, :mod:`.rollout_sources` or :mod:`.steps` (``Rollout`` is
:class:`rlhf.programs.rollout_sources.IterationRollout`).  Nothing in the project imports it.
"""

from __future__ import annotations

import importlib
import warnings

_HOMES = ("registry", "roles", "iteration", "rollout_sources", "steps")
_RENAMED = {"Rollout": ("rollout_sources", "IterationRollout")}


def __getattr__(name: str):
    if name in _RENAMED:
        home, new = _RENAMED[name]
    else:
        home, new = next(((h, name) for h in _HOMES
                          if hasattr(importlib.import_module(f"rlhf.programs.{h}"), name)),
                         (None, name))
    if home is None or name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"rlhf.programs.common.{name} moved to rlhf.programs.{home}.{new}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"rlhf.programs.{home}"), new)
