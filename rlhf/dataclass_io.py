"""Nested dicts (YAML) <-> frozen config dataclasses, and ``key=value`` command-line overrides.

Generic: knows nothing about :mod:`rlhf.config`.  Values are coerced to the annotated field
types (``int``, ``float``, ``bool``, ``str``, ``dict[str, X]``, ``X | None``, nested
dataclasses), so ``lr: 1e-5`` (a string to YAML) becomes a float; an unknown key raises a
ValueError that lists the valid keys of its section.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

import yaml


def to_plain_dict(obj) -> Any:
    """Nested dict of a dataclass's init fields (derived fields are left out)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain_dict(getattr(obj, f.name))
                for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, dict):
        return {k: to_plain_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


def _init_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _unknown_key(key: str, section: str, valid: list[str]) -> ValueError:
    where = f"section {section!r}" if section else "the top level"
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown config key {key!r}{hint}; valid keys of {where}: "
                      f"{', '.join(valid)}")


def _build(cls, data: Any, path: str):
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"config {path or 'root'!r} must be a mapping, got {data!r}")
    valid = _init_fields(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in valid:
            raise _unknown_key(full, path, valid)
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except (ValueError, TypeError) as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}={value!r}: {errors}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, {} if value is None else value, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r} must be a mapping")
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"{key}={value!r} must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)   # YAML reads 1e-5 (no dot) as a string
            except ValueError:
                pass
        raise ValueError(f"{key}={value!r} must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{key}={value!r} must be a string")
    raise TypeError(f"{key}: unsupported field type {tp!r}")  # internal: a new field type


def build_dataclass(cls, data: Any) -> Any:
    """Build the dataclass ``cls`` (and its nested sections) from a nested dict."""
    return _build(cls, data, "")


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("null", "~"):            # as in YAML: "none" stays a string (kl_mode=none)
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        return yaml.safe_load(text)
    return text


def set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, p in enumerate(parts[:-1]):
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ValueError(f"cannot set {key!r}: {'.'.join(parts[:i + 1])!r} is a value "
                             f"({child!r}), not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["a.b=1", ...]`` -> ``{"a.b": 1}``; ValueError for an argument without ``=``."""
    out = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep or not key:
            raise ValueError(f"argument {arg!r} is not key=value (e.g. actor.lr=1e-5)")
        out[key.strip()] = _parse_value(text.strip())
    return out
