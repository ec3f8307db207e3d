"""vLLM behind the :class:`engine.hybrid_engine.Rollout` interface (GPU only, import-guarded).

The caller builds, on every rank, the ``vllm.LLM`` of its generation replica with this
package's worker extension (``pip install .[vllm]`` pins the version, ``requirements-vllm.txt``)::

    llm = build_llm(path, tp_g=..., pp_g=..., world_size=..., dtype="bfloat16", seed=0,
                    gpu_memory_utilization=0.5, max_num_seqs=None)
    rollout = VLLMRollout(llm, groups.gen_tp)

:func:`build_llm` is ``vllm.LLM(path, worker_extension_cls=WORKER_EXTENSION,
logprobs_mode="processed_logprobs", enable_sleep_mode=True, load_format="dummy", ...)`` with
the engine and its worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and
``distributed_executor_backend="external_launcher"`` when the job has several ranks.

One worker per rank (``external_launcher``: the ranks of a generation TP group each drive the
worker of one vLLM TP rank, as verl's colocated mode does; vLLM's world is then the job's, so
also pass ``data_parallel_size = world / (pp_g * tp_g)``, each TP group on consecutive ranks).
In this process the tensors of a bucket reach the worker by reference, no copy.  After every
transition the adapter

* streams the resharder's generation views under Hugging Face names (fused q/k/v and gate/up
  split back into their parts), cuts the stream into buckets under ``bucket_bytes``
  (:func:`plan_weight_buckets`, pure) and loads each with one
  ``llm.collective_rpc(LOAD_BUCKET, args=(bucket,))`` into ``model.load_weights``;
* turns our left-padded prompt batch into vLLM token prompts, one ``SamplingParams`` per row
  with its own seed (:func:`row_seeds`: a GRPO group's identical prompts draw independent
  samples), and vLLM's outputs back into a :class:`GenerationOutput` in the native engine's
  format (:func:`response_tables`: cut after the first EOS, padded after it, log-probs of the
  sampled tokens, ``logprobs=0``).

Between generation phases vLLM sleeps (``enable_sleep_mode``): its weights and KV cache leave
the device while the actor trains, and come back, new weights loaded and the prefix cache
reset, when the next phase starts (:class:`VLLMRollout`).

Full tensors with ``tp_g > 1``: ``load_weights`` is vLLM's supported entry for new weights and
its loaders take a checkpoint's *full* tensor and keep their own TP rank's slice (q/k/v and
gate/up packing, vocabulary padding: their layouts, not ours).  Handing each rank's own shard
would save the gather but means writing into vLLM's parameters by their internal names and
layouts, the coupling this adapter moved away from.  So each tensor is all-gathered over the
generation TP group first, one tensor at a time as the stream is consumed: the extra memory is
one bucket of full tensors (or the largest tensor), not the model.  Every rank of the group
plans the same buckets from the same full sizes, so the gathers line up.

Log-probs: ours are of ``softmax(z / T)`` before top-k / top-p (:mod:`engine.sampling`).
vLLM (V1) returns the raw model's by default; build the ``LLM`` with
``logprobs_mode="processed_logprobs"`` (after temperature, and after top-k / top-p and the
EOS mask of ``min_tokens``, so equal to ours when those are off) to use them as the old
policy's, or keep ``algo.recompute_log_prob=true`` (the default), which recomputes them with
the training engine at the rollout temperature; ``actor/rollout_logprob_diff`` shows the gap
either way.

Nothing here imports vllm at module import time, so the module loads on any machine.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.generation_io import GenerationOutput
from engine.sampling import SamplingParams, derive_seed
from engine.vllm_worker_ext import DESCRIBE, LOAD_BUCKET, WORKER_EXTENSION
from hybridflow_comm.groups import Group

DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Bytes of full tensors handed to the worker per ``collective_rpc`` (one bucket)."""


