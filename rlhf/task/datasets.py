"""Prompt datasets (jsonl, parquet, saved ``datasets`` folders) and a resumable prompt stream.

Rows use verl's layout: ``prompt`` (a string or a chat list of ``{role, content}``), optional
``ground_truth``, ``data_source``, ``extra_info`` and ``tools`` (the names of the tools the row
may use in multi-turn rollouts) (the key names of the first two are
configurable: ``data.prompt_key``, ``data.ground_truth_key``).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence

from rlhf.task.arithmetic import AdditionTask, Example


def _example(rec: dict, where: str, prompt_key: str, answer_key: str, source: str) -> Example:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be an object, got {rec!r:.80}")
    if prompt_key not in rec:
        raise ValueError(f"{where}: record lacks field(s) {[prompt_key]}; it has {sorted(rec)}")
    prompt = rec[prompt_key]
    if not isinstance(prompt, (str, list)):
        raise ValueError(f"{where}: {prompt_key} must be a string or a chat list of "
                         f"{{role, content}}, got {type(prompt).__name__}")
    if isinstance(prompt, list):
        prompt = [dict(m) for m in prompt]
    answer = rec.get(answer_key)
    extra = rec.get("extra_info")
    tools = rec.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, str) for t in tools)):
        raise ValueError(f"{where}: tools must be a list of tool names, got {tools!r:.80}")
    return Example(prompt, "" if answer is None else str(answer),
                   str(rec.get("data_source") or source), dict(extra) if extra else None,
                   list(tools) if tools is not None else None)


def read_jsonl(path: str | os.PathLike, prompt_key: str = "prompt",
               answer_key: str = "ground_truth") -> list[Example]:
    """One JSON object per line; blank lines are skipped."""
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    out, source = [], _source_name(path)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            out.append(_example(rec, f"{path}:{n}", prompt_key, answer_key, source))
    return out


def write_jsonl(path: str | os.PathLike, records: Sequence[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def read_parquet(path: str | os.PathLike, prompt_key: str = "prompt",
                 answer_key: str = "ground_truth") -> list[Example]:
    """A parquet file with one row per prompt (needs ``pyarrow``)."""
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    rows, source = pq.read_table(path).to_pylist(), _source_name(path)
    return [_example(r, f"{path}:row {i}", prompt_key, answer_key, source)
            for i, r in enumerate(rows)]


def read_saved_dataset(path: str | os.PathLike, prompt_key: str = "prompt",
                       answer_key: str = "ground_truth") -> list[Example]:
    """A folder written by ``datasets.Dataset.save_to_disk``."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"dataset folder {str(path)!r} holds splits {list(ds)}; give the "
                             f"folder of one split")
        ds = ds["train"]
    source = _source_name(path)
    return [_example(r, f"{path}:row {i}", prompt_key, answer_key, source)
            for i, r in enumerate(ds)]


def _source_name(path: str | os.PathLike) -> str:
    return os.path.splitext(os.path.basename(os.path.normpath(str(path))))[0]


def read_dataset(paths: str | os.PathLike, prompt_key: str = "prompt",
                 answer_key: str = "ground_truth") -> list[Example]:
    """Rows of one or more datasets (``paths`` comma-separated), in order: ``.jsonl`` /
    ``.json``, ``.parquet`` or a saved ``datasets`` folder.  A row has ``prompt`` (a string
    or a chat list) and optionally ``ground_truth``, ``data_source``, ``extra_info``;
    ``prompt_key`` / ``answer_key`` rename the first two."""
    out: list[Example] = []
    for path in [p.strip() for p in str(paths).split(",") if p.strip()]:
        ext = os.path.splitext(path)[1].lower()
        if os.path.isdir(path):
            out += read_saved_dataset(path, prompt_key, answer_key)
        elif ext in (".jsonl", ".json"):
            out += read_jsonl(path, prompt_key, answer_key)
        elif ext == ".parquet":
            out += read_parquet(path, prompt_key, answer_key)
        else:
            what = "unknown extension" if ext else "no such folder, and no extension"
            raise ValueError(f"dataset {path!r}: {what} {ext!r} (use .jsonl, .parquet or a "
                             f"folder saved by datasets)")
    if not out:
        raise ValueError(f"datasets {str(paths)!r} hold no rows")
    return out


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
