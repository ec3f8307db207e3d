"""Flat parameter buffers and pack/unpack (single process); the CUDA restore's handling of an
out-of-memory mapping on a stand-in for the driver (tests/test_gpu_memory.py: on the device)."""

import itertools
import random

import pytest
import torch

from hybridflow_comm import _C, cuda_vmm
from hybridflow_comm.flat_buffer import FlatParamBuffer, SlotSpec, _gaps, _subtract, plan_segments
from hybridflow_comm.pack import pack_tensors, plan_pack, unpack_tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.uint8]


def _specs(seed=0, n=30):
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        num = rng.choice([1, 2, 4])
        own = rng.choice([None] + list(range(num)))
        specs.append(SlotSpec(f"p{i}", rng.choice(DTYPES[:3]), shape, num, own))
    specs.append(SlotSpec("big", torch.float32, (256, 512), 4, 2))  # spans many pages
    return specs


def test_views_alias_one_storage_per_dtype():
    specs = _specs()
    buf = FlatParamBuffer(specs)
    for dtype in buf.dtypes:
        base = buf.storage(dtype)
        assert buf.byte_storage(dtype).untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert base.untyped_storage().data_ptr() % _C.page_size() == 0
    for s in specs:
        base = buf.storage(s.dtype)
        gen = buf.gen_view(s.name)
        assert gen.shape == (s.num_slots, *s.slot_shape)
        assert gen.is_contiguous()
        assert gen.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        item = gen.element_size()
        assert buf.byte_offset(s.name) % buf.align_bytes == 0
        assert gen.storage_offset() * item == buf.byte_offset(s.name)
        for k in range(s.num_slots):
            v = buf.slot_view(s.name, k)
            assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            assert v.storage_offset() * item == buf.byte_offset(s.name) + k * s.slot_numel * item
            assert v.data_ptr() == gen[k].data_ptr()
        if s.own_slot is not None:
            tv = buf.train_view(s.name)
            assert tv.shape == s.slot_shape
            assert tv.data_ptr() == gen[s.own_slot].data_ptr()
        else:
            with pytest.raises(ValueError, match="own_slot=None"):
                buf.train_view(s.name)


def test_regions_do_not_overlap_and_writes_land_in_place():
    specs = _specs(seed=1)
    buf = FlatParamBuffer(specs)
    for i, s in enumerate(specs):
        buf.gen_view(s.name).fill_(i + 1)
    for i, s in enumerate(specs):
        assert torch.all(buf.gen_view(s.name) == i + 1), s.name
    # A write through the training view is visible in the generation view and the storage.
    tv = buf.train_view("big")
    tv.zero_()
    assert torch.all(buf.gen_view("big")[2] == 0)
    assert torch.all(buf.gen_view("big")[1] != 0)


