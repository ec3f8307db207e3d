"""Load and save transformers checkpoints (``save_pretrained`` folders, safetensors, single
file or sharded with ``model.safetensors.index.json``) into and from a :class:`ParallelLlama`
of any layout.

Families: Llama (with Llama-3 RoPE scaling), Qwen2/2.5, Qwen3 and Mistral, each as
``*ForCausalLM`` (lm head) or ``*ForSequenceClassification`` with one label (value head);
:mod:`engine.hf_families` is the registry, ``config.json`` <-> :class:`LlamaConfig` is
:func:`config_from_hf` / :func:`config_to_hf`.

Loading: every rank reads only the blocks of its own training shards, of its own pipeline
stage (``safe_open(...).get_slice(name)[block]``, :func:`engine.hf_shards.hf_reads`), and
copies each straight into its view of the flat buffer (:func:`engine.hf_shards.shard_parts`);
no rank ever holds a full tensor it does not train.

Saving: the DP-rank-0 replica all-gathers each tensor over its TP group; inner stages send
whole tensors to layout rank 0, which writes ``config.json`` and ``model.safetensors`` (so
rank 0 holds the full model while saving).  Under expert parallelism every rank takes part:
each whole expert goes from its holder (in any replica) to rank 0.
:func:`stream_hf_checkpoint` writes the same checkpoint with at most one global tensor in any
rank's memory: rank 0 writes the safetensors header first (every offset follows from the
specs) and then each tensor as it arrives.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from engine.hf_families import family, family_of_hf
from engine.hf_shards import hf_shapes, shard_parts
from engine.llama_spec import LlamaConfig
from engine.model import ParallelLlama
from engine.rope import RopeScaling
from hybridflow_comm.shard_spec import ShardSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ROPE_TYPES = ("default", "llama3")


def config_from_hf(hf: dict, max_position_embeddings: int | None = None,
                   dtype: torch.dtype = torch.float32) -> LlamaConfig:
    """Our config from a transformers ``config.json`` dict (ValueError if unsupported).

    Args:
        hf: the dict; its ``architectures`` (or ``model_type``) picks the family.
        max_position_embeddings: the longest sequence the run feeds the model (default: the
            checkpoint's); a sliding window must not be shorter.
        dtype: the model's parameter dtype (the run's precision; the checkpoint's own
            ``torch_dtype`` is only how it is stored, and loading casts from it).
    """
    fam, _ = family_of_hf(hf)
    bad = {k: hf[k] for k in ("mlp_bias",) if hf.get(k)}
    if hf.get("hidden_act", "silu") != "silu":
        bad["hidden_act"] = hf["hidden_act"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        bad["rope_type"] = f"{rope_type!r} (supported: {ROPE_TYPES})"
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        bad["partial_rotary_factor"] = rope.get("partial_rotary_factor",
                                                hf.get("partial_rotary_factor"))
    if bad:
        raise ValueError(f"unsupported {fam.model_type} config values: {bad}")
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(rope_type="llama3", factor=float(rope["factor"]),
                              low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_position_embeddings=int(
                                  rope["original_max_position_embeddings"]))
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=(max_position_embeddings
                                 or hf.get("max_position_embeddings", 2048)),
        rope_scaling=scaling, model_type=fam.model_type, dtype=dtype)
    return LlamaConfig(**fields | fam.switches_from_hf(hf))  # an expert's width included


def config_to_hf(config: LlamaConfig, head: str = "lm"):
    """The transformers config of ``config``'s family (``architectures`` set for ``head``:
    ``*ForCausalLM`` or, for ``"value"``, ``*ForSequenceClassification`` with one label)."""
    import transformers

    fam = family(config.model_type)
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope |= asdict(config.rope_scaling)
    kwargs = fam.hf_kwargs(config, config.num_layers, config.head_dim)
    if head == "value":
        kwargs["num_labels"] = 1
    hf = getattr(transformers, fam.config_class)(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=rope,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        dtype=str(config.dtype).removeprefix("torch."), **kwargs)
    hf.architectures = [fam.architecture(head)]
    return hf


def _read_json(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def read_hf_config(folder: str, max_position_embeddings: int | None = None,
                   dtype: torch.dtype = torch.float32) -> LlamaConfig:
    """:func:`config_from_hf` of ``folder/config.json``."""
    return config_from_hf(_read_json(folder), max_position_embeddings, dtype)


def read_hf_head(folder: str) -> str:
    """``"lm"`` for a ``*ForCausalLM`` checkpoint, ``"value"`` for ``*ForSequenceClassification``
    (ValueError for an unsupported architecture)."""
    return family_of_hf(_read_json(folder))[1]


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


def _check_checkpoint(model: ParallelLlama, folder: str) -> None:
    """ValueError unless ``folder`` holds ``model``'s architecture and a usable head (the
    parameter dtype and the training's load-balancing weight may differ)."""
    hf = _read_json(folder)
    cfg = config_from_hf(hf, model.config.max_position_embeddings)
    free = ("dtype", "router_aux_loss_coef")
    mine = {k: v for k, v in model.config.to_dict().items() if k not in free}
    theirs = {k: v for k, v in cfg.to_dict().items() if k not in free}
    diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
    if diff:
        raise ValueError(f"checkpoint {folder} does not match the model config "
                         f"(model, checkpoint): {diff}")
    fam, head = family_of_hf(hf)
    if model.head == "lm" and head == "value":
        raise ValueError(f"checkpoint {folder} is a {fam.architecture(head)} (value head): it "
                         f"cannot initialise a model with head='lm'")


