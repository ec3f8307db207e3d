"""Reward model (or Safe-RLHF cost model) from preference pairs, Bradley-Terry loss.

    python -m rlhf.train_rm --out runs/cache/rm [--kind reward|cost] [--init SFT_DIR]
                            [--steps 300] [key=value ...]

    reward:  pairs (prompt, chosen, rejected)   loss = -log sigmoid(r(chosen) - r(rejected))
    cost:    pairs (prompt, safer, unsafer)     loss = -log sigmoid(c(unsafer) - c(safer))

The model is a Llama with a scalar head read at the last real token of ``<bos> prompt
response <eos>`` (as :class:`rlhf.workers.RewardWorker` reads it); the architecture is the
run config's ``reward_model`` (``cost_model``) model, the actor's when unset.  Use the result
with ``reward.kind=model`` (or ``both``) and ``reward_model.model={..., init_from: OUT}``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from engine.hf_interop import save_hf_checkpoint
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.devices import Precision
from rlhf.builders import run_precision, task_of
from rlhf.config import load_config, resolve_devices
from rlhf.model_arch import llama_config
from rlhf.task import CharTokenizer, CostRule
from rlhf.workers.common import build_model, last_token_index
from rlhf.workers.specs import ModelSpec


def pair_batch(pairs: list[tuple[str, str, str]], tok: CharTokenizer, width: int
               ) -> dict[str, torch.Tensor]:
    """``[2B, width]``: rows ``0..B-1`` the preferred-high responses, ``B..2B-1`` the others."""
    seqs = [tok.encode(p + r, add_bos=True, add_eos=True) for p, r, _ in pairs] + \
           [tok.encode(p + r, add_bos=True, add_eos=True) for p, _, r in pairs]
    ids, mask = tok.pad_batch(seqs, "right", width)
    return {"input_ids": ids, "attention_mask": mask.long()}


def bt_loss(outputs: dict, mb: dict) -> torch.Tensor:
    """Bradley-Terry: the first half of the rows should score above the second half."""
    idx = last_token_index(mb["attention_mask"])
    s = outputs["values"].gather(1, idx[:, None]).squeeze(1)
    high, low = s.chunk(2)
    return -F.logsigmoid(high - low).mean()


def pairs_of(kind: str, task, count: int, start: int, rule: CostRule) -> list[tuple]:
    """(prompt, should-score-high, should-score-low) triples."""
    if kind == "reward":
        return [(r["prompt"], r["chosen"], r["rejected"])
                for r in task.preference_pairs(count, start)]
    return [(r["prompt"], r["unsafer"], r["safer"]) for r in task.cost_pairs(count, rule, start)]


@torch.no_grad()
def accuracy(engine: TrainEngine, batch: dict) -> float:
    out = engine.forward([batch], temperature=1.0)[0]  # a value head: temperature unused
    idx = last_token_index(batch["attention_mask"])
    high, low = out["values"].gather(1, idx[:, None]).squeeze(1).chunk(2)
    return float((high > low).float().mean())


def train_rm(args: ModelSpec, kind: str, task, rule: CostRule, tok: CharTokenizer, *, out: str,
             steps: int, batch: int, lr: float, width: int, precision: Precision,
             device: torch.device = torch.device("cpu")) -> dict:
    """Train and save; returns held-out pair accuracy before and after.

    Args:
        precision: the run's resolved precision (:func:`rlhf.builders.run_precision`), in
            which ``args.config`` builds the model and the engine trains it.
    """
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = build_model(args, groups, device)
    engine = TrainEngine(model, OptimConfig(lr=lr, max_grad_norm=1.0), precision=precision)
    def on_device(b: dict) -> dict:
        return {k: v.to(device) for k, v in b.items()}

    held_out = on_device(pair_batch(pairs_of(kind, task, 256, 10**6, rule), tok, width))
    before = accuracy(engine, held_out)
    for step in range(steps):
        mb = on_device(pair_batch(pairs_of(kind, task, batch, step * batch, rule), tok, width))
        loss = engine.train_step([mb], bt_loss, temperature=1.0)["loss"]
        if step % 100 == 0 or step == steps - 1:
            print(f"[train_rm] {kind} step {step} loss {loss:.4f}", flush=True)
    save_hf_checkpoint(model, out)
    return {"accuracy_before": before, "accuracy_after": accuracy(engine, held_out)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--kind", choices=("reward", "cost"), default="reward")
    p.add_argument("--init", default=None, help="HF folder to start from (e.g. the SFT policy)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("overrides", nargs="*", help="key=value run-config overrides")
    a = p.parse_args(argv)
    try:
        cfg, device = resolve_devices(load_config(a.overrides))  # device=, precision= as rlhf.train
    except ValueError as e:
        print(f"[train_rm] invalid configuration: {e}", file=sys.stderr, flush=True)
        return 2
    role = "reward_model" if a.kind == "reward" else "cost_model"
    precision = run_precision(cfg)
    args = ModelSpec(config=llama_config(cfg.model_of(role), precision), head="value",
                     init_from=a.init, seed=cfg.seed + 3, fresh_head=False, lora=None,
                     lora_init_from=None)
    rule = CostRule(cfg.reward.forbidden_digit, cfg.reward.max_answer_len)
    width = cfg.data.max_prompt_len + cfg.data.max_response_len
    res = train_rm(args, a.kind, task_of(cfg), rule, CharTokenizer.build(), out=a.out,
                   steps=a.steps, batch=a.batch, lr=a.lr, width=width, precision=precision,
                   device=device)
    print(f"[train_rm] saved {a.out}: held-out pair accuracy {res['accuracy_before']:.3f} -> "
          f"{res['accuracy_after']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
