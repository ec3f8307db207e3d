"""Config dataclasses <-> YAML recipes and ``key=value`` overrides, through OmegaConf
structured configs (schema, type conversion and checks are OmegaConf's; this module turns its
errors into one-line ValueErrors and picks replace-not-union semantics for mappings).

Generic: knows nothing about :mod:`rlhf.config`.  How a recipe and overrides combine::

    schema (the dataclass defaults)
      <- recipe YAML        section by section; a mapping-valued field (rule_weights,
      <- key=value ...      pool_sizes) or a whole section given as one value is replaced
    -> check_values         every float finite, every int within 64 bits, no NUL in a string
    -> OmegaConf.to_object  builds the frozen dataclasses (their __post_init__ validates)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Callable
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

T = typing.TypeVar("T")
_hints = functools.cache(typing.get_type_hints)  # a dataclass's field types never change


def _field_paths(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the dataclass ``cls`` (sections and leaves)."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        inner = _dataclass_of(hints[f.name])
        if inner is not None:
            out += _field_paths(inner, key + ".")
    return out


def _dataclass_of(tp: Any):
    """The dataclass in ``tp`` (``X`` or ``X | None``), else None."""
    for t in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(t):
            return t
    return None


def _type_of(cls, key: str) -> Any:
    node = cls
    for part in key.split("."):
        node = _dataclass_of(node)
        if node is None:
            return None
        node = _hints(node).get(part)
    return node


def _type_name(tp: Any) -> str:
    if tp is None:
        return "?"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _error(cls, e: OmegaConfBaseException, value: Any = None) -> ValueError:
    key = getattr(e, "full_key", None) or ""
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        section, _, name = key.rpartition(".")
        paths = _field_paths(cls)
        valid = [p for p in paths if p.rpartition(".")[0] == section]
        same_leaf = sorted((p for p in paths if p.rpartition(".")[2] == name),
                           key=lambda p: not p.startswith(key.partition(".")[0] + "."))
        close = same_leaf or difflib.get_close_matches(key, paths, n=1, cutoff=0.6) \
            or [f"{section}.{m}" if section else m for m in
                difflib.get_close_matches(name, [v.rpartition(".")[2] for v in valid], n=1)]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        where = f"section {section!r}" if section else "the top level"
        names = ", ".join(v.rpartition(".")[2] for v in valid)
        return ValueError(f"unknown config key {key!r}{hint}; valid keys of {where}: {names}")
    if key:
        got = f"{value!r} ({type(value).__name__})" if value is not None else "another type"
        return ValueError(f"config key {key!r} expects {_type_name(_type_of(cls, key))}, got "
                          f"{got}: {str(e).splitlines()[0]}")
    return ValueError(f"invalid config: {str(e).splitlines()[0]}")


def _default_section(cls, cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` is a section; a null one is set to its defaults first."""
    section = _dataclass_of(_type_of(cls, key))
    if section is None:
        return False
    if OmegaConf.select(cfg, key) is None:
        OmegaConf.update(cfg, key, OmegaConf.structured(_defaults(section)), merge=False)
        _writable(OmegaConf.select(cfg, key))
    return True


def _apply(cls, cfg: DictConfig, key: str, value: Any) -> None:
    """Set ``key`` (dotted) to ``value``.  A mapping given for a section sets its fields one
    by one (a null optional section starts from its defaults); anything else is replaced,
    so a mapping-valued field (rule_weights, pool_sizes) is replaced, not merged."""
    parts = key.split(".")
    for i in range(1, len(parts)):        # a null optional section on the way: its defaults
        _default_section(cls, cfg, ".".join(parts[:i]))
    if isinstance(value, dict) and _default_section(cls, cfg, key):
        for k, v in value.items():
            _apply(cls, cfg, f"{key}.{k}", v)
        return
    _check_parent(cfg, key)
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except OmegaConfBaseException as e:
        raise _error(cls, e, value) from None


def _check_parent(cfg: DictConfig, key: str) -> None:
    parts = key.split(".")
    node: Any = cfg
    for i, p in enumerate(parts[:-1]):
        if not isinstance(node, DictConfig) or p not in node:
            return  # unknown keys are reported by OmegaConf with their full path
        node = node[p]
        if node is not None and not isinstance(node, DictConfig):
            raise ValueError(f"cannot set {key!r}: {'.'.join(parts[:i + 1])!r} is a value "
                             f"({node!r}), not a section")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line: what YAML found wrong, and where."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def one_line(e: BaseException) -> str:
    """``e``'s message on one line, its type named unless it is a ValueError (the one-line
    messages of the config's own checks: what an entry point reports for a bad input)."""
    text = " ".join(str(e).split()) or repr(e)
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


def parse_value(key: str, text: str) -> Any:
    """One override's value, read as YAML (``1e-5`` is a float, ``null`` None, ``[1, 2]`` a
    list, ``{a: 1}`` a mapping; ``none`` stays a string)."""
    text = text.strip()
    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError as e:
        raise ValueError(f"{key}={text!r} is not a valid YAML value ({_yaml_problem(e)}); "
                         f"quote the whole argument, e.g. '{key}={{actor: 2, critic: 2}}'"
                         ) from None


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=1", ...]`` -> ``[("a.b", 1), ...]``; ValueError for an argument without ``=``."""
    out = []
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"argument {arg!r} is not key=value (e.g. actor.optim.lr=1e-5)")
        if not all(part.strip() for part in key.split(".")):
            raise ValueError(f"argument {arg!r}: the key {key.strip()!r} has an empty part "
                             f"(e.g. actor.optim.lr=1e-5)")
        out.append((key.strip(), parse_value(key.strip(), text)))
    return out


