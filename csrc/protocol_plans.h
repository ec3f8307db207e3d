// Rank maths of the parallel layouts and rank plans of the transfer protocols, as pure
// arithmetic.
//
// A worker group runs on a resource pool whose layout ranks 0..W-1 follow a HybridLayout:
// training pp x tp x dp, ranks ordered tp fastest, then pp, then dp, and generation
// pp_g x tp_g on the same ranks (the diagram is in hybridflow_comm/layout.py). `Layout` below
// is the one implementation of the coordinate formulas: layout.py's ParallelLayout.coords/rank
// and HybridLayout.gen_coords/gen_rank call it, and the protocol plans are built from it.
//
// A protocol is a (distribute, collect) pair; its plan says, before any byte moves:
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

// Training coordinates of a rank: rank = (dp * pp_size + pp) * tp_size + tp.
struct TrainCoords {
  int64_t pp = 0;
  int64_t tp = 0;
  int64_t dp = 0;
};

// Generation coordinates of a rank. With micro_tp = tp / tp_g and micro_pp = pp / pp_g:
//   tp = tp_g * micro_tp + micro_tp_rank,  pp = pp_g * micro_pp + micro_pp_rank,
//   micro_dp = micro_pp_rank * micro_tp + micro_tp_rank,  dp_g = dp * micro_dp_size + micro_dp.
struct GenCoords {
  int64_t pp_g = 0;
  int64_t tp_g = 0;
  int64_t micro_dp = 0;
  int64_t dp = 0;
  int64_t dp_g = 0;
};

// Training layout pp x tp x dp with the generation layout pp_g x tp_g on the same ranks
// (pp_g = tp_g = 1 for a training layout alone). Every method throws std::invalid_argument,
// naming the values, for a rank or coordinate out of range.
class Layout {
 public:
  // Throws std::invalid_argument unless every size is positive, tp_g | tp and pp_g | pp.
  Layout(int64_t pp, int64_t tp, int64_t dp, int64_t pp_g = 1, int64_t tp_g = 1);

  int64_t pp() const { return pp_; }
  int64_t tp() const { return tp_; }
  int64_t dp() const { return dp_; }
  int64_t pp_g() const { return pp_g_; }
  int64_t tp_g() const { return tp_g_; }
  int64_t world() const { return pp_ * tp_ * dp_; }
  int64_t micro_tp() const { return tp_ / tp_g_; }
  int64_t micro_pp() const { return pp_ / pp_g_; }
  int64_t micro_dp_size() const { return micro_tp() * micro_pp(); }

  TrainCoords train_coords(int64_t rank) const;
  int64_t train_rank(const TrainCoords& c) const;
  GenCoords gen_coords(int64_t rank) const;
  // Inverse of gen_coords (dp_g follows from the other four).
  int64_t gen_rank(int64_t pp_g_rank, int64_t tp_g_rank, int64_t micro_dp_rank,
                   int64_t dp_rank) const;
  std::string str() const;  // "pp=.. tp=.. dp=.. pp_g=.. tp_g=.." for messages

 private:
  int64_t pp_, tp_, dp_, pp_g_, tp_g_;
};

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

// Plan of the built-in protocol `name` for a layout. Throws std::invalid_argument for an
// unknown name (or, from the sizes overload, an invalid layout).
ProtocolPlan protocol_plan(const std::string& name, const Layout& layout);
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
