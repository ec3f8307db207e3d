"""LoRA adapters on a frozen :class:`engine.model.ParallelLlama`: specs and TP maths (the
settings, :class:`LoraConfig`, are :mod:`engine.lora_config`'s).

A targeted linear ``y = W x`` (HF module names: ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) becomes ``y = W x + s B A drop(x)``,
``A [r, in]``, ``B [out, r]``, ``s = alpha / r``; ``B`` starts at zero, so step 0 is the base
model.  Each adapter tensor is a :class:`hybridflow_comm.shard_spec.ShardSpec` of its own
(``layers.<i>.<module>.lora_A`` / ``lora_B``), split over tensor parallelism so that every
rank computes exactly the rows or columns of the delta its shard of ``W`` computes::

    column-parallel W (q, k, v, gate, up: output rows split, x replicated)
        A [r, in]   replicated      u = A drop(x)             same on every TP rank
        B [out, r]  split on dim 0  delta_local = s B_local u  the rank's output rows
        backward: du summed over the TP group (copy_to_tp on u), so dA is the full gradient

    row-parallel W (o, down: input columns split, output summed)
        A [r, in]   split on dim 1  u = sum_t A_t drop(x_t)    reduce_from_tp (one [.., r])
        B [out, r]  replicated      delta = s B u              added after W's all-reduce

The q/k/v and gate/up deltas are written into the fused layouts of ``qkv`` (per KV group:
the group's query heads, then its key and value head) and ``gate_up`` (gate and up rows
interleaved), so a fused product plus its delta equals the HF modules plus PEFT's.  Pipeline
stages hold the adapters of their own layers (the layers' ``stage``).

PEFT's ``target_modules="all-linear"`` is every linear but the output head, as here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.llama_spec import LlamaConfig
from engine.lora_config import ATTENTION, MLP, LoraConfig
from engine.lora_config import ALL_LINEAR, MODULES, resolve_targets  # noqa: F401  (re-exported)
from engine.tp_ops import copy_to_tp, reduce_from_tp
from hybridflow_comm.groups import Group
from hybridflow_comm.shard_spec import ShardSpec

ROW_PARALLEL = ("o_proj", "down_proj")


def module_shape(config: LlamaConfig, module: str) -> tuple[int, int]:
    """``(out, in)`` of the HF module's weight."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size),
            "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q),
            "gate_proj": (c.intermediate_size, c.hidden_size),
            "up_proj": (c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size)}[module]


def peft_name(layer: int, module: str, matrix: str) -> str:
    """The tensor's key in a PEFT adapter's ``adapter_model.safetensors``."""
    block = "self_attn" if module in ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.{matrix}.weight"


def lora_shard_specs(config: LlamaConfig, pp: int, lora: LoraConfig) -> list[ShardSpec]:
    """Every adapter tensor of the model, layer after layer (:data:`MODULES` order, A before
    B), in the model's dtype, on its layer's stage, split as the module docstring says.
    A mixture of experts takes adapters on its attention only (ValueError naming the MLP
    modules otherwise, ``all-linear`` included)."""
    experts = [m for m in lora.target_modules if m in MLP] if config.num_experts else []
    if experts:
        raise ValueError(f"lora.target_modules={list(lora.target_modules)} includes {experts}, "
                         f"but {config.model_type} routes its MLP to {config.num_experts} "
                         f"experts, which take no adapters: use "
                         f"'[{', '.join(ATTENTION)}]' or a part of it")
    specs = []
    for i in range(config.num_layers):
        stage = config.layer_stage(i, pp)
        for m in lora.target_modules:
            out, inp = module_shape(config, m)
            row = m in ROW_PARALLEL
            specs += [ShardSpec(f"layers.{i}.{m}.lora_A", (lora.rank, inp), dtype=config.dtype,
                                partition_dim=1 if row else None, stage=stage,
                                hf_names=(peft_name(i, m, "lora_A"),)),
                      ShardSpec(f"layers.{i}.{m}.lora_B", (out, lora.rank), dtype=config.dtype,
                                partition_dim=None if row else 0, stage=stage,
                                hf_names=(peft_name(i, m, "lora_B"),))]
    return specs