@dataclass(frozen=True)
class WeightBucket:
    """Consecutive tensors of the weight stream, loaded by one ``collective_rpc``."""

    start: int
    """Index of its first tensor in the stream."""
    names: tuple[str, ...]
    """Hugging Face names, in stream order."""
    nbytes: int
    """Bytes of the full tensors."""


@dataclass(frozen=True)
class WeightLoadStats:
    """One :meth:`VLLMRollout.load_weights`, as seen by this rank."""

    buckets: int
    tensors: int
    nbytes: int
    """Bytes of full tensors handed to the worker."""
    time_s: float


def plan_weight_buckets(sizes: Sequence[tuple[str, int]], cap_bytes: int) -> list[WeightBucket]:
    """Cut a stream of tensors into consecutive buckets of at most ``cap_bytes``.

    Greedy, order kept, every tensor in exactly one bucket; a tensor larger than the cap sits
    alone in its bucket.  With a cap of 8 (MiB, say)::

        stream   emb 8 | q 2 | k 1 | v 1 | o 2 | gate 6 | up 6 | down 6 | norm 0
        buckets  [emb] [q  k  v  o]      [gate]  [up]   [down  norm]

    Args:
        sizes: ``(name, bytes)`` of each tensor in stream order (``numel * element_size`` of
            the full tensor); names unique.
        cap_bytes: the most bytes of one bucket.

    Returns:
        the buckets, in stream order.
    """
    if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 1:
        raise ValueError(f"cap_bytes={cap_bytes!r} must be a positive int (bytes per bucket)")
    seen: set[str] = set()
    for name, nbytes in sizes:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"tensor {name!r} has nbytes={nbytes!r}; expected an int >= 0")
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the weight stream")
        seen.add(name)
    buckets: list[WeightBucket] = []
    start, names, total = 0, [], 0
    for i, (name, nbytes) in enumerate(sizes):
        if names and total + nbytes > cap_bytes:
            buckets.append(WeightBucket(start, tuple(names), total))
            start, names, total = i, [], 0
        names.append(name)
        total += nbytes
    if names:
        buckets.append(WeightBucket(start, tuple(names), total))
    return buckets


def _hf_shards(resharder, tp_group: Group) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    """``(HF name, this rank's view, gather dim or None)`` of this generation stage.

    The dim is None where nothing is gathered (a one-rank group, a replicated tensor).  The
    tied ``lm_head`` copy of a pp > 1 model (named like the embedding) is skipped.
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
        yield name, shard, None if tp_group.pg is None else part_dim.get(name)


def full_hf_sizes(resharder, tp_group: Group) -> list[tuple[str, int]]:
    """``(HF name, bytes of the full tensor)`` of :func:`full_hf_weights`, with no collective."""
    return [(name, shard.numel() * shard.element_size() * (1 if dim is None else tp_group.size))
            for name, shard, dim in _hf_shards(resharder, tp_group)]


def full_hf_weights(resharder, tp_group: Group) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of this generation stage, gathered over ``tp_group``.

    Views of the flat buffer when the group has one rank; otherwise one gathered tensor at a
    time (collective over ``tp_group``: every member must consume the same items).
    """
    for name, shard, dim in _hf_shards(resharder, tp_group):
        if dim is None:
            yield name, shard
            continue
        pieces = [torch.empty_like(shard) for _ in range(tp_group.size)]
        dist.all_gather(pieces, shard.contiguous(), group=tp_group.pg)
        yield name, torch.cat(pieces, dim=dim)


def row_seeds(sampling: SamplingParams, rows: int) -> list[int]:
    """One vLLM seed per row: row ``i`` of the call is row ``first_row + i`` of the batch, as
    in the native engine's draw (:func:`engine.sampling.clock_uniforms`), so a GRPO group's
    identical prompts draw independent samples and a wave split does not change them."""
    return [derive_seed(sampling.seed, "row", sampling.first_row + i) for i in range(rows)]


