// Standalone checks of the transfer-protocol rank plans (ctest). The exhaustive comparison
// against the Python layout maths is in tests/test_protocols.py.
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "../protocol_plans.h"


int main() {
  using namespace hybridflow;
  using V = std::vector<int64_t>;
  // Worked example of REFERENCE.md: 8 ranks, training 1-4-2, generation 1-2.
  auto p3d = protocol_plan("3D_PROTO", 1, 4, 2, 1, 2);
  CHECK(p3d.num_chunks == 2);
  CHECK((p3d.chunk_of_rank == V{0, 0, 0, 0, 1, 1, 1, 1}));
  CHECK((p3d.collect_ranks == V{0, 4}));
  auto micro = protocol_plan("3D_ALL_MICRO_DP", 1, 4, 2, 1, 2);
  CHECK(micro.num_chunks == 4);  // micro-DP groups [0,1] [2,3] [4,5] [6,7]
  CHECK((micro.chunk_of_rank == V{0, 0, 1, 1, 2, 2, 3, 3}));
  CHECK((micro.collect_ranks == V{0, 2, 4, 6}));
  auto pp_only = protocol_plan("3D_PP_ONLY", 2, 2, 2, 1, 1);
  CHECK((pp_only.collect_ranks == V{0, 2}));
  // Padding: 5 rows over 2 chunks -> padded to 6.
  CHECK((chunk_offsets(5, 2) == V{0, 3, 6}));
  // Rows [2, 6) of 5 valid rows from sources of 2 and 4 rows (the last row is padding).
  auto seg = transfer_segments({2, 4}, 5, 2, 6);
  CHECK(seg.size() == 2);
  CHECK(seg[0].src == 1 && seg[0].src_start == 0 && seg[0].src_end == 3);
  CHECK(seg[1].src == 0 && seg[1].src_start == 0 && seg[1].src_end == 1);
  bool threw = false;
  try {
    protocol_plan("NOPE", 1, 1, 1, 1, 1);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  std::puts("protocol plans: ok");
  return 0;
}
