"""Shard specs from megatron-core 0.16.1 parameters, and binding them to a flat buffer.

Megatron marks every tensor-parallel parameter with three attributes, which map directly::

    tensor_model_parallel  True              -> partitioned, else replicated (norms, row bias)
                           (absent: the layer type decides, see _partitioning)
    partition_dim          0 (Column, Vocab) -> ShardSpec.partition_dim 0
                           1 (Row)           -> ShardSpec.partition_dim 1
    partition_stride       1                 -> plain contiguous TP chunks
                           other             -> ValueError naming the parameter, except below

Global shape = local shape with ``partition_dim`` multiplied by ``tp``.

Fused tensors (checked against megatron-core 0.16.1's own code):

* ``SelfAttention.linear_qkv`` stores, on each TP rank, ``[ng/tp, (np/ng + 2) * hn, H]``
  flattened: per query group the group's query heads, then its key head, then its value head
  (``Attention.get_query_key_value_tensors`` views the output as
  ``[sq, b, ng/tp, (np/ng + 2) * hn]`` and splits ``[np/ng * hn, hn, hn]``).  That *is*
  :class:`QKVFusion`: concatenating neighbouring TP shards gives a valid smaller-TP shard.
* ``MLP.linear_fc1`` with ``gated_linear_unit`` stores ``[gate_t; up_t]`` on TP rank ``t``
  (``partition_stride=2``)::

      rank 0: [gate_0; up_0]   rank 1: [gate_1; up_1]
      concatenated: [gate_0; up_0; gate_1; up_1]  !=  a TP=1 shard [gate_0; gate_1; up_0; up_1]

  That does not survive the micro-DP concatenation.  We do **not** reorder during transitions.
  Instead the model is built so that fc1 rows are :class:`GateUpFusion`-interleaved
  ``[gate[0], up[0], gate[1], up[1], ...]`` from the start: :func:`interleaved_glu_layer_spec`
  swaps the MLP's activation for :class:`InterleavedSwiGLU` (through megatron's
  ``MLPSubmodules.activation_func`` hook, enabled by ``use_te_activation_func=True``; no
  TransformerEngine is involved).  Such an fc1 gets a GateUpFusion spec and aliases the flat
  buffer like everything else.  A stride-2 fc1 of a stock megatron MLP raises ValueError;
  :func:`fc1_to_interleaved` converts a stock ``[gate; up]`` shard (e.g. from a megatron
  checkpoint) for loading into an interleaved model.

Names are megatron's ``named_parameters()`` names with each ``TransformerLayer``'s local index
replaced by its global one (``layer_number - 1``), so every pipeline stage names its layers the
way a pp=1 model would.  :func:`gpt_hf_names` maps a GPT model's names to Hugging Face Llama
names.

Everything here is local to the rank except :func:`from_megatron` (one object all-gather over
the training PP group, only when pp > 1).  megatron is imported lazily.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import HybridGroups
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec
from hybridflow_comm.interop.state_dict import merge_stage_specs

HFNames = Callable[[str], tuple[str, ...]]


class InterleavedSwiGLU(nn.Module):
    """SwiGLU over interleaved fc1 rows: ``silu(x[..., 0::2]) * x[..., 1::2]``."""

    def __init__(self, config=None) -> None:  # megatron's build_module passes config=
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (-1, 2))  # [..., F/tp, 2] = (gate, up)
        return F.silu(pairs[..., 0]) * pairs[..., 1]


def interleaved_glu_layer_spec(normalization: str = "RMSNorm", num_experts: int | None = None):
    """megatron's local (non-TransformerEngine) GPT layer spec with an interleaved SwiGLU MLP
    (with ``num_experts``: a mixture of that many SequentialMLP experts, each one's SwiGLU
    interleaved).

    Build the model with ``TransformerConfig(gated_linear_unit=True, activation_func=F.silu,
    use_te_activation_func=True, bias_activation_fusion=False)``; the flag only tells
    megatron's MLP (and each expert's) to call the spec's activation module.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    def interleaved(mlp):
        sub = dataclasses.replace(mlp.submodules,
                                  activation_func=ModuleSpec(module=InterleavedSwiGLU))
        return dataclasses.replace(mlp, submodules=sub)

    spec = get_gpt_layer_local_spec(normalization=normalization, num_experts=num_experts,
                                    moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    if num_experts:  # MoELayer: its experts' (and shared experts') MLP submodules
        moe = dataclasses.replace(mlp.submodules, experts=interleaved(mlp.submodules.experts))
        if getattr(moe, "shared_experts", None) is not None:
            moe = dataclasses.replace(moe, shared_experts=interleaved(moe.shared_experts))
        mlp = dataclasses.replace(mlp, submodules=moe)
    else:
        mlp = interleaved(mlp)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def fc1_to_interleaved(shard: torch.Tensor) -> torch.Tensor:
    """A stock megatron fc1 TP shard ``[gate_t; up_t]`` -> interleaved rows (a copy)."""
    if shard.shape[0] % 2:
        raise ValueError(f"fc1 shard has {shard.shape[0]} rows, not [gate; up]")
    gate, up = shard.chunk(2, dim=0)
    return GateUpFusion().fuse(gate, up)


_GPT_HF = [
    (r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",)),
    (r"decoder\.layers\.(\d+)\.input_layernorm\.weight",
     ("model.layers.{0}.input_layernorm.weight",)),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.weight",
     tuple(f"model.layers.{{0}}.self_attn.{p}_proj.weight" for p in "qkv")),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.weight",
     ("model.layers.{0}.self_attn.o_proj.weight",)),
    (r"decoder\.layers\.(\d+)\.pre_mlp_layernorm\.weight",
     ("model.layers.{0}.post_attention_layernorm.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.weight",
     ("model.layers.{0}.mlp.gate_proj.weight", "model.layers.{0}.mlp.up_proj.weight")),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.weight",
     ("model.layers.{0}.mlp.down_proj.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.router\.weight", ("model.layers.{0}.mlp.gate.weight",)),
    (r"decoder\.layers\.(\d+)\.mlp\.experts\.(\d+)\.linear_fc1\.weight",
     ("model.layers.{0}.mlp.experts.{1}.gate_proj.weight",
      "model.layers.{0}.mlp.experts.{1}.up_proj.weight")),
    (r"decoder\.layers\.(\d+)\.mlp\.experts\.(\d+)\.linear_fc2\.weight",
     ("model.layers.{0}.mlp.experts.{1}.down_proj.weight",)),
    (r"decoder\.final_layernorm\.weight", ("model.norm.weight",)),
    (r"output_layer\.weight", ("lm_head.weight",)),
]


def gpt_hf_names(name: str) -> tuple[str, ...]:
    """Hugging Face Llama names of a megatron GPT parameter (global layer index; a mixture of
    experts' router and experts, by global expert index, as Qwen3-MoE names them).

    Fused tensors get one name per part, in fusion order (q, k, v / gate, up).
    Raises ValueError for a name with no Llama counterpart (e.g. biases, qk-norms).
    """
    for pattern, names in _GPT_HF:
        m = re.fullmatch(pattern, name)
        if m:
            return tuple(n.format(*m.groups()) for n in names)
    raise ValueError(f"megatron parameter {name!r} has no Hugging Face Llama name")


def _layer_prefixes(model: nn.Module) -> dict[str, str]:
    """Local module path of each TransformerLayer -> the path with its global index."""
    out = {}
    for path, mod in model.named_modules():
        number = getattr(mod, "layer_number", None)
        parent, _, local = path.rpartition(".")
        if isinstance(number, int) and local.isdigit() and type(mod).__name__.endswith("Layer"):
            out[path] = f"{parent}.{number - 1}" if parent else str(number - 1)
    return out


def _global_name(path: str, prefixes: dict[str, str]) -> str:
    best = max((p for p in prefixes if path == p or path.startswith(p + ".")), key=len,
               default=None)
    return path if best is None else prefixes[best] + path[len(best):]


def _fusions(model: nn.Module) -> tuple[dict[int, object], set[int]]:
    """id(param) -> fusion for fused QKV and interleaved fc1; ids of stock stride-2 fc1s."""
    fused: dict[int, object] = {}
    stock_glu: set[int] = set()
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        qkv = getattr(mod, "linear_qkv", None)
        if qkv is not None and cfg is not None:
            fusion = QKVFusion(cfg.num_attention_heads, cfg.num_query_groups or
                               cfg.num_attention_heads, cfg.kv_channels)
            for p in qkv.parameters(recurse=False):
                fused[id(p)] = fusion
        fc1 = getattr(mod, "linear_fc1", None)
        if fc1 is not None and cfg is not None and cfg.gated_linear_unit:
            interleaved = (cfg.use_te_activation_func
                           and isinstance(getattr(mod, "activation_func", None),
                                          InterleavedSwiGLU))
            for p in fc1.parameters(recurse=False):
                if interleaved:
                    fused[id(p)] = GateUpFusion()
                else:
                    stock_glu.add(id(p))
    return fused, stock_glu


def stage_specs_from_megatron(model: nn.Module, train: ParallelLayout, rank: int,
                              hf_names: HFNames | None = None
                              ) -> tuple[list[ShardSpec], dict[str, nn.Parameter]]:
    """Specs and parameters of this rank's pipeline stage of a megatron model (local only).

    Args:
        model: this rank's megatron module (one pipeline stage).
        train: the training layout the model was built for (megatron's TP group must be this
            rank's ``train`` TP group).
        rank: this rank in ``train``.
        hf_names: maps a (global) parameter name to its Hugging Face names.

    Returns:
        ``(specs, params)``: this stage's specs (stage = this rank's pp rank) and the megatron
        Parameters by spec name (this rank's training shards).

    Raises:
        ValueError: unsupported ``partition_stride``, a TP group that does not match ``train``,
            a shape that does not split, naming the parameter.
    """
    coords = train.coords(rank)
    prefixes = _layer_prefixes(model)
    fused, stock_glu = _fusions(model)
    moe = {path: (list(mod.local_expert_indices), mod.config.num_moe_experts)
           for path, mod in model.named_modules() if hasattr(mod, "local_expert_indices")}
    specs, params, seen = [], {}, set()
    for mod_path, mod in model.named_modules():
        tp_group = getattr(mod, "tp_group", None)
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = f"{mod_path}.{pname}" if mod_path else pname
            name, expert, ep = _global_name(local, prefixes), None, 1
            m = _LOCAL_EXPERT.fullmatch(local)
            if m and m.group(1) in moe:  # expert j of this EP rank: its global index
                indices, num = moe[m.group(1)]
                expert, ep = indices[int(m.group(2))], num // len(indices)
                name = _global_name(f"{m.group(1)}.experts.{expert}.{m.group(3)}", prefixes)
            shape, (dim, stride) = tuple(p.shape), _partitioning(mod, pname, p)
            if dim is not None:
                if id(p) in stock_glu:
                    raise ValueError(
                        f"{name}: partition_stride={stride} ([gate; up] per TP rank, megatron's "
                        f"SwiGLU fc1) does not survive the micro-DP concatenation; build the "
                        f"model with interleaved_glu_layer_spec() and load fc1 shards through "
                        f"fc1_to_interleaved()")
                if stride != 1 and not isinstance(fused.get(id(p)), GateUpFusion):
                    raise ValueError(f"{name}: partition_stride={stride} is not supported "
                                     f"(only 1)")
                if ep > 1:  # whole experts on their EP rank
                    _check_tp_group(name, tp_group, ParallelLayout(train.pp, 1, 1), 0,
                                    "expert_tensor_parallel_size=1 with expert parallelism")
                else:
                    _check_tp_group(name, tp_group, train, coords.tp)
                    shape = shape[:dim] + (shape[dim] * train.tp,) + shape[dim + 1:]
            spec = ShardSpec(name, shape, dtype=p.dtype, partition_dim=dim, stage=coords.pp,
                             fusion=fused.get(id(p)) if dim == 0 else None,
                             hf_names=hf_names(name) if hf_names else (), expert=expert)
            if ep == 1:
                spec.check_layout(train)
            specs.append(spec)
            params[name] = p
    return _every_expert(specs, moe, prefixes, hf_names), params


_LOCAL_EXPERT = re.compile(r"(.*\.mlp)\.experts\.local_experts\.(\d+)\.(.*)")
"""A SequentialMLP expert's parameter: ``(MoE layer path, local index, rest)``."""


def _every_expert(specs: list[ShardSpec], moe: dict[str, tuple[list[int], int]], prefixes,
                  hf_names: HFNames | None) -> list[ShardSpec]:
    """``specs`` with each MoE layer's experts complete and in global order (an EP rank
    builds only its own; every rank of a stage needs the same list): the experts of a layer
    go where its first one was, expert after expert, each like the rank's first."""
    layer_of = {_global_name(path, prefixes): (num, indices[0])
                for path, (indices, num) in moe.items()}
    template: dict[str, list[ShardSpec]] = {}
    for s in specs:
        layer = s.name.split(".experts.")[0] if s.expert is not None else None
        if layer in layer_of and s.expert == layer_of[layer][1]:
            template.setdefault(layer, []).append(s)
    out, done = [], set()
    for s in specs:
        layer = s.name.split(".experts.")[0] if s.expert is not None else None
        if layer not in layer_of:
            out.append(s)
            continue
        if layer in done:
            continue
        done.add(layer)
        first = layer_of[layer][1]
        for e in range(layer_of[layer][0]):
            for t in template[layer]:
                name = t.name.replace(f".experts.{first}.", f".experts.{e}.", 1)
                out.append(dataclasses.replace(t, name=name, expert=e,
                                               hf_names=hf_names(name) if hf_names else ()))
    return out


def megatron_experts(model: nn.Module) -> tuple[int, int, list[int]] | None:
    """``(num_experts, ep, EP group ranks)`` of a megatron mixture of experts (its first MoE
    layer's), or None for a dense model."""
    for mod in model.modules():
        indices = getattr(mod, "local_expert_indices", None)
        if indices is not None:
            num = mod.config.num_moe_experts
            group = getattr(mod, "ep_group", None)
            ranks = (dist.get_process_group_ranks(group) if group is not None
                     and dist.is_initialized() else [dist.get_rank() if dist.is_initialized()
                                                     else 0])
            return num, num // len(indices), sorted(ranks)
    return None


def _partitioning(mod: nn.Module, pname: str, p: nn.Parameter) -> tuple[int | None, int]:
    """``(partition_dim or None, partition_stride)`` of one parameter.

    The megatron attributes when present.  megatron 0.16.1 sets them only when it initialises
    the weight (``perform_initialization=True``); without them the layer type decides:
    Column / VocabParallel weights (and Column biases) split dim 0, Row weights dim 1.
    """
    if hasattr(p, "tensor_model_parallel"):
        if not p.tensor_model_parallel:
            return None, 1
        return int(p.partition_dim), int(getattr(p, "partition_stride", 1))
    from megatron.core.tensor_parallel import layers

    stride = int(getattr(p, "partition_stride", 1))
    if isinstance(mod, (layers.ColumnParallelLinear, layers.VocabParallelEmbedding)):
        return 0, stride
    if isinstance(mod, layers.RowParallelLinear) and pname == "weight":
        return 1, stride
    return None, 1


def _check_tp_group(name: str, tp_group, train: ParallelLayout, tp_rank: int,
                    why: str = "") -> None:
    """megatron's TP group of a layer must be this rank's training TP group (size and rank;
    for whole experts, ``why`` says which setting gives a group of one)."""
    if tp_group is None or not dist.is_initialized():
        return
    size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if size != train.tp or rank != tp_rank:
        expects = why or f"the training layout {train}"
        raise ValueError(f"{name}: megatron TP group has size {size}, rank {rank}, but "
                         f"{expects} expects size {train.tp}, rank {tp_rank}")


def from_megatron(model: nn.Module, groups: HybridGroups, hf_names: HFNames | None = None
                  ) -> tuple[list[ShardSpec], dict[str, nn.Parameter]]:
    """Whole-model specs (merged over the training PP group) and this rank's parameters.

    Validates locally first (:func:`stage_specs_from_megatron`); the only collective is the
    spec exchange over the PP group when pp > 1.
    """
    stage_specs, params = stage_specs_from_megatron(model, groups.layout.train, groups.rank,
                                                    hf_names)
    return merge_stage_specs(stage_specs, groups.train_pp), params


def bind_megatron_params(params: dict[str, nn.Parameter], buffer: FlatParamBuffer) -> None:
    """Make every megatron parameter alias its training slot of ``buffer``.

    Copies each parameter's values into ``buffer.train_view(name)`` once, then sets
    ``param.data`` to that view: training updates write the flat buffer directly, and the
    Resharder's transitions need no copy.  The Parameter objects (and their megatron
    attributes, optimizer references) are unchanged.
    """
    for name, p in params.items():
        view = buffer.train_view(name)
        if view.shape != p.shape or view.dtype != p.dtype:
            raise ValueError(f"{name}: parameter {tuple(p.shape)} {p.dtype} does not fit its "
                             f"buffer slot {tuple(view.shape)} {view.dtype}")
    with torch.no_grad():
        for name, p in params.items():
            view = buffer.train_view(name)
            view.copy_(p.data)
            p.data = view
