"""Rule reward for the GSM8K-style example: is the final number equal to the ground truth?

Used by the RL runtime as ``reward.kind=function
reward.function=examples/gsm8k_style/reward.py:compute_score``.  Standard library only, so the
file can be loaded by path from any process.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

ANSWER_MARK = "####"
# A sign counts only when attached and not after a word/number ("7 - 5" and "3-4" hold no -5 / -4).
_NUMBER = r"(?<![\w.])-?\$?\d[\d,]*(?:\.\d+)?"
_MARKED = re.compile(re.escape(ANSWER_MARK) + r"\s*(" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)


def _value(text: str) -> Decimal | None:
    """``"1,234"``, ``"$12"``, ``"-3"``, ``"7.50"`` -> a Decimal; None if not a number."""
    cleaned = re.sub(r"[\s$,]", "", text)
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_answer(solution_str: str) -> str | None:
    """The number after the last ``####``; without one, the last number in the text; else None."""
    marked = _MARKED.findall(solution_str)
    if marked:
        return marked[-1]
    numbers = _ANY.findall(solution_str)
    return numbers[-1] if numbers else None


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """verl's reward-function signature.

    Args:
        data_source: the row's ``data_source`` (unused: one task here).
        solution_str: the decoded response.
        ground_truth: the row's ``ground_truth``, a number or its string.
        extra_info: the row's ``extra_info`` (unused).

    Returns:
        ``{"score": 1.0 or 0.0, "format": 1.0 if "####" is in the response else 0.0}``.
    """
    del data_source, extra_info
    answer = extract_answer(solution_str)
    got = _value(answer) if answer is not None else None
    want = _value(str(ground_truth))
    if want is None:
        raise ValueError(f"ground_truth {ground_truth!r} is not a number")
    return {"score": 1.0 if got is not None and got == want else 0.0,
            "format": 1.0 if ANSWER_MARK in solution_str else 0.0}
