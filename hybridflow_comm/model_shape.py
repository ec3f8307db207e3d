"""The shape of a model: its architecture's sizes under the engine's names, and the parameter
and FLOP counts that follow from them (pure arithmetic).  One type for the planner
(:mod:`rlhf.planner`) and the weight-sync plans (:mod:`hybridflow_comm.sync_plan`).

Parameter count of a Llama decoder (``V`` vocab, ``H`` hidden, ``F`` SwiGLU width, ``L`` layers,
``Q`` query heads, ``G`` KV heads, ``D`` head dim; a mixture of ``E`` experts, ``k`` per
token)::

    embedding             V * H
    per layer             H * (Q + 2G) * D   (qkv)  +  Q * D * H  (o_proj)
                          + 3 * H * F        (gate, up, down)  +  2 * H  (norms)
                          [+ (Q + 2G) * D  q/k/v bias, + H  o bias, + 2 * D  q/k norms]
      mixture of experts  3 * H * F per expert: E of them stored, k of them active per token,
                          + E * H  (the router)
    final norm            H
    head                  V * H   (lm head, untied)   or   H   (value head: critic, reward, cost)

A token's matmuls (FLOPs) read the active parameters only; memory and transitions hold
every parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch


class Architecture(Protocol):
    """What a :class:`ModelShape` reads of its architecture: the fields of the engine's
    ``engine.llama_spec.LlamaConfig`` (``head_dim`` resolved), which satisfies it, as does
    :class:`DecoderSizes`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    num_experts: int
    num_experts_per_tok: int
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool


@dataclass(frozen=True, kw_only=True)
class DecoderSizes:
    """A dense Llama decoder's sizes under the engine's names, for code that cannot build the
    engine's ``LlamaConfig`` (the weight-sync CLI's ``--dims`` and ``--hf-config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """SwiGLU width F."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    """Per-head width; None: ``hidden_size // num_heads``."""
    tie_word_embeddings: bool = True
    """The LM head is the embedding."""
    dtype: torch.dtype = torch.bfloat16
    """Element type of every parameter."""
    num_experts: int = 0
    num_experts_per_tok: int = 0
    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)


@dataclass(frozen=True)
class ModelShape:
    """One model's shape: a name, its architecture and which head it carries; the sizes under
    the engine's names, parameter and FLOP counts.  What the planner plans and the weight-sync
    plans shard (:func:`hybridflow_comm.sync_plan.llama_specs`).

    Args:
        name: label used in plans and cache keys (e.g. ``llama-7b``).
        config: the architecture: the engine's ``LlamaConfig`` (which validates it), or the
            :class:`DecoderSizes` of code below the engine (the sync CLI's ``--dims``).
        value_head: True for critic/reward/cost models: a scalar head ``[1, H]`` instead of
            the LM head.

    Example::

        shape = ModelShape("tiny", DecoderSizes(vocab_size=24, hidden_size=64,
                                                intermediate_size=128, num_layers=2,
                                                num_heads=4, num_kv_heads=2))
        shape.params, shape.as_value_model().params
    """

    name: str
    config: Architecture
    value_head: bool = False

    vocab_size = property(lambda self: self.config.vocab_size)
    hidden_size = property(lambda self: self.config.hidden_size)
    intermediate_size = property(lambda self: self.config.intermediate_size)
    num_layers = property(lambda self: self.config.num_layers)
    num_heads = property(lambda self: self.config.num_heads)
    num_kv_heads = property(lambda self: self.config.num_kv_heads)
    num_experts = property(lambda self: self.config.num_experts)
    tie_word_embeddings = property(lambda self: self.config.tie_word_embeddings)
    dtype = property(lambda self: self.config.dtype)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def _layer_vectors(self) -> int:
        """One decoder layer's parameters outside any matmul: norms and biases."""
        c, h, d = self.config, self.hidden_size, self.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * d
        return 2 * h + (qkv_rows if c.qkv_bias else 0) + (h if c.o_proj_bias else 0) + \
            (2 * d if c.qk_norm else 0)

    def _layer_params(self, experts: int) -> int:
        """One decoder layer's parameters with ``experts`` SwiGLUs counted."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        router = self.config.num_experts * h
        return attn + experts * 3 * h * self.intermediate_size + router + self._layer_vectors()

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (every expert of a mixture)."""
        return self._layer_params(self.config.num_experts or 1)

    @property
    def expert_layer_params(self) -> int:
        """Parameters of one decoder layer's experts (``E * 3 * H * F``; 0 for a dense model):
        what expert parallelism splits into whole experts."""
        return self.config.num_experts * 3 * self.hidden_size * self.intermediate_size

    @property
    def active_layer_params(self) -> int:
        """Parameters of one decoder layer a token uses (``k`` experts of a mixture)."""
        c = self.config
        return self._layer_params(c.num_experts_per_tok if c.num_experts else 1)

    def _total(self, layer: int) -> int:
        h = self.hidden_size
        head = h if self.value_head else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @property
    def params(self) -> int:
        """Total parameters (what memory and the transitions hold)."""
        return self._total(self.layer_params)

    @property
    def active_params(self) -> int:
        """Parameters one token uses (= :attr:`params` for a dense model)."""
        return self._total(self.active_layer_params)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the active ones but embedding,
        norms and biases)."""
        h = self.hidden_size
        head = h if self.value_head else self.vocab_size * h
        return self.num_layers * (self.active_layer_params - self._layer_vectors()) + head

    def kv_elems_per_token(self) -> int:
        """K and V elements cached per token over all layers: ``2 * L * G * D``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def forward_flops(self, tokens: float, context: float) -> float:
        """FLOPs of a forward pass over ``tokens`` tokens that attend to ``context`` tokens on
        average: ``2 * matmul_params`` per token plus ``4 * L * H * context`` for QK^T and AV."""
        return tokens * (2.0 * self.matmul_params
                         + 4.0 * self.num_layers * self.hidden_size * context)

    def check_parallel(self, pp: int, tp: int) -> bool:
        """Whether the model splits into ``pp`` stages x ``tp`` shards (the engine's rules:
        tp divides KV heads, SwiGLU width and vocab; pp divides the layers)."""
        return (self.num_kv_heads % tp == 0 and self.intermediate_size % tp == 0
                and self.vocab_size % tp == 0 and self.num_layers % pp == 0)

    def as_value_model(self) -> ModelShape:
        """The same shape with a scalar value head (critic, reward and cost models)."""
        return replace(self, value_head=True)

