// Standalone checks of the C++ core, built by CMakeLists.txt and run by ctest.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.h"
#include "../flat_buffer.h"


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
  // Strided buckets: equal kinds at equal spacing merge until the byte budget is reached.
  auto sb = plan_strided_buckets({0, 0, 0, 1, 1, 0}, {0, 100, 200, 300, 350, 400},
                                 {10, 10, 10, 20, 20, 10}, 25);
  CHECK(sb.size() == 5 && sb[0].start == 0 && sb[0].count == 2 && sb[0].stride == 100);
  auto sb2 = plan_strided_buckets({0, 0, 0}, {0, 64, 192}, {8, 8, 8}, 1000);  // uneven spacing
  CHECK(sb2.size() == 2 && sb2[0].count == 2 && sb2[1].start == 2);

  // Checksums: equal bytes agree, a swapped pair of words does not.
  at::Tensor a = at::arange(1000, at::kLong);
  at::Tensor b = a.clone();
  CHECK(checksum(a) == checksum(b));
  b[3] = 4;
  b[4] = 3;
  CHECK(checksum(a) != checksum(b));

  // Stacked <-> logical swap against at::transpose.
  at::Tensor st = at::randn({3, 4, 5});
  at::Tensor lg = at::empty({4, 3, 5});
  unstack_to_logical(st, lg);
  CHECK(at::equal(lg, st.transpose(0, 1)));
  at::Tensor back = at::empty_like(st);
  stack_from_logical(lg, back);
  CHECK(at::equal(back, st));
  std::printf("hybridflow core: all checks passed\n");
  return 0;
}
