"""The flat buffer on CUDA virtual memory: released chunks go back to the device (measured
with ``torch.cuda.mem_get_info``), views keep their addresses, restored slots read as zeros; a
restore that meets memory held in torch's allocator cache empties it, one that cannot fit
raises and stays released; rlhf.metrics' vmm_mapped follows the mappings.  Skipped without
CUDA."""

import gc

import pytest
import torch

from hybridflow_comm import cuda_vmm
from hybridflow_comm.flat_buffer import FlatParamBuffer, SlotSpec
from rlhf.metrics import memory_sample

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MIB = 1 << 20


def _specs():
    # w: 4 slots of 32 MiB (this rank owns slot 1); other_stage: 64 MiB this rank never trains;
    # small: many tiny regions whose chunks all hold some training slot
    return ([SlotSpec("w", torch.bfloat16, (4096, 4096), 4, 1),
             SlotSpec("other_stage", torch.bfloat16, (4096, 4096), 2, None)]
            + [SlotSpec(f"small{i}", torch.float32, (1000,), 2, i % 2) for i in range(50)])


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_release_gives_memory_back_and_restore_takes_it_again():
    buf = FlatParamBuffer(_specs(), device="cuda")
    step = cuda_vmm.granularity(buf.device.index)
    for i, s in enumerate(buf.specs):
        buf.gen_view(s.name).fill_(i + 1)
    trained = {n: t.clone() for n, t in buf.train_views().items()}
    ptrs = {n: t.data_ptr() for n, t in buf.train_views().items()}
    mapped, free0 = buf.resident_nbytes(), _free()

    released = buf.release_generation_slots()
    gen_only = 3 * 32 * MIB + 2 * 32 * MIB  # w's three other slots + other_stage
    assert gen_only - 4 * step <= released <= gen_only
    assert buf.resident_nbytes() == mapped - released
    assert _free() - free0 >= released - step  # the device got the bytes back

    for n, t in buf.train_views().items():
        assert t.data_ptr() == ptrs[n] and torch.equal(t, trained[n]), n
    assert buf.restore_generation_slots() == released
    assert free0 - _free() <= step and buf.resident_nbytes() == mapped
    for s in buf.specs:
        gen = buf.gen_view(s.name)
        others = [k for k in range(s.num_slots) if k != s.own_slot]
        assert all(torch.count_nonzero(gen[k]) == 0 for k in others), s.name
        gen.fill_(5)  # the next transition's writes land
        assert torch.all(buf.gen_view(s.name) == 5)


def test_views_outlive_the_buffer():
    buf = FlatParamBuffer(_specs()[:1], device="cuda")
    view = buf.train_view("w")
    view.fill_(2)
    del buf
    gc.collect()
    torch.cuda.synchronize()
    assert torch.all(view == 2)  # torch holds the reservation while a tensor lives


def test_resharding_writes_after_release():
    # the transition's accessors restore on their own: storage() after a release is backed
    buf = FlatParamBuffer(_specs(), device="cuda")
    buf.release_generation_slots()
    storage = buf.storage(torch.bfloat16)
    storage.fill_(1)
    torch.cuda.synchronize()
    assert not buf.released and torch.all(buf.gen_view("other_stage") == 1)


def test_restore_against_torchs_cache_and_out_of_memory():
    """cuMemCreate cannot use the blocks torch's caching allocator keeps: with them held by a
    tensor the restore raises one OutOfMemoryError naming the rank and bytes and the buffer
    stays released with nothing of the restore mapped; with them only cached the restore
    empties the cache and succeeds."""
    buf = FlatParamBuffer(_specs(), device="cuda")
    buf.gen_view("w").fill_(3)
    mapped, vmm = buf.resident_nbytes(), memory_sample(buf.device)["vmm_mapped"]
    released = buf.release_generation_slots()
    assert vmm - memory_sample(buf.device)["vmm_mapped"] == released
    hog = torch.empty(_free() - 64 * MIB, dtype=torch.uint8, device="cuda")  # 64 MiB left
    with pytest.raises(torch.OutOfMemoryError, match=rf"^rank 0: .* needs {released} bytes"):
        buf.restore_generation_slots()
    assert buf.released and buf.resident_nbytes() == mapped - released
    assert vmm - memory_sample(buf.device)["vmm_mapped"] == released
    del hog  # its block stays in the allocator's cache, out of cuMemCreate's reach
    assert _free() < released < torch.cuda.memory_reserved()
    assert buf.restore_generation_slots() == released and not buf.released
    assert buf.resident_nbytes() == mapped and memory_sample(buf.device)["vmm_mapped"] == vmm
    gen = buf.gen_view("w")
    assert torch.all(gen[1] == 3) and torch.count_nonzero(gen[0]) == 0
