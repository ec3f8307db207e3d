"""KV caches of a generation engine: one protocol, two layouts, storage kept across calls.

:class:`KVCache` is what the layer paths, the early exit and the engine use; two classes
implement it, chosen by device (:func:`resolve_layout`, :data:`KV_CACHES`): the CPU's
:class:`TiledKVCache` for the C++ decode kernels, and :class:`DenseKVCache`, which SDPA reads
in place (CUDA; CPU tests force it) and which alone hands out the fixed-address
:class:`DecodeSlots` of a captured decode step.  Each holds one K and one V storage for all of
a stage's layers, allocated once for ``capacity`` rows of ``positions`` positions; a call
starts with :meth:`KVCache.reset_` (``length`` 0, K zeroed) on the storage of the call before
when :meth:`KVCache.fits` says its sizes fit, so an engine allocates its cache once and again
only to grow it (:mod:`engine.decode_memory`).

``tiled`` (the current rows' tensors are the front of the flat storages, contiguous, as the
kernels take them)::

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
:func:`engine.attention.attention` expects (values as a strided view, keys gathered out of
their tiles).  The storages are flat, so a call of fewer rows and more positions than the
one before may fit the same bytes.

``dense``::

    k_buf, v_buf   [layers, C, h_kv, L, D]   C = capacity >= B rows (a decode bucket's rows,
                                             engine.cuda_graphs), L = positions >= max_len;
           k, v = rows [0, B) of them
           row r, KV head h:  | pos 0 | pos 1 | ... | pos length-1 | zeros / stale ... |
                              each position D contiguous elements

A step writes its keys and values in place at ``[length, length + S)`` (a slice assignment;
a captured decode step writes at a device position, :class:`DecodeSlots`) and attention reads
``[0, length + S)`` as views (``[B, S_kv, h_kv, D]`` by a transpose, never a copy):
SDPA's kernels read D-contiguous rows of a strided sequence dim.  The hooks of this layout
carry ``stacked_decode = True`` (the tiled layout's ``False``): a one-token step attends with
each KV group's query heads stacked as rows (:func:`engine.attention.decode_attention`), so
no kernel expands the cache per query head.  Positions past ``length`` are zeros or finite
leftovers of dropped rows (never NaN: a masked position's zero weight times its value must
stay zero); :meth:`DenseKVCache.reset_` zeroes the buffers.  Its shape never changes, so
every address a captured step recorded stays valid from call to call.

:meth:`KVCache.advance` moves ``length`` once every layer of the step has run.
:meth:`KVCache.keep_rows_` drops finished sequences (early exit, :mod:`engine.early_exit`) in
place: the kept rows' filled positions move to the first rows (dense: of the same buffers,
whose addresses a captured decode step relies on; tiled: to the contiguous tensors of the
smaller batch at the front of the same storage, one layer at a time).  With repeated rows it
copies the cache of a prompt prefilled once to each of its sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.attention import KVHook

KEY_TILE = 64
"""Positions per tile of the cached keys (a multiple of every vector width of the kernel)."""


class KVCache(Protocol):
    """A stage's KV cache (module docstring): what the layer paths, the early exit and the
    engine read."""

    layout: ClassVar[str]
    """``"tiled"`` or ``"dense"``."""
    length: int
    """Positions filled in every row."""
    max_len: int
    """Positions the current call may fill (past them a write raises)."""

    @property
    def rows(self) -> int:
        """The sequences the cache holds now."""

    @property
    def capacity(self) -> int:
        """Rows the storage was allocated for."""

    @property
    def positions(self) -> int:
        """Positions per row the storage was allocated for."""

    @property
    def nbytes(self) -> int:
        """Bytes of the storage."""

    def hook(self, layer: int) -> KVHook:
        """The ``kv_hook`` of local layer ``layer`` for the current step."""

    def advance(self, steps: int) -> None:
        """Mark ``steps`` more positions as filled (after every layer wrote them)."""

    def keep_rows_(self, rows: torch.Tensor) -> None:
        """Keep the sequences ``rows`` (``[n]`` int64 indices into the current batch, in the
        order they are to take; an index may repeat), in place."""

    def keys(self, start: int, end: int) -> torch.Tensor:
        """Cached keys of positions ``[start, end)``, transposed: ``[layers, B, h_kv, D,
        end - start]`` (a copy)."""

    def fits(self, capacity: int, max_len: int) -> bool:
        """Whether a call of up to ``capacity`` rows and ``max_len`` positions fits the
        storage (:meth:`reset_` then reuses it)."""

    def reset_(self, batch: int, max_len: int) -> None:
        """Start a call of ``batch`` rows and up to ``max_len`` positions on the same storage:
        ``length`` 0, K's positions zeros (ValueError unless :meth:`fits`)."""


