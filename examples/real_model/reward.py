"""Reward of the real-model example: is the last integer of the response the ground truth?

``reward.kind=function reward.function=examples/real_model/reward.py:compute_score``
(verl's signature; standard library only, so any process can load the file by path).
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"(?<![\w.])-?\d+")


def last_integer(text: str) -> str | None:
    found = _INTEGER.findall(text.replace(",", ""))
    return found[-1] if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(last_integer(solution_str) == str(ground_truth).strip())
