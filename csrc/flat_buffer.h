// Flat parameter storage: page-aligned buffers whose physical pages can be released and
// re-created in place, and fast many-tensor pack/unpack for bucketed collectives.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace hybridflow {

// Byte size of one memory page on this machine.
int64_t page_size();

// A 1-D uint8 CPU tensor of `nbytes` backed by its own anonymous mapping (page aligned).
// The mapping is returned to the OS when the last view of the storage dies.
at::Tensor alloc_paged(int64_t nbytes);

// Drops the physical pages that lie wholly inside [offset, offset + nbytes) of `buffer`'s
// storage. Pages shared with bytes outside the range are kept, so neighbouring data is never
// touched. Released pages read back as zeros. Returns the number of bytes released.
int64_t release_pages(const at::Tensor& buffer, int64_t offset, int64_t nbytes);

// Bytes of [offset, offset + nbytes) of `buffer`'s storage whose pages are resident in RAM
// (counted in whole pages that overlap the range).
int64_t resident_bytes(const at::Tensor& buffer, int64_t offset, int64_t nbytes);

// Start offsets (bytes) for regions of the given byte sizes, each start a multiple of `align`.
// The last element is the total size, padded to `align`.
std::vector<int64_t> plan_offsets(const std::vector<int64_t>& nbytes, int64_t align);

// Copies each contiguous tensor's bytes into `flat` (1-D uint8) at the given byte offsets.
void pack_into(const std::vector<at::Tensor>& tensors, at::Tensor& flat,
               const std::vector<int64_t>& offsets);

// Copies bytes of `flat` at the given offsets back into each contiguous tensor.
void unpack_from(const at::Tensor& flat, std::vector<at::Tensor>& tensors,
                 const std::vector<int64_t>& offsets);

// Many-region memcpy: dst[i] <- src[i] for `nbytes[i]` bytes, split into chunks and run with
// at::parallel_for. The building block of pack, unpack and slot scatter.
void copy_regions(const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst,
                  const std::vector<int64_t>& nbytes);

// Copies `lengths[i]` bytes from `src` at `src_offsets[i]` to `dst` at `dst_offsets[i]`
// (offsets relative to each tensor's first byte; both contiguous CPU tensors), in parallel.
void copy_bytes(const at::Tensor& src, at::Tensor& dst, const std::vector<int64_t>& src_offsets,
                const std::vector<int64_t>& dst_offsets, const std::vector<int64_t>& lengths);

// Position-dependent 64-bit checksum of a contiguous CPU tensor's bytes (order-sensitive,
// computed in parallel). Equal bytes give equal sums on every rank and every thread count.
int64_t checksum(const at::Tensor& tensor);

// One coalesced collective over `count` equally spaced regions: items [start, start + count),
// region i at `first_offset + i * stride` bytes.
struct StridedBucket {
  int64_t start;
  int64_t count;
  int64_t stride;
};

// Groups consecutive items with equal `kinds[i]` whose offsets are equally spaced into
// strided buckets of at most `bucket_bytes` (item size `nbytes[i]`; an item larger than that
// gets its own bucket). Each bucket can then be described by one strided view per slot.
std::vector<StridedBucket> plan_strided_buckets(const std::vector<int64_t>& kinds,
                                                const std::vector<int64_t>& offsets,
                                                const std::vector<int64_t>& nbytes,
                                                int64_t bucket_bytes);

// Stacked generation form -> logical form for a non-leading partition dim.
// `stacked` is [m, A, L] (m training shards, A = product of the dims before the partition
// dim, L = partition size x product of the dims after it); `out` is [A, m, L]:
//     out[a, k, :] = stacked[k, a, :]
// Contiguous CPU tensors of one dtype. `stack_from_logical` is the inverse.
void unstack_to_logical(const at::Tensor& stacked, at::Tensor& out);
void stack_from_logical(const at::Tensor& logical, at::Tensor& stacked);

}  // namespace hybridflow
