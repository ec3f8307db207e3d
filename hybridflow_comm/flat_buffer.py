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
  gives their memory back; :meth:`restore_generation_slots` takes it again before the next
  transition writes them.  Memory is handled in chunks (a page on CPU, the allocation
  granularity of CUDA virtual memory on GPUs); a chunk is released only when no byte of it
  belongs to a training slot, so a training shard is never touched and stays in place::

      storage  |  w: slot 0 | slot 1 (own) | slot 2 | slot 3  |pad| norm (own) | other stage |
      chunks   |   c0   |   c1   |   c2   |   c3   |   c4   |   c5   |   c6   |   c7   |
      segments |releasable|<-------- kept -------->|released|<-- kept ->|<- releasable ->|

  :func:`plan_segments` cuts each storage into such segments (pure arithmetic).  On CPU the
  storage is an anonymous mapping and released pages go back to the OS
  (``madvise(MADV_DONTNEED)``); on CUDA it is one reserved virtual range
  (:mod:`hybridflow_comm.cuda_vmm`) with one physical allocation per segment, unmapped on
  release and mapped again on restore.  Either way every view keeps its address.
* Release and restore mean the same on both devices: after a release, the slots outside this
  rank's training shards hold nothing (on CUDA their released chunks must not be touched;
  CPU pages read as zeros); after a restore they read as zeros.  Any access to them through the
  buffer (:meth:`gen_view`, :meth:`slot_view` of another rank's slot, :meth:`storage`,
  :meth:`byte_storage`) restores first, so a transition's writes always land in backed memory;
  views of other ranks' slots taken *before* a release must not be used after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridflow_comm import _C, cuda_vmm


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


@dataclass(frozen=True)
class Segment:
    """Bytes ``[lo, hi)`` of a storage, cut at chunk boundaries; ``releasable`` when no byte of
    it belongs to a training slot."""

    lo: int
    hi: int
    releasable: bool


def plan_segments(nbytes: int, keep: list[tuple[int, int]], chunk: int) -> list[Segment]:
    """Cut a storage of ``nbytes`` (rounded up to whole chunks, at least one) into maximal runs
    of chunks, alternately kept and releasable.

    Args:
        nbytes: bytes of the storage.
        keep: ``[start, end)`` byte ranges that must stay backed (the training slots).
        chunk: the unit of release (a page, or the CUDA allocation granularity).

    Returns:
        Segments covering ``[0, total)`` in order; a chunk is releasable iff it meets no
        non-empty keep range.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be positive")
    total = max(1, -(-nbytes // chunk)) * chunk
    pinned: list[list[int]] = []  # merged [first chunk, end chunk) runs that hold kept bytes
    for start, end in sorted(k for k in keep if k[1] > k[0]):
        if not 0 <= start < end <= total:
            raise ValueError(f"keep range [{start}, {end}) is outside [0, {total})")
        lo, hi = start // chunk, -(-end // chunk)
        if pinned and lo <= pinned[-1][1]:
            pinned[-1][1] = max(pinned[-1][1], hi)
        else:
            pinned.append([lo, hi])
    segments, cursor = [], 0
    for lo, hi in pinned + [[total // chunk, total // chunk]]:
        if lo > cursor:
            segments.append(Segment(cursor * chunk, lo * chunk, True))
        if hi > lo:
            segments.append(Segment(lo * chunk, hi * chunk, False))
        cursor = hi
    return segments


def _gaps(nbytes: int, keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges of ``[0, nbytes)`` outside every keep range."""
    out, cursor = [], 0
    for start, end in sorted(keep) + [(nbytes, nbytes)]:
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    return out