def load_hf_checkpoint(model: ParallelLlama, folder: str, load_head: bool = True) -> None:
    """Load a ``save_pretrained`` folder into ``model`` (this rank's shards only).

    Blocks are read in the dtype the file stores and cast only where the model's dtype differs
    (a bf16 checkpoint fills a bf16 model with no float32 copy).
    A value-head model takes ``score.weight`` of a sequence-classification checkpoint (one
    label; unless ``load_head`` is False) and keeps its initialised head with a causal-LM
    checkpoint.  Raises ValueError if
    the folder's architecture differs from ``model.config`` or a tensor has another shape
    (checked before anything is copied).
    """
    _check_checkpoint(model, folder)
    files = _tensor_files(folder)
    plan = []
    for spec in model.local_specs:
        reads = model.hf_reads(spec)
        if spec.name == "value_head" and (not load_head or reads[0].hf_name not in files):
            continue  # a causal-LM checkpoint has no value head: keep the initialised one
        plan.append((spec, reads))
    # under expert parallelism every rank also checks the other experts of its stage, so a
    # bad checkpoint fails on all ranks of the stage alike, not only on an expert's holders
    held = {spec.name for spec, _ in plan}
    checked = plan + [(s, model.hf_reads(s)) for s in model.specs if model.experts is not None
                      and s.expert is not None and s.stage == model.stage
                      and s.name not in held]
    for spec, reads in checked:
        missing = [r.hf_name for r in reads if r.hf_name not in files]
        if missing:
            raise KeyError(f"checkpoint {folder} has no tensor {missing[0]!r}")
    with contextlib.ExitStack() as stack:
        handles: dict[str, object] = {}

        def block_slice(name: str):
            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path].get_slice(name)

        for spec, reads in checked:  # every shape first: a bad checkpoint changes no weight
            for r in reads:
                shape = tuple(block_slice(r.hf_name).get_shape())
                if shape != r.hf_shape:
                    raise ValueError(f"checkpoint tensor {r.hf_name} has shape {shape}, the "
                                     f"model expects {r.hf_shape}")
        with torch.no_grad():
            for spec, reads in plan:
                param = model.params[spec.name]
                if param.dim() != len(spec.shape):  # a whole expert stored stacked
                    (r,) = reads
                    param.copy_(model.train_shard(block_slice(r.hf_name)[r.index], spec))
                    continue
                parts = shard_parts(spec, param)  # views of the flat buffer
                for r in reads:  # the block in its stored dtype; copy_ casts if they differ
                    dst = parts[r.part]
                    dst.copy_(block_slice(r.hf_name)[r.index].view(dst.shape))


