"""LoRA adapters in and out of PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``), through ``peft`` itself.

Reading (``actor.lora.init_from``): ``peft.PeftConfig.from_pretrained`` and
``peft.utils.load_peft_weights``; the folder's rank, alpha and target modules must be the
run's.  Writing (the HF export of a LoRA actor, and with ``log.export_merged`` the base with
the adapters merged, :func:`save_merged`): the global adapter tensors are gathered to
layout rank 0 (:func:`engine.hf_interop.global_on_rank0`), put into a PEFT model over the base
architecture built on the ``meta`` device (no base weights in memory) and written by
``save_pretrained``, so ``PeftModel.from_pretrained(base, folder)`` loads what we trained.
"""

from __future__ import annotations

import os
import re

import torch

from engine.hf_interop import config_to_hf, global_on_rank0, stream_hf_checkpoint
from engine.llama_spec import LlamaConfig
from engine.lora import ALL_LINEAR, MODULES, LoraConfig, lora_shard_specs, module_shape
from engine.model import ParallelLlama
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion


def peft_lora_config(lora: LoraConfig, base: str | None = None):
    """PEFT's ``LoraConfig`` of ``lora`` (a causal LM; ``base``: the base checkpoint)."""
    import peft

    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.target_modules), bias="none",
                           task_type="CAUSAL_LM", base_model_name_or_path=base)


def read_peft_adapter(folder: str, config: LlamaConfig, lora: LoraConfig
                      ) -> dict[str, torch.Tensor]:
    """The global adapter tensors of a PEFT adapter folder, by our spec names, in the model's
    dtype; ValueError naming what differs from ``lora`` or what is missing."""
    import peft
    from peft.utils import load_peft_weights

    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        raise ValueError(f"lora.init_from={folder!r} holds no adapter_config.json (a PEFT "
                         f"adapter folder, as save_pretrained writes it)")
    saved = peft.PeftConfig.from_pretrained(folder)
    targets = saved.target_modules
    targets = {targets} if isinstance(targets, str) else set(targets)
    want = set(lora.target_modules)
    if targets == {ALL_LINEAR}:
        targets = set(MODULES)
    if (saved.r, float(saved.lora_alpha), targets) != (lora.rank, lora.alpha, want):
        raise ValueError(f"lora.init_from={folder!r} has r={saved.r}, lora_alpha="
                         f"{saved.lora_alpha}, target_modules={sorted(targets)}; the run has "
                         f"lora.rank={lora.rank}, alpha={lora.alpha}, target_modules="
                         f"{sorted(want)}")
    weights = load_peft_weights(folder, device="cpu")
    out = {}
    for spec in lora_shard_specs(config, 1, lora):
        key = spec.hf_names[0]
        if key not in weights:
            raise ValueError(f"lora.init_from={folder!r} lacks {key}")
        if tuple(weights[key].shape) != spec.shape:
            raise ValueError(f"lora.init_from={folder!r}: {key} has shape "
                             f"{tuple(weights[key].shape)}, the model needs {spec.shape}")
        out[spec.name] = weights[key].to(config.dtype)
    return out


def gather_adapters(model: ParallelLlama) -> dict[str, torch.Tensor] | None:
    """The global adapter tensors by spec name on layout rank 0 (None elsewhere; collective
    over the DP-rank-0 replica, like :func:`engine.hf_interop.global_on_rank0`)."""
    if model.coords.dp != 0:
        return None
    full = {}
    for spec in model.adapter_specs:
        t = global_on_rank0(model, spec, model.adapter_params)
        if t is not None:
            full[spec.name] = t.detach()
    return full if model.coords.pp == 0 and model.coords.tp == 0 else None


def lora_delta(config: LlamaConfig, lora: LoraConfig, adapters: dict[str, torch.Tensor],
               name: str) -> torch.Tensor | None:
    """``s B A`` of the base tensor ``name`` (our fused layouts: ``layers.<i>.qkv``,
    ``gate_up``, ``o_proj``, ``down_proj``) in float32, or None where no adapter touches it."""
    match = re.fullmatch(r"layers\.(\d+)\.(qkv|gate_up|o_proj|down_proj)", name)
    if match is None:
        return None
    layer, kind = int(match[1]), match[2]
    parts = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}.get(
        kind, (kind,))
    if not set(parts) & set(lora.target_modules):
        return None

    def one(module: str) -> torch.Tensor:
        if module not in lora.target_modules:
            return torch.zeros(module_shape(config, module))
        a = adapters[f"layers.{layer}.{module}.lora_A"].float().cpu()
        b = adapters[f"layers.{layer}.{module}.lora_B"].float().cpu()
        return lora.scale * (b @ a)

    deltas = [one(m) for m in parts]
    if kind == "qkv":
        return QKVFusion(config.num_heads, config.num_kv_heads, config.head_dim).fuse(*deltas)
    if kind == "gate_up":
        return GateUpFusion().fuse(*deltas)
    return deltas[0]


def save_merged(model: ParallelLlama, folder: str) -> None:
    """The base with the adapters merged (``W + s B A`` in float32, written in the model's
    dtype) as a plain HF checkpoint (collective, like :func:`engine.hf_interop.
    stream_hf_checkpoint`); the model's own weights are not touched."""
    if model.lora is None:
        raise ValueError("save_merged: the model has no LoRA adapters")
    adapters = gather_adapters(model)
    delta = (None if adapters is None else
             lambda name: lora_delta(model.config, model.lora, adapters, name))
    stream_hf_checkpoint(model, folder, delta)


def save_peft_adapter(model: ParallelLlama, folder: str, base: str | None = None) -> None:
    """Write the model's adapters as a PEFT adapter folder (collective over the model's
    layout; layout rank 0 writes).  ``base``: recorded as ``base_model_name_or_path``."""
    if model.lora is None:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    adapters = gather_adapters(model)
    if adapters is None:
        return
    names = {s.name: s.hf_names[0] for s in model.adapter_specs}
    full = {names[n]: t.cpu() for n, t in adapters.items()}
    import peft
    import transformers

    hf_config = config_to_hf(model.config, model.head)
    with torch.device("meta"):
        base_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    peft_model = peft.get_peft_model(base_model, peft_lora_config(model.lora, base))
    state = {k.replace(".weight", ".default.weight"): v for k, v in full.items()}
    missing = set(state) - set(dict(peft_model.named_parameters()))
    if missing:
        raise RuntimeError(f"PEFT's model has no parameters {sorted(missing)[:3]}")
    peft_model.load_state_dict(state, strict=False, assign=True)
    peft_model.save_pretrained(folder)
