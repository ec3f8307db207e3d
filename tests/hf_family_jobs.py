"""Rank-side work of tests/test_hf_families.py: importable by the spawned gloo ranks (no
transformers import) and run in the test process too for the single-process reference."""

from __future__ import annotations

import os

import torch

from engine.generation import GenerationEngine
from engine.hf_interop import load_hf_checkpoint, read_hf_config, save_hf_checkpoint
from engine.model import ParallelLlama
from engine.sampling import SamplingParams
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder

# name -> ((pp, tp, dp), (pp_g, tp_g), train and save?)
SINGLE = {"single": ((1, 1, 1), (1, 1), True)}
MULTI = {
    "tp2": ((1, 2, 1), (1, 1), True),  # generation on 1 rank: stacked slots of 2 TP shards
    "pp2": ((2, 1, 1), (2, 1), True),  # pipelined generation
    "tp2_gen_tp2": ((1, 2, 1), (1, 2), False),  # TP generation (kernel_layers / python)
    "dp2": ((1, 1, 2), (1, 1), True),
}
# Adam with eps well above the gradients' fp32 summation noise: every layout takes the same
# step to ~1e-7 (an update is lr * g / (|g| + eps), so noise is scaled by lr / eps).
OPTIM = OptimConfig(lr=1e-2, eps=1e-3, max_grad_norm=None)


def build(train: tuple, gen: tuple, folder: str, head: str = "lm") -> ParallelLlama | None:
    """Groups on ranks [0, world) (collective over the pool), then the model from ``folder``."""
    layout = HybridLayout(ParallelLayout(*train), *gen)
    groups = build_hybrid_groups(layout, pool=list(range(layout.world_size)))
    if groups is None:
        return None
    model = ParallelLlama(read_hf_config(folder), groups, head)
    load_hf_checkpoint(model, folder)
    return model


def lm_loss(outputs: dict, mb: dict) -> torch.Tensor:
    m = (mb["attention_mask"][:, 1:] * mb["attention_mask"][:, :-1]).float()
    return -(outputs["log_probs"] * m).sum() / m.sum() - 0.01 * outputs["entropy"].mean()


def train_batches(vocab: int) -> list[dict]:
    """Two micro-batches with left and right padding."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(2):
        ids = torch.randint(1, vocab, (2, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[0, 10 - 2 - i:] = 0
        mask[1, :1 + i] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def run_layouts(rank: int, world_size: int, layouts: dict, folder: str, ids: torch.Tensor,
                prompts: torch.Tensor, mask: torch.Tensor, n_new: int, out_root: str) -> dict:
    """Per layout: logits of ``ids``, greedy tokens of ``prompts`` and the layer paths; then
    (where the layout says so) one train step, ``save_hf_checkpoint`` into
    ``out_root/<layout>`` and the logits after the step.  Logits come from the last stage
    (this rank's vocab slice)."""
    results = {}
    for name, (train, gen, step) in layouts.items():
        model = build(train, gen, folder)
        if model is None:
            continue
        r: dict = {"tp_rank": model.coords.tp, "dp_rank": model.coords.dp,
                   "is_last": model.is_last}
        eng = TrainEngine(model, OPTIM)
        out = eng.forward([{"input_ids": ids}], with_logits=True, temperature=1.0)
        if model.is_last:
            r["logits"] = out[0]["logits"]
        resharder = Resharder(model.specs, model.groups, buffer=model.buffer)
        stats = resharder.to_generation()
        r["reshard_bytes"] = (stats.received_bytes, resharder.minimum_received_bytes())
        rollout = GenerationEngine(model.config, model.groups, record_routes=True)
        rollout.load_weights(resharder)
        o = rollout.generate(prompts, mask, SamplingParams(max_new_tokens=n_new,
                                                           temperature=0.0))
        r["tokens"], r["routes"] = o.responses, o.routes  # routes: a mixture of experts
        r["paths"] = (rollout.paths.prefill.name, rollout.paths.decode.name)
        rollout.release()
        resharder.to_training()
        if step:
            step = eng.train_step(train_batches(model.config.vocab_size), lm_loss,
                                  temperature=1.0)
            if "router_aux_loss" in step:
                r["router_aux_loss"] = step["router_aux_loss"]
            save_hf_checkpoint(model, os.path.join(out_root, name))
            out = eng.forward([{"input_ids": ids}], with_logits=True, temperature=1.0)
            if model.is_last:
                r["logits_after"] = out[0]["logits"]
        results[name] = r
    return results


def value_scores(rank: int, world_size: int, train: tuple, folder: str, ids: torch.Tensor,
                 out_folder: str | None) -> dict | None:
    """A value-head model loaded from ``folder``: its values (last stage) and, if asked, the
    model saved to ``out_folder``."""
    model = build(train, (train[0], train[1]), folder, head="value")
    if model is None:
        return None
    out = TrainEngine(model).forward([{"input_ids": ids}], temperature=1.0)
    if out_folder is not None:
        save_hf_checkpoint(model, out_folder)
    return {"values": out[0]["values"]} if model.is_last else {}
