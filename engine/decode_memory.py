"""What a generation engine keeps between calls: its KV cache and the static decode steps
(CUDA graphs) recorded over the cache's addresses.

    made      by the first call, for its rows (a decode bucket's with static steps) and
              max_len (engine.kv_cache)
    reused    by every later call that fits (KVCache.fits): same storage, length 0, K zeroed
              (KVCache.reset_); the static steps keep their buckets and graphs
    grown     by a call that does not fit: the old cache and graphs are dropped first, the
              new one holds the old sizes and the call's (the largest of each), so calls
              of alternating sizes settle on one allocation
    graphs    per (batch bucket, key bucket), valid while the cache's buffers and the
              weights' addresses are: weights at other addresses (a new set_weights) make
              new static steps over the same cache
    released  by GenerationEngine.release() (back to training) unless the engine keeps them:
              the tensors go back to torch's caching allocator, where training's next
              allocations find them (no empty_cache(); the graphs' private pool goes back
              when the allocator next frees its cached blocks, e.g. on an out-of-memory
              retry)

Sizing follows the calls: with ``rollout.max_num_seqs`` the waves of a batch are at most that
many rows (``rlhf.workers.rollout_engine``), so the first full wave sizes the cache and the
rest reuse it.
"""

from __future__ import annotations

import torch

from engine.cuda_graphs import Embed, Layers, StaticDecode
from engine.kv_cache import DenseKVCache, KVCache


class DecodeMemory:
    """One engine's KV cache and static decode steps (module docstring).

    Args:
        cache_type: the KV cache class (:data:`engine.kv_cache.KV_CACHES`).
        device: where the cache lives.
        capture: the static steps record CUDA graphs (else they run eagerly).
    """

    def __init__(self, cache_type: type[KVCache], device: torch.device, capture: bool) -> None:
        self.cache_type, self.device, self.capture = cache_type, device, capture
        self.cache: KVCache | None = None
        self.static: StaticDecode | None = None
        self._static_key: object = None  # the weights' addresses the graphs read

    def cache_for(self, num_layers: int, batch: int, max_len: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype, capacity: int) -> KVCache:
        """The cache of a call of ``batch`` rows to start with (the prefill's), up to
        ``capacity`` rows (its batch, or the batch's decode bucket) and ``max_len`` positions:
        the held one reset where it fits, else a new one grown to hold both."""
        held = self.cache
        if held is not None and held.fits(capacity, max_len):
            held.reset_(batch, max_len)
            return held
        positions = max_len
        if held is not None:
            capacity, positions = max(capacity, held.capacity), max(max_len, held.positions)
        del held
        self.release()  # the old buffers and graphs go before the new ones are allocated
        self.cache = self.cache_type(num_layers, batch, max_len, kv_heads, head_dim, dtype,
                                     self.device, capacity=capacity, positions=positions)
        return self.cache

    def static_decode(self, embed: Embed | None, layers: Layers, weights_key: object
                      ) -> StaticDecode:
        """The static steps over the held dense cache for a call that runs ``embed`` and
        ``layers``; those of the calls before (their buckets and graphs) while the weights
        are at the addresses ``weights_key`` names."""
        assert isinstance(self.cache, DenseKVCache), "static steps read the dense layout"
        if self.static is None or self.static.cache is not self.cache \
                or self._static_key != weights_key:
            self.static = None  # its graphs' pool goes before the new captures
            self.static = StaticDecode(embed, layers, self.cache, capture=self.capture)
            self._static_key = weights_key
        else:
            self.static.begin_call(embed, layers)
        return self.static

    @property
    def nbytes(self) -> int:
        """Bytes of the held KV cache (0 without one)."""
        return 0 if self.cache is None else self.cache.nbytes

    def release(self, keep: bool = False) -> None:
        """Drop the cache and the static steps; ``keep``: keep them, only the step functions
        (which hold the weights) are dropped."""
        if keep:
            if self.static is not None:
                self.static.end_call()
            return
        self.cache, self.static, self._static_key = None, None, None
