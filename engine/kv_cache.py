"""KV cache of one generation call: sized from batch and lengths, dropped when the call ends.

One :class:`KVCache` interface, two layouts, chosen by device (:func:`resolve_layout`): the
CPU's ``tiled`` layout for the C++ decode kernels, and the ``dense`` layout that SDPA reads
in place (CUDA; CPU tests force it).  Each is one tensor per K and V for all of a stage's
layers, allocated once (no growth, no copy).

``tiled``::

    k   [layers, B, h_kv, T, D, KEY_TILE]   keys transposed in tiles of KEY_TILE positions:
                                             tile t holds positions t*KEY_TILE + [0, KEY_TILE)
                                             as D rows; T = ceil(max_len / KEY_TILE)
    v   [layers, B, h_kv, max_len, D]        h_kv = G / t_g (this rank's KV heads)
                              positions 0 .. length-1 are filled

Keys are stored transposed so the decode kernel (``engine._kernels``) computes a query's scores
against all cached keys as D contiguous multiply-adds over positions (vectorised, no
horizontal sums).  They are tiled so that the keys of positions ``[0, n)`` of one (sequence,
KV head) are one contiguous run of memory (``ceil(n / KEY_TILE)`` tiles of ``D * KEY_TILE``
floats), read front to back; one ``[D, max_len]`` matrix would be read as D partial rows
with gaps between them, which the hardware prefetcher fetches too.  The unfilled positions
of K are zeros (never NaN or denormal garbage: the kernel's vectors span whole tile rows and
ignore the lanes past the filled positions).  A layer's hook (the Python layers: prefill, or
every step without the kernels) writes the step's new keys/values at ``[length, length + S)``
and hands attention ``[0, length + S)`` in the ``[B, S_kv, h_kv, D]`` form that
:func:`engine.layers.attention` expects (values as a strided view, keys gathered out of
their tiles).

``dense``::

    k, v   [layers, C, h_kv, max_len, D]     C = capacity >= B rows (a decode bucket's rows,
                                             engine.cuda_graphs); rows [0, B) are the batch
           row r, KV head h:  | pos 0 | pos 1 | ... | pos length-1 | zeros / stale ... |
                              each position D contiguous elements

A step writes its keys and values in place at ``[length, length + S)`` (a slice assignment;
a captured decode step writes at a device position, :class:`DecodeSlots`) and attention reads
``[0, length + S)`` as views (``[B, S_kv, h_kv, D]`` by a transpose, never a copy):
SDPA's kernels read D-contiguous rows of a strided sequence dim.  The hooks of this layout
carry ``stacked_decode``: a one-token step attends with each KV group's query heads stacked
as rows (:func:`engine.layers.decode_attention`), so no kernel expands the cache per query
head.  Positions past ``length`` are zeros or finite leftovers of dropped rows (never NaN:
a masked position's zero weight times its value must stay zero).

:meth:`KVCache.advance` moves ``length`` once every layer of the step has run.
:meth:`KVCache.keep_rows_` drops finished sequences (early exit, :mod:`engine.early_exit`):
the tiled layout copies the kept rows' filled positions to new, smaller tensors; the dense
layout moves them to the first rows of its own buffers (its addresses never change, which a
captured decode step relies on).  With repeated rows it copies the cache of a prompt
prefilled once to each of its sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers import KVHook

KEY_TILE = 64
"""Positions per tile of the cached keys (a multiple of every vector width of the kernel)."""
LAYOUTS = ("tiled", "dense")


def resolve_layout(layout: str | None, device: torch.device | str) -> str:
    """The KV layout for the user's ``layout`` on ``device`` (None: ``dense`` on CUDA,
    ``tiled`` elsewhere); ValueError for an unknown name."""
    if layout is None:
        return "dense" if torch.device(device).type == "cuda" else "tiled"
    if layout not in LAYOUTS:
        raise ValueError(f"kv_layout={layout!r} must be one of {LAYOUTS} or None")
    return layout


def key_tiles(max_len: int) -> int:
    """Tiles that hold ``max_len`` positions."""
    return -(-max_len // KEY_TILE)


def kv_cache_nbytes(num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype, layout: str = "tiled", capacity: int | None = None
                    ) -> int:
    """Bytes of a :class:`KVCache` with these sizes (tiled: K padded to whole tiles, and V;
    dense: K and V of ``capacity`` rows, default ``batch``)."""
    item = dtype.itemsize
    if layout == "dense":
        rows = batch if capacity is None else capacity
        return 2 * num_layers * rows * kv_heads * max_len * head_dim * item
    positions = key_tiles(max_len) * KEY_TILE + max_len
    return num_layers * batch * kv_heads * positions * head_dim * item


def tile_keys(keys: torch.Tensor) -> torch.Tensor:
    """``[..., D, L]`` transposed keys -> the cache's ``[..., ceil(L / KEY_TILE), D, KEY_TILE]``
    tiles (a new tensor; positions past L are zeros)."""
    *lead, d, length = keys.shape
    tiles = keys.new_zeros(*lead, d, key_tiles(length) * KEY_TILE)
    tiles[..., :length] = keys
    return tiles.unflatten(-1, (-1, KEY_TILE)).transpose(-3, -2).contiguous()


def untile_keys(tiles: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions ``[start, end)`` of tiled keys ``[..., T, D, KEY_TILE]`` as transposed keys
    ``[..., D, end - start]`` (a copy)."""
    t0, t1 = start // KEY_TILE, key_tiles(end)
    out = torch.empty(*tiles.shape[:-3], tiles.shape[-2], (t1 - t0) * KEY_TILE,
                      dtype=tiles.dtype, device=tiles.device)
    out.view(*out.shape[:-1], t1 - t0, KEY_TILE).copy_(tiles[..., t0:t1, :, :].transpose(-3, -2))
    return out[..., start - t0 * KEY_TILE:end - t0 * KEY_TILE]