def init_lora_state_dict(config: LlamaConfig, lora: LoraConfig, seed: int = 0
                         ) -> dict[str, torch.Tensor]:
    """Fresh global adapter tensors as PEFT makes them: ``A`` Kaiming-uniform with ``a =
    sqrt(5)`` (``nn.Linear``'s default), ``B`` zeros; deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in lora_shard_specs(config, 1, lora):
        if spec.name.endswith("lora_A"):
            bound = 1.0 / math.sqrt(spec.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
            t = (torch.rand(spec.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
        else:
            t = torch.zeros(spec.shape, dtype=torch.float64)
        out[spec.name] = t.to(config.dtype)
    return out


@dataclass(frozen=True)
class LayerLora:
    """One layer's adapters on this rank: the deltas :func:`engine.layers.decoder_layer` adds
    to its products (:class:`engine.layers.LoraDeltas`).

    Attributes:
        a, b: this rank's shards by module name (targeted modules only); a row-parallel
            ``A`` may be the generation layout's stacked ``[m, r, in/m]``.
        scale: ``alpha / rank``.
        dropout: on the adapter inputs (0 when not training).
        tp_group: the TP group of the shards.
        q_per_group, head_dim: the fused qkv layout.
    """

    a: Mapping[str, torch.Tensor]
    b: Mapping[str, torch.Tensor]
    scale: float
    dropout: float
    tp_group: Group | None
    q_per_group: int
    head_dim: int

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, training=True) if self.dropout > 0 else x

    def _column(self, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """``s B_local A drop(x)`` of a column-parallel module (``x`` replicated), or None
        where the module has no adapter."""
        if module not in self.a:
            return None
        u = copy_to_tp(F.linear(self._input(x), self.a[module]), self.tp_group)
        return F.linear(u, self.b[module]) * self.scale

    def row(self, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """``s B A drop(x)`` of a row-parallel module from this rank's input columns ``x``
        (replicated over the TP group, like the module's reduced output), or None."""
        if module not in self.a:
            return None
        a, x = self.a[module], self._input(x)
        if a.dim() == 3:  # the generation form [m, r, in/m] (m training shards, stacked)
            m, _, k = a.shape
            part = torch.einsum("...mk,mrk->...r", x.unflatten(-1, (m, k)), a)
        else:
            part = F.linear(x, a)
        u = reduce_from_tp(part, self.tp_group)
        return F.linear(u, self.b[module]) * self.scale

    def qkv(self, x: torch.Tensor) -> torch.Tensor | None:
        """The q/k/v deltas in the fused ``qkv`` layout of this rank ``[..., h_kv*(qpg+2)*D]``
        (zeros for an untargeted part), or None without any of the three."""
        parts = [self._column(m, x) for m in ("q_proj", "k_proj", "v_proj")]
        if all(p is None for p in parts):
            return None
        d, qpg = self.head_dim, self.q_per_group
        groups = next((p.shape[-1] // (d * n) for p, n in zip(parts, (qpg, 1, 1))
                       if p is not None))
        pieces = [p.unflatten(-1, (groups, n, d)) if p is not None
                  else x.new_zeros(*x.shape[:-1], groups, n, d)
                  for p, n in zip(parts, (qpg, 1, 1))]
        return torch.cat(pieces, dim=-2).flatten(-3)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gate/up deltas interleaved as ``gate_up``'s rows ``[..., F_local * 2]``, or
        None."""
        gate, up = self._column("gate_proj", x), self._column("up_proj", x)
        if gate is None and up is None:
            return None
        gate = torch.zeros_like(up) if gate is None else gate
        up = torch.zeros_like(gate) if up is None else up
        return torch.stack([gate, up], dim=-1).flatten(-2)


def compiled_adapters(lora: LayerLora | None, modules: tuple[str, ...], group: Group | None
                      ) -> tuple:
    """``lora``'s adapters over ``modules`` as plain values for a compiled function,
    ``(a, b, scale, dropout)``, or ``()`` without any: the TP group left out, the replicated
    matrices (column-parallel ``A``, row-parallel ``B``) through ``copy_to_tp`` on ``group``
    (identity forward, their gradients summed), so that one compiled function serves every
    layer and :func:`lora_from_values` rebuilds a group-free :class:`LayerLora` inside it."""
    if lora is None or not any(m in lora.a for m in modules):
        return ()
    a = {m: t if m in ROW_PARALLEL else copy_to_tp(t, group)
         for m, t in lora.a.items() if m in modules}
    b = {m: copy_to_tp(t, group) if m in ROW_PARALLEL else t
         for m, t in lora.b.items() if m in modules}
    return a, b, lora.scale, lora.dropout


def lora_from_values(adapters: tuple, q_per_group: int, head_dim: int) -> LayerLora | None:
    """The :class:`LayerLora` (no TP group: this rank's partial deltas) of
    :func:`compiled_adapters`' values, or None for ``()``."""
    if not adapters:
        return None
    a, b, scale, dropout = adapters
    return LayerLora(a=a, b=b, scale=scale, dropout=dropout, tp_group=None,
                     q_per_group=q_per_group, head_dim=head_dim)
