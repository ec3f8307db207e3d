"""SFT on the built-in addition task: the warm start that :mod:`rlhf.main_job` runs, through
``python -m rlhf.sft --out DIR [--steps N] [--noise P] [--carry-errors P] [key=value ...]``.

The architecture and task come from the run config (same recipe and overrides as
``rlhf.train``), so the saved folder matches ``actor.model``; ``actor.model.init_from=DIR``
continues from ``DIR`` (a second phase).  The demonstrations are the task's
(:meth:`rlhf.task.AdditionTask.noisy_sft_records`, optionally sloppy), written with the
built-in character tokenizer.  One process, one rank: the model is tiny.  An existing folder
saved with the same settings (``sft_meta.json``) is reused.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hybridflow_comm.devices import Precision
from hybridflow_comm.groups import Group
from rlhf.builders import run_precision, task_of
from rlhf.config import load_config, resolve_devices
from rlhf.model_arch import llama_config
from rlhf.sft_loop import META, train_steps
from rlhf.task import AdditionTask, CharTokenizer
from rlhf.workers.specs import ModelSpec


def sft_batch(records: list[dict], tok: CharTokenizer, width: int) -> dict[str, torch.Tensor]:
    """``<bos> prompt answer <eos>`` right-padded to ``width``; loss mask on answer + eos."""
    seqs, masks = [], []
    for r in records:
        p = tok.encode(r["prompt"], add_bos=True)
        a = tok.encode(r["answer"], add_eos=True)
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    ids, attn = tok.pad_batch(seqs, "right", width)
    loss_mask = torch.zeros(len(seqs), width)
    for i, m in enumerate(masks):
        loss_mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attn.long(), "loss_mask": loss_mask[:, 1:]}


def sft_loss(outputs: dict, mb: dict) -> torch.Tensor:
    m = mb["loss_mask"]
    return -(outputs["log_probs"] * m).sum() / m.sum()


def train_sft(spec: ModelSpec, task: AdditionTask, tok: CharTokenizer, *, out: str, steps: int,
              batch: int, lr: float, width: int, noise: float, carry_errors: float,
              device: torch.device, precision: Precision) -> dict:
    """Train from ``spec`` (its config in ``precision``, the run's resolved one) on the task's
    demonstrations and save to ``out`` (with the tokenizer); returns
    :func:`rlhf.sft_loop.train_steps`'s losses and time."""
    def batch_at(step: int, _dp: Group) -> dict[str, torch.Tensor]:  # one rank: all rows
        records = task.noisy_sft_records(batch, step * batch, noise, carry_errors)
        return sft_batch(records, tok, width)

    result = train_steps(spec, world=1, steps=steps, lr=lr, batch_at=batch_at,
                         loss_fn=sft_loss, out=out, device=device, precision=precision)
    tok.save(os.path.join(out, "tokenizer.json"))
    return result


def _settings_of(folder: str) -> dict | None:
    """The settings an earlier ``rlhf.sft`` run saved with ``folder`` (None: not one)."""
    path = os.path.join(folder, META)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("settings")


def main_builtin(a: argparse.Namespace) -> int:
    """The built-in addition task with :func:`rlhf.sft.main`'s arguments (``out``, ``steps``,
    ``batch``, ``lr``, ``noise``, ``carry_errors``, ``overrides``)."""
    cfg, device = resolve_devices(load_config(a.overrides))  # device=, precision= as rlhf.train
    torch.manual_seed(cfg.seed)
    task = task_of(cfg)
    start = cfg.actor.model.init_from  # continue from a checkpoint (a second SFT phase)
    precision = run_precision(cfg)
    config = llama_config(cfg.actor.model, precision)
    settings = {"model": config.to_dict(), "task": vars(task),  # the dtype included
                "steps": a.steps, "batch": a.batch, "lr": a.lr, "seed": cfg.seed,
                "noise": a.noise, "carry_errors": a.carry_errors,
                "init_from": None if start is None else {"path": start,
                                                         "settings": _settings_of(start)}}
    for name in ("noise", "carry_errors"):
        if not 0 <= getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)} must be in [0, 1)")
    if _settings_of(a.out) == settings:
        print(f"[sft] reusing {a.out}", flush=True)
        return 0
    tok = CharTokenizer.build()
    width = cfg.data.max_prompt_len + cfg.data.max_response_len
    spec = ModelSpec(config=config, head="lm", init_from=start, seed=cfg.seed,
                     fresh_head=False, lora=None, lora_init_from=None)
    result = train_sft(spec, task, tok, out=a.out, steps=a.steps, batch=a.batch, lr=a.lr,
                       width=width, noise=a.noise, carry_errors=a.carry_errors, device=device,
                       precision=precision)
    with open(os.path.join(a.out, META), "w") as f:
        json.dump({"settings": settings, **result}, f)
    print(f"[sft] saved {a.out} (loss {result['loss']:.4f}, {result['time_s']:.1f} s)")
    return 0
