"""Decode steps at static shapes per batch bucket, replayed as CUDA graphs.

A CUDA graph records the kernels of one decode step of a generation stage (the first stage's
embedding and every layer of the stage) with all addresses fixed; ``graph.replay()`` then
launches them in one call, with no Python and no per-kernel launch cost.  As in vLLM and
nano-vllm, one graph per batch bucket: the running rows ``R`` are padded to the smallest
bucket ``b >= R`` (:func:`bucket`)::

    buckets      1 2 4 8 16 32 48 64 ... (multiples of 16)
    key buckets  L = 128 256 384 ... max_len: the step at position pos attends over the
                 cache's first key_bucket(pos + 1) positions
    inputs       ids [b, 1] int64 (a later pipeline stage: the hidden states [b, 1, H] it
                 received), cos/sin [b, 1, D], attn [b, 1, 1, L] bool (a view of
                 [b, 1, 1, max_len]), pos [1] int64 (the position written, = cache.length)
    cache        rows [0, b) and positions [0, L) of the dense KV cache's buffers
                 (engine.kv_cache.DecodeSlots), the key mask hiding those past pos
    output       x [b, 1, H], of which rows [0, R) are read

A step copies its inputs into the bucket's buffers (no host sync: every copy is on the
device), replays the graph of its (bucket, key bucket) and hands ``x[:R]`` to the sampler
(:mod:`engine.sampling`, on the device).  The pad rows compute garbage that nobody reads;
each row's floats depend only on its own inputs and the two buckets, so :class:`StaticDecode`
run eagerly (``capture=False``, also the CPU tests' path) gives the graph's bits exactly.

The price of static shapes: attention reads all ``L`` positions of the key bucket at every
step, the mask zeroing those not yet written (SDPA takes no per-row key lengths, which flash
attention's ``cache_seqlens`` would): at most :data:`KEY_STEP` - 1 positions more than the
filled ones.  Over all the cache's positions instead, a call of a short prompt and 512 new
tokens would read about 1.5 times the keys and values (at Qwen2.5-0.5B's batch 128 they are
up to half the bytes of the weights per step).  Key buckets are cut from the cache's
``positions`` (its buffers' length, which only grows), not from one call's ``max_len``, so
calls of other prompt lengths reuse the same graphs.

Graphs are used where the whole step can be captured (:func:`graphs_apply`): a CUDA device,
and under tensor parallelism a generation TP group over NCCL from 2.9.6 (the first NCCL whose
collectives a CUDA graph can record; torch's process group then leaves the captured work out
of its watchdog).  The TP all-reduces are recorded with the step and replayed with it: every
TP rank runs the same rows, so each captures and replays the same (bucket, key bucket) in the
same order, and the communicator exists before any capture (the prefill's all-reduces made
it).  Captures run in ``thread_local`` error mode: another thread's CUDA calls (NCCL's
watchdog querying the events of eager collectives) do not invalidate them.  On pipeline
stages each stage captures its own step; the hidden states sent and received between the
stages and the tokens broadcast back stay outside the graphs.
Everywhere else the same static step runs eagerly.  A :class:`StaticDecode` lives as long as
its KV cache's buffers and the weights' addresses (:mod:`engine.decode_memory`: across calls
and, where kept, iterations): it captures a (bucket, key bucket) the first time one runs, all
its graphs sharing one memory pool, and replays it in every later call.  A capture does not
empty torch's allocator cache (``torch.cuda.graph`` does, which would hand the training
blocks back to the driver at every capture): the graph's pool takes what it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.kv_cache import DenseKVCache
from hybridflow_comm.groups import Group

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16
KEY_STEP = 128
"""Key buckets: multiples of KEY_STEP positions (the last one ``max_len``)."""
WARMUP_STEPS = 2
"""Eager runs of a step on a side stream before it is captured (cuBLAS and SDPA pick and
initialise their kernels outside the capture)."""

StepOutput = torch.Tensor | tuple[torch.Tensor, ...]
"""A step's output: ``x [b, 1, H]``, or ``x`` and more per-row outputs (a mixture's routes
``[b, layers, k]``); a captured step's are rewritten at each replay."""
Layers = Callable[[torch.Tensor, object, tuple[torch.Tensor, torch.Tensor], torch.Tensor],
                  StepOutput]  # (x, cache with .hook, rope, attn) -> x: LayerPath.forward
Embed = Callable[[torch.Tensor], torch.Tensor]


