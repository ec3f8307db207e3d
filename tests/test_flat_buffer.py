"""Flat parameter buffers and pack/unpack (single process)."""

import itertools
import random

import pytest
import torch

from hybridflow_comm import _C
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
