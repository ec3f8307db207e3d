"""Prompt datasets: jsonl / parquet readers and a resumable prompt stream.

Records are dicts with at least a prompt and an answer field (names configurable).  Parquet
needs ``pyarrow``, which is optional: without it :func:`read_parquet` raises an ImportError that
says so.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence

from rlhf.task.arithmetic import AdditionTask, Example


def _check_fields(rec: dict, where: str, prompt_key: str, answer_key: str) -> Example:
    missing = [k for k in (prompt_key, answer_key) if k not in rec]
    if missing:
        raise ValueError(f"{where}: record lacks field(s) {missing}; it has {sorted(rec)}")
    return Example(str(rec[prompt_key]), str(rec[answer_key]))


def read_jsonl(path: str | os.PathLike, prompt_key: str = "prompt",
               answer_key: str = "answer") -> list[Example]:
    """One JSON object per line; blank lines are skipped."""
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            out.append(_check_fields(rec, f"{path}:{n}", prompt_key, answer_key))
    return out


def write_jsonl(path: str | os.PathLike, records: Sequence[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def read_parquet(path: str | os.PathLike, prompt_key: str = "prompt",
                 answer_key: str = "answer") -> list[Example]:
    """Read a parquet file with prompt/answer columns (needs the optional ``pyarrow``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {str(path)!r} needs pyarrow (pip install pyarrow); "
                          f"or convert the data to jsonl") from None
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    rows = pq.read_table(path).to_pylist()
    return [_check_fields(r, f"{path}:row {i}", prompt_key, answer_key)
            for i, r in enumerate(rows)]


def read_dataset(path: str | os.PathLike, prompt_key: str = "prompt",
                 answer_key: str = "answer") -> list[Example]:
    """Dispatch on the extension: ``.jsonl`` / ``.json`` or ``.parquet``."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext in (".jsonl", ".json"):
        return read_jsonl(path, prompt_key, answer_key)
    if ext == ".parquet":
        return read_parquet(path, prompt_key, answer_key)
    raise ValueError(f"dataset {str(path)!r}: unknown extension {ext!r} (use .jsonl or .parquet)")


class PromptStream:
    """Endless, resumable stream of prompts: shuffled epochs over a record list, or the
    addition task's ``train`` split (index = position, no epochs).

    The whole state is ``position`` (prompts handed out so far); the order of epoch ``e`` is a
    permutation seeded by ``(seed, e)``, so ``load_state_dict`` resumes exactly.
    """

    def __init__(self, source: AdditionTask | Sequence[Example], seed: int = 0,
                 shuffle: bool = True) -> None:
        if not isinstance(source, AdditionTask) and len(source) == 0:
            raise ValueError("PromptStream needs a non-empty dataset")
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._order: tuple[int, list[int]] | None = None

    def _item(self, pos: int) -> Example:
        if isinstance(self.source, AdditionTask):
            return self.source.example(pos, "train")
        n = len(self.source)
        epoch, i = divmod(pos, n)
        if not self.shuffle:
            return self.source[i]
        if self._order is None or self._order[0] != epoch:
            order = list(range(n))
            random.Random(f"stream:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self.source[self._order[1][i]]

    def next_batch(self, count: int) -> list[Example]:
        if count < 1:
            raise ValueError(f"count={count} must be >= 1")
        out = [self._item(p) for p in range(self.position, self.position + count)]
        self.position += count
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.seed = state["seed"]
        self._order = None
