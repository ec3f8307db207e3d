"""The generation backend of a worker that generates, chosen by ``rollout.engine``.

Both backends are an :class:`engine.hybrid_engine.Rollout` (``load_weights``, ``generate``,
``release``), so the actor's :class:`engine.hybrid_engine.HybridEngine` and the rollout pool's
worker drive either the same way::

    rollout.engine=native   WavedGeneration(GenerationEngine)   a batch in waves of at most
                                                                 max_num_seqs rows, each wave's
                                                                 KV cache within the budget
    rollout.engine=vllm     VLLMRollout(vllm.LLM)                vLLM schedules its own rows;
                                                                 it sleeps between phases on
                                                                 the actor

Waves of consecutive rows: wave ``[a, b)`` samples with ``first_row = a`` (row ``i`` of it
draws as row ``a + i`` of the batch, :attr:`engine.sampling.SamplingParams.first_row`), so
the tokens do not depend on the wave split (greedy: up to near-ties where a batch of another
size rounds a product differently, as early exit, :mod:`engine.early_exit`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from engine.generation import GenerationEngine
from engine.generation_io import GenerationOutput
from engine.hf_interop import config_to_hf
from engine.llama_spec import LlamaConfig
from engine.lora import LoraConfig
from engine.sampling import SamplingParams
from hybridflow_comm.groups import HybridGroups
from rlhf.config import RolloutConfig


def wave_rows(batch: int, max_num_seqs: int | None, row_bytes: int,
              budget_bytes: int | None) -> int:
    """Rows per wave: at most ``max_num_seqs`` (None: no limit) and, with a budget, at most
    the rows whose KV cache (``row_bytes`` each) fits ``budget_bytes``; at least 1."""
    rows = batch if max_num_seqs is None else min(batch, max_num_seqs)
    if budget_bytes is not None and row_bytes > 0:
        rows = min(rows, budget_bytes // row_bytes)
    return max(rows, 1)


def _summed(values: list):
    """Counts and seconds add up over the waves; anything else (names, flags, the weights
    version) is the first wave's."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values)
    return values[0]


def routes_field(out: GenerationOutput) -> dict[str, torch.Tensor]:
    """``{"routes": ...}`` of a rollout that recorded its routing, else ``{}``: the batch
    field the replaying passes read."""
    return {} if out.routes is None else {"routes": out.routes}


def join_outputs(outs: list[GenerationOutput]) -> GenerationOutput:
    """The waves' outputs as one call's: rows in wave order, counts summed, the KV cache's
    peak, the weights version of the call."""
    stats = {k: _summed([o.stats[k] for o in outs]) for k in outs[0].stats}
    stats["tokens_per_s"] = stats["new_tokens"] / max(stats["time_s"], 1e-9)
    stats["kv_cache_bytes"] = max(o.stats["kv_cache_bytes"] for o in outs)
    stats["weights_version"] = outs[0].stats["weights_version"]
    stats["waves"] = len(outs)
    return GenerationOutput(
        input_ids=torch.cat([o.input_ids for o in outs]),
        attention_mask=torch.cat([o.attention_mask for o in outs]),
        log_probs=torch.cat([o.log_probs for o in outs]),
        routes=None if outs[0].routes is None else torch.cat([o.routes for o in outs]),
        prompt_length=outs[0].prompt_length, stats=stats)


