#include "flat_buffer.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define HYBRIDFLOW_HAVE_MMAP 1
#endif

namespace hybridflow {
namespace {

// Chunk size for parallel copies: large enough to amortise scheduling, small enough to
// spread one big tensor over all threads.
constexpr int64_t kCopyChunk = 1 << 20;

// Copies of at least this many bytes bypass the cache with streaming stores: the destination
// is not read back soon (a bucket goes to the network, a slot waits for the next phase), and
// skipping the read-for-ownership of every destination line is worth a third of the bandwidth.
constexpr int64_t kStreamThreshold = 256 << 10;

void stream_copy(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(__SSE2__)
  if (n >= kStreamThreshold) {
    const int64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, static_cast<size_t>(head));
    dst += head;
    src += head;
    n -= head;
    const int64_t blocks = n / 64;
    for (int64_t b = 0; b < blocks; ++b) {
      const auto* s = reinterpret_cast<const __m128i*>(src + b * 64);
      auto* d = reinterpret_cast<__m128i*>(dst + b * 64);
      const __m128i x0 = _mm_loadu_si128(s), x1 = _mm_loadu_si128(s + 1);
      const __m128i x2 = _mm_loadu_si128(s + 2), x3 = _mm_loadu_si128(s + 3);
      _mm_stream_si128(d, x0);
      _mm_stream_si128(d + 1, x1);
      _mm_stream_si128(d + 2, x2);
      _mm_stream_si128(d + 3, x3);
    }
    std::memcpy(dst + blocks * 64, src + blocks * 64, static_cast<size_t>(n - blocks * 64));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

void check_range(const at::Tensor& buffer, int64_t offset, int64_t nbytes) {
  TORCH_CHECK(buffer.device().is_cpu(), "page operations need a CPU tensor");
  TORCH_CHECK(offset >= 0 && nbytes >= 0, "offset=", offset, " and nbytes=", nbytes,
              " must be non-negative");
  const int64_t storage_bytes = static_cast<int64_t>(buffer.storage().nbytes());
  TORCH_CHECK(offset + nbytes <= storage_bytes, "range [", offset, ", ", offset + nbytes,
              ") exceeds the storage of ", storage_bytes, " bytes");
}

uint8_t* storage_base(const at::Tensor& buffer) {
  return static_cast<uint8_t*>(buffer.storage().mutable_data());
}

}  // namespace

int64_t page_size() {
#ifdef HYBRIDFLOW_HAVE_MMAP
  return static_cast<int64_t>(sysconf(_SC_PAGESIZE));
#else
  return 4096;
#endif
}

at::Tensor alloc_paged(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "nbytes=", nbytes, " must be non-negative");
  const int64_t page = page_size();
  const int64_t len = std::max<int64_t>(page, (nbytes + page - 1) / page * page);
#ifdef HYBRIDFLOW_HAVE_MMAP
  // Large buffers are 2 MiB aligned, so a kernel that backs memory with transparent huge pages
  // by default can.  They do not advise MADV_HUGEPAGE: under the common defrag=madvise setting
  // an advised fault compacts memory synchronously, and the generation-only pages are released
  // and faulted in again at every transition, after other large allocations.
  constexpr int64_t kHuge = 2 << 20;
  const bool huge = len >= kHuge;
  const int64_t map_len = huge ? len + kHuge : len;
  void* base = mmap(nullptr, static_cast<size_t>(map_len), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "mmap of ", map_len, " bytes failed");
  void* ptr = base;
  if (huge) {
    const auto addr = reinterpret_cast<uintptr_t>(base);
    ptr = reinterpret_cast<void*>((addr + kHuge - 1) / kHuge * kHuge);
  }
  auto deleter = [base, map_len](void*) { munmap(base, static_cast<size_t>(map_len)); };
#else
  void* ptr = std::calloc(static_cast<size_t>(len), 1);
  TORCH_CHECK(ptr != nullptr, "allocation of ", len, " bytes failed");
  auto deleter = [](void* p) { std::free(p); };
#endif
  return at::from_blob(ptr, {nbytes}, deleter, at::TensorOptions().dtype(at::kByte));
}

int64_t release_pages(const at::Tensor& buffer, int64_t offset, int64_t nbytes) {
  check_range(buffer, offset, nbytes);
#ifdef HYBRIDFLOW_HAVE_MMAP
  const int64_t page = page_size();
  const auto base = reinterpret_cast<uintptr_t>(storage_base(buffer));
  const uintptr_t lo = base + static_cast<uintptr_t>(offset);
  const uintptr_t hi = lo + static_cast<uintptr_t>(nbytes);
  const uintptr_t first = (lo + page - 1) / page * page;  // round inwards: never touch
  const uintptr_t last = hi / page * page;                 // bytes outside the range
  if (last <= first) return 0;
  TORCH_CHECK(madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) == 0,
              "madvise(MADV_DONTNEED) failed");
  return static_cast<int64_t>(last - first);
#else
  return 0;
#endif
}

