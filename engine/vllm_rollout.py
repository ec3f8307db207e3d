"""vLLM behind the :class:`engine.hybrid_engine.Rollout` interface (GPU only, import-guarded).

The caller builds the ``vllm.LLM`` for this rank's generation replica (same architecture, any
initial weights, ``tensor_parallel_size = tp_g``); this adapter then

* feeds ``model.load_weights`` from the resharder's generation views after every transition,
  under Hugging Face names (fused q/k/v and gate/up split back into their parts).  vLLM's
  weight loaders slice *full* tensors by their own TP rank, so with ``tp_g > 1`` each tensor is
  all-gathered over the generation TP group first, one tensor at a time (the extra memory is
  bounded by the largest tensor, not the model);
* turns our left-padded prompt batch into vLLM token prompts and vLLM's outputs back into a
  :class:`GenerationOutput` (log-probs of the sampled tokens, ``logprobs=0``).

Log-probs: ours are of ``softmax(z / T)`` before top-k / top-p (:mod:`engine.sampling`).
vLLM (V1) returns the raw model's by default; build the ``LLM`` with
``logprobs_mode="processed_logprobs"`` (after temperature, and after top-k / top-p, so equal
to ours when those are off) to use them as the old policy's, or keep
``algo.recompute_log_prob=true`` (the default), which recomputes them with the training
engine at the rollout temperature; ``actor/rollout_logprob_diff`` shows the gap either way.

Nothing here imports vllm at module import time, so the module loads on any machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from engine.generation import GenerationOutput
from engine.sampling import SamplingParams
from hybridflow_comm.groups import Group


def full_hf_weights(resharder, tp_group: Group) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of this generation stage, gathered over ``tp_group``.

    Views of the flat buffer when the group has one rank; otherwise one gathered tensor at a
    time.  The tied ``lm_head`` copy of a pp > 1 model (named like the embedding) is skipped.
    """
    part_dim = {}
    for spec in resharder.specs:
        for name in spec.hf_names:
            part_dim.setdefault(name, spec.partition_dim)
    seen = set()
    for name, shard in resharder.named_generation_weights(hf_names=True):
        if name in seen:
            continue
        seen.add(name)
        dim = part_dim.get(name)
        if tp_group.pg is None or dim is None:
            yield name, shard
            continue
        pieces = [torch.empty_like(shard) for _ in range(tp_group.size)]
        dist.all_gather(pieces, shard.contiguous(), group=tp_group.pg)
        yield name, torch.cat(pieces, dim=dim)


def _default_model(llm):
    """The ``nn.Module`` inside a vLLM engine (the attribute path moved between versions)."""
    paths = ("llm_engine.model_executor.driver_worker.worker.model_runner.model",
             "llm_engine.model_executor.driver_worker.model_runner.model")
    for path in paths:
        obj = llm
        try:
            for attr in path.split("."):
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            continue
    raise RuntimeError("cannot find the model inside this vLLM version; pass model_getter")


class VLLMRollout:
    """A ``vllm.LLM`` as a :class:`Rollout`.

    Args:
        llm: the engine (or any object with the same ``generate``).
        tp_group: this rank's generation TP group (``groups.gen_tp``).
        model_getter: ``fn(llm) -> module with load_weights``; default: vLLM's known paths.
        sampling_cls: class of vLLM's sampling params (default ``vllm.SamplingParams``).
    """

    def __init__(self, llm, tp_group: Group, model_getter: Callable | None = None,
                 sampling_cls=None) -> None:
        self.llm, self.tp_group = llm, tp_group
        self.model_getter = model_getter or _default_model
        if sampling_cls is None:
            from vllm import SamplingParams as sampling_cls  # noqa: N813 - import guard
        self.sampling_cls = sampling_cls
        self.weights_version: int | None = None

    def load_weights(self, resharder) -> None:
        self.model_getter(self.llm).load_weights(full_hf_weights(resharder, self.tp_group))
        self.weights_version = resharder.version

    def release(self) -> None:
        self.weights_version = None  # vLLM keeps its own copy; nothing of ours is held

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 sampling: SamplingParams) -> GenerationOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.long()
        t0 = time.perf_counter()
        vp = self.sampling_cls(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, top_p=sampling.top_p,
            seed=sampling.seed, logprobs=0,
            stop_token_ids=[] if sampling.eos_token_id is None else [sampling.eos_token_id])
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in
                   zip(input_ids, mask)]
        outs = self.llm.generate(prompts, sampling_params=vp, use_tqdm=False)
        n = sampling.max_new_tokens
        batch = input_ids.shape[0]
        resp = torch.full((batch, n), sampling.pad_token_id, dtype=torch.long)
        resp_mask = torch.zeros(batch, n, dtype=torch.long)
        lps = torch.zeros(batch, n)
        for b, o in enumerate(outs):
            comp = o.outputs[0]
            toks = list(comp.token_ids)[:n]
            resp[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            resp_mask[b, :len(toks)] = 1
            for i, (tok, entry) in enumerate(zip(toks, comp.logprobs or [])):
                lps[b, i] = entry[tok].logprob
        prompt = input_ids.long().masked_fill(mask == 0, sampling.pad_token_id)
        elapsed = time.perf_counter() - t0
        return GenerationOutput(
            input_ids=torch.cat([prompt, resp], 1), attention_mask=torch.cat([mask, resp_mask], 1),
            log_probs=lps, prompt_length=input_ids.shape[1],
            stats={"time_s": elapsed, "new_tokens": int(resp_mask.sum()),
                   "weights_version": self.weights_version})
