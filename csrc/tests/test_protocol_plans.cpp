// Standalone checks of the layout coordinates and the transfer-protocol rank plans (ctest).
// The exhaustive comparisons against brute-force enumeration are in tests/test_layout.py
// (coordinates) and tests/test_protocols.py (plans).
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "../protocol_plans.h"


int main() {
  using namespace hybridflow;
  using V = std::vector<int64_t>;
  // Coordinates invert, for every layout of up to 8 ranks.
  for (int64_t pp = 1; pp <= 8; ++pp)
    for (int64_t tp = 1; pp * tp <= 8; ++tp)
      for (int64_t dp = 1; pp * tp * dp <= 8; ++dp)
        for (int64_t pp_g = 1; pp_g <= pp; ++pp_g)
          for (int64_t tp_g = 1; tp_g <= tp; ++tp_g) {
            if (pp % pp_g || tp % tp_g) continue;
            const Layout l(pp, tp, dp, pp_g, tp_g);
            for (int64_t r = 0; r < l.world(); ++r) {
              CHECK(l.train_rank(l.train_coords(r)) == r);
              const GenCoords g = l.gen_coords(r);
              CHECK(l.gen_rank(g.pp_g, g.tp_g, g.micro_dp, g.dp) == r);
            }
          }
  // Worked example of REFERENCE.md: 8 ranks, training 1-4-2, generation 1-2.
  const Layout paper(1, 4, 2, 1, 2);
  const GenCoords g5 = paper.gen_coords(5);  // tp 1 of replica 1: tp_g 0, micro-DP rank 1
  CHECK(g5.pp_g == 0 && g5.tp_g == 0 && g5.micro_dp == 1 && g5.dp == 1 && g5.dp_g == 3);
  CHECK(paper.gen_rank(0, 1, 0, 1) == 6);
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
  threw = false;
  try {
    paper.train_coords(8);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    Layout(1, 4, 1, 1, 3);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  std::puts("layout coordinates and protocol plans: ok");
  return 0;
}