def response_tables(token_lists: Sequence[Sequence[int]],
                    logprob_lists: Sequence[Sequence[float]], sampling: SamplingParams,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native engine's response columns from per-row token and log-prob lists.

    A row ends after its first ``eos_token_id`` (kept, mask 1) or at ``max_new_tokens``;
    after its end come ``pad_token_id``, mask 0 and log-prob 0 (what
    :meth:`engine.generation.GenerationEngine.generate` returns).

    Returns:
        ``(ids [B, N] int64, mask [B, N] int64, log_probs [B, N] float32)`` on ``device``.
    """
    n, eos = sampling.max_new_tokens, sampling.eos_token_id
    # the lists are host values (vLLM's outputs): the tables are filled on the host, then
    # moved to the prompts' device once
    host = torch.device("cpu")
    batch = len(token_lists)
    ids = torch.full((batch, n), sampling.pad_token_id, dtype=torch.long, device=host)
    mask = torch.zeros(batch, n, dtype=torch.long, device=host)
    lps = torch.zeros(batch, n, dtype=torch.float32, device=host)
    for b, (toks, lp) in enumerate(zip(token_lists, logprob_lists)):
        toks = list(toks)[:n]
        if eos is not None and eos in toks:
            toks = toks[:toks.index(eos) + 1]
        k = len(toks)
        ids[b, :k] = torch.tensor(toks, dtype=torch.long, device=host)
        mask[b, :k] = 1
        lps[b, :min(k, len(lp))] = torch.tensor(list(lp)[:k], dtype=torch.float32, device=host)
    return ids.to(device), mask.to(device), lps.to(device)


def build_llm(model_dir: str, *, tp_g: int, pp_g: int, world_size: int, dtype: str, seed: int,
              gpu_memory_utilization: float, max_num_seqs: int | None,
              max_lora_rank: int | None = None, llm_cls=None):
    """This rank's ``vllm.LLM`` for :class:`VLLMRollout` (engine and worker in this process).

    Args:
        model_dir: a Hugging Face folder with ``config.json`` (its weights are not read:
            ``load_format="dummy"``; the adapter loads the actor's before every generation).
        tp_g, pp_g: the generation layout of the replica.
        world_size: ranks of the job; above 1, vLLM joins it through ``external_launcher``
            with ``data_parallel_size = world_size / (pp_g * tp_g)``.
        dtype: vLLM's ``dtype`` (``"bfloat16"``, ``"float32"``).
        seed: vLLM's global seed (each request carries its own, :func:`row_seeds`).
        gpu_memory_utilization: fraction of the GPU vLLM may take (weights and KV cache).
        max_num_seqs: rows vLLM schedules at once; None = vLLM's default.
        max_lora_rank: the actor's LoRA rank: vLLM is built with LoRA enabled (one adapter
            at a time); None = no LoRA.
        llm_cls: the class to build (default ``vllm.LLM``).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # worker in this process: buckets by
    # reference, and one worker per rank (the adapter's check)
    if llm_cls is None:
        from vllm import LLM as llm_cls  # noqa: N813 - import guard
    kwargs = dict(model=model_dir, tensor_parallel_size=tp_g, pipeline_parallel_size=pp_g,
                  dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                  worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs",
                  enable_sleep_mode=True, load_format="dummy", skip_tokenizer_init=True)
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if max_lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    if world_size > 1:
        kwargs.update(distributed_executor_backend="external_launcher",
                      data_parallel_size=world_size // (pp_g * tp_g))
    return llm_cls(**kwargs)


class VLLMRollout:
    """A ``vllm.LLM`` built with ``worker_extension_cls=WORKER_EXTENSION`` as a :class:`Rollout`.

    Args:
        llm: the engine (or any object with the same ``collective_rpc``, ``generate``,
            ``sleep``, ``wake_up`` and ``reset_prefix_cache``).
        tp_group: this rank's generation TP group (``groups.gen_tp``).
        bucket_bytes: bytes of full tensors per ``collective_rpc`` (see the module docstring).
        sampling_cls: class of vLLM's sampling params (default ``vllm.SamplingParams``).
        sleep_level: ``llm.sleep(level=)`` between generations (the LLM built with
            ``enable_sleep_mode=True``): 1 moves vLLM's weights to host memory and drops its KV
            cache, 2 drops both; None = vLLM stays on the device.
        lora_request_cls: class of vLLM's LoRA requests (default
            ``vllm.lora.request.LoRARequest``), for an actor with adapters.

    Construction asks the worker (one ``collective_rpc``, no collective of ours) for its TP
    size and checks it against ``tp_group`` before any weight moves, then puts the engine to
    sleep.  Each generation phase (:meth:`engine.hybrid_engine.HybridEngine.generation_mode`)::

        load_weights   wake_up(weights) -> buckets -> wake_up(kv_cache) -> reset_prefix_cache
        generate       (any number of calls)
        release        sleep(level)                 training runs with vLLM off the device
    """

    def __init__(self, llm, tp_group: Group, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 sampling_cls=None, sleep_level: int | None = 1,
                 lora_request_cls=None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
                or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive int")
        if sleep_level not in (None, 1, 2):
            raise ValueError(f"sleep_level={sleep_level!r} must be 1, 2 or None (no sleep)")
        try:
            workers = llm.collective_rpc(DESCRIBE)
        except AttributeError as err:
            raise TypeError(f"{type(llm).__name__} does not serve {DESCRIBE!r}: build it with "
                            f"vllm.LLM(..., worker_extension_cls={WORKER_EXTENSION!r})") from err
        if len(workers) != 1:
            raise ValueError(f"this rank's LLM reaches {len(workers)} workers; the adapter "
                             "feeds one worker per rank: build it with "
                             "distributed_executor_backend='external_launcher' when tp_g > 1")
        if workers[0]["tp_size"] != tp_group.size:
            raise ValueError(f"the LLM has tensor_parallel_size={workers[0]['tp_size']} but "
                             f"the generation TP group has tp_g={tp_group.size} ranks")
        self.llm, self.tp_group, self.bucket_bytes = llm, tp_group, bucket_bytes
        if sampling_cls is None:
            from vllm import SamplingParams as sampling_cls  # noqa: N813 - import guard
        self.sampling_cls = sampling_cls
        self.sleep_level = sleep_level
        self.asleep = False
        self.weights_version: int | None = None
        self.last_load: WeightLoadStats | None = None
        self.lora_request_cls = lora_request_cls
        self.adapters = self.lora = self.lora_request = None
        self._adapter_root: str | None = None
        self._base_loaded = False
        self._sleep()

    def _sleep(self) -> None:
        if self.sleep_level is not None and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def _wake(self, tag: str) -> None:
        if self.asleep:
            self.llm.wake_up(tags=[tag])

    def set_adapters(self, source, lora) -> None:
        """LoRA adapters for the next :meth:`load_weights` (``source``: their generation
        shards as a resharder holds them; ``lora``: their :class:`engine.lora_config.LoraConfig`).
        vLLM then applies them through its own LoRA support (a request naming a PEFT folder),
        and the frozen base is loaded with the first :meth:`load_weights` only (it stays in
        vLLM's weights, which sleep level 1 keeps in host memory)."""
        self.adapters, self.lora = source, lora

    def load_weights(self, resharder) -> None:
        """Wake vLLM's weights, load the generation weights of ``resharder`` (or any source
        with ``specs``, ``named_generation_weights`` and ``version``, e.g. a
        :class:`hybridflow_comm.sync.WeightSync`), wake its KV cache and drop the prefix
        cache computed with the old weights.  With adapters (:meth:`set_adapters`) the base
        is loaded once and the adapters are written as a PEFT folder for vLLM's LoRA loader
        every time."""
        t0 = time.perf_counter()
        self._wake("weights")
        if self.adapters is not None and self._base_loaded and self.sleep_level != 2:
            self._load_adapters(resharder.version)
            self._finish_load(resharder.version, [], t0)
            return
        plan = plan_weight_buckets(full_hf_sizes(resharder, self.tp_group), self.bucket_bytes)
        stream = full_hf_weights(resharder, self.tp_group)
        loaded = 0
        for bucket in plan:
            pairs = list(itertools.islice(stream, len(bucket.names)))
            assert tuple(name for name, _ in pairs) == bucket.names
            (count,) = self.llm.collective_rpc(LOAD_BUCKET, args=(pairs,))
            loaded += count
            del pairs  # the gathered tensors of this bucket go before the next is gathered
        tensors = sum(len(b.names) for b in plan)
        assert loaded == tensors and next(stream, None) is None, (loaded, tensors)
        self._base_loaded = True
        if self.adapters is not None:
            self._load_adapters(resharder.version)
        self._finish_load(resharder.version, plan, t0)

    def _finish_load(self, version: int, plan: list[WeightBucket], t0: float) -> None:
        self._wake("kv_cache")
        self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        self.weights_version = version
        self.last_load = WeightLoadStats(buckets=len(plan),
                                         tensors=sum(len(b.names) for b in plan),
                                         nbytes=sum(b.nbytes for b in plan),
                                         time_s=time.perf_counter() - t0)

    def _load_adapters(self, version: int) -> None:
        """The adapters' full tensors (gathered over the generation TP group) as a PEFT folder
        of this process, and the LoRA request that makes vLLM load it (a new id per weight
        version, so it never serves an older adapter)."""
        from safetensors.torch import save_file

        from engine.peft_interop import peft_lora_config

        if self._adapter_root is None:
            self._adapter_root = tempfile.mkdtemp(prefix="hybridflow_vllm_lora_")
        folder = os.path.join(self._adapter_root, f"v{version}")
        os.makedirs(folder, exist_ok=True)
        weights = {name: t.detach().to("cpu").contiguous()
                   for name, t in full_hf_weights(self.adapters, self.tp_group)}
        peft_lora_config(self.lora).save_pretrained(folder)
        save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
        if self.lora_request is not None:
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        cls = self.lora_request_cls
        if cls is None:
            from vllm.lora.request import LoRARequest as cls  # noqa: N813 - import guard
        self.lora_request = cls(lora_name=f"actor-v{version}", lora_int_id=version + 1,
                                lora_path=folder)

    def release(self) -> None:
        """Put vLLM to sleep (its weights and KV cache leave the device for training)."""
        self.weights_version = None
        self._sleep()

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 sampling: SamplingParams) -> GenerationOutput:
        if self.asleep:
            raise RuntimeError("vLLM is asleep: generate between load_weights and release")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.long()
        t0 = time.perf_counter()
        eos = [] if sampling.eos_token_id is None else [sampling.eos_token_id]
        params = [self.sampling_cls(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_k=sampling.top_k, top_p=sampling.top_p,  # top_k 0 disables, in vLLM too
            seed=seed, logprobs=0, min_tokens=sampling.min_new_tokens, stop_token_ids=eos,
            detokenize=False) for seed in row_seeds(sampling, input_ids.shape[0])]
        # the prompts' real tokens as host lists: vLLM's input format
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in
                   zip(input_ids, mask)]
        extra = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False, **extra)
        comps = [o.outputs[0] for o in outs]
        resp, resp_mask, lps = response_tables(
            [c.token_ids for c in comps],
            [[entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs or [])]
             for c in comps], sampling, input_ids.device)
        prompt = input_ids.long().masked_fill(mask == 0, sampling.pad_token_id)
        elapsed = time.perf_counter() - t0
        new_tokens = int(resp_mask.sum())  # host value for the stats
        return GenerationOutput(
            input_ids=torch.cat([prompt, resp], 1), attention_mask=torch.cat([mask, resp_mask], 1),
            log_probs=lps, prompt_length=input_ids.shape[1],
            stats={"time_s": elapsed, "new_tokens": new_tokens,
                   "tokens_per_s": new_tokens / max(elapsed, 1e-9),
                   "weights_version": self.weights_version})