def test_release_keeps_training_shards_and_frees_pages():
    specs = [SlotSpec("w", torch.float32, (512, 256), 4, 1),
             SlotSpec("n", torch.float32, (256,), 1, 0),
             SlotSpec("other_stage", torch.float32, (512, 256), 2, None)]
    buf = FlatParamBuffer(specs)
    for s in specs:
        buf.gen_view(s.name).normal_()
    before = {n: t.clone() for n, t in buf.train_views().items()}
    ptrs = {n: t.data_ptr() for n, t in buf.train_views().items()}
    resident_before = buf.resident_nbytes()
    released = buf.release_generation_slots()
    gen_only = buf.gen_nbytes - buf.train_nbytes
    page = _C.page_size()
    assert gen_only - 4 * page <= released <= gen_only
    assert buf.resident_nbytes() <= resident_before - released + page
    for n, t in buf.train_views().items():
        assert t.data_ptr() == ptrs[n]
        assert torch.equal(t, before[n])
    # Released slots read zeros; writing re-creates them at the same address.
    raw = buf.byte_storage(torch.float32)
    for name, lo_slot, hi_slot in (("other_stage", 0, 2), ("w", 2, 4)):
        lo = -(-buf.byte_offset(name, lo_slot) // page) * page  # whole pages inside the slots
        hi = buf.byte_offset(name, hi_slot) // page * page
        assert hi - lo > page and torch.all(raw[lo:hi] == 0)
    buf.gen_view("w")[3].fill_(5.0)
    assert torch.all(buf.slot_view("w", 3) == 5.0)
    assert torch.equal(buf.train_view("w"), before["w"])


def _byte_mask(buf, dtype):
    """True at every byte of ``dtype``'s storage that lies in a training slot (by slot views)."""
    raw = buf._bytes[dtype]  # the raw storage, without the restoring accessor
    base = raw.data_ptr()
    mask = torch.zeros(raw.numel(), dtype=torch.bool)
    for s in buf.specs:
        if s.dtype == dtype and s.own_slot is not None:
            start = buf.train_view(s.name).data_ptr() - base
            mask[start:start + s.slot_nbytes] = True
    return raw, mask


def test_restore_zeroes_every_generation_only_byte_and_keeps_training_shards():
    specs = _specs(seed=2)
    buf = FlatParamBuffer(specs)
    for rnd in range(2):  # two transitions: release and restore twice
        for s in specs:
            buf.gen_view(s.name).fill_(rnd + 7)
        before = {n: t.clone() for n, t in buf.train_views().items()}
        assert buf.release_generation_slots() > 0 and buf.released
        resident_released = buf.resident_nbytes()
        assert buf.restore_generation_slots() == 0  # CPU: pages come back on first write
        assert not buf.released and buf.restore_generation_slots() == 0
        assert buf.resident_nbytes() <= resident_released + 2 * _C.page_size() * len(specs)
        for dtype in buf.dtypes:
            raw, mask = _byte_mask(buf, dtype)
            assert torch.all(raw[~mask] == 0), dtype
        for n, t in buf.train_views().items():
            assert torch.equal(t, before[n]), n


def test_access_after_release_restores_first():
    specs = [SlotSpec("w", torch.float32, (512, 256), 4, 1)]
    buf = FlatParamBuffer(specs)
    buf.gen_view("w").fill_(3.0)
    buf.release_generation_slots()
    buf.train_view("w")  # its own slot: no restore needed
    assert buf.released
    assert torch.all(buf.slot_view("w", 0) == 0) and not buf.released
    buf.release_generation_slots()
    buf.byte_storage(torch.float32)
    assert not buf.released
    assert torch.all(buf.gen_view("w")[1] == 3.0) and torch.all(buf.gen_view("w")[2:] == 0)


class _Driver:
    """Stands in for the CUDA driver's ``cuMemCreate``: counts the mappings asked for and
    fails those whose number is in ``oom_at`` with ``CUDA_ERROR_OUT_OF_MEMORY``."""

    def __init__(self, oom_at=()):
        self.calls, self.oom_at = 0, set(oom_at)

    def create(self):
        self.calls += 1
        if self.calls in self.oom_at:
            raise cuda_vmm.OutOfMemory("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)")


class _FakeReservation:
    """:class:`cuda_vmm.Reservation`'s bookkeeping (map/unmap of whole segments, idempotent)."""

    def __init__(self, driver, segments):
        self.driver, self.mapped = driver, {(g.lo, g.hi) for g in segments}

    def map(self, lo, hi):
        if (lo, hi) not in self.mapped:
            self.driver.create()
            self.mapped.add((lo, hi))

    def unmap(self, lo, hi):
        self.mapped.discard((lo, hi))

    @property
    def mapped_nbytes(self):
        return sum(hi - lo for lo, hi in self.mapped)


def _fake_cuda_buffer(monkeypatch, driver):
    """A CPU buffer whose memory calls take the CUDA path onto :class:`_FakeReservation`s;
    its generation slots hold 5s, its training slots 1, 2, ...; returns it and the list of
    ``torch.cuda.empty_cache`` calls."""
    specs = [SlotSpec("w", torch.float32, (4096,), 4, 1),
             SlotSpec("other_stage", torch.bfloat16, (8192,), 2, None),
             SlotSpec("norm", torch.bfloat16, (64,), 1, 0)]
    buf = FlatParamBuffer(specs)
    for s in specs:
        buf.gen_view(s.name).fill_(5)
    for i, t in enumerate(buf.train_views().values()):
        t.fill_(i + 1)
    emptied = []
    monkeypatch.setattr(buf, "device", torch.device("cuda", 0))
    buf._vmm = {d: _FakeReservation(driver, buf._segments[d]) for d in buf.dtypes}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 20, 80 << 30))
    return buf, emptied


def _assert_restored(buf, trained):
    assert not buf.released
    for dtype in buf.dtypes:
        assert buf._vmm[dtype].mapped == {(g.lo, g.hi) for g in buf._segments[dtype]}
        raw, mask = _byte_mask(buf, dtype)
        assert torch.all(raw[~mask] == 0), dtype
    for n, t in buf.train_views().items():
        assert torch.equal(t, trained[n]), n


def test_cuda_restore_out_of_memory_empties_the_allocator_cache_and_maps_the_rest(monkeypatch):
    driver = _Driver()
    buf, emptied = _fake_cuda_buffer(monkeypatch, driver)
    trained = {n: t.clone() for n, t in buf.train_views().items()}
    released = buf.release_generation_slots()
    kept = buf.resident_nbytes()
    assert released > 0 and buf.released
    driver.calls, driver.oom_at = 0, {2}  # the second chunk finds the memory in torch's cache
    assert buf.restore_generation_slots() == released
    assert emptied == [True] and driver.calls == 4  # 3 chunks, the second asked for twice
    assert buf.resident_nbytes() == kept + released
    _assert_restored(buf, trained)


