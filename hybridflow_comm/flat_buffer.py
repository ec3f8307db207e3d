"""Flat parameter buffers: one page-aligned storage per dtype, every parameter a view.

The buffer of one rank holds that rank's *generation shard* of every parameter, laid out
parameter-major.  Each parameter owns one region made of ``num_slots`` equal slots; slot ``k``
holds the training shard of micro-DP rank ``k`` (see :mod:`hybridflow_comm.layout`), so the
slot numbered by this rank's micro-DP rank *is* its training parameter::

    storage[float32]  (one anonymous mapping, page aligned)
    |<------------- region "wq" ------------->|pad|<--- region "norm" --->|pad|<-- region "wo"
    | slot 0     | slot 1     | slot 2 | ...  |   | slot 0 (num_slots=1) |   | slot 0 | slot 1 ..
    | rank k=0   | rank k=1   |        |      |   | replicated           |   |
                 ^ this rank's training view (micro-DP rank 1): no copy, fixed address
    ^ generation view: the whole region, shape [num_slots, *slot_shape]  # [m, *shard]

Rules:

* Regions start at a multiple of ``align_bytes`` (default 64, a cache line; zeros in between);
  slots inside a region are packed with no padding, so the generation view is contiguous.  For
  a shard split on dim 0, ``gen_view(name).flatten(0, 1)`` is the concatenated generation
  tensor; for any other partition dim the generation layer reads the stacked ``[m, *shard]``
  form directly (the resharder documents which).
* A parameter that this rank does not hold in training (``own_slot=None``: it lives on another
  pipeline stage) still has a region; all of its slots arrive by the transition.
* During training the slots of other ranks are dead weight.  :meth:`release_generation_slots`
  returns their physical pages to the OS (``madvise(MADV_DONTNEED)``): the virtual addresses stay
  reserved, so every view keeps its address, and the next write (the all-gather of the next
  transition) faults fresh zeroed pages back in.  Only whole pages that lie entirely outside
  every training slot are released, so a training shard is never touched and stays in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridflow_comm import _C


@dataclass(frozen=True)
class SlotSpec:
    """One parameter's region in a rank's flat buffer.

    Attributes:
        name: parameter name, unique in the buffer.
        dtype: element type; one storage is made per dtype.
        slot_shape: shape of one slot, i.e. of one training shard.
        num_slots: slots in this rank's generation shard of the parameter (1 for a tensor that
            the transition does not gather, such as a replicated norm).
        own_slot: the slot that is this rank's training shard, or None when this rank does not
            hold the parameter in training (another pipeline stage owns it).
    """

    name: str
    dtype: torch.dtype
    slot_shape: tuple[int, ...]
    num_slots: int = 1
    own_slot: int | None = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"{self.name}: dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "slot_shape", tuple(int(s) for s in self.slot_shape))
        if any(s < 0 for s in self.slot_shape):
            raise ValueError(f"{self.name}: slot_shape={self.slot_shape} has a negative size")
        if self.num_slots < 1:
            raise ValueError(f"{self.name}: num_slots={self.num_slots} must be >= 1")
        if self.own_slot is not None and not 0 <= self.own_slot < self.num_slots:
            raise ValueError(
                f"{self.name}: own_slot={self.own_slot} is outside [0, {self.num_slots})")

    @property
    def slot_numel(self) -> int:
        return math.prod(self.slot_shape)

    @property
    def slot_nbytes(self) -> int:
        return self.slot_numel * self.dtype.itemsize


@dataclass(frozen=True)
class _Region:
    spec: SlotSpec
    byte_offset: int  # start of slot 0 inside the dtype's storage


class FlatParamBuffer:
    """A rank's generation shards of many parameters, one storage per dtype.

    Args:
        specs: the parameters, in the order their regions are laid out.
        align_bytes: alignment of every region start (power of two, at least the largest
            element size).
        device: ``"cpu"`` (page-aligned mappings whose pages can be released) or a CUDA
            device (one ``torch.empty`` per dtype; page release there would need CUDA virtual
            memory management and is not done: :meth:`release_generation_slots` returns 0).
    """

    def __init__(self, specs: list[SlotSpec], align_bytes: int = 64,
                 device: str | torch.device = "cpu") -> None:
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate parameter names in the flat buffer: {dup}")
        if align_bytes < 16 or align_bytes & (align_bytes - 1):
            raise ValueError(f"align_bytes={align_bytes} must be a power of two >= 16")
        self.align_bytes = align_bytes
        self.device = torch.device(device)
        self.specs = list(specs)
        self._regions: dict[str, _Region] = {}
        self._bytes: dict[torch.dtype, torch.Tensor] = {}  # uint8 view of each storage
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dict.fromkeys(s.dtype for s in specs):
            group = [s for s in specs if s.dtype == dtype]
            offsets = _C.plan_offsets([s.num_slots * s.slot_nbytes for s in group], align_bytes)
            raw = (_C.alloc_paged(offsets[-1]) if self.device.type == "cpu" else
                   torch.zeros(offsets[-1], dtype=torch.uint8, device=self.device))
            self._bytes[dtype] = raw
            self._typed[dtype] = raw.view(dtype)
            for spec, off in zip(group, offsets):
                self._regions[spec.name] = _Region(spec, off)

    # Views --------------------------------------------------------------------------------
    def spec(self, name: str) -> SlotSpec:
        return self._region(name).spec

    def _region(self, name: str) -> _Region:
        try:
            return self._regions[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r} in this flat buffer") from None

    def slot_view(self, name: str, slot: int) -> torch.Tensor:
        """Slot ``slot`` of ``name``, shaped like one training shard."""
        r = self._region(name)
        if not 0 <= slot < r.spec.num_slots:
            raise ValueError(f"{name}: slot={slot} is outside [0, {r.spec.num_slots})")
        start = r.byte_offset // r.spec.dtype.itemsize + slot * r.spec.slot_numel
        flat = self._typed[r.spec.dtype][start:start + r.spec.slot_numel]
        return flat.view(r.spec.slot_shape)

    def train_view(self, name: str) -> torch.Tensor:
        """This rank's training shard of ``name``: a view of its own slot."""
        spec = self._region(name).spec
        if spec.own_slot is None:
            raise ValueError(f"{name}: this rank holds no training shard of it (own_slot=None)")
        return self.slot_view(name, spec.own_slot)

    def gen_view(self, name: str) -> torch.Tensor:
        """The whole region of ``name``: shape ``[num_slots, *slot_shape]``."""
        r = self._region(name)
        start = r.byte_offset // r.spec.dtype.itemsize
        n = r.spec.num_slots * r.spec.slot_numel
        return self._typed[r.spec.dtype][start:start + n].view(r.spec.num_slots,
                                                               *r.spec.slot_shape)

    def byte_offset(self, name: str, slot: int = 0) -> int:
        """Byte offset of ``slot`` of ``name`` inside its dtype's storage."""
        r = self._region(name)
        return r.byte_offset + slot * r.spec.slot_nbytes

    def storage(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole typed storage of ``dtype`` (1-D)."""
        return self._typed[dtype]

    def byte_storage(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole storage of ``dtype`` as 1-D uint8."""
        return self._bytes[dtype]

    @property
    def dtypes(self) -> list[torch.dtype]:
        return list(self._typed)

    def train_views(self) -> dict[str, torch.Tensor]:
        return {s.name: self.train_view(s.name) for s in self.specs if s.own_slot is not None}

    # Sizes --------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes reserved (virtual) over all storages, padding included."""
        return sum(b.numel() for b in self._bytes.values())

    @property
    def train_nbytes(self) -> int:
        """Bytes of this rank's training shards."""
        return sum(s.slot_nbytes for s in self.specs if s.own_slot is not None)

    @property
    def gen_nbytes(self) -> int:
        """Bytes of this rank's generation shards (all slots, no padding)."""
        return sum(s.num_slots * s.slot_nbytes for s in self.specs)

    # Memory release -----------------------------------------------------------------------
    def _keep_ranges(self, dtype: torch.dtype) -> list[tuple[int, int]]:
        keep = []
        for s in self.specs:
            if s.dtype == dtype and s.own_slot is not None:
                start = self.byte_offset(s.name, s.own_slot)
                keep.append((start, start + s.slot_nbytes))
        return sorted(keep)

    def release_generation_slots(self) -> int:
        """Return the pages of every slot that is not this rank's training shard to the OS.

        Views stay valid and keep their addresses; released slots read as zeros until the next
        transition writes them.  Returns the bytes released.
        """
        released = 0
        if self.device.type != "cpu":
            return 0
        for dtype, raw in self._bytes.items():
            cursor = 0
            for start, end in self._keep_ranges(dtype) + [(raw.numel(), raw.numel())]:
                if start > cursor:
                    released += _C.release_pages(raw, cursor, start - cursor)
                cursor = max(cursor, end)
        return released

    def resident_nbytes(self) -> int:
        """Bytes of all storages whose pages are resident in RAM (whole pages)."""
        if self.device.type != "cpu":
            return self.nbytes
        return sum(_C.resident_bytes(raw, 0, raw.numel()) for raw in self._bytes.values())
