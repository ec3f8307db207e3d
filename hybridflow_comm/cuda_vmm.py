"""CUDA virtual memory management through the driver API (``libcuda.so.1`` via ctypes).

One :class:`Reservation` is a fixed range of device virtual addresses whose physical backing
can be given back and taken again piece by piece, while every pointer into the range stays
the same.  The flat parameter buffer uses it to drop the generation-only slots between phases::

    cuMemAddressReserve   [------------------- reserved virtual range -------------------]
    cuMemCreate + cuMemMap [== segment 0 ==][-- segment 1 --][== segment 2 ==][-- seg 3 --]
       + cuMemSetAccess     always mapped    unmap / re-map   always mapped    unmap / re-map

A segment is a multiple of the allocation granularity (:func:`granularity`, 2 MiB on current
GPUs) and owns one physical allocation (``cuMemCreate``), so unmapping it and releasing its
handle returns its memory to the device at once (``cuMemUnmap`` must cover exactly what one
``cuMemMap`` mapped).  The range is exposed to torch through ``__cuda_array_interface__``;
torch keeps the reservation object alive for as long as any tensor on it lives.

Every call runs with the device's primary context pushed (the context torch's runtime uses),
so a reservation works from any thread.  A failing call raises RuntimeError naming the driver
function and its ``CUresult``; out of device memory it is :class:`OutOfMemory`.  Physical
memory mapped this way bypasses torch's caching allocator, so ``torch.cuda.memory_allocated``
does not count it: :func:`mapped_bytes` does.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class OutOfMemory(RuntimeError):
    """A driver call failed with ``CUDA_ERROR_OUT_OF_MEMORY``."""


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):  # CUmemAllocationProp::allocFlags
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_contexts: dict[int, ctypes.c_void_p] = {}
_mapped: dict[int, int] = {}  # device -> bytes mapped by every live reservation on it


def mapped_bytes(device: int) -> int:
    """Physical bytes this process has mapped on ``device`` through reservations (no driver
    call: a tally kept by :meth:`Reservation.map` and :meth:`Reservation.unmap`)."""
    return _mapped.get(device, 0)


def _tally(device: int, nbytes: int) -> None:
    with _lock:
        _mapped[device] = _mapped.get(device, 0) + nbytes


def _driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise RuntimeError(f"CUDA virtual memory needs the driver library "
                                   f"libcuda.so.1: {e}") from None
            _check(lib, lib.cuInit(0), "cuInit")
            _lib = lib
        return _lib


def _check(lib: ctypes.CDLL, result: int, call: str) -> None:
    if result == 0:
        return
    name = ctypes.c_char_p()
    known = lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value
    error = OutOfMemory if result == CUDA_ERROR_OUT_OF_MEMORY else RuntimeError
    raise error(f"{call} failed: {name.value.decode() if known else 'CUresult'} ({result})")


def _call(call: str, *args) -> None:
    lib = _driver()
    _check(lib, getattr(lib, call)(*args), call)


def _primary_context(device: int) -> ctypes.c_void_p:
    ctx = _contexts.get(device)
    if ctx is None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        _call("cuDeviceGet", ctypes.byref(dev), device)
        _call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)  # held for the process
        _contexts[device] = ctx
    return ctx


@contextmanager
def _on(device: int):
    _call("cuCtxPushCurrent_v2", _primary_context(device))
    try:
        yield
    finally:
        _call("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE
    prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device)
    return prop


def granularity(device: int) -> int:
    """The minimum allocation granularity of device ``device`` in bytes (the size every
    segment and the reserved range are multiples of)."""
    size = ctypes.c_size_t()
    with _on(device):
        _call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(_prop(device)),
              CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    return size.value


class Reservation:
    """``nbytes`` of reserved device addresses on ``device``, mapped segment by segment.

    Args:
        nbytes: size of the range; a positive multiple of :func:`granularity`.
        device: CUDA device ordinal.

    Segments are ``(lo, hi)`` byte ranges relative to :attr:`ptr`, each a multiple of the
    granularity; :meth:`map` and :meth:`unmap` take the same segment.  The memory of a fresh
    mapping is uninitialised.
    """

    def __init__(self, nbytes: int, device: int) -> None:
        step = granularity(device)
        if nbytes <= 0 or nbytes % step:
            raise ValueError(f"nbytes={nbytes} must be a positive multiple of the "
                             f"granularity {step}")
        self.nbytes, self.device, self.granularity = nbytes, device, step
        self.ptr: int | None = None
        self._handles: dict[tuple[int, int], int] = {}
        ptr = ctypes.c_uint64()
        with _on(device):
            _call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                  ctypes.c_size_t(step), ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        self.ptr = ptr.value

    def _check_segment(self, lo: int, hi: int) -> None:
        if not (0 <= lo < hi <= self.nbytes and lo % self.granularity == 0
                and hi % self.granularity == 0):
            raise ValueError(f"segment [{lo}, {hi}) is not granularity-aligned inside "
                             f"[0, {self.nbytes})")

    def map(self, lo: int, hi: int) -> None:
        """Back ``[lo, hi)`` with a new physical allocation, read-write for this device."""
        self._check_segment(lo, hi)
        if (lo, hi) in self._handles:
            return
        handle = ctypes.c_ulonglong()
        size = ctypes.c_size_t(hi - lo)
        access = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, self.device),
                             CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        with _on(self.device):
            _call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(_prop(self.device)),
                  ctypes.c_ulonglong(0))
            try:
                _call("cuMemMap", ctypes.c_uint64(self.ptr + lo), size, ctypes.c_size_t(0),
                      handle, ctypes.c_ulonglong(0))
            except RuntimeError:
                _call("cuMemRelease", handle)
                raise
            try:
                _call("cuMemSetAccess", ctypes.c_uint64(self.ptr + lo), size,
                      ctypes.byref(access), ctypes.c_size_t(1))
            except RuntimeError:  # nothing of this segment may stay behind
                _call("cuMemUnmap", ctypes.c_uint64(self.ptr + lo), size)
                _call("cuMemRelease", handle)
                raise
        self._handles[(lo, hi)] = handle.value
        _tally(self.device, hi - lo)

    def unmap(self, lo: int, hi: int) -> None:
        """Unmap ``[lo, hi)`` and free its physical memory; the addresses stay reserved.
        The caller makes sure no queued kernel still uses the segment."""
        self._check_segment(lo, hi)
        handle = self._handles.pop((lo, hi), None)
        if handle is None:
            return
        with _on(self.device):
            _call("cuMemUnmap", ctypes.c_uint64(self.ptr + lo), ctypes.c_size_t(hi - lo))
            _call("cuMemRelease", ctypes.c_ulonglong(handle))
        _tally(self.device, lo - hi)

    @property
    def mapped_nbytes(self) -> int:
        """Bytes currently backed by physical memory."""
        return sum(hi - lo for lo, hi in self._handles)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None}

    def close(self) -> None:
        """Wait for the device, unmap everything and free the address range (idempotent)."""
        if getattr(self, "ptr", None) is None:
            return
        with _on(self.device):
            _call("cuCtxSynchronize")
        for lo, hi in list(self._handles):
            self.unmap(lo, hi)
        with _on(self.device):
            _call("cuMemAddressFree", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes))
        self.ptr = None

    def __del__(self) -> None:
        # torch drops its reference when the last tensor on the range is freed; at interpreter
        # exit the driver may already be gone, and there is nothing left to give back then
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