def test_cuda_restore_that_does_not_fit_stays_released_and_says_so(monkeypatch):
    """A chunk that cannot be backed even after the cache is emptied: one error naming the
    rank and the bytes, nothing of the restore left mapped, the buffer still released (its
    released chunks are never handed out), and the next access restores cleanly."""
    driver = _Driver()
    buf, emptied = _fake_cuda_buffer(monkeypatch, driver)
    trained = {n: t.clone() for n, t in buf.train_views().items()}
    released = buf.release_generation_slots()
    kept = buf.resident_nbytes()
    driver.calls, driver.oom_at = 0, {2, 3}  # the second chunk, and again after emptying
    with pytest.raises(torch.OutOfMemoryError,
                       match=rf"^rank 0: .* on cuda:0 needs {released} bytes .* 3145728 bytes "
                             r"are free .*CUDA_ERROR_OUT_OF_MEMORY"):
        buf.restore_generation_slots()
    assert emptied == [True] and buf.released and buf.resident_nbytes() == kept
    driver.calls, driver.oom_at = 0, {1, 2}
    with pytest.raises(torch.OutOfMemoryError):  # every access restores first: no stale view
        buf.gen_view("w")
    assert len(emptied) == 2 and buf.released and buf.resident_nbytes() == kept
    driver.oom_at = set()
    assert torch.all(buf.gen_view("other_stage") == 0)
    _assert_restored(buf, trained)


def _chunk_flags(nbytes, keep, chunk):
    """Reference: per chunk, True when no non-empty keep range meets it."""
    n = max(1, -(-nbytes // chunk))
    return [not any(a < (i + 1) * chunk and b > i * chunk for a, b in keep if b > a)
            for i in range(n)]


def _range_sets(nbytes):
    spans = [(a, b) for a in range(nbytes + 1) for b in range(a, nbytes + 1)]
    yield []
    for k in (1, 2):
        for combo in itertools.combinations(spans, k):
            if k == 1 or combo[0][1] <= combo[1][0]:
                yield list(combo)


def test_plan_segments_exhaustive_small():
    for chunk in (1, 2, 3, 4):
        for nbytes in range(0, 10):
            for keep in _range_sets(nbytes):
                segs = plan_segments(nbytes, keep, chunk)
                flags = _chunk_flags(nbytes, keep, chunk)
                assert segs[0].lo == 0 and segs[-1].hi == len(flags) * chunk
                for a, b in zip(segs, segs[1:]):
                    assert a.hi == b.lo and a.releasable != b.releasable  # maximal runs
                for g in segs:
                    assert g.lo % chunk == 0 and g.hi % chunk == 0 and g.hi > g.lo
                    assert all(f == g.releasable for f in flags[g.lo // chunk:g.hi // chunk])
    with pytest.raises(ValueError, match="chunk=0"):
        plan_segments(8, [], 0)
    with pytest.raises(ValueError, match=r"\[6, 12\)"):
        plan_segments(8, [(6, 12)], 4)


def test_gaps_and_subtract_exhaustive_small():
    for nbytes in range(0, 9):
        for keep in _range_sets(nbytes):
            kept = {i for a, b in keep for i in range(a, b)}
            gaps = _gaps(nbytes, keep)
            assert {i for a, b in gaps for i in range(a, b)} == set(range(nbytes)) - kept
            for cut in _range_sets(nbytes):
                removed = {i for a, b in cut for i in range(a, b)}
                got = _subtract(gaps, cut)
                assert all(b > a for a, b in got)
                assert {i for a, b in got for i in range(a, b)} == \
                    set(range(nbytes)) - kept - removed


def test_spec_validation():
    with pytest.raises(ValueError, match="own_slot=3"):
        SlotSpec("a", torch.float32, (2,), 2, 3)
    with pytest.raises(ValueError, match="num_slots=0"):
        SlotSpec("a", torch.float32, (2,), 0, None)
    with pytest.raises(ValueError, match="duplicate"):
        FlatParamBuffer([SlotSpec("a", torch.float32, (2,)), SlotSpec("a", torch.float32, (3,))])
    with pytest.raises(KeyError, match="'zz'"):
        FlatParamBuffer([SlotSpec("a", torch.float32, (2,))]).gen_view("zz")


@pytest.mark.parametrize("seed", range(4))
def test_pack_unpack_roundtrip_mixed(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    tensors = []
    for _ in range(200):
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        t = (torch.randint(0, 255, shape, generator=g) if not dtype.is_floating_point
             else torch.randn(shape, generator=g)).to(dtype)
        tensors.append(t)
    tensors.append(torch.randn(3 << 20, generator=g))  # a multi-chunk tensor
    flat, offsets = pack_tensors(tensors)
    # The bytes of each tensor sit at its offset (independent check with Python slicing).
    for t, off in zip(tensors, offsets):
        assert torch.equal(flat[off:off + t.nbytes], t.reshape(-1).view(torch.uint8))
    out = [torch.empty_like(t) for t in tensors]
    unpack_tensors(flat, out, offsets)
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="contiguous"):
        pack_tensors([torch.randn(4, 4).t()])
    offsets, total = plan_pack([torch.empty(3), torch.empty(5)])
    with pytest.raises(RuntimeError, match="exceeds"):
        _C.pack_into([torch.empty(3), torch.empty(5)], torch.empty(total - 40, dtype=torch.uint8), offsets)
