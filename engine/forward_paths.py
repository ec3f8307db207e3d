"""The ways one generation stage can run a step, each a small object chosen once.

A step of :class:`engine.generation.GenerationEngine` is::

    ids [B, S] --stage.enter--> x [B, S, H] --path.forward(x, cache, rope, attn)--> x
               --stage.leave--> (tokens [B], log-probs [B])

The stage boundary (:class:`SingleStage` or :class:`PipelineStage`) is chosen when the engine
is built; the layer paths when its weights are set, since the weights' form decides which
kernels can read them (:func:`choose_paths`).  Every layer path computes the same maths, the
pre-norm Llama layers of :mod:`engine.layers`, and writes the step's keys and values into the
KV cache at ``[cache.length, cache.length + S)`` without advancing it:

    path           steps             how
    python         prefill, decode   engine.layers.decoder_layer per layer, keys and values by
                                     the cache's hook: the reference every other path is
                                     tested against (tests/test_decode_kernels.py); also the
                                     static decode steps of the dense layout, whose "cache"
                                     is then the DecodeSlots of engine.kv_cache
    kernel_stage   decode            engine._kernels.decode_layers: the whole stage in one
                                     call; no TP; its small products in the k-lane or the
                                     row-lane form (csrc/engine/small_gemm.h), one form a
                                     generation (ForwardPaths.with_row_lanes)
    kernel_layers  decode            engine._kernels.decode_attention / decode_mlp per layer,
                                     the TP all-reduces between them

The kernel paths read float32 plain Llama layers (:data:`engine.llama_spec.LAYER_KEYS`) and
the q/k/v bias (``qkv_bias``: Qwen2, :data:`DECODE_EXTRA_KEYS`), added after the qkv product
and before RoPE as in :func:`engine.layers.attention_block`.  A layer with an o_proj bias or
q/k norms (Qwen3, Llama ``attention_bias``) runs on the python path for every step.  Every
prefill runs on the python path (bench/kernels_vs_compile.py compares it with
``torch.compile``).  A prefill step starts from an empty cache with the prompt (``S = P``); a
decode step feeds one token per row (``S = 1``).  A path registers itself in
:data:`LAYER_PATHS`, which the test against the reference reads.

What a generation call runs is fixed once per call by :func:`plan_call` (a
:class:`CallPlan`): the paths in one product form, whether the LM head runs the kernels'
small product, and whether a greedy call's decode steps after the first go to one
``greedy_decode`` call.  Each choice is made by the call's full batch, never by the running
rows, so dropping finished rows (:mod:`engine.early_exit`) never switches a product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist

from engine.kv_cache import KVCache
from engine.layers import LayerSpec, LoraDeltas, decoder_layer
from engine.llama_spec import LAYER_KEYS
from engine.moe import MoeFn, MoeRouting
from engine.route_trace import RouteTrace
from engine.tp_ops import reduce_from_tp
from hybridflow_comm.groups import Group

try:  # C++ kernels (setup.py builds them; absent in a source tree never built)
    from engine import _kernels
except ImportError:  # pragma: no cover - only the Python paths are built then
    _kernels = None

PREFILL, DECODE = "prefill", "decode"
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [B, S, D]


@dataclass(frozen=True, eq=False)
class StageLayers:
    """What every layer path reads: this rank's layers of one generation stage."""

    weights: tuple[Mapping[str, torch.Tensor], ...]
    """Per local layer, its weights by layer-key name (:attr:`engine.llama_spec.LlamaConfig.
    layer_keys`; generation shards:
    views, never copies; row-parallel weights 2-D or stacked ``[m, H, in/m]``)."""
    q_per_group: int
    head_dim: int
    eps: float
    """RMSNorm epsilon."""
    tp_group: Group | None
    """The generation TP group (None or a group of one: no collectives)."""
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    """Where the weights live (the kernel paths read CPU weights only)."""
    loras: tuple[LoraDeltas | None, ...] = ()
    """Per local layer its LoRA adapters (:class:`engine.lora.LayerLora`), or ``()``: none.
    Only the Python layers apply them."""
    routing: MoeRouting | None = None
    """The layers' mixture-of-experts routing (None: dense MLPs); only the Python layers read
    experts."""
    moe: MoeFn | None = None
    """The mixture-of-experts block (None: :func:`engine.moe.moe_block` over every
    expert; generation EP: over this rank's experts)."""
    route_log: list[torch.Tensor] | None = None
    """Where the Python layers append each forward's ``[tokens, layers, k]`` experts (None:
    not recorded)."""

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_group is not None and self.tp_group.pg is not None

    @functools.cached_property
    def layer_spec(self) -> LayerSpec:
        """The settings every layer of the stage shares (:class:`engine.layers.LayerSpec`)."""
        return LayerSpec(self.q_per_group, self.head_dim, self.eps, self.tp_group, self.routing,
                         self.moe)