class KVCache:
    """Keys and values of ``num_layers`` layers for ``batch`` sequences of up to ``max_len``,
    in one of the two layouts of the module docstring.

    Args:
        num_layers: layers of this rank's generation stage.
        batch: sequences.
        max_len: prompt length plus the new tokens that are fed back (``P + N - 1``).
        kv_heads: this rank's KV heads.
        head_dim: D.
        dtype: element type of the activations.
        device: where the cache lives (the weights' device; default CPU).
        layout: ``"tiled"`` or ``"dense"`` (None: by device, :func:`resolve_layout`).
        capacity: rows of the dense buffers (default ``batch``; at least ``batch``).
    """

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 layout: str | None = None, capacity: int | None = None) -> None:
        self.layout = resolve_layout(layout, device)
        if self.layout == "dense":
            capacity = batch if capacity is None else capacity
            if capacity < batch:
                raise ValueError(f"capacity={capacity} < batch={batch}")
            shape = (num_layers, capacity, kv_heads, max_len, head_dim)
            # zeros: a masked position's weight (0) times its value must stay 0, never NaN
            self.k_buf = torch.zeros(shape, dtype=dtype, device=device)
            self.v_buf = torch.zeros(shape, dtype=dtype, device=device)
            self.k, self.v = self.k_buf[:, :batch], self.v_buf[:, :batch]
        else:
            self.k = torch.zeros(num_layers, batch, kv_heads, key_tiles(max_len), head_dim,
                                 KEY_TILE, dtype=dtype, device=device)
            self.v = torch.empty(num_layers, batch, kv_heads, max_len, head_dim, dtype=dtype,
                                 device=device)
        self.max_len = max_len
        self.length = 0

    @property
    def nbytes(self) -> int:
        if self.layout == "dense":
            return self.k_buf.nbytes + self.v_buf.nbytes
        return self.k.nbytes + self.v.nbytes

    @property
    def rows(self) -> int:
        """The sequences the cache holds now."""
        return self.k.shape[1]

    def hook(self, layer: int) -> KVHook:
        """The ``kv_hook`` of local layer ``layer`` for the current step."""
        return (self._dense_hook if self.layout == "dense" else self._tiled_hook)(layer)

    def _tiled_hook(self, layer: int) -> KVHook:
        def append(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # k, v [B, S, h_kv, D] -> cached k tiles [B, h_kv, T, D, KEY_TILE], v
            # [B, h_kv, 0:end, D]; both returned as [B, end, h_kv, D] (v a view, k a copy)
            end = self._end(k.shape[1])
            kt = k.permute(0, 2, 3, 1)  # [B, h_kv, D, S]
            for t0 in range(self.length - self.length % KEY_TILE, end, KEY_TILE):
                a, b = max(self.length, t0), min(end, t0 + KEY_TILE)
                self.k[layer, :, :, t0 // KEY_TILE, :, a - t0:b - t0] = \
                    kt[..., a - self.length:b - self.length]
            self.v[layer, :, :, self.length:end] = v.transpose(1, 2)
            return (untile_keys(self.k[layer], 0, end).permute(0, 3, 1, 2),
                    self.v[layer, :, :, :end].transpose(1, 2))

        return append

    def _dense_hook(self, layer: int) -> KVHook:
        def append(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # k, v [B, S, h_kv, D] written at [B, h_kv, length:end, D]; [0, end) returned as
            # [B, end, h_kv, D] views
            end = self._end(k.shape[1])
            self.k[layer, :, :, self.length:end] = k.transpose(1, 2)
            self.v[layer, :, :, self.length:end] = v.transpose(1, 2)
            return (self.k[layer, :, :, :end].transpose(1, 2),
                    self.v[layer, :, :, :end].transpose(1, 2))

        append.stacked_decode = True
        return append

    def keys(self, start: int, end: int) -> torch.Tensor:
        """Cached keys of positions ``[start, end)``, transposed: ``[layers, B, h_kv, D,
        end - start]`` (a copy)."""
        if self.layout == "dense":
            return self.k[:, :, :, start:end].transpose(-1, -2).clone()
        return untile_keys(self.k, start, end)

    def slots(self, rows: int, pos: torch.Tensor, positions: int | None = None
              ) -> DecodeSlots:
        """Dense layout: the first ``rows`` rows (up to the capacity) over the first
        ``positions`` positions (default all ``max_len``), written at the device position
        ``pos`` (a captured decode step's cache)."""
        positions = self.max_len if positions is None else positions
        if self.layout != "dense" or rows > self.k_buf.shape[1] or \
                not 0 < positions <= self.max_len:
            raise ValueError(f"slots of {rows} rows over {positions} positions need the dense "
                             f"layout with that capacity and max_len (layout {self.layout!r}, "
                             f"max_len={self.max_len})")
        return DecodeSlots(self.k_buf[:, :rows, :, :positions],
                           self.v_buf[:, :rows, :, :positions], pos)

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
        in place.  Tiled: new ``[layers, n, ...]`` tensors, of which the filled positions
        ``[0, length)`` are copied (the tiles of K that hold them whole; the rest of K is
        zeros, the rest of V unwritten, as before).  Dense: the filled positions of the kept
        rows move to rows ``[0, n)`` of the same buffers (ValueError past the capacity)."""
        if self.layout == "dense":
            n, filled = rows.numel(), self.length
            if n > self.k_buf.shape[1]:
                raise ValueError(f"{n} rows exceed the dense cache's capacity "
                                 f"{self.k_buf.shape[1]}")
            for buf in (self.k_buf, self.v_buf):
                buf[:, :n, :, :filled] = buf[:, :, :, :filled].index_select(1, rows)
            self.k, self.v = self.k_buf[:, :n], self.v_buf[:, :n]
            return
        k = self.k.new_empty(self.k.shape[0], rows.numel(), *self.k.shape[2:])
        v = self.v.new_empty(self.v.shape[0], rows.numel(), *self.v.shape[2:])
        t = key_tiles(self.length)
        torch.index_select(self.k[:, :, :, :t], 1, rows, out=k[:, :, :, :t])
        k[:, :, :, t:].zero_()
        torch.index_select(self.v[:, :, :, :self.length], 1, rows, out=v[:, :, :, :self.length])
        self.k, self.v = k, v


@dataclass(frozen=True, eq=False)
class DecodeSlots:
    """Rows ``[0, b)`` of a dense cache over its first ``L`` positions (``pos < L <=
    max_len``), written at the device position ``pos`` (``[1]`` int64): one decode step at
    fixed shapes and addresses, what a CUDA graph can capture (:mod:`engine.cuda_graphs`).
    Attention reads every one of the ``L`` positions, the key mask hiding those at or past
    ``pos + 1``."""

    k: torch.Tensor
    """``[layers, b, h_kv, L, D]`` (a view of the cache's buffer)."""
    v: torch.Tensor
    pos: torch.Tensor

    def hook(self, layer: int) -> KVHook:
        return LayerSlots(self.k[layer], self.v[layer], self.pos)


@dataclass(frozen=True, eq=False)
class LayerSlots:
    """One layer's rows of :class:`DecodeSlots` as a KV hook: writes the new keys and values
    at ``pos`` and returns the slots' positions as ``[b, L, h_kv, D]`` views (a plain object,
    so that ``torch.compile`` traces it: :mod:`engine.compiled_decode`)."""

    k: torch.Tensor
    """``[b, h_kv, L, D]``."""
    v: torch.Tensor
    pos: torch.Tensor
    stacked_decode = True
    """One new query reads the cache by :func:`engine.layers.decode_attention`."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v [b, 1, h_kv, D] -> position pos of [b, h_kv, L, D]
        self.k.index_copy_(2, self.pos, k.transpose(1, 2))
        self.v.index_copy_(2, self.pos, v.transpose(1, 2))
        return self.k.transpose(1, 2), self.v.transpose(1, 2)
