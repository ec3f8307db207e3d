"""``log.rollouts_every``: an iteration's samples as ``<run_dir>/rollouts/iter_<k>.jsonl``,
one object per sample::

    {"messages": [...], "reward": 1.0, "num_turns": 2, "num_tool_calls": 1,
     "response_tokens": 41, "tool_tokens": 23}

``messages`` is the decoded conversation (a one-turn rollout: the prompt and the decoded
response); ``response_tokens`` counts the model's tokens, ``tool_tokens`` the masked ones of
the response (tool results and the template's text between turns).
"""

from __future__ import annotations

import json
import os

from rlhf.controller import Batch
from rlhf.tools.multi_turn import first_messages


def rollout_records(batch: Batch, tok) -> list[dict]:
    """One record per row of an iteration's final ``batch`` (with ``scores``)."""
    nt = batch.non_tensors
    response = batch["response_mask"].bool()
    width = batch["input_ids"].shape[1] - response.shape[1]
    real = batch["attention_mask"][:, width:].bool()
    model_tokens = response.sum(1).tolist()
    tool_tokens = (real & ~response).sum(1).tolist()
    scores = batch["scores"].float().tolist()
    out = []
    for i in range(len(batch)):
        if "messages" in nt:
            messages = nt["messages"][i]
        else:
            text = tok.decode_response(batch["input_ids"][i, width:])
            messages = first_messages(nt["prompt"][i]) + [{"role": "assistant",
                                                           "content": text}]
        out.append({"messages": messages, "reward": scores[i],
                    "num_turns": nt["num_turns"][i] if "num_turns" in nt else 1,
                    "num_tool_calls": nt["num_tool_calls"][i] if "num_tool_calls" in nt else 0,
                    "response_tokens": model_tokens[i], "tool_tokens": tool_tokens[i]})
    return out


def write_rollouts(run_dir: str, step: int, records: list[dict]) -> str:
    """``<run_dir>/rollouts/iter_<step>.jsonl``; returns its path."""
    folder = os.path.join(run_dir, "rollouts")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"iter_{step}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path
