"""Reward of the real-model example: is the last number of the response the ground truth?

``reward.kind=function reward.function=examples/real_model/reward.py:compute_score``
(verl's signature; standard library only, so any process can load the file by path).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (an integer or a decimal, thousands commas
    ignored), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(last_number(solution_str) == str(ground_truth).strip())
