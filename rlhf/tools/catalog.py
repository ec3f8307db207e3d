"""The tools of a run (``rollout.tools``) and each trajectory's own :class:`ToolBox`.

``rollout.tools=my_tools.py,builtin:python``: every ``@rlhf.tools.tool`` function and
``@rlhf.tools.environment`` class of each file, plus the built-in tools named.  A data row
may list the tools it may use (its ``tools`` field; default: all).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_type_hints

from rlhf.tools.decorators import is_environment, is_tool, tool_methods
from rlhf.user_files import import_file

EXTRA_INFO = "extra_info"


def tool_schema(fn: Callable) -> dict:
    """``{"type": "function", "function": {...}}`` of ``fn`` from its type hints and
    docstring (transformers' ``get_json_schema``), without ``self`` and ``extra_info``."""
    from transformers.utils import get_json_schema

    sig = inspect.signature(fn)
    params = [p for n, p in sig.parameters.items() if n not in ("self", EXTRA_INFO)]
    hints = get_type_hints(fn)

    def proxy():
        pass

    proxy.__name__, proxy.__doc__ = fn.__name__, fn.__doc__
    proxy.__signature__ = sig.replace(parameters=params)
    proxy.__annotations__ = {k: v for k, v in hints.items() if k not in ("self", EXTRA_INFO)}
    try:
        return get_json_schema(proxy)
    except Exception as e:
        raise ValueError(f"tool {fn.__qualname__!r}: no JSON schema from its type hints and "
                         f"docstring ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class Tool:
    """A tool of the catalog: a function, or a method of an environment class."""

    name: str
    fn: Callable
    schema: dict
    environment: type | None = None
    """The environment class whose instance the method runs on; None for a function."""

    @property
    def wants_extra_info(self) -> bool:
        return EXTRA_INFO in inspect.signature(self.fn).parameters


class ToolBox:
    """One trajectory's tools: the catalog's, with its environments made from its row.

    Call :meth:`close` when the trajectory ends."""

    def __init__(self, tools: dict[str, Tool], row: dict) -> None:
        self.tools, self.row = tools, row
        self.envs = {cls: cls(row) for cls in dict.fromkeys(
            t.environment for t in tools.values() if t.environment is not None)}

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def first_messages(self) -> list[dict]:
        """User messages the environments' ``reset()`` return (none return None)."""
        out = []
        for env in self.envs.values():
            text = env.reset() if hasattr(env, "reset") else None
            if text is not None:
                out.append({"role": "user", "content": str(text)})
        return out

    def bound(self, name: str) -> Callable:
        """The callable of tool ``name`` for this trajectory (KeyError if it has none)."""
        t = self.tools[name]
        fn = t.fn.__get__(self.envs[t.environment]) if t.environment is not None else t.fn
        if t.wants_extra_info:
            extra = self.row.get("extra_info")
            return lambda **kw: fn(**kw, extra_info=extra)
        return fn

    def close(self) -> None:
        for env in self.envs.values():
            if hasattr(env, "close"):
                env.close()


class ToolCatalog:
    """Every tool of a run by name (names are unique across files and built-ins)."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"rollout.tools: two tools are named {t.name!r}")
            self.tools[t.name] = t

    def allowed(self, names: list[str] | None) -> dict[str, Tool]:
        """The tools a row may use (``names`` from its ``tools`` field; None = all)."""
        if names is None:
            return dict(self.tools)
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            raise ValueError(f"a data row names tools {unknown} that rollout.tools does not "
                             f"have ({sorted(self.tools)})")
        return {n: self.tools[n] for n in names}

    def schemas(self, names: list[str] | None = None) -> list[dict]:
        return [t.schema for t in self.allowed(names).values()]

    def open(self, row: dict) -> ToolBox:
        """The tools of one trajectory of ``row`` (a dict with the row's fields)."""
        return ToolBox(self.allowed(row.get("tools")), row)


def _tools_of_file(path: str) -> list[Tool]:
    module = import_file(path, "tools_", f"rollout.tools={path!r}")
    out = []
    for name, obj in vars(module).items():
        if is_tool(obj) and obj.__module__ == module.__name__:
            out.append(Tool(name, obj, tool_schema(obj)))
        elif is_environment(obj) and obj.__module__ == module.__name__:
            out += [Tool(m, fn, tool_schema(fn), obj) for m, fn in tool_methods(obj).items()]
    if not out:
        raise ValueError(f"rollout.tools: {path} has no @rlhf.tools.tool function or "
                         f"@rlhf.tools.environment class")
    return out


def load_catalog(spec: str, builtins: dict[str, Callable]) -> ToolCatalog:
    """The catalog of ``rollout.tools`` (``spec``); ``builtins`` maps the names usable as
    ``builtin:<name>`` to their tool functions."""
    tools: list[Tool] = []
    for item in [s.strip() for s in str(spec).split(",") if s.strip()]:
        if item.startswith("builtin:"):
            name = item.removeprefix("builtin:")
            if name not in builtins:
                raise ValueError(f"rollout.tools: {item!r} is not a built-in tool "
                                 f"({', '.join('builtin:' + b for b in sorted(builtins))})")
            tools.append(Tool(name, builtins[name], tool_schema(builtins[name])))
        elif not os.path.isfile(item):
            raise ValueError(f"rollout.tools: file {item!r} does not exist")
        else:
            tools += _tools_of_file(item)
    return ToolCatalog(tools)
