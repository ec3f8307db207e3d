"""Llama model config, the shard specs of every parameter, and deterministic initialisation.

Parameter names are global (the same on every rank) and use global layer indices::

    embed_tokens                 [V, H]            vocab-parallel, dim 0            stage 0
    layers.{i}.input_norm        [H]               replicated                       stage(i)
    layers.{i}.qkv               [G*(Q/G+2)*D, H]  column-parallel, QKVFusion       stage(i)
    layers.{i}.o_proj            [H, Q*D]          row-parallel, dim 1              stage(i)
    layers.{i}.post_norm         [H]               replicated                       stage(i)
    layers.{i}.gate_up           [2*F, H]          column-parallel, GateUpFusion    stage(i)
    layers.{i}.down_proj         [H, F]            row-parallel, dim 1              stage(i)
    norm                         [H]               replicated                       last
    lm_head                      [V, H]            vocab-parallel, dim 0            last
    value_head                   [1, H]            replicated                       last

(V vocab, H hidden, F intermediate, Q query heads, G KV heads, D head dim; layers are split
evenly over the ``pp`` stages.)  With tied embeddings the LM head *is* ``embed_tokens``: for
``pp == 1`` there is no ``lm_head`` spec; for ``pp > 1`` the last stage keeps a copy named
``lm_head`` whose gradient is summed with the embedding's every step (see :mod:`engine.train`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec

HEADS = ("lm", "value")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Architecture of a Llama decoder (the subset of transformers' LlamaConfig we support)."""

    vocab_size: int
    """Number of tokens; must be divisible by tp (vocab-parallel embedding and head)."""
    hidden_size: int
    """Model width H."""
    intermediate_size: int
    """SwiGLU width F; must be divisible by tp."""
    num_layers: int
    """Decoder layers; must be divisible by pp."""
    num_heads: int
    """Query heads Q."""
    num_kv_heads: int
    """Key/value heads G (grouped-query attention); divides num_heads; tp must divide it."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    tie_word_embeddings: bool
    """The LM head reuses the embedding matrix (no default: the run config's model section
    holds it)."""
    max_position_embeddings: int = 2048
    """Longest sequence the rotary tables are built for."""
    dtype: torch.dtype = torch.float32
    """Element type of every parameter."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} (hidden_size/num_heads) must be even "
                             f"for rotary embeddings")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta="
                             f"{self.rope_theta} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_parallel(self, pp: int, tp: int) -> None:
        """Raise ValueError unless the model can be split ``pp`` stages x ``tp`` shards."""
        for what, value in (("num_kv_heads", self.num_kv_heads), ("vocab_size", self.vocab_size),
                            ("intermediate_size", self.intermediate_size)):
            if value % tp:
                raise ValueError(f"tp={tp} must divide {what}={value}")
        if self.num_layers % pp:
            raise ValueError(f"pp={pp} must divide num_layers={self.num_layers}")

    def layer_stage(self, layer: int, pp: int) -> int:
        """Training pipeline stage that owns decoder layer ``layer``."""
        return layer // (self.num_layers // pp)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"head={head!r} must be one of {HEADS}")


def llama_shard_specs(config: LlamaConfig, pp: int, head: str = "lm") -> list[ShardSpec]:
    """Every parameter of the model with its global shape, partitioning, stage and HF names.

    Args:
        config: the architecture.
        pp: number of training pipeline stages (layers are split evenly).
        head: ``"lm"`` (actor, reference) or ``"value"`` (critic, reward, cost).

    Returns:
        Specs in forward order (embedding, layers, final norm, head).
    """
    _check_head(head)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a positive int, got pp={pp!r}")
    if config.num_layers % pp:
        raise ValueError(f"pp={pp} must divide num_layers={config.num_layers}")
    c, dt, last = config, config.dtype, pp - 1
    H, F, D = c.hidden_size, c.intermediate_size, c.head_dim
    qkv = QKVFusion(c.num_heads, c.num_kv_heads, D)
    specs = [ShardSpec("embed_tokens", (c.vocab_size, H), dtype=dt, partition_dim=0, stage=0,
                       fusion=None, hf_names=("model.embed_tokens.weight",))]
    for i in range(c.num_layers):
        s, hf = c.layer_stage(i, pp), f"model.layers.{i}."
        specs += [
            ShardSpec(f"layers.{i}.input_norm", (H,), dtype=dt, partition_dim=None, stage=s,
                      fusion=None, hf_names=(hf + "input_layernorm.weight",)),
            ShardSpec(f"layers.{i}.qkv", ((c.num_heads + 2 * c.num_kv_heads) * D, H), dtype=dt,
                      partition_dim=0, stage=s, fusion=qkv,
                      hf_names=tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv")),
            ShardSpec(f"layers.{i}.o_proj", (H, c.num_heads * D), dtype=dt, partition_dim=1,
                      stage=s, fusion=None, hf_names=(hf + "self_attn.o_proj.weight",)),
            ShardSpec(f"layers.{i}.post_norm", (H,), dtype=dt, partition_dim=None, stage=s,
                      fusion=None, hf_names=(hf + "post_attention_layernorm.weight",)),
            ShardSpec(f"layers.{i}.gate_up", (2 * F, H), dtype=dt, partition_dim=0, stage=s,
                      fusion=GateUpFusion(),
                      hf_names=(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")),
            ShardSpec(f"layers.{i}.down_proj", (H, F), dtype=dt, partition_dim=1, stage=s,
                      fusion=None, hf_names=(hf + "mlp.down_proj.weight",)),
        ]
    specs.append(ShardSpec("norm", (H,), dtype=dt, partition_dim=None, stage=last, fusion=None,
                           hf_names=("model.norm.weight",)))
    if head == "value":
        specs.append(ShardSpec("value_head", (1, H), dtype=dt, partition_dim=None, stage=last,
                               fusion=None, hf_names=("score.weight",)))
    elif not c.tie_word_embeddings:
        specs.append(ShardSpec("lm_head", (c.vocab_size, H), dtype=dt, partition_dim=0, stage=last,
                               fusion=None, hf_names=("lm_head.weight",)))
    elif pp > 1:  # tied: the last stage keeps a gradient-synchronised copy of the embedding
        specs.append(ShardSpec("lm_head", (c.vocab_size, H), dtype=dt, partition_dim=0, stage=last,
                               fusion=None, hf_names=("model.embed_tokens.weight",)))
    return specs


def head_weight_name(config: LlamaConfig, pp: int, head: str = "lm") -> str:
    """Name of the parameter the last stage uses as its output projection."""
    _check_head(head)
    if head == "value":
        return "value_head"
    return "embed_tokens" if config.tie_word_embeddings and pp == 1 else "lm_head"


def init_full_state_dict(config: LlamaConfig, seed: int = 0, head: str = "lm",
                         std: float = 0.02) -> dict[str, torch.Tensor]:
    """The global (unsharded) weights of a freshly initialised model, in stored layout.

    Deterministic in ``seed`` and independent of any parallel layout: norms start at one
    plus a small perturbation (so norm gradients are not trivially symmetric), every matrix is
    normal(0, std).  Names follow :func:`llama_shard_specs` with ``pp=1``; a tied ``lm_head``
    copy (pp > 1) is filled from ``embed_tokens`` by :func:`engine.model.load_full_state_dict`.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in llama_shard_specs(config, 1, head):
        if spec.partition_dim is None and len(spec.shape) == 1:
            t = 1.0 + 0.1 * torch.randn(spec.shape, generator=g)
        else:
            t = std * torch.randn(spec.shape, generator=g)
        out[spec.name] = t.to(config.dtype)
    return out
