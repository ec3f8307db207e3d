// Standalone checks of the C++ core, built by CMakeLists.txt and run by ctest.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../flat_buffer.h"

#define CHECK(cond)                                                     \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                     \
    }                                                                   \
  } while (0)

int main() {
  using namespace hybridflow;
  // plan_offsets aligns every start and pads the total.
  auto off = plan_offsets({3, 100, 0, 64}, 64);
  CHECK((off == std::vector<int64_t>{0, 64, 192, 192, 256}));

  // pack/unpack round trip over mixed dtypes, one tensor larger than a copy chunk.
  std::vector<at::Tensor> src = {at::randn({7, 3}), at::arange(1000, at::kLong),
                                 at::randn({3 << 19}).to(at::kBFloat16)};
  std::vector<int64_t> sizes;
  for (auto& t : src) sizes.push_back(static_cast<int64_t>(t.nbytes()));
  auto plan = plan_offsets(sizes, 16);
  std::vector<int64_t> offsets(plan.begin(), plan.end() - 1);
  at::Tensor flat = at::empty({plan.back()}, at::kByte);
  pack_into(src, flat, offsets);
  std::vector<at::Tensor> dst;
  for (auto& t : src) dst.push_back(at::empty_like(t));
  unpack_from(flat, dst, offsets);
  for (size_t i = 0; i < src.size(); ++i) CHECK(at::equal(src[i], dst[i]));

  // Paged buffer: release drops whole inner pages only and keeps the rest.
  const int64_t page = page_size();
  at::Tensor buf = alloc_paged(8 * page);
  buf.fill_(3);
  CHECK(resident_bytes(buf, 0, 8 * page) == 8 * page);
  CHECK(release_pages(buf, 100, 4 * page) == 3 * page);
  CHECK(resident_bytes(buf, 0, 8 * page) == 5 * page);  // before reading maps zero pages
  CHECK(buf[99].item<uint8_t>() == 3 && buf[page].item<uint8_t>() == 0);
  CHECK(buf[4 * page + 100].item<uint8_t>() == 3);
  std::printf("hybridflow core: all checks passed\n");
  return 0;
}
