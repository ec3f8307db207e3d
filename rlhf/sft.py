"""Supervised warm start of the policy on the addition task; saves an HF-format folder.

    python -m rlhf.sft --out runs/cache/sft [--steps 400] [key=value ...]

The architecture and task come from the run config (same recipe and overrides as
``rlhf.train``), so the saved folder matches ``actor.model``.  One process, one rank: the model
is tiny.  Loss: token cross-entropy on the answer and ``<eos>`` only (prompt tokens masked).
An existing folder with the same settings (``sft_meta.json``) is reused, not retrained.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import random

import torch

from engine.hf_interop import save_hf_checkpoint
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.builders import task_of
from rlhf.config import load_config
from rlhf.task import CharTokenizer, corrupt_answer
from rlhf.workers.common import build_model
from rlhf.workers.specs import ModelSpec

META = "sft_meta.json"


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


def noisy_records(task, count: int, start: int, noise: float) -> list[dict]:
    """SFT records with a fraction ``noise`` of wrong answers (deterministic per index): a
    warm start that imitates imperfect demonstrations, which RL on the verifiable reward then
    corrects."""
    out = task.sft_records(count, start)
    for i, r in enumerate(out):
        rng = random.Random(f"sft-noise:{start + i}")
        if rng.random() < noise:
            r["answer"] = corrupt_answer(r["answer"], rng)
    return out


def sft_loss(outputs: dict, mb: dict) -> torch.Tensor:
    m = mb["loss_mask"]
    return -(outputs["log_probs"] * m).sum() / m.sum()


def train_sft(args: ModelSpec, task, tok: CharTokenizer, *, out: str, steps: int, batch: int,
              lr: float, width: int, noise: float) -> dict:
    """Train from ``args`` and save to ``out``; returns ``{"loss", "time_s"}``."""
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = build_model(args, groups)
    engine = TrainEngine(model, OptimConfig(lr=lr, weight_decay=0.0, max_grad_norm=1.0))
    t0, loss = time.perf_counter(), float("nan")
    for step in range(steps):
        mb = sft_batch(noisy_records(task, batch, step * batch, noise), tok, width)
        for g in engine.optimizer.param_groups:  # linear decay to 10%
            g["lr"] = lr * (1 - 0.9 * step / steps)
        loss = engine.train_step([mb], sft_loss)["loss"]
        if step % 100 == 0 or step == steps - 1:
            print(f"[sft] step {step} loss {loss:.4f}", flush=True)
    save_hf_checkpoint(model, out)
    tok.save(os.path.join(out, "tokenizer.json"))
    return {"loss": loss, "time_s": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (HF format)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--noise", type=float, default=0.0,
                   help="fraction of SFT answers replaced by a wrong answer")
    p.add_argument("overrides", nargs="*", help="key=value run-config overrides")
    a = p.parse_args(argv)
    cfg = load_config(a.overrides)
    torch.manual_seed(cfg.seed)
    task = task_of(cfg)
    settings = {"model": cfg.actor.model.llama().to_dict(), "task": vars(task),
                "steps": a.steps, "batch": a.batch, "lr": a.lr, "seed": cfg.seed,
                "noise": a.noise}
    meta_path = os.path.join(a.out, META)
    if not 0 <= a.noise < 1:
        raise ValueError(f"--noise={a.noise} must be in [0, 1)")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            if json.load(f).get("settings") == settings:
                print(f"[sft] reusing {a.out}", flush=True)
                return 0
    tok = CharTokenizer.build()
    width = cfg.data.max_prompt_len + cfg.data.max_response_len
    args = ModelSpec(config=cfg.actor.model.llama(), head="lm", init_from=None, seed=cfg.seed)
    result = train_sft(args, task, tok, out=a.out, steps=a.steps, batch=a.batch, lr=a.lr,
                       width=width, noise=a.noise)
    with open(meta_path, "w") as f:
        json.dump({"settings": settings, **result}, f)
    print(f"[sft] saved {a.out} (loss {result['loss']:.4f}, {result['time_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