def gather_full_state_dict(model: ParallelLlama, local: dict[str, torch.Tensor] | None = None
                           ) -> dict[str, torch.Tensor] | None:
    """Global tensors by spec name on layout rank 0 (None on every other rank).

    Args:
        model: the rank's model.
        local: tensors shaped like this rank's training shards, by spec name, all of one
            dtype (e.g. Adam moments, master weights); default the model's parameters.

    Collective over the DP-rank-0 replica (other DP ranks return at once; under expert
    parallelism every rank takes part: an expert's holder may be in any replica).  The tied
    ``lm_head`` copy of a pp > 1 model is left out (it equals ``embed_tokens``).
    """
    g, c = model.groups, model.coords
    experts = model.experts is not None
    if c.dp != 0 and not experts:
        return None
    tensors = model.params if local is None else local
    dtype = next(iter(tensors.values())).dtype  # fp32 masters or moments of a bf16 model
    out: dict[str, torch.Tensor] = {}
    for spec in model.specs:
        if spec.name == "lm_head" and model.config.tie_word_embeddings:
            continue
        if experts and spec.expert is not None:
            t = _expert_on_rank0(model, spec, tensors, dtype)
            if t is not None:
                out[spec.name] = t.clone()
            continue
        if c.dp != 0:
            continue
        if spec.stage != c.pp:
            if c.pp == 0 and c.tp == 0:  # receive another stage's tensor on rank 0
                t = torch.empty(spec.shape, dtype=dtype, device=model.buffer.device)
                dist.recv(t, src=g.train_pp.ranks[spec.stage], group=g.train_pp.pg)
                out[spec.name] = t
            continue
        local_t = tensors[spec.name].detach()
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
    return out if (c.pp == 0 and c.tp == 0 and c.dp == 0) else None


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
    """Write ``model`` as a transformers ``save_pretrained`` folder of its family (collective;
    rank 0 writes): ``*ForCausalLM``, or ``*ForSequenceClassification`` with one label for a
    value head (``AutoModelFor...from_pretrained`` loads it)."""
    full = gather_full_state_dict(model)
    if full is None:
        return
    os.makedirs(folder, exist_ok=True)
    config_to_hf(model.config, model.head).save_pretrained(folder)
    save_file(full_to_hf_state_dict(full, model.specs), os.path.join(folder, SINGLE_FILE),
              metadata={"format": "pt"})


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64"}


def _exported_specs(model: ParallelLlama) -> list[ShardSpec]:
    """The specs an HF checkpoint holds (a tied LM-head copy is the embedding)."""
    return [s for s in model.specs
            if not (s.name == "lm_head" and model.config.tie_word_embeddings)]


