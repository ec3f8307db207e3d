"""Llama model config, the shard specs of every parameter, and deterministic initialisation.

Parameter names are global (the same on every rank) and use global layer indices::

    embed_tokens                 [V, H]            vocab-parallel, dim 0            stage 0
    layers.{i}.input_norm        [H]               replicated                       stage(i)
    layers.{i}.qkv               [G*(Q/G+2)*D, H]  column-parallel, QKVFusion       stage(i)
    layers.{i}.qkv_bias          [G*(Q/G+2)*D]     column-parallel, QKVFusion       stage(i) *
    layers.{i}.q_norm, k_norm    [D]               replicated                       stage(i) *
    layers.{i}.o_proj            [H, Q*D]          row-parallel, dim 1              stage(i)
    layers.{i}.o_proj_bias       [H]               replicated                       stage(i) *
    layers.{i}.post_norm         [H]               replicated                       stage(i)
    layers.{i}.gate_up           [2*F, H]          column-parallel, GateUpFusion    stage(i)
    layers.{i}.down_proj         [H, F]            row-parallel, dim 1              stage(i)
  a mixture of experts (num_experts E > 0) in place of gate_up and down_proj:
    layers.{i}.router            [E, H]            replicated                       stage(i)
    layers.{i}.experts.{e}.gate_up    [2*F, H]     column-parallel, GateUpFusion    stage(i)
    layers.{i}.experts.{e}.down_proj  [H, F]       row-parallel, dim 1              stage(i)
    norm                         [H]               replicated                       last
    lm_head                      [V, H]            vocab-parallel, dim 0            last
    value_head                   [1, H]            replicated                       last

(V vocab, H hidden, F intermediate (an expert's width in a mixture of experts), Q query heads,
G KV heads, D head dim; layers are split evenly over the ``pp`` stages; ``*``: only where the
config switch of the same name is on, ``qk_norm`` for the norms, see :mod:`engine.hf_families`
for the families that use them.)
With tied embeddings the LM head *is* ``embed_tokens``: for ``pp == 1`` there is no
``lm_head`` spec; for ``pp > 1`` the last stage keeps a copy named ``lm_head`` whose gradient
is summed with the embedding's every step (see :mod:`engine.train`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from engine.hf_families import family
from engine.moe import MoeRouting
from engine.rope import RopeScaling
from hybridflow_comm.shard_spec import GateUpFusion, QKVFusion, ShardSpec

HEADS = ("lm", "value")
# Weights of every layer (the C++ kernels read exactly these, in this order) and the optional
# ones with the config switch that adds them (engine.layers documents their shapes).
LAYER_KEYS = ("input_norm", "qkv", "o_proj", "post_norm", "gate_up", "down_proj")
OPTIONAL_LAYER_KEYS = {"qkv_bias": "qkv_bias", "q_norm": "qk_norm", "k_norm": "qk_norm",
                       "o_proj_bias": "o_proj_bias"}


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Architecture of a Llama-style decoder: Llama, Qwen2, Qwen3 and Mistral checkpoints
    (:mod:`engine.hf_families`) are this layer with some switches set."""

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
    """Longest sequence the run feeds the model (rotary tables, generation limit)."""
    dtype: torch.dtype = torch.float32
    """Element type of every parameter."""
    head_dim: int | None = None
    """Per-head width D; None = hidden_size / num_heads (set in ``__post_init__``).  Qwen3
    checkpoints have ``num_heads * head_dim != hidden_size``."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 RoPE frequency scaling, or None for plain RoPE."""
    qkv_bias: bool = False
    """The q, k and v projections have biases (Qwen2; Llama/Qwen3 ``attention_bias``)."""
    o_proj_bias: bool = False
    """The output projection has a bias (Llama/Qwen3 ``attention_bias``)."""
    qk_norm: bool = False
    """RMSNorm (weight ``[D]``) of every query and key head before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """The checkpoint's attention window (Mistral, Qwen with ``use_sliding_window``); None =
    full attention.  The engine runs full causal attention, the same maths while sequences fit
    the window, so it must be >= max_position_embeddings."""
    num_experts: int = 0
    """Experts of every layer's MLP (a mixture of experts: Qwen3-MoE, Mixtral), each a SwiGLU
    of width ``intermediate_size``; 0 = one dense SwiGLU MLP."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to: the top k of the router's softmax (a mixture of
    experts: 1 to num_experts; a dense model: unused)."""
    norm_topk_prob: bool = True
    """The k routing weights are renormalised to sum to one (Mixtral always; Qwen3-MoE's
    switch); else they are the softmax's own probabilities."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss of the router (the checkpoint's value; MoE only)."""
    model_type: str = "llama"
    """transformers family the checkpoint is written as (:data:`engine.hf_families.FAMILIES`);
    it must be able to state the switches above."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} must be divisible by "
                                 f"num_heads={self.num_heads} (or give head_dim)")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) \
                or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even int for "
                             f"rotary embeddings")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta="
                             f"{self.rope_theta} must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got "
                            f"{type(self.rope_scaling).__name__}")
        if self.num_experts:
            if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) \
                    or self.num_experts < 2:
                raise ValueError(f"num_experts={self.num_experts!r} must be an int >= 2 (0 = "
                                 f"a dense MLP)")
            if isinstance(self.num_experts_per_tok, bool) or \
                    not isinstance(self.num_experts_per_tok, int) or \
                    not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok!r} must be an "
                                 f"int in [1, num_experts={self.num_experts}]")
            if not self.router_aux_loss_coef >= 0:
                raise ValueError(f"router_aux_loss_coef={self.router_aux_loss_coef} must be "
                                 f">= 0")
        if self.sliding_window is not None and \
                self.sliding_window < self.max_position_embeddings:
            raise ValueError(f"sliding_window={self.sliding_window} is shorter than "
                             f"max_position_embeddings={self.max_position_embeddings}: the "
                             f"engine has no windowed attention; build the model for at most "
                             f"{self.sliding_window} tokens (max_position_embeddings <= "
                             f"{self.sliding_window}, e.g. read_hf_config(folder, "
                             f"max_position_embeddings=...))")
        family(self.model_type).check(self)

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def routing(self) -> MoeRouting | None:
        """How the MLP of every layer routes its tokens (None: a dense MLP)."""
        if not self.num_experts:
            return None
        return MoeRouting(top_k=self.num_experts_per_tok, norm_topk=self.norm_topk_prob)

    @property
    def layer_keys(self) -> tuple[str, ...]:
        """The weights of every decoder layer: :data:`LAYER_KEYS` (a mixture of experts: the
        router and each expert's ``gate_up`` and ``down_proj`` in place of the MLP's, see
        :func:`moe_layer_keys`) and the optional ones this config switches on."""
        keys = LAYER_KEYS if not self.num_experts else \
            LAYER_KEYS[:4] + moe_layer_keys(self.num_experts)
        return keys + tuple(k for k, switch in OPTIONAL_LAYER_KEYS.items()
                            if getattr(self, switch))

    def check_parallel(self, pp: int, tp: int) -> None:
        """Raise ValueError unless the model can be split ``pp`` stages x ``tp`` shards."""
        sizes = (("num_kv_heads", self.num_kv_heads), ("vocab_size", self.vocab_size),
                 ("intermediate_size", self.intermediate_size))
        for what, value in sizes:
            if value % tp:
                fits = [t for t in range(1, self.num_kv_heads + 1)
                        if all(v % t == 0 for _, v in sizes)]
                heads = f" (num_heads={self.num_heads}: each TP rank holds whole key/value " \
                    f"heads and their query heads)" if what == "num_kv_heads" else ""
                raise ValueError(f"tp={tp} must divide {what}={value}{heads}; tp can be one "
                                 f"of {fits}")
        if self.num_layers % pp:
            raise ValueError(f"pp={pp} must divide num_layers={self.num_layers}")

    def layer_stage(self, layer: int, pp: int) -> int:
        """Training pipeline stage that owns decoder layer ``layer``."""
        return layer // (self.num_layers // pp)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d