int64_t resident_bytes(const at::Tensor& buffer, int64_t offset, int64_t nbytes) {
  check_range(buffer, offset, nbytes);
  if (nbytes == 0) return 0;
#ifdef HYBRIDFLOW_HAVE_MMAP
  const int64_t page = page_size();
  const auto base = reinterpret_cast<uintptr_t>(storage_base(buffer));
  const uintptr_t lo = (base + offset) / page * page;
  const uintptr_t hi = (base + offset + nbytes + page - 1) / page * page;
  const size_t npages = (hi - lo) / page;
  std::vector<unsigned char> vec(npages);
  TORCH_CHECK(mincore(reinterpret_cast<void*>(lo), hi - lo, vec.data()) == 0, "mincore failed");
  int64_t resident = 0;
  for (unsigned char v : vec) resident += (v & 1) ? page : 0;
  return resident;
#else
  return nbytes;
#endif
}

std::vector<int64_t> plan_offsets(const std::vector<int64_t>& nbytes, int64_t align) {
  TORCH_CHECK(align > 0 && (align & (align - 1)) == 0, "align=", align,
              " must be a power of two");
  std::vector<int64_t> offsets;
  offsets.reserve(nbytes.size() + 1);
  int64_t cursor = 0;
  for (int64_t n : nbytes) {
    TORCH_CHECK(n >= 0, "region size ", n, " must be non-negative");
    offsets.push_back(cursor);
    cursor = (cursor + n + align - 1) / align * align;
  }
  offsets.push_back(cursor);
  return offsets;
}

void copy_regions(const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst,
                  const std::vector<int64_t>& nbytes) {
  TORCH_CHECK(src.size() == dst.size() && src.size() == nbytes.size(),
              "copy_regions needs equal-length lists");
  // Parallelise over the concatenated byte range, not over regions, so that every thread gets
  // the same number of bytes whatever the mix of tiny and huge tensors.
  std::vector<int64_t> prefix(nbytes.size() + 1, 0);
  for (size_t i = 0; i < nbytes.size(); ++i) {
    TORCH_CHECK(nbytes[i] >= 0, "region ", i, " has negative size ", nbytes[i]);
    prefix[i + 1] = prefix[i] + nbytes[i];
  }
  at::parallel_for(0, prefix.back(), kCopyChunk, [&](int64_t begin, int64_t end) {
    size_t r = std::upper_bound(prefix.begin(), prefix.end(), begin) - prefix.begin() - 1;
    for (int64_t pos = begin; pos < end && r < nbytes.size(); ++r) {
      const int64_t lo = pos - prefix[r];
      const int64_t len = std::min(end, prefix[r + 1]) - pos;
      if (len > 0) stream_copy(dst[r] + lo, src[r] + lo, len);
      pos += std::max<int64_t>(len, 0);
    }
#if defined(__SSE2__)
    _mm_sfence();  // streaming stores are weakly ordered: publish them before returning
#endif
  });
}