class WavedGeneration:
    """The native :class:`GenerationEngine` as a Rollout that generates in waves.

    Args:
        engine: the engine (its weights are set through this object).
        max_num_seqs: rows per wave at most; None = no limit.
        kv_fraction: on a GPU, the fraction of free device memory one wave's KV cache may
            take (measured at each call); unused on the CPU.
    """

    def __init__(self, engine: GenerationEngine, max_num_seqs: int | None,
                 kv_fraction: float = 1.0) -> None:
        self.engine, self.max_num_seqs, self.kv_fraction = engine, max_num_seqs, kv_fraction

    def load_weights(self, source) -> None:
        self.engine.load_weights(source)

    def set_adapters(self, source, lora) -> None:
        self.engine.set_adapters(source, lora)

    def set_weights(self, weights: Mapping[str, torch.Tensor], version: int | None = None
                    ) -> None:
        self.engine.set_weights(weights, version)

    def release(self) -> None:
        self.engine.release()

    def kv_budget(self) -> int | None:
        """Bytes one wave's KV cache may take; None on the CPU (no budget).  The KV cache the
        engine holds from its earlier calls counts as free: a wave reuses it (or replaces
        it), so later waves of a block are sized as the first."""
        device = self.engine.device
        if device.type != "cuda":
            return None
        free, _total = torch.cuda.mem_get_info(device)  # host ints: a sizing decision
        return int((free + self.engine.memory.nbytes) * self.kv_fraction)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 sampling: SamplingParams) -> GenerationOutput:
        batch, plen = input_ids.shape
        n_new = sampling.max_new_tokens
        row_bytes = -(-self.engine.kv_cache_bytes(batch, plen, n_new) // batch)
        rows = wave_rows(batch, self.max_num_seqs, row_bytes, self.kv_budget())
        if rows >= batch:
            return self.engine.generate(input_ids, attention_mask, sampling)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return join_outputs([
            self.engine.generate(input_ids[a:a + rows], attention_mask[a:a + rows],
                                 replace(sampling, first_row=sampling.first_row + a))
            for a in range(0, batch, rows)])


def vllm_model_dir(config: LlamaConfig, init_from: str | None) -> str:
    """A folder with the model's ``config.json`` for vLLM: ``init_from`` when it has one,
    else a new temporary folder written from the architecture (vLLM reads no weights)."""
    if init_from is not None and os.path.isfile(os.path.join(init_from, "config.json")):
        return init_from
    folder = tempfile.mkdtemp(prefix="hybridflow-vllm-")
    config_to_hf(config).save_pretrained(folder)
    return folder


def build_rollout(settings: RolloutConfig, config: LlamaConfig, groups: HybridGroups,
                  device: torch.device, init_from: str | None, seed: int,
                  sleep_between_phases: bool, lora: LoraConfig | None = None,
                  record_routes: bool = False, experts: Sequence[int] | None = None):
    """This rank's generation backend for ``settings.engine``.

    Args:
        settings: the run config's ``rollout`` section.
        config: the architecture (its dtype is the generation dtype).
        groups: this rank's groups (generation TP group and layout).
        device: the worker's device.
        init_from: the actor's HF folder (vLLM reads its config.json), or None.
        seed: vLLM's global seed.
        sleep_between_phases: the backend gives its memory back outside generation where
            ``settings.free_cache_engine`` (the actor, which trains on the same GPUs: vLLM
            sleeps, the native engine drops its KV cache and graphs); the rollout pool keeps
            it.
        lora: the actor's LoRA adapters (vLLM is built with LoRA enabled at their rank).
        record_routes: the native engine records a mixture of experts' routing
            (``actor.router_replay``).
        experts: the experts this rank computes in generation (generation expert
            parallelism, the native engine; None: every expert).
    """
    free = sleep_between_phases and settings.free_cache_engine
    if settings.engine == "native":
        return WavedGeneration(GenerationEngine(config, groups, device=device,
                                                record_routes=record_routes, experts=experts,
                                                keep_cache=not free),
                               settings.max_num_seqs, settings.gpu_memory_utilization)
    from engine.vllm_rollout import VLLMRollout, build_llm

    layout = groups.layout
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    llm = build_llm(vllm_model_dir(config, init_from), tp_g=layout.tp_g, pp_g=layout.pp_g,
                    world_size=world, dtype=str(config.dtype).removeprefix("torch."),
                    seed=seed, gpu_memory_utilization=settings.gpu_memory_utilization,
                    max_num_seqs=settings.max_num_seqs,
                    max_lora_rank=lora.rank if lora is not None else None)
    return VLLMRollout(llm, groups.gen_tp, sleep_level=1 if free else None)