def moe_layer_keys(num_experts: int) -> tuple[str, ...]:
    """A mixture-of-experts layer's MLP weights: ``router`` then every expert's."""
    return ("router",) + tuple(f"experts.{e}.{k}" for e in range(num_experts)
                               for k in ("gate_up", "down_proj"))


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
    H, D = c.hidden_size, c.head_dim
    qkv = QKVFusion(c.num_heads, c.num_kv_heads, D)
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * D
    specs = [ShardSpec("embed_tokens", (c.vocab_size, H), dtype=dt, partition_dim=0, stage=0,
                       fusion=None, hf_names=("model.embed_tokens.weight",))]
    for i in range(c.num_layers):
        s, hf = c.layer_stage(i, pp), f"model.layers.{i}."
        specs += [
            ShardSpec(f"layers.{i}.input_norm", (H,), dtype=dt, partition_dim=None, stage=s,
                      fusion=None, hf_names=(hf + "input_layernorm.weight",)),
            ShardSpec(f"layers.{i}.qkv", (qkv_rows, H), dtype=dt, partition_dim=0, stage=s,
                      fusion=qkv, hf_names=tuple(hf + f"self_attn.{p}_proj.weight"
                                                 for p in "qkv")),
        ]
        if c.qkv_bias:
            specs.append(ShardSpec(f"layers.{i}.qkv_bias", (qkv_rows,), dtype=dt,
                                   partition_dim=0, stage=s, fusion=qkv,
                                   hf_names=tuple(hf + f"self_attn.{p}_proj.bias"
                                                  for p in "qkv")))
        if c.qk_norm:
            specs += [ShardSpec(f"layers.{i}.{p}_norm", (D,), dtype=dt, partition_dim=None,
                                stage=s, fusion=None, hf_names=(hf + f"self_attn.{p}_norm.weight",))
                      for p in "qk"]
        specs.append(ShardSpec(f"layers.{i}.o_proj", (H, c.num_heads * D), dtype=dt,
                               partition_dim=1, stage=s, fusion=None,
                               hf_names=(hf + "self_attn.o_proj.weight",)))
        if c.o_proj_bias:
            specs.append(ShardSpec(f"layers.{i}.o_proj_bias", (H,), dtype=dt, partition_dim=None,
                                   stage=s, fusion=None, hf_names=(hf + "self_attn.o_proj.bias",)))
        specs.append(ShardSpec(f"layers.{i}.post_norm", (H,), dtype=dt, partition_dim=None,
                               stage=s, fusion=None,
                               hf_names=(hf + "post_attention_layernorm.weight",)))
        specs += _mlp_specs(c, i, s, hf)
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


