"""The actor as a megatron-core 0.16.1 ``GPTModel`` (local layer spec, no TransformerEngine),
on CPU / gloo, handing its parameters to the Resharder through the megatron interop.

Rank order.  Our training layout numbers ranks ``rank = dp*pp*tp + pp*tp + tp`` (tp fastest,
then pp, then dp).  megatron's default order ``"tp-cp-ep-dp-pp"`` puts dp *inside* pp, so its
groups would differ from ours whenever pp > 1 and dp > 1.  megatron 0.16.1 also accepts
``order="tp-pp-dp"`` (cp = ep = 1 are appended), which is exactly our order; we always use it,
and :func:`init_megatron_parallel` checks that megatron's TP, PP and DP groups equal the
layout's before any model is built::

    ours:      rank = dp*(pp*tp) + pp_rank*tp + tp_rank
    megatron:  order "tp-pp-dp"  ->  the same formula (tp fastest, dp slowest)

megatron's parallel_state is process-global: one training layout per process at a time
(:func:`init_megatron_parallel` destroys the previous one).

Weights.  Parameter layouts match :mod:`engine.llama_spec`'s stored layout one to one (fused QKV
per query group; fc1 = ``gate_up`` rows interleaved, via
:func:`hybridflow_comm.interop.megatron.interleaved_glu_layer_spec`), so a full state dict of
the native engine loads by cutting TP chunks, and the Resharder's generation shards are the
same tensors the native engine would produce.  Limitations: forward/backward runs for pp == 1
only (megatron's pipeline schedules are not wired to CPU here); untied embeddings or pp == 1
with tied ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.llama_spec import LlamaConfig
from hybridflow_comm.groups import HybridGroups
from hybridflow_comm.interop import megatron_cpu_shim as shim
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.reshard import Resharder

MEGATRON_ORDER = "tp-pp-dp"

_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "qkv": "self_attention.linear_qkv.weight",
    "o_proj": "self_attention.linear_proj.weight",
    "post_norm": "pre_mlp_layernorm.weight",
    "gate_up": "mlp.linear_fc1.weight",
    "down_proj": "mlp.linear_fc2.weight",
}


def megatron_name(engine_name: str) -> str:
    """Native engine parameter name (:mod:`engine.llama_spec`) -> megatron GPT name."""
    if engine_name == "embed_tokens":
        return "embedding.word_embeddings.weight"
    if engine_name == "norm":
        return "decoder.final_layernorm.weight"
    if engine_name == "lm_head":
        return "output_layer.weight"
    parts = engine_name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"decoder.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"engine parameter {engine_name!r} has no megatron GPT counterpart")


def init_megatron_parallel(layout: ParallelLayout) -> None:
    """(Re)initialise megatron's global parallel_state for ``layout`` (collective).

    Raises ValueError (before any collective) when the layout does not cover the job, and
    RuntimeError if megatron's groups came out different from the layout's.
    """
    from megatron.core import parallel_state as ps

    layout.check_world_size(dist.get_world_size() if dist.is_initialized() else 1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                 pipeline_model_parallel_size=layout.pp, order=MEGATRON_ORDER,
                                 create_gloo_process_groups=False)
    rank = dist.get_rank()
    for what, got, ours in (
            ("TP", ps.get_tensor_model_parallel_group(), layout.tp_groups()),
            ("PP", ps.get_pipeline_model_parallel_group(), layout.pp_groups()),
            ("DP", ps.get_data_parallel_group(), layout.dp_groups())):
        members = sorted(dist.get_process_group_ranks(got))
        want = next(g for g in ours if rank in g)
        if members != want:
            raise RuntimeError(f"megatron {what} group {members} != layout {what} group {want}")


def transformer_config(config: LlamaConfig, layout: ParallelLayout):
    """megatron ``TransformerConfig`` of a Llama architecture (CPU init, no fusions, no
    dropout, interleaved SwiGLU through the layer spec's activation module)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extras = {k: getattr(config, k) for k in ("rope_scaling", "qkv_bias", "o_proj_bias",
                                              "qk_norm", "num_experts") if getattr(config, k)}
    if extras:
        raise ValueError(f"the megatron-core backend builds plain Llama layers; this "
                         f"{config.model_type} config also has {extras}: use the native engine")
    return TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads, num_query_groups=config.num_kv_heads,
        kv_channels=config.head_dim, ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, use_te_activation_func=True,
        bias_activation_fusion=False, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True,
        params_dtype=config.dtype, pipeline_dtype=config.dtype,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)


