"""vLLM behind the :class:`engine.hybrid_engine.Rollout` interface (GPU only, import-guarded).

The caller builds, on every rank, the ``vllm.LLM`` of its generation replica with this
package's worker extension (``pip install .[vllm]`` pins the version, ``requirements-vllm.txt``)::

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"    # engine and worker in this process
    llm = vllm.LLM(path, tensor_parallel_size=tp_g, worker_extension_cls=WORKER_EXTENSION,
                   logprobs_mode="processed_logprobs",
                   distributed_executor_backend="external_launcher" if tp_g > 1 else None)
    rollout = VLLMRollout(llm, groups.gen_tp)

One worker per rank (``external_launcher``: the ranks of a generation TP group each drive the
worker of one vLLM TP rank, as verl's colocated mode does; vLLM's world is then the job's, so
also pass ``data_parallel_size = world / (pp_g * tp_g)``, each TP group on consecutive ranks).
In this process the tensors of a bucket reach the worker by reference, no copy.  After every
transition the adapter

* streams the resharder's generation views under Hugging Face names (fused q/k/v and gate/up
  split back into their parts), cuts the stream into buckets under ``bucket_bytes``
  (:func:`plan_weight_buckets`, pure) and loads each with one
  ``llm.collective_rpc(LOAD_BUCKET, args=(bucket,))`` into ``model.load_weights``;
* turns our left-padded prompt batch into vLLM token prompts and vLLM's outputs back into a
  :class:`GenerationOutput` (log-probs of the sampled tokens, ``logprobs=0``).

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
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.generation import GenerationOutput
from engine.sampling import SamplingParams
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


class VLLMRollout:
    """A ``vllm.LLM`` built with ``worker_extension_cls=WORKER_EXTENSION`` as a :class:`Rollout`.

    Args:
        llm: the engine (or any object with the same ``collective_rpc`` and ``generate``).
        tp_group: this rank's generation TP group (``groups.gen_tp``).
        bucket_bytes: bytes of full tensors per ``collective_rpc`` (see the module docstring).
        sampling_cls: class of vLLM's sampling params (default ``vllm.SamplingParams``).

    Construction asks the worker (one ``collective_rpc``, no collective of ours) for its TP
    size and checks it against ``tp_group`` before any weight moves.
    """

    def __init__(self, llm, tp_group: Group, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 sampling_cls=None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
                or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive int")
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
        self.weights_version: int | None = None
        self.last_load: WeightLoadStats | None = None

    def load_weights(self, resharder) -> None:
        t0 = time.perf_counter()
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
        self.weights_version = resharder.version
        self.last_load = WeightLoadStats(buckets=len(plan), tensors=tensors,
                                         nbytes=sum(b.nbytes for b in plan),
                                         time_s=time.perf_counter() - t0)

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
            top_k=sampling.top_k, top_p=sampling.top_p,  # top_k 0 disables, in vLLM too
            seed=sampling.seed, logprobs=0, min_tokens=sampling.min_new_tokens,
            stop_token_ids=[] if sampling.eos_token_id is None else [sampling.eos_token_id])
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in
                   zip(input_ids, mask)]
        outs = self.llm.generate(prompts, sampling_params=vp, use_tqdm=False)
        n = sampling.max_new_tokens
        batch = input_ids.shape[0]
        # vLLM returns host lists: the tables are filled on the host, then moved to the
        # prompts' device once
        host = torch.device("cpu")
        resp = torch.full((batch, n), sampling.pad_token_id, dtype=torch.long, device=host)
        resp_mask = torch.zeros(batch, n, dtype=torch.long, device=host)
        lps = torch.zeros(batch, n, device=host)
        for b, o in enumerate(outs):
            comp = o.outputs[0]
            toks = list(comp.token_ids)[:n]
            resp[b, :len(toks)] = torch.tensor(toks, dtype=torch.long, device=host)
            resp_mask[b, :len(toks)] = 1
            for i, (tok, entry) in enumerate(zip(toks, comp.logprobs or [])):
                lps[b, i] = entry[tok].logprob
        resp, resp_mask, lps = (t.to(input_ids.device) for t in (resp, resp_mask, lps))
        prompt = input_ids.long().masked_fill(mask == 0, sampling.pad_token_id)
        elapsed = time.perf_counter() - t0
        return GenerationOutput(
            input_ids=torch.cat([prompt, resp], 1), attention_mask=torch.cat([mask, resp_mask], 1),
            log_probs=lps, prompt_length=input_ids.shape[1],
            stats={"time_s": elapsed, "new_tokens": int(resp_mask.sum()),
                   "weights_version": self.weights_version})