class LayerPath(Protocol):
    """One way to run the stage's layers (see the module docstring)."""

    name: ClassVar[str]
    steps: ClassVar[frozenset[str]]
    """The steps it can run: :data:`PREFILL` (empty cache) and/or :data:`DECODE` (one token)."""

    @classmethod
    def build(cls, stage: StageLayers) -> LayerPath | None:
        """The path over ``stage``, or None where it cannot read these weights."""

    def forward(self, x: torch.Tensor, cache: KVCache, rope: Rope, attn: torch.Tensor | None
                ) -> torch.Tensor:
        """``x [B, S, H]`` through the stage's layers, writing the cache; ``[B, S, H]``.

        ``rope`` is the step's ``(cos, sin)`` ``[B, S, D]``; ``attn`` the boolean
        ``[B, 1, S, length + S]`` mask over the cached and new keys (True = attend), or None
        where no key is padding (causal; :func:`engine.attention.attention`).
        """


LAYER_PATHS: dict[str, type[LayerPath]] = {}


def register_layer_path(cls: type[LayerPath]) -> type[LayerPath]:
    """Class decorator: add a layer path to :data:`LAYER_PATHS` (ValueError if the name is
    taken)."""
    if cls.name in LAYER_PATHS:
        raise ValueError(f"layer path {cls.name!r} is registered twice")
    LAYER_PATHS[cls.name] = cls
    return cls


# Layer keys the decode kernels read beyond engine.llama_spec.LAYER_KEYS.
DECODE_EXTRA_KEYS = ("qkv_bias",)


def _unread_keys(layer_keys: Iterable[str]) -> list[str]:
    """The layer weights the decode kernels cannot read (o_proj bias, q/k norms)."""
    return [k for k in layer_keys if k not in LAYER_KEYS and k not in DECODE_EXTRA_KEYS]


def kernels_available(dtype: torch.dtype, layer_keys: Iterable[str],
                      device: torch.device | str = "cpu") -> bool:
    """Whether the decode kernels can run layers of ``dtype`` with the weights ``layer_keys``
    on ``device``: extension built, CPU, float32, only :data:`engine.llama_spec.LAYER_KEYS`
    and :data:`DECODE_EXTRA_KEYS`."""
    return (_kernels is not None and torch.device(device).type == "cpu"
            and dtype == torch.float32 and not _unread_keys(layer_keys))


def resolve_kernels(fused_decode: bool | None, dtype: torch.dtype,
                    layer_keys: Iterable[str], device: torch.device | str = "cpu") -> bool:
    """Whether to decode layers of ``dtype`` with the weights ``layer_keys`` on ``device`` on
    the kernels for the user's ``fused_decode`` (None: where :func:`kernels_available`);
    ValueError for True where they cannot."""
    layer_keys = tuple(layer_keys)
    ok = kernels_available(dtype, layer_keys, device)
    if fused_decode and not ok:
        raise ValueError(f"fused_decode=True needs the engine._kernels extension, a CPU, "
                         f"float32 and plain Llama layers (device={device}, dtype={dtype}, "
                         f"extension "
                         f"{'present' if _kernels is not None else 'missing'}, weights the "
                         f"kernels lack: {_unread_keys(layer_keys)}); use fused_decode=None or "
                         f"False")
    return ok if fused_decode is None else bool(fused_decode)