def bucket(rows: int) -> int:
    """The batch bucket of ``rows >= 1`` running rows (pure): the next of 1, 2, 4, 8, then
    the next multiple of :data:`BUCKET_STEP`."""
    if rows < 1:
        raise ValueError(f"rows={rows} must be >= 1")
    for b in SMALL_BUCKETS:
        if rows <= b:
            return b
    return -(-rows // BUCKET_STEP) * BUCKET_STEP


def key_bucket(keys: int, max_len: int) -> int:
    """The positions a decode step with ``keys`` filled positions (the new one included)
    attends over (pure): the next multiple of :data:`KEY_STEP`, at most ``max_len``."""
    if not 1 <= keys <= max_len:
        raise ValueError(f"keys={keys} must be in [1, max_len={max_len}]")
    return min(max_len, -(-keys // KEY_STEP) * KEY_STEP)


NCCL_CAPTURE = (2, 9, 6)
"""The first NCCL whose collectives CUDA graphs can record."""


def graphs_apply(device: torch.device, tp_backend: str | None,
                 nccl_version: tuple[int, ...] | None = None) -> bool:
    """Whether a stage's decode step can be captured as a CUDA graph (pure; module
    docstring).  ``tp_backend``: the generation TP group's backend (None: no collectives in
    the step); ``nccl_version``: torch's NCCL."""
    if device.type != "cuda":
        return False
    if tp_backend is None:
        return True
    return (tp_backend == "nccl" and nccl_version is not None
            and tuple(nccl_version) >= NCCL_CAPTURE)


def cuda_backend(backend: str) -> str | None:
    """The backend a process group of ``backend`` runs CUDA tensors' collectives on (pure):
    ``"nccl"`` of ``"nccl"`` and of a per-device map such as ``"cpu:gloo,cuda:nccl"``
    (:func:`hybridflow_comm.devices.backend_for`); None where the map has no CUDA entry."""
    if ":" not in backend:
        return backend
    devices = dict(part.split(":", 1) for part in backend.split(","))
    return devices.get("cuda")


def tp_backend(group: Group | None) -> str | None:
    """The backend of ``group``'s collectives on CUDA tensors (None: a group of one, none)."""
    if group is None or group.pg is None:
        return None
    return cuda_backend(dist.get_backend(group.pg))


def nccl_version() -> tuple[int, ...] | None:
    """torch's NCCL version (None: a torch without NCCL)."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return tuple(version) if isinstance(version, tuple) else None


def resolve_graphs(cuda_graphs: bool | None, device: torch.device) -> bool:
    """The user's ``cuda_graphs`` on ``device`` (None: on for CUDA); ValueError for True
    elsewhere.  Where :func:`graphs_apply` says no, the steps still run eagerly."""
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got device={device}")
    return device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)


@dataclass
class _Bucket:
    """The static buffers of one bucket and its graph per key bucket (captured steps)."""

    inputs: torch.Tensor
    """``[b, 1]`` token ids (first stage) or ``[b, 1, H]`` hidden states (later stages)."""
    cos: torch.Tensor
    sin: torch.Tensor
    attn: torch.Tensor
    """``[b, 1, 1, positions]``; a key bucket's steps read its first ``L`` positions."""
    graphs: dict[int, tuple[StepOutput, torch.cuda.CUDAGraph]] = field(default_factory=dict)
    """Key bucket -> (output buffer, graph)."""


class StaticDecode:
    """The decode steps at the shapes of their batch bucket, over one dense KV cache's
    buffers, kept across the calls that reuse the cache.

    Args:
        embed: ``ids [b, 1] -> x [b, 1, H]`` (the first stage's embedding); None on a later
            pipeline stage, whose steps take the hidden states it received.
        layers: the stage's decode layer path's ``forward``.
        cache: the dense KV cache, capacity at least ``bucket(batch)`` of every call.
        capture: record each bucket's step as a CUDA graph (CUDA only); False runs the same
            step eagerly.
    """

    def __init__(self, embed: Embed | None, layers: Layers, cache: DenseKVCache, capture: bool
                 ) -> None:
        self.device = cache.k.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, got {self.device}")
        self.cache, self.capture = cache, capture
        self.positions = torch.arange(cache.positions, device=self.device)  # [positions]
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.buckets: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # shared by buckets
        self.stream: torch.cuda.Stream | None = None  # of the warm-ups and captures
        self.begin_call(embed, layers)

    def begin_call(self, embed: Embed | None, layers: Layers) -> None:
        """A new call's step functions (new weights at the same addresses, a call's plan),
        and its capture counters at zero."""
        self.embed, self.layers = embed, layers
        self.captured = 0
        """Graphs captured in this call."""
        self.capture_s = 0.0
        """Wall seconds of this call's warm-ups and captures (the device synchronised before
        and after each, so the queued steps are not in it): what a timing of the steps
        leaves out."""

    def end_call(self) -> None:
        """Drop the call's step functions (they hold the weights; the graphs do not)."""
        self.embed = self.layers = None

    def step(self, inputs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             keys_ok: torch.Tensor) -> torch.Tensor:
        """One decode step of the ``R`` running rows at position ``cache.length`` (the cache
        does not advance).

        Args:
            inputs: ``[R, 1]`` the rows' last tokens (first stage), or ``[R, 1, H]`` the
                hidden states the stage received.
            cos, sin: ``[R, 1, D]`` RoPE of the new position.
            keys_ok: ``[R, 1, 1, > cache.length]`` bool, the key positions that are not
                padding (those past its last are masked as unwritten).

        Returns:
            ``[R, 1, H]`` hidden states (a view of the bucket's output buffer: read it before
            the next step), with the step's other outputs' ``R`` rows where the layers return
            more (:data:`StepOutput`).
        """
        r, length = inputs.shape[0], self.cache.length
        if length >= self.cache.max_len:
            raise RuntimeError(f"KV cache overflow: {length + 1} > max_len="
                               f"{self.cache.max_len}")
        keys = key_bucket(length + 1, self.cache.positions)
        buf = self._bucket(r, inputs)
        buf.inputs[:r].copy_(inputs)
        buf.cos[:r].copy_(cos)
        buf.sin[:r].copy_(sin)
        given = min(keys, keys_ok.shape[-1])  # past the call's own positions: unwritten
        torch.logical_and(keys_ok[..., :given], self.positions[:given] <= length,
                          out=buf.attn[:r, ..., :given])
        if given < keys:
            buf.attn[:r, ..., given:keys] = False
        self.pos.fill_(length)  # a host scalar into a device tensor: no sync
        if not self.capture:
            return _rows(self._run(buf, keys), r)
        if keys not in buf.graphs:
            buf.graphs[keys] = self._capture(buf, keys)
            self.captured += 1
        out, graph = buf.graphs[keys]
        graph.replay()
        return _rows(out, r)

    @property
    def graph_count(self) -> int:
        """CUDA graphs held (one per batch bucket and key bucket run since the cache was
        made)."""
        return sum(len(b.graphs) for b in self.buckets.values())

    def _bucket(self, rows: int, inputs: torch.Tensor) -> _Bucket:
        b = bucket(rows)
        if b not in self.buckets:
            self.buckets[b] = self._new_bucket(b, inputs)
        return self.buckets[b]

    def _new_bucket(self, b: int, inputs: torch.Tensor) -> _Bucket:
        d, dtype = self.cache.k.shape[-1], self.cache.k.dtype
        buf = _Bucket(inputs=inputs.new_zeros(b, *inputs.shape[1:]),
                      cos=torch.zeros(b, 1, d, dtype=dtype, device=self.device),
                      sin=torch.zeros(b, 1, d, dtype=dtype, device=self.device),
                      # pad rows see every key: never a row without one (no NaN)
                      attn=torch.ones(b, 1, 1, self.cache.positions, dtype=torch.bool,
                                      device=self.device))
        return buf

    def _run(self, buf: _Bucket, keys: int) -> StepOutput:
        """The step of ``buf``'s bucket and key bucket ``keys`` over its buffers (eager, or
        inside a capture)."""
        slots = self.cache.slots(buf.inputs.shape[0], self.pos, keys)
        x = buf.inputs if self.embed is None else self.embed(buf.inputs)
        return self.layers(x, slots, (buf.cos, buf.sin),
                           buf.attn[..., :keys])

    def _capture(self, buf: _Bucket, keys: int) -> tuple[StepOutput, torch.cuda.CUDAGraph]:
        """Warm the step up on a side stream, then record it (``capture_begin`` /
        ``capture_end``: ``torch.cuda.graph`` without its ``empty_cache()``).  The warm-up
        writes position ``pos`` of the cache with the step's own keys and values (its inputs
        are in the buffers already), which the replay that follows writes again."""
        torch.cuda.synchronize(self.device)  # the steps queued so far are not the capture's
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            # one side stream for every warm-up and capture: the BLAS handles and workspaces
            # made for it in the warm-up are the capture's, and captures that share a pool
            # share their stream (torch.cuda.graph's note on memory sharing)
            if self.stream is None:
                self.stream = torch.cuda.Stream()
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_STEPS):
                    self._run(buf, keys)
                torch.cuda.synchronize(self.device)  # what torch.cuda.graph waits for
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(self.pool, capture_error_mode="thread_local")
                try:
                    out = self._run(buf, keys)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0
        return out, graph


def _rows(out: StepOutput, rows: int) -> StepOutput:
    """The first ``rows`` rows of each of a step's outputs."""
    return out[:rows] if isinstance(out, torch.Tensor) else tuple(t[:rows] for t in out)