def resolve_layout(layout: str | None, device: torch.device | str) -> str:
    """The KV layout for the user's ``layout`` on ``device`` (None: ``dense`` on CUDA,
    ``tiled`` elsewhere); ValueError for an unknown name.  :data:`KV_CACHES` maps it to its
    class."""
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
    """Bytes of a KV cache allocated for these sizes (``capacity`` rows, default ``batch``;
    tiled: K padded to whole tiles, and V; dense: K and V)."""
    item, rows = dtype.itemsize, batch if capacity is None else capacity
    if layout == "dense":
        return 2 * num_layers * rows * kv_heads * max_len * head_dim * item
    positions = key_tiles(max_len) * KEY_TILE + max_len
    return num_layers * rows * kv_heads * positions * head_dim * item


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


def _storage_sizes(batch: int, max_len: int, capacity: int | None, positions: int | None
                   ) -> tuple[int, int]:
    """``(capacity, positions)`` of a new cache's storage (defaults: ``batch``, ``max_len``);
    ValueError where they do not hold the first call's sizes."""
    capacity = batch if capacity is None else capacity
    positions = max_len if positions is None else positions
    if capacity < batch or positions < max_len:
        raise ValueError(f"capacity={capacity} < batch={batch} or positions={positions} < "
                         f"max_len={max_len}")
    return capacity, positions


def _check_end(length: int, steps: int, max_len: int) -> int:
    """End of the ``steps`` positions a step writes from ``length`` (overflow raises)."""
    end = length + steps
    if end > max_len:
        raise RuntimeError(f"KV cache overflow: {end} > max_len={max_len}")
    return end