namespace {

void check_flat_and_tensors(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                            const std::vector<int64_t>& offsets, const char* what) {
  TORCH_CHECK(flat.device().is_cpu() && flat.is_contiguous() && flat.dim() == 1 &&
                  flat.scalar_type() == at::kByte,
              what, ": flat must be a contiguous 1-D uint8 CPU tensor");
  TORCH_CHECK(tensors.size() == offsets.size(), what, ": got ", tensors.size(), " tensors and ",
              offsets.size(), " offsets");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, ": tensor ", i,
                " must be a contiguous CPU tensor");
    const int64_t n = static_cast<int64_t>(t.nbytes());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + n <= flat.numel(), what, ": tensor ", i, " of ",
                n, " bytes at offset ", offsets[i], " exceeds the flat buffer of ", flat.numel(),
                " bytes");
  }
}

}  // namespace

void pack_into(const std::vector<at::Tensor>& tensors, at::Tensor& flat,
               const std::vector<int64_t>& offsets) {
  check_flat_and_tensors(flat, tensors, offsets, "pack_into");
  std::vector<const uint8_t*> src;
  std::vector<uint8_t*> dst;
  std::vector<int64_t> n;
  auto* base = static_cast<uint8_t*>(flat.data_ptr());
  for (size_t i = 0; i < tensors.size(); ++i) {
    src.push_back(static_cast<const uint8_t*>(tensors[i].const_data_ptr()));
    dst.push_back(base + offsets[i]);
    n.push_back(static_cast<int64_t>(tensors[i].nbytes()));
  }
  copy_regions(src, dst, n);
}

void unpack_from(const at::Tensor& flat, std::vector<at::Tensor>& tensors,
                 const std::vector<int64_t>& offsets) {
  check_flat_and_tensors(flat, tensors, offsets, "unpack_from");
  std::vector<const uint8_t*> src;
  std::vector<uint8_t*> dst;
  std::vector<int64_t> n;
  const auto* base = static_cast<const uint8_t*>(flat.const_data_ptr());
  for (size_t i = 0; i < tensors.size(); ++i) {
    src.push_back(base + offsets[i]);
    dst.push_back(static_cast<uint8_t*>(tensors[i].data_ptr()));
    n.push_back(static_cast<int64_t>(tensors[i].nbytes()));
  }
  copy_regions(src, dst, n);
}


void copy_bytes(const at::Tensor& src, at::Tensor& dst, const std::vector<int64_t>& src_offsets,
                const std::vector<int64_t>& dst_offsets, const std::vector<int64_t>& lengths) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu() && src.is_contiguous() &&
                  dst.is_contiguous(),
              "copy_bytes needs contiguous CPU tensors");
  TORCH_CHECK(src_offsets.size() == lengths.size() && dst_offsets.size() == lengths.size(),
              "copy_bytes needs equal-length offset and length lists");
  const auto src_n = static_cast<int64_t>(src.nbytes());
  const auto dst_n = static_cast<int64_t>(dst.nbytes());
  std::vector<const uint8_t*> s;
  std::vector<uint8_t*> d;
  const auto* sb = static_cast<const uint8_t*>(src.const_data_ptr());
  auto* db = static_cast<uint8_t*>(dst.data_ptr());
  for (size_t i = 0; i < lengths.size(); ++i) {
    TORCH_CHECK(lengths[i] >= 0 && src_offsets[i] >= 0 && dst_offsets[i] >= 0 &&
                    src_offsets[i] + lengths[i] <= src_n && dst_offsets[i] + lengths[i] <= dst_n,
                "copy_bytes: region ", i, " (src ", src_offsets[i], ", dst ", dst_offsets[i],
                ", ", lengths[i], " bytes) is out of bounds (", src_n, ", ", dst_n, ")");
    s.push_back(sb + src_offsets[i]);
    d.push_back(db + dst_offsets[i]);
  }
  copy_regions(s, d, lengths);
}

