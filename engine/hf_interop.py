"""Load and save transformers ``LlamaForCausalLM`` checkpoints (save_pretrained folders,
safetensors) into and from a :class:`ParallelLlama` of any layout.

Loading: every rank reads only its own training shard of the tensors of its own pipeline stage
(``safe_open`` slices).  Fused tensors need no full read either: TP shard ``t`` of the fused
QKV (gate/up) is the fusion of chunk ``t`` of q, k and v (gate and up), because the stored
layout is per query group (interleaved rows), so each part's chunk is one contiguous slice.

Saving: the DP-rank-0 replica all-gathers each tensor over its TP group; inner stages send
whole tensors to layout rank 0, which writes ``config.json`` and ``model.safetensors`` (so
rank 0 holds the full model while saving).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from engine.llama_spec import LlamaConfig
from engine.model import ParallelLlama
from hybridflow_comm.shard_spec import ShardSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our config from a transformers Llama ``config.json`` dict (ValueError if unsupported)."""
    bad = {k: hf.get(k) for k in ("attention_bias", "mlp_bias") if hf.get(k)}
    if hf.get("hidden_act", "silu") != "silu":
        bad["hidden_act"] = hf["hidden_act"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        bad["rope_type"] = rope.get("rope_type")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        bad["head_dim"] = head_dim
    if bad:
        raise ValueError(f"unsupported Llama config values: {bad}")
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048))


def config_to_hf(config: LlamaConfig):
    """A ``transformers.LlamaConfig`` with the same architecture."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings, head_dim=config.head_dim)


def read_hf_config(folder: str) -> LlamaConfig:
    with open(os.path.join(folder, "config.json")) as f:
        return config_from_hf(json.load(f))


def _tensor_files(folder: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    path = os.path.join(folder, SINGLE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")
    with safe_open(path, framework="pt") as f:
        return {k: path for k in f.keys()}


def _read_shard(files: dict[str, str], name: str, dim: int | None, index: int,
                parts: int) -> torch.Tensor:
    """Tensor ``name``, or only chunk ``index`` of ``parts`` along ``dim`` (reads the chunk)."""
    if name not in files:
        raise KeyError(f"checkpoint has no tensor {name!r}")
    with safe_open(files[name], framework="pt") as f:
        if dim is None or parts == 1:
            return f.get_tensor(name)
        sl = f.get_slice(name)
        size = sl.get_shape()[dim] // parts
        key = [slice(None)] * len(sl.get_shape())
        key[dim] = slice(index * size, (index + 1) * size)
        return sl[tuple(key)]


def hf_full_tensor(spec: ShardSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    """``spec``'s tensor in stored layout from its HF parts (or from one TP chunk of each)."""
    return spec.fusion.fuse(*parts) if spec.fusion is not None else parts[0]


def load_hf_checkpoint(model: ParallelLlama, folder: str) -> None:
    """Load a ``save_pretrained`` folder into ``model`` (this rank's shards only).

    Raises ValueError if the folder's architecture differs from ``model.config`` (checked
    before anything is read).
    """
    cfg = read_hf_config(folder)
    mine = {k: v for k, v in model.config.to_dict().items() if k != "dtype"}
    theirs = {k: v for k, v in cfg.to_dict().items() if k != "dtype"}
    diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
    if diff:
        raise ValueError(f"checkpoint {folder} does not match the model config "
                         f"(model, checkpoint): {diff}")
    files = _tensor_files(folder)
    tp, tp_rank = model.layout.tp, model.coords.tp
    for spec in model.local_specs:
        if spec.name == "value_head" and spec.hf_names[0] not in files:
            continue  # a causal-LM checkpoint has no value head: keep the initialised one
        parts = [_read_shard(files, n, spec.partition_dim, tp_rank, tp) for n in spec.hf_names]
        shard = hf_full_tensor(spec, parts)  # fuse() works on TP shards as on full tensors
        with torch.no_grad():
            model.params[spec.name].copy_(shard.to(spec.dtype))


def gather_full_state_dict(model: ParallelLlama, local: dict[str, torch.Tensor] | None = None
                           ) -> dict[str, torch.Tensor] | None:
    """Global tensors by spec name on layout rank 0 (None on every other rank).

    Args:
        model: the rank's model.
        local: tensors shaped like this rank's training shards, by spec name (e.g. Adam
            moments); default the model's parameters.

    Collective over the DP-rank-0 replica (other DP ranks return at once).  The tied
    ``lm_head`` copy of a pp > 1 model is left out (it equals ``embed_tokens``).
    """
    g, c = model.groups, model.coords
    if c.dp != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for spec in model.specs:
        if spec.name == "lm_head" and model.config.tie_word_embeddings:
            continue
        if spec.stage != c.pp:
            if c.pp == 0 and c.tp == 0:  # receive another stage's tensor on rank 0
                t = torch.empty(spec.shape, dtype=spec.dtype)
                dist.recv(t, src=g.train_pp.ranks[spec.stage], group=g.train_pp.pg)
                out[spec.name] = t
            continue
        local_t = (model.params if local is None else local)[spec.name].detach()
        full = local_t
        if spec.partition_dim is not None and g.train_tp.pg is not None:
            pieces = [torch.empty_like(local_t) for _ in range(g.train_tp.size)]
            dist.all_gather(pieces, local_t.contiguous(), group=g.train_tp.pg)
            full = torch.cat(pieces, dim=spec.partition_dim)
        if c.tp == 0:
            if c.pp == 0:
                out[spec.name] = full.clone()
            else:
                dist.send(full.contiguous(), dst=g.train_pp.ranks[0], group=g.train_pp.pg)
    return out if (c.pp == 0 and c.tp == 0) else None


def full_to_hf_state_dict(full: dict[str, torch.Tensor], specs: list[ShardSpec]
                          ) -> dict[str, torch.Tensor]:
    """Split fused tensors back into their HF parts, renamed to HF names."""
    out = {}
    for spec in specs:
        if spec.name not in full:
            continue
        t = full[spec.name]
        parts = spec.fusion.split(t) if spec.fusion is not None else (t,)
        for name, part in zip(spec.hf_names, parts):
            out[name] = part.contiguous().clone()
    return out


def save_hf_checkpoint(model: ParallelLlama, folder: str) -> None:
    """Write ``model`` as a transformers ``save_pretrained`` folder (collective; rank 0 writes)."""
    full = gather_full_state_dict(model)
    if full is None:
        return
    os.makedirs(folder, exist_ok=True)
    config_to_hf(model.config).save_pretrained(folder)
    save_file(full_to_hf_state_dict(full, model.specs), os.path.join(folder, SINGLE_FILE),
              metadata={"format": "pt"})