class TiledKVCache:
    """Keys and values of ``num_layers`` layers in the ``tiled`` layout (module docstring):
    ``batch`` sequences of up to ``max_len`` positions, in storage for ``capacity`` rows of
    ``positions`` positions.

    Args:
        num_layers: layers of this rank's generation stage.
        batch: sequences of the first call.
        max_len: prompt length plus the new tokens that are fed back (``P + N - 1``).
        kv_heads: this rank's KV heads.
        head_dim: D.
        dtype: element type of the activations.
        device: where the cache lives (the weights' device; default CPU).
        capacity: rows the storage holds (default ``batch``; at least ``batch``).
        positions: positions per row the storage holds (default ``max_len``).
    """

    layout: ClassVar[str] = "tiled"

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 capacity: int | None = None, positions: int | None = None) -> None:
        self._capacity, self._positions = _storage_sizes(batch, max_len, capacity, positions)
        self._dims = (num_layers, kv_heads, head_dim)
        k_shape, v_shape = self._shapes(self._capacity, self._positions)
        self._k_store = torch.empty(math.prod(k_shape), dtype=dtype, device=device)
        self._v_store = torch.empty(math.prod(v_shape), dtype=dtype, device=device)
        self._scratch: torch.Tensor | None = None  # one layer's kept rows (keep_rows_)
        self.reset_(batch, max_len)

    def _shapes(self, rows: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        layers, heads, d = self._dims
        return ((layers, rows, heads, key_tiles(max_len), d, KEY_TILE),
                (layers, rows, heads, max_len, d))

    def _views(self, rows: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v`` of ``rows`` rows of ``max_len`` positions: the front of the storages."""
        k_shape, v_shape = self._shapes(rows, max_len)
        return (self._k_store[:math.prod(k_shape)].view(k_shape),
                self._v_store[:math.prod(v_shape)].view(v_shape))

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def positions(self) -> int:
        return self._positions

    @property
    def nbytes(self) -> int:
        return self._k_store.nbytes + self._v_store.nbytes

    def fits(self, capacity: int, max_len: int) -> bool:
        k_shape, v_shape = self._shapes(capacity, max_len)
        return (math.prod(k_shape) <= self._k_store.numel()
                and math.prod(v_shape) <= self._v_store.numel())

    def reset_(self, batch: int, max_len: int) -> None:
        if not self.fits(batch, max_len):
            raise ValueError(f"a call of {batch} rows and max_len={max_len} does not fit the "
                             f"KV cache's storage ({self._capacity} rows of "
                             f"{self._positions} positions)")
        self.k, self.v = self._views(batch, max_len)
        self.k.zero_()  # whole tile rows are read: the unfilled positions must be zeros
        self.max_len, self.length = max_len, 0

    def hook(self, layer: int) -> KVHook:
        def append(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # k, v [B, S, h_kv, D] -> cached k tiles [B, h_kv, T, D, KEY_TILE], v
            # [B, h_kv, 0:end, D]; both returned as [B, end, h_kv, D] (v a view, k a copy)
            end = _check_end(self.length, k.shape[1], self.max_len)
            kt = k.permute(0, 2, 3, 1)  # [B, h_kv, D, S]
            for t0 in range(self.length - self.length % KEY_TILE, end, KEY_TILE):
                a, b = max(self.length, t0), min(end, t0 + KEY_TILE)
                self.k[layer, :, :, t0 // KEY_TILE, :, a - t0:b - t0] = \
                    kt[..., a - self.length:b - self.length]
            self.v[layer, :, :, self.length:end] = v.transpose(1, 2)
            return (untile_keys(self.k[layer], 0, end).permute(0, 3, 1, 2),
                    self.v[layer, :, :, :end].transpose(1, 2))

        append.stacked_decode = False  # every KV cache's hook says which attention it takes
        return append

    def keys(self, start: int, end: int) -> torch.Tensor:
        return untile_keys(self.k, start, end)

    def advance(self, steps: int) -> None:
        self.length += steps

    def keep_rows_(self, rows: torch.Tensor) -> None:
        """In place (ValueError past the storage): the kept rows' filled positions ``[0,
        length)`` (the tiles of K that hold them whole) move to the ``[layers, n, ...]``
        tensors at the front of the storage; the rest of K is zeros, the rest of V unwritten,
        as before.

        The new tensors overlap the old ones, so each layer is gathered into a scratch of one
        layer first, and the layers go in the order that never overwrites a layer not yet
        read: shrinking, layer l's new place ends before layer l + 1's old one begins (front
        to back); growing (the copies of shared prompts), it begins after layer l - 1's old
        one ends (back to front)."""
        n, filled, t = rows.numel(), self.length, key_tiles(self.length)
        if not self.fits(n, self.max_len):
            raise ValueError(f"{n} rows of max_len={self.max_len} exceed the KV cache's "
                             f"storage ({self._capacity} rows of {self._positions} positions)")
        old_k, old_v = self.k, self.v
        k, v = self._views(n, self.max_len)
        k_kept = (n, *old_k.shape[2:3], t, *old_k.shape[4:])  # [n, h_kv, t, D, KEY_TILE]
        v_kept = (n, old_v.shape[2], filled, old_v.shape[4])  # [n, h_kv, filled, D]
        nk, nv = math.prod(k_kept), math.prod(v_kept)
        if self._scratch is None or self._scratch.numel() < nk + nv:
            self._scratch = old_k.new_empty(nk + nv)
        k_tmp, v_tmp = self._scratch[:nk].view(k_kept), self._scratch[nk:nk + nv].view(v_kept)
        layers = range(k.shape[0])
        for layer in (layers if n <= old_k.shape[1] else reversed(layers)):
            torch.index_select(old_k[layer, :, :, :t], 0, rows, out=k_tmp)
            torch.index_select(old_v[layer, :, :, :filled], 0, rows, out=v_tmp)
            k[layer, :, :, :t] = k_tmp
            k[layer, :, :, t:].zero_()
            v[layer, :, :, :filled] = v_tmp
        self.k, self.v = k, v


class DenseKVCache:
    """Keys and values of ``num_layers`` layers in the ``dense`` layout (module docstring):
    ``batch`` sequences of up to ``max_len`` positions in buffers of ``capacity`` rows and
    ``positions`` positions, whose addresses never change.

    Args: as :class:`TiledKVCache`'s (``capacity``: a decode bucket's rows for static steps).
    """

    layout: ClassVar[str] = "dense"

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 capacity: int | None = None, positions: int | None = None) -> None:
        capacity, positions = _storage_sizes(batch, max_len, capacity, positions)
        shape = (num_layers, capacity, kv_heads, positions, head_dim)
        self.k_buf = torch.empty(shape, dtype=dtype, device=device)
        self.v_buf = torch.empty(shape, dtype=dtype, device=device)
        self.reset_(batch, max_len)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k_buf.shape[1]

    @property
    def positions(self) -> int:
        return self.k_buf.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k_buf.nbytes + self.v_buf.nbytes

    def fits(self, capacity: int, max_len: int) -> bool:
        return capacity <= self.capacity and max_len <= self.positions

    def reset_(self, batch: int, max_len: int) -> None:
        if not self.fits(batch, max_len):
            raise ValueError(f"a call of {batch} rows and max_len={max_len} does not fit the "
                             f"KV cache's buffers ({self.capacity} rows of {self.positions} "
                             f"positions)")
        # zeros: a masked position's weight (0) times its value must stay 0, never NaN
        self.k_buf.zero_()
        self.v_buf.zero_()
        self.k, self.v = self.k_buf[:, :batch], self.v_buf[:, :batch]
        self.max_len, self.length = max_len, 0

    def hook(self, layer: int) -> KVHook:
        def append(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # k, v [B, S, h_kv, D] written at [B, h_kv, length:end, D]; [0, end) returned as
            # [B, end, h_kv, D] views
            end = _check_end(self.length, k.shape[1], self.max_len)
            self.k[layer, :, :, self.length:end] = k.transpose(1, 2)
            self.v[layer, :, :, self.length:end] = v.transpose(1, 2)
            return (self.k[layer, :, :, :end].transpose(1, 2),
                    self.v[layer, :, :, :end].transpose(1, 2))

        append.stacked_decode = True
        return append

    def keys(self, start: int, end: int) -> torch.Tensor:
        return self.k[:, :, :, start:end].transpose(-1, -2).clone()

    def advance(self, steps: int) -> None:
        self.length += steps

    def keep_rows_(self, rows: torch.Tensor) -> None:
        """In place: the filled positions of the kept rows move to rows ``[0, n)`` of the same
        buffers (ValueError past the capacity)."""
        n, filled = rows.numel(), self.length
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the dense cache's capacity {self.capacity}")
        for buf in (self.k_buf, self.v_buf):
            buf[:, :n, :, :filled] = buf[:, :, :, :filled].index_select(1, rows)
        self.k, self.v = self.k_buf[:, :n], self.v_buf[:, :n]

    def slots(self, rows: int, pos: torch.Tensor, positions: int | None = None
              ) -> DecodeSlots:
        """The first ``rows`` rows (up to the capacity) over the first ``positions`` positions
        (default all of the buffers'), written at the device position ``pos`` (a captured
        decode step's cache)."""
        positions = self.positions if positions is None else positions
        if rows > self.capacity or not 0 < positions <= self.positions:
            raise ValueError(f"slots of {rows} rows over {positions} positions exceed the "
                             f"dense cache's capacity {self.capacity} and positions "
                             f"{self.positions}")
        return DecodeSlots(self.k_buf[:, :rows, :, :positions],
                           self.v_buf[:, :rows, :, :positions], pos)


KV_CACHES: dict[str, type[KVCache]] = {c.layout: c for c in (TiledKVCache, DenseKVCache)}
"""Layout name -> class (:func:`resolve_layout` picks the name)."""
LAYOUTS = tuple(KV_CACHES)


@dataclass(frozen=True, eq=False)
class DecodeSlots:
    """Rows ``[0, b)`` of a dense cache over its first ``L`` positions (``pos < L <=
    positions``), written at the device position ``pos`` (``[1]`` int64): one decode step at
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
    """One new query reads the cache by :func:`engine.attention.decode_attention`."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v [b, 1, h_kv, D] -> position pos of [b, h_kv, L, D]
        self.k.index_copy_(2, self.pos, k.transpose(1, 2))
        self.v.index_copy_(2, self.pos, v.transpose(1, 2))
        return self.k.transpose(1, 2), self.v.transpose(1, 2)
