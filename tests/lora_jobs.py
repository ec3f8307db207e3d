"""Rank-side work of tests/test_lora.py: importable by the spawned gloo ranks (no transformers
or peft import) and run in the test process too for the single-process case."""

from __future__ import annotations

import torch

from engine.hf_interop import load_hf_checkpoint, read_hf_config
from engine.lora import LoraConfig
from engine.model import ParallelLlama, load_adapter_state_dict
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout


def build(train: tuple, folder: str, lora: LoraConfig, adapters: dict[str, torch.Tensor],
          dtype: torch.dtype | None = None) -> ParallelLlama | None:
    """Groups on ranks [0, pp*tp*dp), then the base from ``folder`` and the global adapter
    tensors ``adapters`` (spec names)."""
    layout = HybridLayout(ParallelLayout(*train), train[0], train[1])
    groups = build_hybrid_groups(layout, pool=list(range(layout.world_size)))
    if groups is None:
        return None
    config = read_hf_config(folder)
    if dtype is not None:
        from dataclasses import replace
        config = replace(config, dtype=dtype)
    model = ParallelLlama(config, groups, lora=lora)
    load_hf_checkpoint(model, folder)
    load_adapter_state_dict(model, adapters)
    return model


def nll(outputs: dict, mb: dict) -> torch.Tensor:
    return -outputs["log_probs"].mean()


def logits_and_grads(rank: int, world_size: int, train: tuple, folder: str,
                     lora: LoraConfig, adapters: dict, ids: torch.Tensor) -> dict:
    """This rank's logits (last stage, its vocab slice), its adapter shards' gradients of the
    full logits' mean square (each TP slice's share of it) and the base logits with the
    adapters off."""
    model = build(train, folder, lora, adapters)
    if model is None:
        return {}
    logits = _stages(model, ids, backward=True)
    with torch.no_grad(), model.adapters_disabled():
        base = _stages(model, ids, backward=False)
    out = {"stage": model.stage, "tp_rank": model.coords.tp, "grads": _grads(model)}
    if model.is_last:
        out |= {"logits": logits.detach(), "base_logits": base}
    return out


def _stages(model: ParallelLlama, ids: torch.Tensor, backward: bool) -> torch.Tensor | None:
    """The logits of ``ids`` through one stage or two (hidden states and their gradients sent
    between the stages); with ``backward``, the gradients of the mean square of the full
    logits.  The last stage returns its vocab slice, the first of two returns None."""
    import torch.distributed as dist

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return logits.pow(2).sum() / (logits.numel() * model.layout.tp)

    if model.layout.pp == 1:
        logits = model.local_logits(model.stage_forward(ids))
        if backward:
            loss(logits).backward()
        return logits
    pg = model.groups.train_pp.pg
    other = dist.get_global_rank(pg, 1 - model.stage)
    if model.is_first:
        hidden = model.stage_forward(ids)
        dist.send(hidden.detach().contiguous(), dst=other, group=pg)
        if backward:
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=other, group=pg)
            hidden.backward(grad)
        return None
    inp = torch.empty(*ids.shape, model.config.hidden_size)
    dist.recv(inp, src=other, group=pg)
    inp.requires_grad_(backward)
    logits = model.local_logits(model.stage_forward(inp))
    if backward:
        loss(logits).backward()
        dist.send(inp.grad.contiguous(), dst=other, group=pg)
    return logits


def _grads(model: ParallelLlama) -> dict[str, torch.Tensor]:
    assert all(p.grad is None for p in model.params.values()), "the frozen base got gradients"
    return {n: p.grad.clone() for n, p in model.adapter_params.items()}


def train_steps(rank: int, world_size: int, train: tuple, folder: str, lora: LoraConfig,
                adapters: dict, batches: list[dict], steps: int,
                dtype: torch.dtype | None = None) -> dict:
    """``steps`` optimizer steps of :func:`nll` on the LoRA model: this rank's adapter
    shards after them, whether the base stayed bitwise, and what the engine trains."""
    model = build(train, folder, lora, adapters, dtype)
    if model is None:
        return {}
    base = {n: p.detach().clone() for n, p in model.params.items()}
    eng = TrainEngine(model, OptimConfig(lr=1e-2, eps=1e-3, max_grad_norm=1.0))
    losses = [eng.train_step(batches, nll, temperature=1.0)["loss"] for _ in range(steps)]
    optim_numel = sum(v.numel() for st in eng.optimizer.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"stage": model.stage, "tp_rank": model.coords.tp, "losses": losses,
            "adapters": {n: p.detach().clone() for n, p in model.adapter_params.items()},
            "base_unchanged": all(torch.equal(p, base[n]) for n, p in model.params.items()),
            "trained_numel": sum(p.numel() for p in eng.train_params.values()),
            "grad_numel": sum(t.numel() for t in eng.grads.flat.values()),
            "optim_numel": optim_numel,
            "adapter_numel": sum(p.numel() for p in model.adapter_params.values()),
            "masters": eng.masters is not None}
