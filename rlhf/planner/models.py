"""Model size descriptions for the planner: Llama shapes, parameter and FLOP counts, presets.

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

Presets: ``llama-7b``, ``llama-13b``, ``llama-34b``, ``llama-70b`` (published Llama-2 /
CodeLlama shapes) and ``tiny``, ``tiny-4l`` (this project's CPU models; ``tiny`` is the default
architecture of :class:`rlhf.config.ModelConfig` and the shipped recipes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.llama_spec import LlamaConfig


@dataclass(frozen=True)
class ModelShape:
    """Architecture of one model as the planner sees it: the engine's :class:`LlamaConfig`
    (which validates it) plus a name and which head it carries."""

    name: str
    """Label used in plans and cache keys (e.g. ``llama-7b``)."""
    config: LlamaConfig
    """The architecture, exactly as the engine builds it."""
    value_head: bool = False
    """True for critic/reward/cost models: a scalar head ``[1, H]`` instead of the LM head."""

    vocab_size = property(lambda self: self.config.vocab_size)
    hidden_size = property(lambda self: self.config.hidden_size)
    intermediate_size = property(lambda self: self.config.intermediate_size)
    num_layers = property(lambda self: self.config.num_layers)
    num_heads = property(lambda self: self.config.num_heads)
    num_kv_heads = property(lambda self: self.config.num_kv_heads)

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


def _shape(name: str, v: int, h: int, f: int, layers: int, heads: int, kv: int) -> ModelShape:
    return ModelShape(name, LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=f,
                                        num_layers=layers, num_heads=heads, num_kv_heads=kv,
                                        tie_word_embeddings=False))


PRESETS: dict[str, ModelShape] = {
    "llama-7b": _shape("llama-7b", 32000, 4096, 11008, 32, 32, 32),
    "llama-13b": _shape("llama-13b", 32000, 5120, 13824, 40, 40, 40),
    "llama-34b": _shape("llama-34b", 32000, 8192, 22016, 48, 64, 8),
    "llama-70b": _shape("llama-70b", 32000, 8192, 28672, 80, 64, 8),
    "tiny": _shape("tiny", 24, 64, 128, 2, 4, 2),
    "tiny-4l": _shape("tiny-4l", 24, 128, 256, 4, 4, 2),
    # Qwen3-30B-A3B's config.json: 128 experts of width 768, 8 per token
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", LlamaConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=768, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, tie_word_embeddings=False, qk_norm=True,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, model_type="qwen3_moe",
        max_position_embeddings=40960, router_aux_loss_coef=0.001)),
}


def model_shape(name: str) -> ModelShape:
    """A preset by name (``llama-7b`` ... ``tiny``); also accepts ``7b``, ``13b`` ..."""
    key = name.lower()
    if key not in PRESETS and f"llama-{key}" in PRESETS:
        key = f"llama-{key}"
    if key not in PRESETS:
        raise ValueError(f"model={name!r} is not a preset; choose from {sorted(PRESETS)}")
    return PRESETS[key]


def shape_from_model_config(model, name: str = "model") -> ModelShape:
    """A :class:`ModelShape` from an :class:`rlhf.config.ModelConfig` (its resolved
    architecture: the checkpoint's or the built-in one)."""
    return ModelShape(name, model.llama())
