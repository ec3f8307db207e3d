"""Rank-side work of tests/test_real_model.py on the real checkpoint (SmolLM2-135M-Instruct):
importable by the spawned gloo ranks (no transformers import) and run in the test process for
the single-process (tp=1) case."""

from __future__ import annotations

import torch

from engine.generation import GenerationEngine
from engine.hf_interop import full_to_hf_state_dict, gather_full_state_dict, \
    load_hf_checkpoint, read_hf_config
from engine.model import ParallelLlama
from engine.sampling import SamplingParams
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder

SAMPLE_SEED = 5


def response_loss(outputs: dict, mb: dict) -> torch.Tensor:
    """Mean negative log-prob of the response tokens (``mb["loss_mask"] [B, S-1]``: 1 where
    ``log_probs[:, t]``, the log-prob of token ``t + 1``, is a response token)."""
    m = mb["loss_mask"]
    return -(outputs["log_probs"] * m).sum() / m.sum()


def loss_mask(attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[B, S-1]`` float: the response positions of a generated batch, shifted by one."""
    m = attention_mask[:, 1:].float().clone()
    m[:, :prompt_length - 1] = 0
    return m


def build(folder: str, tp: int, tp_g: int, dtype: torch.dtype = torch.float32
          ) -> ParallelLlama:
    layout = HybridLayout(ParallelLayout(1, tp, 1), 1, tp_g)
    groups = build_hybrid_groups(layout, pool=list(range(layout.world_size)))
    model = ParallelLlama(read_hf_config(folder, dtype=dtype), groups)
    load_hf_checkpoint(model, folder)
    return model


def run_layout(rank: int, world_size: int, folder: str, ids: torch.Tensor, mask: torch.Tensor,
               n_new: int, eos: int, pad: int, batch: dict | None = None, train_rows: int = 8,
               tp: int = 1, tp_g: int = 1) -> dict:
    """Greedy and sampled generations of the prompts ``ids [B, P]`` (left padded, ``mask``)
    on the layout train tp x generation tp_g; then, on ``batch`` (``input_ids``,
    ``attention_mask``, ``loss_mask``; default the first ``train_rows`` sampled rows), the training
    forward's log-probs and the gradients of one :func:`response_loss` step by HF name
    (layout rank 0)."""
    model = build(folder, tp, tp_g)
    # no clipping, plain Adam: the gradients are read back as computed
    engine = TrainEngine(model, OptimConfig(lr=1e-6, max_grad_norm=None))
    resharder = Resharder(model.specs, model.groups, buffer=model.buffer)
    resharder.to_generation()
    rollout = GenerationEngine(model.config, model.groups)
    rollout.load_weights(resharder)
    params = dict(max_new_tokens=n_new, eos_token_id=eos, pad_token_id=pad)
    greedy = rollout.generate(ids, mask, SamplingParams(temperature=0.0, **params))
    sampled = rollout.generate(ids, mask, SamplingParams(temperature=1.0, seed=SAMPLE_SEED,
                                                         **params))
    paths = (rollout.paths.prefill.name, rollout.paths.decode.name)
    rollout.release()
    resharder.to_training()
    r = {"greedy": greedy.responses, "greedy_mask": greedy.response_mask,
         "sampled": {"input_ids": sampled.input_ids,
                     "attention_mask": sampled.attention_mask,
                     "log_probs": sampled.log_probs, "prompt_length": sampled.prompt_length},
         "paths": paths}
    if batch is None:
        rows = slice(0, train_rows)
        batch = {"input_ids": sampled.input_ids[rows],
                 "attention_mask": sampled.attention_mask[rows],
                 "loss_mask": loss_mask(sampled.attention_mask[rows], sampled.prompt_length)}
    out = engine.forward([batch], temperature=1.0)
    r["train_log_probs"] = out[0]["log_probs"]
    r["loss"] = engine.train_step([batch], response_loss, temperature=1.0)["loss"]
    grads = gather_full_state_dict(model, {n: p.grad for n, p in engine.train_params.items()})
    r["grads"] = None if grads is None else full_to_hf_state_dict(grads, model.specs)
    return r


def greedy(folder: str, ids: torch.Tensor, mask: torch.Tensor, n_new: int, eos: int, pad: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Greedy responses of one process whose weights are ``dtype``."""
    model = build(folder, 1, 1, dtype)
    resharder = Resharder(model.specs, model.groups, buffer=model.buffer)
    resharder.to_generation()
    rollout = GenerationEngine(model.config, model.groups)
    rollout.load_weights(resharder)
    out = rollout.generate(ids, mask, SamplingParams(temperature=0.0, max_new_tokens=n_new,
                                                     eos_token_id=eos, pad_token_id=pad))
    return out.responses
