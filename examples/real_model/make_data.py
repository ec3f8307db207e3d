"""Chat prompts for the real-model example: sums of two numbers from 1 to 99, asked for the
number only, with their ground truth, as verl-style rows::

    python examples/real_model/make_data.py [--out DIR] [--train 2000] [--val 128]

writes ``DIR/train.jsonl`` and ``DIR/val.jsonl`` (default ``runs/real_model_data``).  The
held-out pairs never appear in the training rows (neither as ``a + b`` nor as ``b + a``).
"""

from __future__ import annotations

import argparse
import json
import os
import random

QUESTION = "What is {a} + {b}? Reply with the number only."
DATA_SOURCE = "sums"


def row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
            "ground_truth": str(a + b), "data_source": DATA_SOURCE}


def split(train: int, val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``train`` and ``val`` rows over disjoint unordered pairs, each split in a seeded order."""
    pairs = [(a, b) for a in range(1, 100) for b in range(a, 100)]
    if train + val > len(pairs):
        raise ValueError(f"train={train} + val={val} rows exceed the {len(pairs)} distinct pairs")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    flip = [rng.random() < 0.5 for _ in pairs]
    ordered = [(b, a) if f else (a, b) for (a, b), f in zip(pairs, flip)]
    return [row(*p) for p in ordered[val:val + train]], [row(*p) for p in ordered[:val]]


def write(folder: str, train: int = 2000, val: int = 128, seed: int = 0) -> tuple[str, str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, rows in zip(("train", "val"), split(train, val, seed)):
        path = os.path.join(folder, f"{name}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        paths.append(path)
    return paths[0], paths[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("runs", "real_model_data"))
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--val", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for path in write(a.out, a.train, a.val, a.seed):
        print(path)


if __name__ == "__main__":
    main()