def _subtract(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` minus ``cut``; both sorted lists of disjoint ``[lo, hi)`` ranges."""
    out, j = [], 0
    for lo, hi in ranges:
        while j < len(cut) and cut[j][1] <= lo:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < hi:
            if cut[k][0] > lo:
                out.append((lo, cut[k][0]))
            lo = max(lo, cut[k][1])
            k += 1
        if hi > lo:
            out.append((lo, hi))
    return out


def _rank() -> int:
    """This process's rank in the default process group (0 without one), for messages."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _storage_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device} must be cpu or cuda")
    return device


class FlatParamBuffer:
    """A rank's generation shards of many parameters, one storage per dtype.

    Args:
        specs: the parameters, in the order their regions are laid out.
        align_bytes: alignment of every region start (power of two, at least the largest
            element size).
        device: ``"cpu"`` (page-aligned anonymous mappings) or a CUDA device (reserved
            virtual ranges, :mod:`hybridflow_comm.cuda_vmm`).  Both release and restore the
            generation-only slots (module docstring).
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
        self.device = _storage_device(device)
        self.specs = list(specs)
        self._regions: dict[str, _Region] = {}
        self._bytes: dict[torch.dtype, torch.Tensor] = {}  # uint8 view of each storage
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._segments: dict[torch.dtype, list[Segment]] = {}
        self._vmm: dict[torch.dtype, cuda_vmm.Reservation] = {}
        self._zeroed_by_os: dict[torch.dtype, list[tuple[int, int]]] = {}
        self._released = False
        for dtype in dict.fromkeys(s.dtype for s in specs):
            group = [s for s in specs if s.dtype == dtype]
            offsets = _C.plan_offsets([s.num_slots * s.slot_nbytes for s in group], align_bytes)
            for spec, off in zip(group, offsets):
                self._regions[spec.name] = _Region(spec, off)
            raw = self._allocate(dtype, offsets[-1])
            self._bytes[dtype] = raw
            self._typed[dtype] = raw.view(dtype)

    def _allocate(self, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """A zeroed 1-D uint8 storage of ``nbytes`` for ``dtype``, and its segment plan."""
        if self.device.type == "cpu":
            self._segments[dtype] = plan_segments(nbytes, self._keep_ranges(dtype),
                                                  _C.page_size())
            return _C.alloc_paged(nbytes)
        segments = plan_segments(nbytes, self._keep_ranges(dtype),
                                 cuda_vmm.granularity(self.device.index))
        reservation = cuda_vmm.Reservation(segments[-1].hi, self.device.index)
        for seg in segments:
            reservation.map(seg.lo, seg.hi)
        self._segments[dtype], self._vmm[dtype] = segments, reservation
        # torch holds the reservation for as long as a tensor on it lives
        return torch.as_tensor(reservation, device=self.device)[:nbytes].zero_()

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
        if slot != r.spec.own_slot:
            self._ensure_restored()
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
        self._ensure_restored()
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
        self._ensure_restored()
        return self._typed[dtype]

    def byte_storage(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole storage of ``dtype`` as 1-D uint8."""
        self._ensure_restored()
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

    @property
    def released(self) -> bool:
        """Whether the generation-only slots are released (until the next restore)."""
        return self._released

    def release_generation_slots(self) -> int:
        """Give back the memory of every chunk that holds no training slot.

        Training views keep their contents and addresses; the other slots hold nothing until
        :meth:`restore_generation_slots` (module docstring).  On CUDA the device is synchronised
        first, so no queued kernel still reads a released chunk.

        Returns:
            The bytes given back by this call.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        released = 0
        for dtype, raw in self._bytes.items():
            freed = []
            for seg in (g for g in self._segments[dtype] if g.releasable):
                if self.device.type == "cuda":
                    released += self._vmm[dtype].mapped_nbytes
                    self._vmm[dtype].unmap(seg.lo, seg.hi)
                    released -= self._vmm[dtype].mapped_nbytes
                elif seg.lo < raw.numel():
                    # the storage's last page may be partial: whole pages only
                    n = _C.release_pages(raw, seg.lo, min(seg.hi, raw.numel()) - seg.lo)
                    freed.append((seg.lo, seg.lo + n))
                    released += n
            self._zeroed_by_os[dtype] = freed
        self._released = True
        return released

    def restore_generation_slots(self) -> int:
        """Back the released chunks with memory again; every byte outside the training slots
        then reads as zero (a no-op when nothing is released).  The buffer counts as restored
        only once every chunk is backed.

        Returns:
            The bytes mapped again (CUDA); 0 on CPU, where the OS backs a page on its first
            write.

        Raises:
            torch.OutOfMemoryError: (CUDA) the device cannot back the chunks even after torch's
                caching allocator gave its cache back; the buffer stays released, nothing of
                this call stays mapped, and a later access tries again.
        """
        if not self._released:
            return 0
        restored = self._map_releasable() if self.device.type == "cuda" else 0
        for dtype, raw in self._bytes.items():
            stale = _subtract(_gaps(raw.numel(), self._keep_ranges(dtype)),
                              self._zeroed_by_os.pop(dtype, []))
            for lo, hi in stale:
                raw[lo:hi].zero_()
        self._released = False
        return restored

    def _map_releasable(self) -> int:
        """Map every releasable chunk of the CUDA storages; returns the bytes mapped.

        ``cuMemCreate`` takes memory from the device, not from torch's caching allocator, so
        blocks the allocator keeps cached for tensors are out of its reach: out of memory, the
        cache is emptied and the mapping tried once more (chunks already mapped stay).  Any
        failure after that unmaps every releasable chunk again, so that the buffer is
        consistently released and a later restore starts from scratch.
        """
        pieces = [(self._vmm[dtype], seg) for dtype, segments in self._segments.items()
                  for seg in segments if seg.releasable]
        before = sum(r.mapped_nbytes for r in self._vmm.values())
        try:
            try:
                for reservation, seg in pieces:
                    reservation.map(seg.lo, seg.hi)
            except cuda_vmm.OutOfMemory:
                torch.cuda.empty_cache()
                for reservation, seg in pieces:
                    reservation.map(seg.lo, seg.hi)  # a no-op for the chunks already mapped
        except Exception as exc:
            for reservation, seg in pieces:
                reservation.unmap(seg.lo, seg.hi)
            if not isinstance(exc, cuda_vmm.OutOfMemory):
                raise
            need = sum(seg.hi - seg.lo for _, seg in pieces)
            free = torch.cuda.mem_get_info(self.device)[0]
            raise torch.OutOfMemoryError(
                f"rank {_rank()}: restoring the released generation slots of a flat buffer on "
                f"{self.device} needs {need} bytes ({need / 2**20:.1f} MiB) of device memory; "
                f"{free} bytes are free after emptying torch's allocator cache ({exc})") from exc
        return sum(r.mapped_nbytes for r in self._vmm.values()) - before

    def _ensure_restored(self) -> None:
        if self._released:
            self.restore_generation_slots()

    def resident_nbytes(self) -> int:
        """Bytes of all storages backed by memory: resident whole pages on CPU, mapped chunks
        on CUDA."""
        if self.device.type == "cuda":
            return sum(r.mapped_nbytes for r in self._vmm.values())
        return sum(_C.resident_bytes(raw, 0, raw.numel()) for raw in self._bytes.values())
