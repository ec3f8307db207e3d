"""``@tool`` and ``@environment``: marks the tool catalog (:mod:`rlhf.tools.catalog`) looks
for in a user's file."""

from __future__ import annotations

import inspect

_TOOL = "__rlhf_tool__"
_ENVIRONMENT = "__rlhf_environment__"


def tool(fn):
    """Mark ``fn`` (a function, or a method of an :func:`environment` class) as a tool; it is
    returned unchanged.  Its JSON schema comes from its type hints and Google-style docstring
    (``Args:`` describes every parameter); a parameter named ``extra_info`` receives the data
    row's ``extra_info`` and is not part of the schema."""
    if not inspect.isfunction(fn):
        raise TypeError(f"@rlhf.tools.tool decorates a function, got {fn!r:.80}")
    if not inspect.getdoc(fn):
        raise ValueError(f"tool {fn.__qualname__!r} has no docstring: the model learns what a "
                         f"tool does and what its arguments mean from it")
    setattr(fn, _TOOL, True)
    return fn


def environment(cls):
    """Mark ``cls`` as an environment: one instance per trajectory, made from its data row
    (``cls(row)``, the row a dict with ``prompt``, ``ground_truth``, ``data_source``,
    ``extra_info``); optional ``reset() -> str | None`` gives a first user message appended
    to the prompt, optional ``close()`` runs when the trajectory ends.  Its public methods
    marked ``@rlhf.tools.tool`` are the trajectory's tools."""
    if not inspect.isclass(cls):
        raise TypeError(f"@rlhf.tools.environment decorates a class, got {cls!r:.80}")
    if not tool_methods(cls):
        raise ValueError(f"environment {cls.__qualname__!r} has no public method marked "
                         f"@rlhf.tools.tool")
    setattr(cls, _ENVIRONMENT, True)
    return cls


def is_tool(obj) -> bool:
    return inspect.isfunction(obj) and getattr(obj, _TOOL, False)


def is_environment(obj) -> bool:
    return inspect.isclass(obj) and obj.__dict__.get(_ENVIRONMENT, False)


def tool_methods(cls) -> dict[str, object]:
    """Public methods of ``cls`` marked as tools, by name."""
    return {name: fn for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and is_tool(fn)}
