"""The engine's architecture of a configured model (:class:`rlhf.config_roles.ModelConfig`):
the built-in task's tiny Llama, or the configuration an HF checkpoint folder's
``config.json`` holds.  The one place a run reads a checkpoint's configuration: the world
check (:mod:`rlhf.world_plan`), the planner and the builders ask here, and the config
sections stay data (``import rlhf.config`` reads no file and loads no torch)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rlhf.config_roles import ARCH_FIELDS, BUILTIN_ARCH, ModelConfig

if TYPE_CHECKING:
    from engine.llama_spec import LlamaConfig
    from hybridflow_comm.devices import Precision


def llama_config(model: ModelConfig, precision: Precision | None = None) -> LlamaConfig:
    """The engine's :class:`engine.llama_spec.LlamaConfig` of ``model``: the checkpoint's
    (``init_from``) or the built-in architecture, with the section's explicit fields;
    ValueError naming both values of any field that disagrees with the checkpoint.

    Args:
        precision: the run's resolved precision (:func:`rlhf.builders.run_precision`): its
            ``param_dtype`` is the parameters' dtype, whatever dtype the checkpoint stores.
            None: fp32, for a caller that reads the architecture only.
    """
    from engine.hf_interop import read_hf_config
    from engine.llama_spec import LlamaConfig
    from hybridflow_comm.devices import FP32

    dtype = (FP32 if precision is None else precision).param_dtype
    explicit = {k: getattr(model, k) for k in ARCH_FIELDS if getattr(model, k) is not None}
    if model.init_from is None:
        arch = {k: BUILTIN_ARCH[k] for k in ARCH_FIELDS} | explicit
        if not arch["num_experts"] and "num_experts_per_tok" not in explicit:
            del arch["num_experts_per_tok"]  # a dense model routes nothing
        return LlamaConfig(**arch, max_position_embeddings=seq_len(model), dtype=dtype,
                           model_type="mixtral" if arch["num_experts"] else "llama")
    folder = model.init_from
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"model init_from={folder!r} is not an HF-format folder (no "
                         f"config.json); create it with rlhf.sft / rlhf.train_rm or "
                         f"save_pretrained")
    try:
        hf = read_hf_config(folder, max_position_embeddings=model.max_seq_len, dtype=dtype)
    except ValueError as e:  # an unsupported architecture, a bad value, not JSON
        raise ValueError(f"model init_from={folder!r}: {e}") from None
    except (KeyError, TypeError, AttributeError, OSError) as e:
        raise ValueError(f"model init_from={folder!r}: its config.json is not a "
                         f"usable HF config ({type(e).__name__}: {e})") from None
    clash = {k: (v, getattr(hf, k)) for k, v in explicit.items() if getattr(hf, k) != v}
    if clash:
        raise ValueError(f"model init_from={folder!r}: the config sets " + ", ".join(
            f"{k}={mine} but its config.json has {k}={theirs}"
            for k, (mine, theirs) in clash.items()) + "; drop them or make them agree")
    return hf


def seq_len(model: ModelConfig) -> int:
    """``max_seq_len``, resolved (the checkpoint's max_position_embeddings when None)."""
    if model.max_seq_len is not None:
        return model.max_seq_len
    if model.init_from is None:
        return BUILTIN_ARCH["max_seq_len"]
    return llama_config(model).max_position_embeddings
