"""Batch: the data that moves between roles (named tensors with one batch dimension).

A small own container instead of tensordict (not a dependency of the project)::

    Batch
      tensors      {"prompts": [B, Lp] int64, "values": [B] float32, ...}   dim 0 = batch
      non_tensors  {"uid": [B python objects], ...}                          one item per row
      meta         {"temperature": 1.0, ...}                                  not per row

Every operation returns a new Batch; tensors are views where torch allows (``rows`` with a
slice, ``select``, ``chunk``) and copies otherwise (``concat``, ``repeat``, ``reorder``).
Padding repeats the batch from its first row (so a padded row is a valid row) and records the
pad count in ``meta["_pad"]``; :meth:`unpad` removes exactly those rows.

Serialization (:meth:`to_bytes` / :meth:`from_bytes`) goes through :mod:`rlhf.controller.wire`,
which sends tensor storages as raw out-of-band buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from rlhf.controller import wire

PAD_KEY = "_pad"


@wire.allow
@dataclass
class Batch:
    """Named tensors sharing dim 0, per-row python objects and meta info.

    Args:
        tensors: name -> tensor with the batch on dim 0.
        non_tensors: name -> list (or tuple) with one item per row.
        meta: free-form info that is not per row (copied, not split, by every operation).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: int(v.shape[0]) for k, v in self.tensors.items() if _check_tensor(k, v)}
        for k, v in self.non_tensors.items():
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"non-tensor field {k!r} must be a list, got {type(v).__name__}")
            sizes[k] = len(v)
        if len(set(sizes.values())) > 1:
            raise ValueError(f"fields disagree on the batch size: {sizes}")
        self.non_tensors = {k: list(v) for k, v in self.non_tensors.items()}

    # Sizes -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def __getitem__(self, key: str) -> torch.Tensor | list:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"{key!r} is not a field of this batch (fields: {self.keys()})")

    def nbytes(self) -> int:
        """Bytes of tensor payload (what the transfer counters count)."""
        return sum(v.numel() * v.element_size() for v in self.tensors.values())

    def describe(self) -> dict:
        """Metadata only: size, field shapes and dtypes (what the controller keeps of a future)."""
        return {"size": len(self),
                "tensors": {k: (tuple(v.shape[1:]), str(v.dtype)) for k, v in self.tensors.items()},
                "non_tensors": list(self.non_tensors)}

    # Field operations -------------------------------------------------------------------------
    def select(self, keys: Iterable[str], meta_keys: Iterable[str] | None = None) -> Batch:
        """The named fields only (views); meta is kept whole unless ``meta_keys`` is given."""
        keys = list(keys)
        missing = [k for k in keys if k not in self.tensors and k not in self.non_tensors]
        if missing:
            raise KeyError(f"fields {missing} are not in this batch (fields: {self.keys()})")
        meta = self.meta if meta_keys is None else {k: self.meta[k] for k in meta_keys}
        return Batch({k: v for k, v in self.tensors.items() if k in keys},
                     {k: v for k, v in self.non_tensors.items() if k in keys}, dict(meta))

    def union(self, other: Batch) -> Batch:
        """Fields of both batches; a field in both must be equal (same values), or ValueError."""
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"union of batches of {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not torch.equal(tensors[k], v):
                raise ValueError(f"union: field {k!r} differs between the two batches")
            tensors[k] = v
        non_tensors = dict(self.non_tensors)
        for k, v in other.non_tensors.items():
            if k in non_tensors and non_tensors[k] != v:
                raise ValueError(f"union: field {k!r} differs between the two batches")
            non_tensors[k] = v
        for k, v in other.meta.items():
            if k in self.meta and self.meta[k] != v:
                raise ValueError(f"union: meta {k!r} differs ({self.meta[k]!r} vs {v!r})")
        return Batch(tensors, non_tensors, self.meta | other.meta)

    # Row operations ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Device of the tensors (of the first one; cpu for a batch without tensors)."""
        for v in self.tensors.values():
            return v.device
        return torch.device("cpu")

    def to(self, device: torch.device | str) -> Batch:
        """The same rows with every tensor on ``device`` (no copy for those already there)."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors,
                     dict(self.meta))

    def rows(self, index: slice | Sequence[int] | torch.Tensor) -> Batch:
        """Rows by slice (views) or by integer index (copies)."""
        if isinstance(index, slice):
            return Batch({k: v[index] for k, v in self.tensors.items()},
                         {k: v[index] for k, v in self.non_tensors.items()}, dict(self.meta))
        idx = torch.as_tensor(index, dtype=torch.long, device=self.device)
        if idx.dim() != 1:
            raise ValueError(f"row index must be 1-D, got shape {tuple(idx.shape)}")
        n = len(self)
        # host synchronisation: the bounds check and the per-row lists read the index
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"row index out of range for a batch of {n} rows")
        pos = idx.tolist()
        return Batch({k: v.index_select(0, idx % max(n, 1)) for k, v in self.tensors.items()},
                     {k: [v[i] for i in pos] for k, v in self.non_tensors.items()},
                     dict(self.meta))

    def reorder(self, order: Sequence[int] | torch.Tensor) -> Batch:
        """Rows in the given order; ``order`` must be a permutation of ``range(len(self))``."""
        idx = torch.as_tensor(order, dtype=torch.long, device=self.device)
        if sorted(idx.tolist()) != list(range(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got {idx.tolist()}")
        return self.rows(idx)

    def chunk(self, k: int) -> list[Batch]:
        """``k`` equal chunks (views); ValueError unless ``k`` divides the size (pad first)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"chunk count must be a positive int, got {k!r}")
        if len(self) % k:
            raise ValueError(f"cannot chunk {len(self)} rows into {k} equal chunks; pad first")
        c = len(self) // k
        return [self.rows(slice(i * c, (i + 1) * c)) for i in range(k)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; fields must match; meta of the first batch."""
        if not batches:
            raise ValueError("concat of an empty list of batches")
        first = batches[0]
        if len(batches) == 1:
            return first.rows(slice(None))  # views, no copy
        for b in batches[1:]:
            if set(b.tensors) != set(first.tensors) or set(b.non_tensors) != set(first.non_tensors):
                raise ValueError(f"concat: fields differ: {first.keys()} vs {b.keys()}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors = {k: [x for b in batches for x in b.non_tensors[k]] for k in first.non_tensors}
        return Batch(tensors, non_tensors, dict(first.meta))

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row ``times`` times: ``a a b b`` (interleave) or ``a b a b``."""
        if not isinstance(times, int) or times < 1:
            raise ValueError(f"repeat times must be a positive int, got {times!r}")
        n = len(self)
        if interleave:
            idx = torch.arange(n, device=self.device).repeat_interleave(times)
        else:
            idx = torch.arange(n, device=self.device).repeat(times)
        return self.rows(idx)

    def pad_to_multiple(self, k: int) -> Batch:
        """Append rows (copies of the first rows, cyclically) up to a multiple of ``k``."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"pad multiple must be a positive int, got {k!r}")
        n = len(self)
        pad = (-n) % k
        if pad and n == 0:
            raise ValueError("cannot pad an empty batch")
        out = self.rows(torch.arange(n + pad, device=self.device) % max(n, 1)) if pad \
            else self.rows(slice(None))
        out.meta[PAD_KEY] = self.meta.get(PAD_KEY, 0) + pad
        return out

    def unpad(self) -> Batch:
        """Drop the rows that :meth:`pad_to_multiple` added."""
        pad = int(self.meta.get(PAD_KEY, 0))
        out = self.rows(slice(0, len(self) - pad))
        out.meta.pop(PAD_KEY, None)
        return out

    # Serialization ----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return wire.dumps(self)

    @staticmethod
    def from_bytes(data: bytes | bytearray | memoryview) -> Batch:
        out = wire.loads(data)
        if not isinstance(out, Batch):
            raise TypeError(f"bytes hold a {type(out).__name__}, not a Batch")
        return out

    def equal(self, other: Batch) -> bool:
        """Same fields, same values (bit-exact), same meta."""
        return (set(self.tensors) == set(other.tensors)
                and all(self.tensors[k].dtype == other.tensors[k].dtype
                        and torch.equal(self.tensors[k], other.tensors[k]) for k in self.tensors)
                and self.non_tensors == other.non_tensors and self.meta == other.meta)


def _check_tensor(name: str, value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tensor field {name!r} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 0:
        raise ValueError(f"tensor field {name!r} needs a batch dim, got a 0-d tensor")
    return True
