"""Limits and value checks shared by the config sections (:mod:`rlhf.config`): each raises a
ValueError naming the key and the offending value."""

from __future__ import annotations

from typing import Any

from engine.seeds import SEED_LIMIT, check_seed

__all__ = ["MAX_COUNT", "MAX_MODEL_PARAMS", "MAX_ROLLOUT_TOKENS", "SEED_LIMIT", "check_at_most",
           "check_one_of", "check_path", "check_positive", "check_seed", "check_token_budget"]

MAX_COUNT = 10**7
"""Largest batch size, length, model dimension, layer, iteration or step count a config
accepts: a typo such as ``data.prompts_per_iter=99999999999999999999`` stops at validation
instead of allocating (or looping) for ever."""
MAX_ROLLOUT_TOKENS = 2**31
"""Largest rollout batch in tokens, ``prompts_per_iter x samples_per_prompt x
(max_prompt_len + max_response_len)``: beyond it the batch's ids alone need 16 GiB."""
MAX_MODEL_PARAMS = 2**40
"""Largest model a config accepts, in parameters estimated from its architecture."""


def check_positive(**values: int | float) -> None:
    """ValueError naming the first value that is not > 0 (a bool is not a number here)."""
    for name, v in values.items():
        if isinstance(v, bool) or not v > 0:
            raise ValueError(f"{name}={v!r} must be > 0")


def check_at_most(limit: int, **values: int | None) -> None:
    """ValueError naming the first value above ``limit`` (None is skipped)."""
    for name, v in values.items():
        if v is not None and v > limit:
            raise ValueError(f"{name}={v!r} is larger than the sane maximum {limit:_}; use a "
                             f"smaller value")


def check_path(name: str, v: str | None) -> None:
    """ValueError for a blank path (None, the default, passes)."""
    if v is not None and not v.strip():
        raise ValueError(f"{name}={v!r} is empty; give a path, or null for the default")


def check_one_of(name: str, value: Any, choices: tuple) -> None:
    """ValueError naming ``value`` and the valid ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {choices}")


def check_token_budget(section: str, max_tokens: int) -> None:
    """A role's ``max_token_len_per_micro_batch`` is in ``[1, MAX_COUNT]`` (``section`` is the
    key's prefix in the message, e.g. ``"actor."``)."""
    key = f"{section}max_token_len_per_micro_batch"
    check_positive(**{key: max_tokens})
    check_at_most(MAX_COUNT, **{key: max_tokens})