def safetensors_header(specs: list[ShardSpec]) -> bytes:
    """The safetensors header of the HF tensors of ``specs``, in spec order (fused tensors as
    their parts), data packed back to back: the 8-byte length, then the JSON padded to 8."""
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{spec.name}: no safetensors dtype for {spec.dtype}")
        for name, shape in zip(spec.hf_names, hf_shapes(spec), strict=True):
            n = math.prod(shape) * spec.dtype.itemsize
            entries[name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(shape),
                             "data_offsets": [offset, offset + n]}
            offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def global_on_rank0(model: ParallelLlama, spec: ShardSpec,
                    params: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The global tensor of ``spec`` on layout rank 0 (None elsewhere): gathered to TP rank 0
    of its stage, then sent to rank 0 from another stage.  Collective over the DP-rank-0
    replica (under expert parallelism over every rank: an expert's holder may be in any
    replica); every rank calls it for every spec, in the same order.  ``params``: where the
    shards are (default the model's parameters; its adapters for an adapter spec)."""
    g, c = model.groups, model.coords
    if model.experts is not None and spec.expert is not None:
        return _expert_on_rank0(model, spec, model.params if params is None else params,
                                spec.dtype)
    if c.dp != 0:
        return None
    if spec.stage != c.pp:
        if c.pp == 0 and c.tp == 0:
            t = torch.empty(spec.shape, dtype=spec.dtype, device=model.buffer.device)
            dist.recv(t, src=g.train_pp.ranks[spec.stage], group=g.train_pp.pg)
            return t
        return None
    full = (model.params if params is None else params)[spec.name].detach()
    if spec.partition_dim is not None and g.train_tp.pg is not None:
        local = full.contiguous()
        pieces = [torch.empty_like(local) for _ in range(g.train_tp.size)] if c.tp == 0 else None
        dist.gather(local, pieces, dst=g.train_tp.ranks[0], group=g.train_tp.pg)
        if c.tp != 0:
            return None
        full = torch.cat(pieces, dim=spec.partition_dim)
    if c.tp != 0:
        return None
    if c.pp != 0:
        dist.send(full.contiguous(), dst=g.train_pp.ranks[0], group=g.train_pp.pg)
        return None
    return full


def _expert_on_rank0(model: ParallelLlama, spec: ShardSpec, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype) -> torch.Tensor | None:
    """A whole expert of an expert-parallel model on layout rank 0 (None elsewhere): its
    holder at expert-DP rank 0 sends its tensor of ``tensors`` (``dtype``: theirs) over the
    layout's world group."""
    world, me = model.groups.world, model.groups.rank
    src = model.experts.layout.source(0, spec.stage, spec.expert)  # rank 0's expert-DP rank: 0
    if me == src:
        full = model.logical_expert(tensors[spec.name].detach(), spec)
        if me == 0:
            return full
        dist.send(full.contiguous(), dst=world.ranks[0], group=world.pg)
    elif me == 0:
        t = torch.empty(spec.shape, dtype=dtype, device=model.buffer.device)
        dist.recv(t, src=world.ranks[src], group=world.pg)
        return t
    return None


def _agree_to_start(model: ParallelLlama, failed: Exception | None, folder: str) -> None:
    """Collective over the layout's ranks: raise on every rank if rank 0 could not start
    writing ``folder`` (its own error on rank 0), before any tensor moves."""
    world = model.groups.world
    bad = torch.tensor([0 if failed is None else 1], device=model.buffer.device)
    if world.pg is not None:
        dist.all_reduce(bad, group=world.pg)
    if failed is not None:
        raise failed
    if bad.item():
        raise RuntimeError(f"stream_hf_checkpoint: layout rank 0 could not write {folder!r}")


def stream_hf_checkpoint(model: ParallelLlama, folder: str,
                         delta: Callable[[str], torch.Tensor | None] | None = None) -> None:
    """:func:`save_hf_checkpoint` with bounded memory (collective; layout rank 0 writes).

    Rank 0 writes ``config.json`` and the ``model.safetensors`` header, then, spec by spec,
    receives one global tensor (TP-gathered on its stage's TP rank 0) and appends its HF
    parts; no rank holds more than one global tensor (and its TP pieces) at a time.
    ``delta``: on rank 0, what to add to a global tensor by spec name (None: nothing), e.g.
    merged LoRA adapters (:func:`engine.peft_interop.save_merged`); added in float32.
    """
    c = model.coords
    if c.dp != 0 and model.experts is None:
        return
    specs = _exported_specs(model)
    with contextlib.ExitStack() as stack:
        out, failed = None, None
        if c.pp == 0 and c.tp == 0 and c.dp == 0:
            try:
                os.makedirs(folder, exist_ok=True)
                config_to_hf(model.config, model.head).save_pretrained(folder)
                out = stack.enter_context(open(os.path.join(folder, SINGLE_FILE), "wb"))
                out.write(safetensors_header(specs))
            except (OSError, ValueError) as e:
                failed = e
        if model.experts is not None:  # every rank sends experts: all learn of a failed start
            _agree_to_start(model, failed, folder)
        elif failed is not None:
            raise failed
        for spec in specs:
            full = global_on_rank0(model, spec)
            if full is None:
                continue
            add = delta(spec.name) if delta is not None else None
            if add is not None:
                full = (full.float() + add.to(full.device)).to(full.dtype)
            for part in spec.fusion.split(full) if spec.fusion is not None else (full,):
                out.write(part.contiguous().view(-1).view(torch.uint8).cpu().numpy())  # to file