int64_t checksum(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
              "checksum needs a contiguous CPU tensor");
  const auto* p = static_cast<const uint8_t*>(tensor.const_data_ptr());
  const int64_t n = static_cast<int64_t>(tensor.nbytes());
  const int64_t words = n / 8;
  // sum_i word_i * (2i + 1) mod 2^64: addition commutes, so threads can split the range.
  const uint64_t total = at::parallel_reduce(
      0, words, 1 << 16, uint64_t{0},
      [&](int64_t b, int64_t e, uint64_t acc) {
        for (int64_t i = b; i < e; ++i) {
          uint64_t w;
          std::memcpy(&w, p + i * 8, 8);
          acc += w * (2 * static_cast<uint64_t>(i) + 1);
        }
        return acc;
      },
      [](uint64_t a, uint64_t b) { return a + b; });
  uint64_t tail = 0;
  for (int64_t i = words * 8; i < n; ++i) tail = tail * 131 + p[i];
  uint64_t h = total ^ (tail * 0x9E3779B97F4A7C15ull) ^ static_cast<uint64_t>(n);
  return static_cast<int64_t>(h);
}


std::vector<StridedBucket> plan_strided_buckets(const std::vector<int64_t>& kinds,
                                                const std::vector<int64_t>& offsets,
                                                const std::vector<int64_t>& nbytes,
                                                int64_t bucket_bytes) {
  TORCH_CHECK(kinds.size() == offsets.size() && kinds.size() == nbytes.size(),
              "plan_strided_buckets needs equal-length lists");
  TORCH_CHECK(bucket_bytes > 0, "bucket_bytes=", bucket_bytes, " must be positive");
  std::vector<StridedBucket> out;
  const auto n = static_cast<int64_t>(kinds.size());
  int64_t i = 0;
  while (i < n) {
    StridedBucket b{i, 1, nbytes[i]};
    int64_t filled = nbytes[i];
    while (i + b.count < n) {
      const int64_t j = i + b.count;
      const int64_t stride = offsets[j] - offsets[j - 1];
      const bool same = kinds[j] == kinds[i] && nbytes[j] == nbytes[i] &&
                        (b.count == 1 ? stride > 0 : stride == b.stride);
      if (!same || filled + nbytes[j] > bucket_bytes) break;
      b.stride = stride;
      filled += nbytes[j];
      ++b.count;
    }
    out.push_back(b);
    i += b.count;
  }
  return out;
}

namespace {

void swap_leading_dims(const at::Tensor& src, at::Tensor& dst) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu() && src.is_contiguous() &&
                  dst.is_contiguous() && src.scalar_type() == dst.scalar_type(),
              "unstack/stack need contiguous CPU tensors of one dtype");
  TORCH_CHECK(src.dim() == 3 && dst.dim() == 3 && src.size(0) == dst.size(1) &&
                  src.size(1) == dst.size(0) && src.size(2) == dst.size(2),
              "unstack/stack: shapes ", src.sizes(), " and ", dst.sizes(),
              " are not [m, A, L] and [A, m, L]");
  const int64_t d0 = src.size(0), d1 = src.size(1);
  const int64_t row = src.size(2) * static_cast<int64_t>(src.element_size());
  const auto* s = static_cast<const uint8_t*>(src.const_data_ptr());
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  // dst[j, i, :] = src[i, j, :]; parallel over rows of the destination.
  at::parallel_for(0, d0 * d1, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(row, 1)),
                   [&](int64_t b, int64_t e) {
                     for (int64_t r = b; r < e; ++r) {
                       const int64_t j = r / d0, i = r % d0;
                       std::memcpy(d + r * row, s + (i * d1 + j) * row, static_cast<size_t>(row));
                     }
                   });
}

}  // namespace

void unstack_to_logical(const at::Tensor& stacked, at::Tensor& out) {
  swap_leading_dims(stacked, out);
}

void stack_from_logical(const at::Tensor& logical, at::Tensor& stacked) {
  swap_leading_dims(logical, stacked);
}

}  // namespace hybridflow
