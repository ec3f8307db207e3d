"""The transformers model families the engine runs: one registration each.

Every family is the pre-norm Llama decoder of :mod:`engine.layers` (RMSNorm, RoPE, GQA,
SwiGLU) with some of its switches; a family says which switches its ``config.json`` can state
and under which keys::

    model_type  architectures (lm head / value head)      q,k,v bias      o bias          q/k norm
    llama       LlamaForCausalLM / ...ForSequenceCl.      attention_bias  attention_bias  -
    qwen2       Qwen2ForCausalLM / ...                    always          -               -
    qwen3       Qwen3ForCausalLM / ...                    attention_bias  attention_bias  always
    mistral     MistralForCausalLM / ...                  -               -               -
    qwen3_moe   Qwen3MoeForCausalLM / ...                 attention_bias  attention_bias  always
    mixtral     MixtralForCausalLM / ...                  -               -               -

The last two are mixtures of experts (:class:`MoeNames`): every layer's MLP is a top-k
router over SwiGLU experts, stored per expert in ``config.json``'s naming::

    model_type  block               router        expert e's gate, up, down    experts / width keys
    qwen3_moe   mlp                 gate          gate_proj, up_proj, down_proj  num_experts /
                                                                               moe_intermediate_size
    mixtral     block_sparse_moe    gate          w1, w3, w2                   num_local_experts /
                                                                               intermediate_size

Qwen3-MoE renormalises the top-k weights where ``norm_topk_prob`` says so, Mixtral always.

The sliding window (Mistral's ``sliding_window``; Qwen's ``use_sliding_window`` and
``layer_types``) is kept as a number: the engine runs full causal attention, which equals
windowed attention only while no sequence is longer than the window, so
:class:`engine.llama_spec.LlamaConfig` refuses a window shorter than its
``max_position_embeddings``.  Every list of names, every lookup and every error message reads
:data:`FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

HEAD_SUFFIX = {"lm": "ForCausalLM", "value": "ForSequenceClassification"}


class AttentionSwitches(Protocol):
    """What a family constrains (the matching fields of :class:`engine.llama_spec.LlamaConfig`)."""

    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    sliding_window: int | None
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    router_aux_loss_coef: float


@dataclass(frozen=True, kw_only=True)
class MoeNames:
    """How a mixture-of-experts family names its MLP (see the module docstring)."""

    block: str
    """The MLP module of a layer (``mlp``, ``block_sparse_moe``)."""
    gate: str
    """The expert projections ``gate``, ``up``, ``down`` (``gate_proj``... or ``w1, w3, w2``)."""
    up: str
    down: str
    experts_key: str
    """``config.json``'s number of experts (transformers 5 writes ``num_local_experts`` for
    every family; both are read)."""
    width_key: str
    """``config.json``'s SwiGLU width of one expert."""
    norm_topk_key: str | None
    """``config.json``'s switch of the top-k renormalisation, None where it is always on."""

    def router(self, layer_prefix: str) -> str:
        return f"{layer_prefix}{self.block}.gate.weight"

    def expert(self, layer_prefix: str, e: int, proj: str) -> str:
        """HF name of expert ``e``'s ``proj`` (``"gate"``, ``"up"`` or ``"down"``)."""
        return f"{layer_prefix}{self.block}.experts.{e}.{getattr(self, proj)}.weight"