def _mlp_specs(c: LlamaConfig, i: int, stage: int, hf: str) -> list[ShardSpec]:
    """Layer ``i``'s MLP: one SwiGLU, or the router and every expert (each split over TP like
    the dense MLP: ``gate_up`` by rows, ``down_proj`` by columns)."""
    H, F, dt = c.hidden_size, c.intermediate_size, c.dtype
    moe = family(c.model_type).moe
    if moe is None:
        return [ShardSpec(f"layers.{i}.gate_up", (2 * F, H), dtype=dt, partition_dim=0,
                          stage=stage, fusion=GateUpFusion(),
                          hf_names=(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")),
                ShardSpec(f"layers.{i}.down_proj", (H, F), dtype=dt, partition_dim=1,
                          stage=stage, fusion=None, hf_names=(hf + "mlp.down_proj.weight",))]
    specs = [ShardSpec(f"layers.{i}.router", (c.num_experts, H), dtype=dt, partition_dim=None,
                       stage=stage, fusion=None, hf_names=(moe.router(hf),))]
    for e in range(c.num_experts):
        p = f"layers.{i}.experts.{e}."
        specs += [ShardSpec(p + "gate_up", (2 * F, H), dtype=dt, partition_dim=0, stage=stage,
                            fusion=GateUpFusion(), expert=e,
                            hf_names=(moe.expert(hf, e, "gate"), moe.expert(hf, e, "up"))),
                  ShardSpec(p + "down_proj", (H, F), dtype=dt, partition_dim=1, stage=stage,
                            fusion=None, expert=e, hf_names=(moe.expert(hf, e, "down"),))]
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
    plus a small perturbation (so norm gradients are not trivially symmetric), every matrix and
    bias is normal(0, std).  Names follow :func:`llama_shard_specs` with ``pp=1``; a tied
    ``lm_head`` copy (pp > 1) is filled from ``embed_tokens`` by
    :func:`engine.model.load_full_state_dict`.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in llama_shard_specs(config, 1, head):
        if spec.name.endswith("norm"):
            t = 1.0 + 0.1 * torch.randn(spec.shape, generator=g, device="cpu")
        else:
            t = std * torch.randn(spec.shape, generator=g, device="cpu")
        out[spec.name] = t.to(config.dtype)
    return out
