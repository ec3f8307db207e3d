"""Rule-based rewards of the arithmetic task and their weighted composition.

Each component maps ``(response, answer)`` text to a float in [0, 1]::

    exact    1 if response.strip() == answer
    partial  matching digits, right-aligned (units with units), / max(len(response), len(answer));
             0 unless the response is all digits
    format   1 if the response is 1..max_len digits and nothing else

:class:`CompositeReward` sums ``weight * component`` and reports every component separately
(``reward/<name>/mean`` in the metrics), so a run shows which part of the reward moved.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

RewardFn = Callable[[str, str], float]
_DIGITS = re.compile(r"\d+")


def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == answer)


def partial_digits(response: str, answer: str) -> float:
    r = response.strip()
    if not _DIGITS.fullmatch(r):
        return 0.0
    hits = sum(a == b for a, b in zip(reversed(r), reversed(answer)))
    return hits / max(len(r), len(answer))


def format_ok(response: str, answer: str, max_len: int = 19) -> float:
    r = response.strip()
    return float(bool(_DIGITS.fullmatch(r)) and len(r) <= max_len)


REWARD_FUNCTIONS: dict[str, RewardFn] = {"exact": exact_match, "partial": partial_digits,
                                         "format": format_ok}


@dataclass
class RewardOutput:
    total: torch.Tensor
    """``[B]`` weighted sum of the components."""
    components: dict[str, torch.Tensor]
    """name -> ``[B]`` unweighted component values."""

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        out = {f"{prefix}/mean": float(self.total.mean())} if len(self.total) else {}
        for name, v in self.components.items():
            out[f"{prefix}/{name}/mean"] = float(v.mean()) if len(v) else 0.0
        return out


class CompositeReward:
    """``total = sum_k weight_k * fn_k(response, answer)``; components reported separately.

    Args:
        components: ``(name, fn, weight)`` triples; ``fn(response, answer) -> float``.
    """

    def __init__(self, components: Sequence[tuple[str, RewardFn, float]]) -> None:
        if not components:
            raise ValueError("a CompositeReward needs at least one component")
        names = [c[0] for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique, got {names}")
        self.components = list(components)

    @classmethod
    def from_weights(cls, weights: dict[str, float]) -> "CompositeReward":
        """Compose the built-in functions by name, e.g. ``{"exact": 1.0, "format": 0.1}``;
        zero weights are dropped."""
        unknown = sorted(set(weights) - set(REWARD_FUNCTIONS))
        if unknown:
            raise ValueError(f"unknown reward components {unknown}; valid: "
                             f"{sorted(REWARD_FUNCTIONS)}")
        return cls([(k, REWARD_FUNCTIONS[k], float(w)) for k, w in weights.items() if w != 0])

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> RewardOutput:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        # scores of text, computed on the host
        comps = {name: torch.tensor([fn(r, a) for r, a in zip(responses, answers)],
                                    dtype=torch.float32, device="cpu")
                 for name, fn, _ in self.components}
        total = torch.zeros(len(responses), dtype=torch.float32, device="cpu")
        for name, _, w in self.components:
            total += w * comps[name]
        return RewardOutput(total, comps)