@dataclass(frozen=True, kw_only=True)
class HFFamily:
    """One transformers model family (see the module docstring)."""

    model_type: str
    """transformers' ``model_type`` (``config.json``), also :attr:`LlamaConfig.model_type`."""
    class_prefix: str
    """Prefix of the model classes (``Qwen2`` -> ``Qwen2ForCausalLM``, ``Qwen2Config``)."""
    bias: str
    """``"attention_bias"`` (q, k, v and o follow that key), ``"qkv"`` (q, k, v always, o
    never) or ``"none"``."""
    qk_norm: bool
    """RMSNorm of every query and key head before RoPE."""
    window: str
    """How ``config.json`` states a sliding window: ``"none"``, ``"sliding_window"`` (the key,
    null = none) or ``"use_sliding_window"`` (Qwen: the flag, ``max_window_layers`` and
    ``layer_types``)."""
    default_head_dim: int | None
    """Head dim of a ``config.json`` without ``head_dim`` (None: hidden / heads)."""
    moe: MoeNames | None = None
    """The experts' names of a mixture-of-experts family (None: a dense SwiGLU MLP)."""

    @property
    def config_class(self) -> str:
        return f"{self.class_prefix}Config"

    def architecture(self, head: str) -> str:
        """The ``architectures`` entry of a model with ``head`` (``"lm"`` or ``"value"``)."""
        return self.class_prefix + HEAD_SUFFIX[head]

    def check(self, c: AttentionSwitches) -> None:
        """ValueError unless this family's ``config.json`` can state ``c``'s switches."""
        bias = {"attention_bias": (c.qkv_bias, c.qkv_bias), "qkv": (True, False),
                "none": (False, False)}[self.bias]
        bad = {}
        if (c.qkv_bias, c.o_proj_bias) != bias:
            bad["(qkv_bias, o_proj_bias)"] = ((c.qkv_bias, c.o_proj_bias), bias)
        if c.qk_norm != self.qk_norm:
            bad["qk_norm"] = (c.qk_norm, self.qk_norm)
        if c.sliding_window is not None and self.window == "none":
            bad["sliding_window"] = (c.sliding_window, None)
        if bool(c.num_experts) != (self.moe is not None):
            bad["num_experts"] = (c.num_experts, ">= 2" if self.moe else 0)
        elif self.moe is not None and self.moe.norm_topk_key is None and not c.norm_topk_prob:
            bad["norm_topk_prob"] = (c.norm_topk_prob, True)
        if bad:
            raise ValueError(f"model_type={self.model_type!r} cannot have these values "
                             f"(given, possible): {bad}")

    def switches_from_hf(self, hf: dict) -> dict:
        """``qkv_bias``, ``o_proj_bias``, ``qk_norm``, ``sliding_window`` and ``head_dim`` of
        a ``config.json`` dict."""
        bias = bool(hf.get("attention_bias", False))
        qkv, o = {"attention_bias": (bias, bias), "qkv": (True, False),
                  "none": (False, False)}[self.bias]
        head_dim = hf.get("head_dim") or self.default_head_dim or \
            hf["hidden_size"] // hf["num_attention_heads"]
        return dict(qkv_bias=qkv, o_proj_bias=o, qk_norm=self.qk_norm, head_dim=head_dim,
                    sliding_window=self._window_from_hf(hf), **self._moe_from_hf(hf))

    def _moe_from_hf(self, hf: dict) -> dict:
        """The expert fields of a ``config.json`` dict (none for a dense family); ValueError
        for layouts the engine does not run (dense layers between the sparse ones, router
        noise)."""
        if self.moe is None:
            return {}
        m = self.moe
        bad = {k: hf[k] for k in ("mlp_only_layers", "router_jitter_noise") if hf.get(k)}
        if hf.get("decoder_sparse_step", 1) != 1:
            bad["decoder_sparse_step"] = hf["decoder_sparse_step"]
        if bad:
            raise ValueError(f"unsupported {self.model_type} config values: {bad} (every "
                             f"layer must be a mixture of experts, without router noise)")
        experts = hf.get(m.experts_key, hf.get("num_local_experts"))
        return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                    intermediate_size=hf[m.width_key],
                    norm_topk_prob=bool(hf.get(m.norm_topk_key, False)) if m.norm_topk_key
                    else True,
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))

    def _window_from_hf(self, hf: dict) -> int | None:
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if self.window == "none" or window is None:
            return None
        if layer_types:  # transformers >= 4.5x: the per-layer list decides
            return window if "sliding_attention" in layer_types else None
        if self.window == "use_sliding_window":  # Qwen: layers >= max_window_layers slide
            used = hf.get("use_sliding_window", False) and \
                hf["num_hidden_layers"] > hf.get("max_window_layers", 28)
            return window if used else None
        return window

    def hf_kwargs(self, c: AttentionSwitches, num_layers: int, head_dim: int) -> dict:
        """The family's keyword arguments of its transformers config class for ``c``."""
        out: dict = {"head_dim": head_dim}
        if self.bias == "attention_bias":
            out["attention_bias"] = c.qkv_bias
        if self.window == "sliding_window":
            out["sliding_window"] = c.sliding_window
        elif self.window == "use_sliding_window":
            windowed = c.sliding_window is not None
            out.update(use_sliding_window=windowed, sliding_window=c.sliding_window,
                       max_window_layers=0 if windowed else num_layers)
        if self.moe is not None:
            out.update({self.moe.experts_key: c.num_experts,
                        "num_experts_per_tok": c.num_experts_per_tok,
                        "router_aux_loss_coef": c.router_aux_loss_coef})
            if self.moe.norm_topk_key is not None:
                out[self.moe.norm_topk_key] = c.norm_topk_prob
            if self.moe.width_key != "intermediate_size":
                out[self.moe.width_key] = c.intermediate_size
        return out


