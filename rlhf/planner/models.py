"""The planner's model shapes (:class:`hybridflow_comm.model_shape.ModelShape`, where the
parameter and FLOP counts are) and its presets.

Presets: ``llama-7b``, ``llama-13b``, ``llama-34b``, ``llama-70b`` (published Llama-2 /
CodeLlama shapes) and ``tiny``, ``tiny-4l`` (this project's CPU models; ``tiny`` is the default
architecture of :class:`rlhf.config.ModelConfig` and the shipped recipes).
"""

from __future__ import annotations

from engine.llama_spec import LlamaConfig
from hybridflow_comm.model_shape import ModelShape
from rlhf.model_arch import llama_config

__all__ = ["PRESETS", "ModelShape", "model_shape", "shape_from_model_config"]


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
    return ModelShape(name, llama_config(model))