def _kernels_for(stage: StageLayers) -> bool:
    """Whether the decode kernels read the stage's layers (:func:`kernels_available`; not
    with LoRA adapters, which the kernels do not apply)."""
    return not stage.loras and kernels_available(stage.dtype, {k for w in stage.weights
                                                               for k in w}, stage.device)


def _qkv_biases(stage: StageLayers) -> tuple[torch.Tensor | None, ...]:
    """Each layer's ``qkv_bias`` (None where it has none); ``()`` where no layer has one."""
    biases = tuple(w.get("qkv_bias") for w in stage.weights)
    return () if all(b is None for b in biases) else biases


def _decode_tables(rope: Rope, attn: torch.Tensor | None, cache: KVCache
                   ) -> tuple[torch.Tensor, ...]:
    """The one new position's ``cos, sin [B, D]`` and key mask ``[B, length + 1]`` (every key
    where ``attn`` is None: no padding)."""
    cos, sin = rope[0][:, 0], rope[1][:, 0]
    if attn is None:
        return cos, sin, torch.ones(cos.shape[0], cache.length + 1, dtype=torch.bool,
                                    device=cos.device)
    return cos, sin, attn[:, 0, 0]


@register_layer_path
@dataclass(frozen=True, eq=False)
class PythonLayers:
    """The reference: :func:`engine.layers.decoder_layer` per layer."""

    name: ClassVar[str] = "python"
    steps: ClassVar[frozenset[str]] = frozenset({PREFILL, DECODE})
    stage: StageLayers

    @classmethod
    def build(cls, stage: StageLayers) -> PythonLayers:
        return cls(stage)

    def forward(self, x: torch.Tensor, cache: KVCache, rope: Rope, attn: torch.Tensor | None
                ) -> torch.Tensor:
        s = self.stage
        trace = RouteTrace() if s.route_log is not None else None
        for j, w in enumerate(s.weights):
            x = decoder_layer(x, w, rope, attn, s.layer_spec, kv_hook=cache.hook(j),
                              lora=s.loras[j] if s.loras else None, trace=trace)
        if trace is not None:
            s.route_log.append(trace.recorded())
        return x


@register_layer_path
@dataclass(frozen=True, eq=False)
class KernelStage:
    """Decode without TP: the whole stage in one :func:`engine._kernels.decode_layers` call. Up
    to ``small_gemm_max_rows`` rows the intra-op threads share each step (every product split
    by weight rows, so each weight is read once a step); above it each thread takes its block
    of rows through every layer. Both give the same bits."""

    name: ClassVar[str] = "kernel_stage"
    steps: ClassVar[frozenset[str]] = frozenset({DECODE})
    stage: StageLayers
    flat_weights: tuple[torch.Tensor, ...]
    """Every layer's weights in :data:`engine.llama_spec.LAYER_KEYS` order, layer after
    layer."""
    qkv_biases: tuple[torch.Tensor | None, ...]
    """Per layer its ``qkv_bias`` or None; ``()`` without biases."""
    row_lanes: bool = False
    """The small products in the row-lane form (other roundings than the k-lane form: a
    generation keeps one form throughout, see :meth:`ForwardPaths.with_row_lanes`)."""

    @classmethod
    def build(cls, stage: StageLayers) -> KernelStage | None:
        if not _kernels_for(stage) or stage.tensor_parallel:
            return None
        return cls(stage, tuple(w[k] for w in stage.weights for k in LAYER_KEYS),
                   _qkv_biases(stage))

    def forward(self, x: torch.Tensor, cache: KVCache, rope: Rope, attn: torch.Tensor | None
                ) -> torch.Tensor:
        s = self.stage
        cos, sin, key_mask = _decode_tables(rope, attn, cache)
        return _kernels.decode_layers(x[:, 0], self.flat_weights, s.eps, cos, sin, cache.k,
                                      cache.v, cache.length, key_mask, s.q_per_group,
                                      self.qkv_biases, row_lanes=self.row_lanes).unsqueeze(1)