FAMILIES: dict[str, HFFamily] = {}


def register_family(family: HFFamily) -> HFFamily:
    """Add ``family`` to :data:`FAMILIES` (ValueError if its model_type is taken)."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is registered twice")
    FAMILIES[family.model_type] = family
    return family


register_family(HFFamily(model_type="llama", class_prefix="Llama", bias="attention_bias",
                         qk_norm=False, window="none", default_head_dim=None))
register_family(HFFamily(model_type="qwen2", class_prefix="Qwen2", bias="qkv", qk_norm=False,
                         window="use_sliding_window", default_head_dim=None))
register_family(HFFamily(model_type="qwen3", class_prefix="Qwen3", bias="attention_bias",
                         qk_norm=True, window="use_sliding_window", default_head_dim=128))
register_family(HFFamily(model_type="mistral", class_prefix="Mistral", bias="none",
                         qk_norm=False, window="sliding_window", default_head_dim=None))
register_family(HFFamily(
    model_type="qwen3_moe", class_prefix="Qwen3Moe", bias="attention_bias", qk_norm=True,
    window="use_sliding_window", default_head_dim=None,
    moe=MoeNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj",
                 experts_key="num_experts", width_key="moe_intermediate_size",
                 norm_topk_key="norm_topk_prob")))
register_family(HFFamily(
    model_type="mixtral", class_prefix="Mixtral", bias="none", qk_norm=False,
    window="sliding_window", default_head_dim=None,
    moe=MoeNames(block="block_sparse_moe", gate="w1", up="w3", down="w2",
                 experts_key="num_local_experts", width_key="intermediate_size",
                 norm_topk_key=None)))


def supported_architectures() -> list[str]:
    return [f.architecture(h) for f in FAMILIES.values() for h in HEAD_SUFFIX]


def family(model_type: str) -> HFFamily:
    """The registered family of ``model_type`` (ValueError naming the supported ones)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[model_type]


def family_of_hf(hf: dict) -> tuple[HFFamily, str]:
    """``(family, head)`` of a ``config.json`` dict, from its ``architectures`` entry (or its
    ``model_type`` when it has none); ValueError listing the supported architectures."""
    archs = hf.get("architectures") or []
    by_name = {f.architecture(h): (f, h) for f in FAMILIES.values() for h in HEAD_SUFFIX}
    if len(archs) > 1 or any(a not in by_name for a in archs):
        raise ValueError(f"unsupported architectures {archs} (model_type="
                         f"{hf.get('model_type')!r}); supported: "
                         f"{', '.join(supported_architectures())}")
    if archs:
        return by_name[archs[0]]
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json has no architectures and model_type={model_type!r} is "
                         f"not supported; supported architectures: "
                         f"{', '.join(supported_architectures())}")
    return FAMILIES[model_type], "lm"
