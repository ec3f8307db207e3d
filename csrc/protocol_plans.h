// Rank plans of the transfer protocols of the single controller, as pure arithmetic.
//
// A worker group runs on a resource pool whose layout ranks 0..W-1 follow a HybridLayout
// (training pp x tp x dp, generation pp_g x tp_g; see hybridflow_comm/layout.py). A protocol
// is a (distribute, collect) pair; its plan says, before any byte moves:
//
//   distribute  kind = WHOLE     every called rank receives the arguments unchanged
//               kind = SPLIT     the batch is padded to a multiple of num_chunks rows, cut into
//                                num_chunks equal chunks; rank r receives chunk chunk_of_rank[r]
//               kind = PER_RANK  the caller passes a list of W items; rank r receives item r
//               chunk_of_rank[r] = -1: rank r is not called at all (rank-zero mode)
//   collect     collect_ranks    layout ranks whose outputs are collected, in output order
//               collect = CONCAT the outputs are concatenated (then the padding is removed)
//               collect = LIST   a list of the outputs
//               collect = SINGLE the one output itself
//
// Nothing here depends on torch or Python, so the plans are testable without a process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hybridflow {

enum class DistributeKind : int { kWhole = 0, kSplit = 1, kPerRank = 2 };
enum class CollectKind : int { kConcat = 0, kList = 1, kSingle = 2 };

struct ProtocolPlan {
  std::string name;
  DistributeKind distribute = DistributeKind::kWhole;
  int64_t num_chunks = 1;
  std::vector<int64_t> chunk_of_rank;  // [W], -1 = not called
  std::vector<int64_t> collect_ranks;  // layout ranks, output order
  CollectKind collect = CollectKind::kConcat;
};

// Names of the built-in protocols, in a fixed order.
std::vector<std::string> builtin_protocols();

// Plan of the built-in protocol `name` for the layout (pp, tp, dp) -> (pp_g, tp_g).
// Throws std::invalid_argument for an unknown name or an invalid layout.
ProtocolPlan protocol_plan(const std::string& name, int64_t pp, int64_t tp, int64_t dp,
                           int64_t pp_g, int64_t tp_g);

// Row split of a batch of n rows into k equal chunks after padding: returns k + 1 offsets
// (chunk i = rows [off[i], off[i+1]) of the padded batch; off[k] = padded size, a multiple of
// k, = n rounded up). Throws for n < 0 or k < 1.
std::vector<int64_t> chunk_offsets(int64_t n, int64_t k);

// One contiguous piece of a transfer: rows [src_start, src_end) of source `src`.
struct Segment {
  int64_t src;
  int64_t src_start;
  int64_t src_end;
};

// Where rows [start, end) of a padded logical batch come from when the logical batch (n_valid
// rows) is the concatenation of the outputs of sources with src_counts[i] rows each (their
// concatenation may hold padding rows at its end, which are never read). Padded row i is
// logical row i % n_valid (padding repeats the batch from its start). Adjacent rows of one
// source are merged into one segment.
std::vector<Segment> transfer_segments(const std::vector<int64_t>& src_counts, int64_t n_valid,
                                       int64_t start, int64_t end);

}  // namespace hybridflow

#ifdef PYBIND11_VERSION_MAJOR
// Defined in protocol_bindings.cpp: adds the plans to the Python module.
void register_protocol_plans(pybind11::module_& m);
#endif