@register_layer_path
@dataclass(frozen=True, eq=False)
class KernelLayers:
    """Decode with TP: two kernel calls per layer (attention half, MLP half), each returning
    the row-parallel partial that is summed over the TP group here."""

    name: ClassVar[str] = "kernel_layers"
    steps: ClassVar[frozenset[str]] = frozenset({DECODE})
    stage: StageLayers

    @classmethod
    def build(cls, stage: StageLayers) -> KernelLayers | None:
        return cls(stage) if _kernels_for(stage) else None

    def forward(self, x: torch.Tensor, cache: KVCache, rope: Rope, attn: torch.Tensor | None
                ) -> torch.Tensor:
        s, pos = self.stage, cache.length
        cos, sin, key_mask = _decode_tables(rope, attn, cache)
        x = x[:, 0]  # [B, H]
        for j, w in enumerate(s.weights):
            x = x + reduce_from_tp(_kernels.decode_attention(
                x, w["input_norm"], s.eps, w["qkv"], w["o_proj"], cos, sin, cache.k[j],
                cache.v[j], pos, key_mask, s.q_per_group, w.get("qkv_bias")), s.tp_group)
            x = x + reduce_from_tp(_kernels.decode_mlp(
                x, w["post_norm"], s.eps, w["gate_up"], w["down_proj"]), s.tp_group)
        return x.unsqueeze(1)


@dataclass(frozen=True, eq=False)
class ForwardPaths:
    """The layer paths of one weight version."""

    prefill: LayerPath
    """Prompts of 2 tokens or more."""
    decode: LayerPath
    """One token per row; also a prompt of one token."""

    def for_prompt(self, width: int) -> LayerPath:
        """The path of the prefill of a ``width``-token prompt."""
        return self.decode if width == 1 else self.prefill

    def with_row_lanes(self, row_lanes: bool) -> ForwardPaths:
        """These paths with the kernel stage's small products in the row-lane form (or not);
        other paths have one form only."""
        if not isinstance(self.decode, KernelStage) or self.decode.row_lanes == row_lanes:
            return self
        return replace(self, decode=replace(self.decode, row_lanes=row_lanes))


def choose_paths(stage: StageLayers, kernels: bool) -> ForwardPaths:
    """The layer paths for ``stage``'s weights: the reference everywhere without ``kernels``;
    with them, the kernels for decode steps (see the module docstring)."""
    python = PythonLayers.build(stage)
    if not kernels:
        return ForwardPaths(prefill=python, decode=python)
    decode = KernelLayers.build(stage) if stage.tensor_parallel else KernelStage.build(stage)
    assert decode is not None, "kernels requested where they are not available"
    return ForwardPaths(prefill=python, decode=decode)


# Stage boundaries ---------------------------------------------------------------------------
Embed = Callable[[torch.Tensor], torch.Tensor]  # ids [B, S] -> x [B, S, H]
Sample = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x -> (tokens, log-probs)
# leave(x, sample, rows): the last stage samples from x[rows] (one row per sequence, when the
# step ran on the distinct prompts only), or from x when rows is None