class MegatronActor:
    """This rank's stage and TP shard of a megatron-core GPTModel with a Llama architecture.

    Args:
        config: architecture (the native engine's config type).
        layout: training layout; must cover the whole job.
        seed: megatron initialisation seed (same on every rank).

    Construction is collective (megatron's groups).  Call :meth:`load_full_state_dict` to set
    weights, :meth:`forward_backward` to train, :meth:`resharder` to get the generation side.
    """

    def __init__(self, config: LlamaConfig, layout: ParallelLayout, seed: int = 0) -> None:
        config.check_parallel(layout.pp, layout.tp)
        if config.tie_word_embeddings and layout.pp > 1:
            raise ValueError("tied embeddings with pp > 1 are not supported by this backend")
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel

        from hybridflow_comm.interop.megatron import interleaved_glu_layer_spec

        init_megatron_parallel(layout)
        self.config, self.layout = config, layout
        self.rank = dist.get_rank()
        self.coords = layout.coords(self.rank)
        with shim.cpu_device():
            shim.seed_model_parallel_rng(seed, tp_rank=self.coords.tp)
            self.model = GPTModel(
                config=transformer_config(config, layout),
                transformer_layer_spec=interleaved_glu_layer_spec(),
                vocab_size=config.vocab_size,
                max_sequence_length=config.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(),
                post_process=ps.is_pipeline_last_stage(),
                share_embeddings_and_output_weights=config.tie_word_embeddings,
                position_embedding_type="rope", rotary_base=int(config.rope_theta))

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Megatron parameters by global name (layer numbers global over the stages)."""
        from hybridflow_comm.interop.megatron import stage_specs_from_megatron

        return stage_specs_from_megatron(self.model, self.layout, self.rank)[1]

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's TP chunk of each full tensor (native engine names and stored
        layout, see :mod:`engine.llama_spec`) into the megatron parameters."""
        from hybridflow_comm.interop.megatron import stage_specs_from_megatron

        specs, params = stage_specs_from_megatron(self.model, self.layout, self.rank)
        by_mname = {megatron_name(k): v for k, v in full.items()}
        missing = sorted(s.name for s in specs if s.name not in by_mname)
        if missing:
            raise ValueError(f"full state dict lacks {missing}")
        with torch.no_grad():
            for s in specs:
                t = by_mname[s.name]
                if tuple(t.shape) != s.shape:
                    raise ValueError(f"{s.name}: full shape {tuple(t.shape)} != {s.shape}")
                if s.partition_dim is not None:
                    t = t.chunk(self.layout.tp, s.partition_dim)[self.coords.tp]
                params[s.name].copy_(t)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, s, V/tp]`` (this rank's vocab shard) or, with labels, per-token
        losses ``[b, s]`` (megatron's vocab-parallel cross entropy)."""
        if self.layout.pp != 1:
            raise NotImplementedError("forward with pp > 1 needs megatron's pipeline schedule, "
                                      "which this CPU backend does not run yet")
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with shim.cpu_device():
            return self.model(tokens, pos, attention_mask=None, labels=labels)

    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean token loss of this rank's micro-batch; gradients (``param.grad``) averaged
        over the data-parallel group, so they equal those of the mean loss over the global
        batch when every DP rank has the same number of tokens."""
        from megatron.core import parallel_state as ps

        loss = self.forward(tokens, labels).mean()
        loss.backward()
        value = loss.detach().clone()
        if self.layout.dp > 1:
            group = ps.get_data_parallel_group()
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    p.grad.div_(self.layout.dp)
            dist.all_reduce(value, group=group)
            value /= self.layout.dp
        return float(value)

    def resharder(self, groups: HybridGroups, **kwargs) -> Resharder:
        """A Resharder over this model whose training shards *are* the megatron parameters.

        Builds specs through the megatron interop (Hugging Face names included), then binds
        every parameter to its flat-buffer slot (``param.data`` becomes the slot view).
        """
        from hybridflow_comm.interop.megatron import bind_megatron_params, from_megatron, \
            gpt_hf_names

        if groups.layout.train != self.layout:
            raise ValueError(f"groups are for {groups.layout.train}, the model for {self.layout}")
        specs, params = from_megatron(self.model, groups, hf_names=gpt_hf_names)
        rs = Resharder(specs, groups, **kwargs)
        bind_megatron_params(params, rs.buffer)
        return rs