def _writable(node: Any) -> None:
    if isinstance(node, DictConfig):
        OmegaConf.set_readonly(node, None)  # inherit: the root's flag (writable)
        for k in node.keys():
            _writable(node[k])  # a section's child section is the node itself, not a copy


INT_LIMIT = 2**63
"""Every int of a config lies in ``(-INT_LIMIT, INT_LIMIT)`` (a 64-bit integer, what torch and
numpy take); each section bounds its own sizes far lower."""


def check_values(data: Any, key: str = "") -> None:
    """ValueError naming the dotted key of the first float that is not finite (NaN, inf: no
    size, rate or coefficient makes sense as one), int beyond 64 bits or string holding a NUL
    character, in the plain nested ``data``.  Generic: no section needs to restate it."""
    if isinstance(data, dict):
        for k, v in data.items():
            check_values(v, f"{key}.{k}" if key else str(k))
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            check_values(v, f"{key}[{i}]")
    elif isinstance(data, float) and not math.isfinite(data):
        raise ValueError(f"config key {key!r} is {data}; give a finite number")
    elif isinstance(data, int) and not isinstance(data, bool) and abs(data) >= INT_LIMIT:
        raise ValueError(f"config key {key!r}={data} does not fit a 64-bit integer; give a "
                         f"smaller value")
    elif isinstance(data, str) and "\x00" in data:
        raise ValueError(f"config key {key!r}={data!r} holds a NUL character")


def _defaults(cls: type) -> Any:
    """An instance of the dataclass ``cls`` that holds its defaults (a section field: an
    instance of its section made the same way), made without calling ``__init__``.  The
    schema is built from it, so no section's ``__post_init__`` runs before the recipe and the
    overrides are applied: the checks run once, on the finished config (:func:`_build`), and
    a mistyped key is reported without importing the registries they read."""
    obj = object.__new__(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            section = _dataclass_of(hints[f.name])
            value = _defaults(section) if f.default_factory is section else f.default_factory()
        else:
            value = MISSING
        object.__setattr__(obj, f.name, value)
    return obj


@functools.cache
def _schema(cls: type) -> DictConfig:
    """The structured config of ``cls``'s defaults, writable (copied for every build: a copy
    costs a sixth of building it from the dataclasses)."""
    cfg = OmegaConf.structured(_defaults(cls))
    _writable(cfg)  # frozen dataclasses: writable while it is built
    return cfg


def _build(cls: type[T], recipe: dict, overrides: list[tuple[str, Any]]) -> T:
    cfg = copy.deepcopy(_schema(cls))
    try:
        for key, value in [*recipe.items(), *overrides]:
            _apply(cls, cfg, str(key), value)
        # before any __post_init__: the sections' own checks compute with these values
        check_values(OmegaConf.to_container(cfg, resolve=True))
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _error(cls, e) from None


def from_dict(cls: type[T], data: dict) -> T:
    """Build and validate ``cls`` from a nested dict (YAML layout)."""
    if not isinstance(data, dict):
        raise ValueError(f"a config must be a mapping, got {type(data).__name__}: {data!r}")
    return _build(cls, data, [])


def from_args(cls: type[T], args: list[str], recipe_of: Callable[[str | None], str]) -> T:
    """Recipe + ``key=value`` overrides -> validated ``cls``.

    Args:
        args: ``recipe=PATH`` (a YAML mapping), ``algo=NAME`` (``recipe_of(NAME)`` unless a
            recipe is given; also sets ``algo.name``) and dotted ``key=value`` overrides.
        recipe_of: the recipe file of an algorithm name (None = the default).
    """
    overrides = parse_overrides(args)
    special = {k: v for k, v in overrides if k in ("recipe", "algo")}
    rest = [(k, v) for k, v in overrides if k not in ("recipe", "algo")]
    path = special.get("recipe") or recipe_of(special.get("algo"))
    try:
        with open(str(path), encoding="utf-8") as f:
            recipe = yaml.safe_load(f)
    except FileNotFoundError:
        raise ValueError(f"recipe={path!r} is not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"recipe={path!r} cannot be read: {type(e).__name__}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"recipe={path!r} is not valid YAML: {_yaml_problem(e)}") from None
    if recipe is None:
        recipe = {}
    if not isinstance(recipe, dict):
        raise ValueError(f"recipe={path!r} must be a YAML mapping of config sections, got a "
                         f"{type(recipe).__name__}")
    if "algo" in special:
        rest.insert(0, ("algo.name", special["algo"]))
    return _build(cls, recipe, rest)


def to_dict(obj) -> dict:
    """Plain nested dict of a config dataclass (loads back with :func:`from_dict`)."""
    return OmegaConf.to_container(OmegaConf.structured(obj))


def save_yaml(obj, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(obj), f, sort_keys=False)