class SingleStage:
    """``pp_g == 1``: the stage embeds the ids and samples; nothing is sent."""

    def enter(self, ids: torch.Tensor, embed: Embed) -> torch.Tensor:
        return embed(ids)

    def leave(self, x: torch.Tensor, sample: Sample, rows: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(x if rows is None else x[rows])


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``stage`` of ``pp_g > 1``: hidden states go stage to stage over the generation PP
    group; the last stage samples and broadcasts ``(token, log-prob)`` back to every stage, so
    every rank of the replica knows every token."""

    group: Group
    """The generation PP group (its ranks in stage order)."""
    stage: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    def enter(self, ids: torch.Tensor, embed: Embed) -> torch.Tensor:
        if self.stage == 0:
            return embed(ids)
        x = torch.empty(*ids.shape, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(x, src=self.group.ranks[self.stage - 1], group=self.group.pg)
        return x

    def leave(self, x: torch.Tensor, sample: Sample, rows: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stage == self.group.size - 1:
            tok, lp = sample(x if rows is None else x[rows])
            packed = torch.stack([tok.double(), lp.double()])
        else:
            dist.send(x.contiguous(), dst=self.group.ranks[self.stage + 1], group=self.group.pg)
            packed = torch.empty(2, x.shape[0] if rows is None else rows.numel(),
                                 dtype=torch.float64, device=x.device)
        dist.broadcast(packed, src=self.group.ranks[-1], group=self.group.pg)
        return packed[0].long(), packed[1].float()


# Per-call plan --------------------------------------------------------------------------------
ROW_LANES_MIN_ROWS = 28
"""A call of this many rows or more (and at most the kernels' ``small_gemm_max_rows``) whose
rows all run every step runs its decode products in the row-lane form
(csrc/engine/small_gemm.h); with fewer rows the k-lane form was as fast in greedy steps at the
``small`` shape."""


def uses_row_lanes(batch: int, block_rows: int | None, supported: bool,
                   rows_stay: bool) -> bool:
    """Does a generation of ``batch`` rows run its small decode products in the row-lane form
    (pure)?  Only where every row runs every step (``rows_stay``: no EOS before the last step
    and no shorter per-row limit): the row-lane form costs about as much at 16 rows as at 32,
    so a batch that shrinks would pay for rows it no longer has.  Chosen once a call, by the
    full batch: the two forms round differently."""
    return (supported and rows_stay and block_rows is not None
            and ROW_LANES_MIN_ROWS <= batch <= block_rows)


@dataclass(frozen=True)
class CallPlan:
    """How one generation call runs its steps (:func:`plan_call`)."""

    paths: ForwardPaths
    """The layer paths, the kernel stage in the call's product form."""
    row_lanes: bool
    """The kernels' small products (decode stage and head) in the row-lane form."""
    head: str
    """How the last stage turns hidden states into tokens: ``"greedy_head"`` (norm, head and
    argmax in one ``engine._kernels.greedy_head`` call), ``"small_linear"`` (the kernels'
    small product reads the head in place, then the sampler) or ``"blas"``."""
    greedy_rest: bool
    """Every decode step after the first in one ``engine._kernels.greedy_decode`` call."""


def plan_call(paths: ForwardPaths, batch: int, block_rows: int | None, rows_stay: bool,
              head_in_place: bool, greedy_one_rank: bool, kernel_loop: bool) -> CallPlan:
    """The plan of a call of ``batch`` rows (pure).

    Args:
        paths: the layer paths of the current weights.
        batch: the call's full batch.
        block_rows: the kernels' small-M row block (``_kernels.small_gemm_max_rows``), or None
            when the decode steps run the Python layers.
        rows_stay: no row can finish before the last step (no EOS before it, no shorter
            per-row limit).
        head_in_place: the head weight's rows are contiguous (the kernels read it in place).
        greedy_one_rank: the call is greedy and the head holds the whole vocabulary.
        kernel_loop: the one-call greedy loop is allowed and a step is one stage of the
            kernel stage's (then a greedy step is exactly ``greedy_head(decode_layers(...))``).
    """
    small = block_rows is not None and batch <= block_rows
    row_lanes = small and uses_row_lanes(batch, block_rows, _kernels.row_lanes_supported,
                                         rows_stay)
    head = ("blas" if not (small and head_in_place) else
            "greedy_head" if greedy_one_rank else "small_linear")
    return CallPlan(paths=paths.with_row_lanes(row_lanes), row_lanes=row_lanes, head=head,
                    greedy_rest=head == "greedy_head" and rows_stay and kernel_loop)
