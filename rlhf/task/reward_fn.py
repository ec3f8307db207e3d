"""A user's reward function, in verl's signature, loaded from a file::

    reward.kind=function reward.function=my_reward.py:compute_score

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

``solution_str`` is the decoded response only (no prompt, special tokens skipped).  A dict
result carries ``score`` plus extra numeric fields, each logged as ``reward/<field>``.  An
exception inside the function becomes a :class:`RewardFunctionError` naming the file, line,
exception and the failing sample.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence

import torch

from rlhf.user_files import import_file


class RewardFunctionError(RuntimeError):
    """The user's reward function raised (the message names file, line and sample)."""


def parse_function_spec(spec: str) -> tuple[str, str]:
    """``"path/to/file.py:name"`` -> ``(path, name)``; ValueError for anything else."""
    path, sep, name = str(spec).rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ValueError(f"reward.function={spec!r} must be path/to/file.py:function_name")
    if not os.path.isfile(path):
        raise ValueError(f"reward.function={spec!r}: file {path!r} does not exist")
    return path, name


def load_function(spec: str) -> Callable:
    """Import the file of ``spec`` as a module of its own and return the named callable."""
    path, name = parse_function_spec(spec)
    module = import_file(path, "reward_fn_", f"reward.function={spec!r}")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.function={spec!r}: {path} has no function {name!r}")
    return fn


class FunctionReward:
    """Scores responses with a user's ``compute_score``; one call per response."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.path = os.path.abspath(parse_function_spec(spec)[0])
        self.fn = load_function(spec)

    def __call__(self, texts: Sequence[str], ground_truths: Sequence[str],
                 data_sources: Sequence[str], extra_infos: Sequence[dict | None],
                 sample_ids: Sequence) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(scores [B], {field: [B]})`` for the decoded responses ``texts``."""
        scores, fields = [], []
        for i, text in enumerate(texts):
            try:
                out = self.fn(data_sources[i], text, ground_truths[i], extra_infos[i])
            except Exception as e:
                raise RewardFunctionError(self._where(e, sample_ids[i])) from None
            scores.append(self._score(out, sample_ids[i]))
            fields.append({k: float(v) for k, v in out.items() if k != "score"}
                          if isinstance(out, dict) else {})
        names = sorted({k for f in fields for k in f})
        return (torch.tensor(scores, dtype=torch.float32, device="cpu"),  # scores of text
                {k: torch.tensor([f.get(k, 0.0) for f in fields], device="cpu") for k in names})

    def _score(self, out, sample) -> float:
        value = out.get("score") if isinstance(out, dict) else out
        try:
            return float(value)
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"reward function {self.spec} returned {out!r:.120} for sample {sample}: it "
                f"must return a number or a dict with a numeric 'score'") from None

    def _where(self, e: Exception, sample) -> str:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if os.path.abspath(f.filename) == self.path]
        line = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else self.path
        return (f"reward function {self.spec} raised {type(e).__name__}: {e} at {line} on "
                f"sample {sample}")
