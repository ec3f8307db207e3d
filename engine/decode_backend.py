"""What a generation call's decode steps share on every device, and the protocol of the two
decode backends that run them (:mod:`engine.decode_cpu`, :mod:`engine.decode_cuda`).

:class:`engine.generation.GenerationEngine` runs a call in device-independent phases (tables
and plan, prefill, the decode loop, output); a backend, picked once when the engine is built by
its KV cache layout (tiled: CPU, dense: CUDA, :func:`engine.kv_cache.resolve_layout`), owns
what differs: the KV cache it holds, the layer paths a step takes, the decode step itself and
the LM head::

    backend   cache   decode step                                   head
    cpu       tiled   engine._kernels (k-lane or row-lane), or the   greedy_head / small_linear
                      Python layers; greedy calls end in one          kernels, or BLAS
                      greedy_decode call
    cuda      dense   static shapes per batch bucket, compiled        BLAS, then the sampler on
                      (compile_decode), captured as CUDA graphs       the device
                      (cuda_graphs); eager static steps elsewhere

The cuda backend's static steps run on the CPU too (``kv_layout="dense"``: eager and through
inductor), which is how CI tests them; only their capture needs a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention import causal_mask
from engine.cuda_graphs import StaticDecode
from engine.decode_memory import DecodeMemory
from engine.early_exit import RunningRows
from engine.forward_paths import CallPlan, ForwardPaths, Rope, StageLayers
from engine.kv_cache import KVCache
from engine.llama_spec import LlamaConfig
from engine.norm import rms_norm
from engine.rope import position_ids_from_mask, rope_tables
from engine.sampling import SamplingParams, SeedStream, sample_next
from engine.tp_ops import column_linear
from hybridflow_comm.groups import Group


@dataclass
class StepTables:
    """A call's per-row tables over every position ``[0, P + N)``, as if every new token were
    real (a finished row's later positions are never read)."""

    cos: torch.Tensor
    """``[R, P + N, D]`` RoPE."""
    sin: torch.Tensor
    keys_ok: torch.Tensor
    """``[R, 1, 1, P + N]`` bool: the key positions a query may attend (not left padding)."""
    padded: bool
    """Some prompt has left padding: the steps need masks; without, attention is causal and
    mask-free (SDPA's ``is_causal``, :func:`engine.attention.attention`)."""

    @classmethod
    def build(cls, mask: torch.Tensor, n_new: int, config: LlamaConfig) -> StepTables:
        full = torch.cat([mask, torch.ones(mask.shape[0], n_new, dtype=torch.long,
                                           device=mask.device)], dim=1)
        cos, sin = rope_tables(position_ids_from_mask(full), config.head_dim, config.rope_theta,
                               config.dtype, config.rope_scaling)
        # one device-to-host sync a call (the prompts are validated on the host already)
        return cls(cos, sin, full.bool()[:, None, None, :], padded=not bool(mask.all()))

    def prompt(self, rows: torch.Tensor, length: int, mask: torch.Tensor
               ) -> tuple[Rope, torch.Tensor | None]:
        """RoPE and attention mask (None: no padding) of the prefill of ``rows``' prompts of
        ``length`` tokens, whose attention mask is ``mask [B, P]``."""
        attn = causal_mask(mask[rows], rows.numel(), length) if self.padded else None
        return (self.cos[rows, :length], self.sin[rows, :length]), attn

    def decode(self, end: int) -> tuple[Rope, torch.Tensor | None]:
        """RoPE of position ``end - 1`` and the key mask over ``[0, end)`` (None: no
        padding)."""
        return ((self.cos[:, end - 1:end], self.sin[:, end - 1:end]),
                self.keys_ok[..., :end] if self.padded else None)

    def keep_rows(self, keep: torch.Tensor) -> StepTables:
        return StepTables(self.cos[keep], self.sin[keep], self.keys_ok[keep], self.padded)


@dataclass
class Responses:
    """The response columns of a call's output, filled step by step."""

    ids: torch.Tensor
    """``[B, N]`` int64, ``pad`` after a row's end."""
    mask: torch.Tensor
    """``[B, N]`` int64, 1 for real tokens."""
    log_probs: torch.Tensor
    """``[B, N]`` float32, 0 where masked."""
    pad: int

    @classmethod
    def empty(cls, batch: int, n_new: int, pad: int, device: torch.device) -> Responses:
        return cls(torch.full((batch, n_new), pad, dtype=torch.long, device=device),
                   torch.zeros(batch, n_new, dtype=torch.long, device=device),
                   torch.zeros(batch, n_new, dtype=torch.float32, device=device), pad)

    def record(self, step: int, rows: RunningRows, tokens: torch.Tensor,
               log_probs: torch.Tensor) -> None:
        """Step ``step``'s ``tokens`` and ``log_probs`` ``[R]`` of the running rows; a row
        that had already finished gets padding."""
        live = rows.alive[rows.at]
        self.ids[rows.at, step] = torch.where(live, tokens, self.pad)
        self.mask[rows.at, step] = live.long()
        self.log_probs[rows.at, step] = torch.where(live, log_probs, 0.0)


@dataclass(frozen=True)
class Head:
    """The last stage's LM head: final norm and the (column-parallel) head weight."""

    norm: torch.Tensor
    eps: float
    weight: torch.Tensor
    """``[V/t_g, H]``."""
    tp_group: Group | None

    def sample(self, x: torch.Tensor, sampling: SamplingParams, stream: SeedStream,
               rows: torch.Tensor | None, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of every row from the last position of ``x [R, S, H]`` by BLAS and
        :func:`engine.sampling.sample_next` (``rows``: the running rows of the full batch,
        None = all; ``step``: tokens each row has produced, for ``min_new_tokens``)."""
        h = rms_norm(x[:, -1], self.norm, self.eps)  # [R, H]
        logits = column_linear(h, self.weight, self.tp_group)  # [R, V/t_g]
        return sample_next(logits, sampling, self.tp_group, stream, rows, step)


class DecodeBackend(Protocol):
    """How one device runs a call's KV cache, decode steps and head (module docstring)."""

    name: str
    memory: DecodeMemory
    """The KV cache (and static steps) held from call to call."""
    paths: ForwardPaths | None
    """The layer paths of the current weights (None without weights)."""
    block_rows: int | None
    """The decode kernels' small-M row block (:func:`engine.forward_paths.plan_call`), or
    None where the steps do not run the kernels."""

    def set_weights(self, stage: StageLayers, weights_key: object) -> None:
        """Choose the layer paths (and static layers) over ``stage``'s weights, whose
        addresses ``weights_key`` names."""

    def release(self, keep_cache: bool) -> None:
        """Drop what holds the weights; the KV cache too unless ``keep_cache``."""

    def capacity(self, batch: int) -> int:
        """The KV cache rows a call of ``batch`` sequences needs."""

    def call_cache(self, sizes: dict, embed, plan: CallPlan
                   ) -> tuple[KVCache, StaticDecode | None]:
        """The held cache reset for a call of ``sizes`` (grown where it needs more), and the
        static steps over it where the backend has them."""

    def sample(self, head: Head, x: torch.Tensor, sampling: SamplingParams,
               stream: SeedStream, plan: CallPlan, rows: torch.Tensor | None, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's next tokens and their log-probs (:meth:`Head.sample`'s)."""

    def kernel_loop(self, single_stage: bool) -> bool:
        """Whether a greedy call whose rows all run to the end may finish its decode steps in
        one call (the CPU backend's ``greedy_rest``; never on the cuda backend)."""

    def stats(self) -> dict:
        """The backend's settings for a call's stats."""
