"""KV cache of one generation call: sized from batch and lengths, dropped when the call ends.

One tensor per K and V for all of a stage's layers, allocated once (no growth, no copy)::

    k   [layers, B, h_kv, D, max_len]        keys transposed: a head's keys are D rows of
                                               max_len positions
    v   [layers, B, h_kv, max_len, D]        h_kv = G / t_g (this rank's KV heads)
                              positions 0 .. length-1 are filled

Keys are stored transposed so the decode kernel (``engine._kernels``) computes a query's scores
against all cached keys as D contiguous multiply-adds over positions (vectorised, no
horizontal sums).  A layer's hook (the Python layers: prefill, or every step without the
kernels) writes the step's new keys/values at ``[length, length + S)`` and hands attention
views of ``[0, length + S)`` in the ``[B, S_kv, h_kv, D]`` form that
:func:`engine.layers.attention` expects (strided views, no copy).  :meth:`advance` moves
``length`` once every layer of the step has run.  :meth:`keep_rows_` drops finished sequences
(early exit in :mod:`engine.generation`): the kept rows' filled positions move to new, smaller
tensors of the same layout; with repeated rows it copies the cache of a prompt prefilled once
to each of its sequences.
"""

from __future__ import annotations

import torch

from engine.layers import KVHook


def kv_cache_nbytes(num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes of a :class:`KVCache` with these sizes (K and V)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch * kv_heads * max_len * head_dim * item


class KVCache:
    """Keys and values of ``num_layers`` layers for ``batch`` sequences of up to ``max_len``.

    Args:
        num_layers: layers of this rank's generation stage.
        batch: sequences.
        max_len: prompt length plus the new tokens that are fed back (``P + N - 1``).
        kv_heads: this rank's KV heads.
        head_dim: D.
        dtype: element type of the activations.
    """

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.k = torch.empty(num_layers, batch, kv_heads, head_dim, max_len, dtype=dtype)
        self.v = torch.empty(num_layers, batch, kv_heads, max_len, head_dim, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def hook(self, layer: int) -> KVHook:
        """The ``kv_hook`` of local layer ``layer`` for the current step."""

        def append(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # k, v [B, S, h_kv, D] -> cached k [B, h_kv, D, 0:end], v [B, h_kv, 0:end, D];
            # both returned as [B, end, h_kv, D] views
            end = self._end(k.shape[1])
            self.k[layer, ..., self.length:end] = k.permute(0, 2, 3, 1)
            self.v[layer, :, :, self.length:end] = v.transpose(1, 2)
            return (self.k[layer, ..., :end].permute(0, 3, 1, 2),
                    self.v[layer, :, :, :end].transpose(1, 2))

        return append

    def _end(self, steps: int) -> int:
        """End of the ``steps`` positions a step writes from ``length`` (overflow raises)."""
        end = self.length + steps
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} > max_len={self.max_len}")
        return end

    def advance(self, steps: int) -> None:
        """Mark ``steps`` more positions as filled (after every layer wrote them)."""
        self.length += steps

    def keep_rows_(self, rows: torch.Tensor) -> None:
        """Keep the sequences ``rows`` (``[n]`` int64 indices into the current batch, in the
        order they are to take; an index may repeat: the copies of a shared prompt's cache),
        in place: new ``[layers, n, ...]`` tensors, of which the filled positions
        ``[0, length)`` are copied (the rest stays unwritten, as before)."""
        k = torch.empty(self.k.shape[0], rows.numel(), *self.k.shape[2:], dtype=self.k.dtype)
        v = torch.empty(self.v.shape[0], rows.numel(), *self.v.shape[2:], dtype=self.v.dtype)
        torch.index_select(self.k[..., :self.length], 1, rows, out=k[..., :self.length])
        torch.index_select(self.v[:, :, :, :self.length], 1, rows, out=v[:, :, :, :self.length])
        self.k, self.v = k, v
