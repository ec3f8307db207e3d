"""LoRA adapters in and out of PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``), through ``peft`` itself.

Reading (``actor.lora.init_from``): ``peft.PeftConfig.from_pretrained`` and
``peft.utils.load_peft_weights``; the folder's rank, alpha and target modules must be the
run's.  Writing (the HF export of a LoRA actor): the global adapter tensors are gathered to
layout rank 0 (:func:`engine.hf_interop.global_on_rank0`), put into a PEFT model over the base
architecture built on the ``meta`` device (no base weights in memory) and written by
``save_pretrained``, so ``PeftModel.from_pretrained(base, folder)`` loads what we trained.
"""

from __future__ import annotations

import os

import torch

from engine.hf_interop import config_to_hf, global_on_rank0
from engine.llama_spec import LlamaConfig
from engine.lora import ALL_LINEAR, MODULES, LoraConfig, lora_shard_specs
from engine.model import ParallelLlama


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


def save_peft_adapter(model: ParallelLlama, folder: str, base: str | None = None) -> None:
    """Write the model's adapters as a PEFT adapter folder (collective over the model's
    layout; layout rank 0 writes).  ``base``: recorded as ``base_model_name_or_path``."""
    if model.lora is None:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    if model.coords.dp != 0:
        return
    full = {}
    for spec in model.adapter_specs:
        t = global_on_rank0(model, spec, model.adapter_params)
        if t is not None:
            full[spec.hf_names[0]] = t.detach().cpu()
    if model.coords.pp != 0 or model.coords.tp != 0:
        return
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
