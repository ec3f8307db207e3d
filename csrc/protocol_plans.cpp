// Layout rank maths and transfer-protocol rank plans (see protocol_plans.h). Pure C++, no torch.
#include "protocol_plans.h"

#include <algorithm>
#include <stdexcept>

namespace hybridflow {
namespace {

std::string range_error(const char* name, int64_t value, int64_t size, const Layout& l) {
  return std::string(name) + "=" + std::to_string(value) + " is outside [0, " +
         std::to_string(size) + ") for layout " + l.str();
}

void check_index(const char* name, int64_t value, int64_t size, const Layout& l) {
  if (value < 0 || value >= size) throw std::invalid_argument(range_error(name, value, size, l));
}

// Index of the micro-DP group of a rank, groups ordered by their first (smallest) rank: the
// first rank of a group has micro_dp = 0, so the order is (dp, pp_g, tp_g).
int64_t micro_dp_group(const Layout& l, const GenCoords& g) {
  return (g.dp * l.pp_g() + g.pp_g) * l.tp_g() + g.tp_g;
}

std::vector<int64_t> all_ranks(int64_t w) {
  std::vector<int64_t> out(w);
  for (int64_t r = 0; r < w; ++r) out[r] = r;
  return out;
}

}  // namespace

Layout::Layout(int64_t pp, int64_t tp, int64_t dp, int64_t pp_g, int64_t tp_g)
    : pp_(pp), tp_(tp), dp_(dp), pp_g_(pp_g), tp_g_(tp_g) {
  if (pp < 1 || tp < 1 || dp < 1 || pp_g < 1 || tp_g < 1)
    throw std::invalid_argument("layout sizes must be positive: " + str());
  if (tp % tp_g || pp % pp_g)
    throw std::invalid_argument("tp_g=" + std::to_string(tp_g) + " must divide tp=" +
                                std::to_string(tp) + " and pp_g=" + std::to_string(pp_g) +
                                " must divide pp=" + std::to_string(pp));
}

std::string Layout::str() const {
  return "pp=" + std::to_string(pp_) + " tp=" + std::to_string(tp_) + " dp=" +
         std::to_string(dp_) + " pp_g=" + std::to_string(pp_g_) + " tp_g=" +
         std::to_string(tp_g_);
}

TrainCoords Layout::train_coords(int64_t rank) const {
  check_index("rank", rank, world(), *this);
  return TrainCoords{(rank / tp_) % pp_, rank % tp_, rank / (tp_ * pp_)};
}

int64_t Layout::train_rank(const TrainCoords& c) const {
  check_index("pp", c.pp, pp_, *this);
  check_index("tp", c.tp, tp_, *this);
  check_index("dp", c.dp, dp_, *this);
  return (c.dp * pp_ + c.pp) * tp_ + c.tp;
}

GenCoords Layout::gen_coords(int64_t rank) const {
  const TrainCoords c = train_coords(rank);
  const int64_t micro_dp = (c.pp % micro_pp()) * micro_tp() + c.tp % micro_tp();
  return GenCoords{c.pp / micro_pp(), c.tp / micro_tp(), micro_dp, c.dp,
                   c.dp * micro_dp_size() + micro_dp};
}

int64_t Layout::gen_rank(int64_t pp_g_rank, int64_t tp_g_rank, int64_t micro_dp_rank,
                         int64_t dp_rank) const {
  check_index("pp_g", pp_g_rank, pp_g_, *this);
  check_index("tp_g", tp_g_rank, tp_g_, *this);
  check_index("micro_dp", micro_dp_rank, micro_dp_size(), *this);
  check_index("dp", dp_rank, dp_, *this);
  return train_rank(TrainCoords{pp_g_rank * micro_pp() + micro_dp_rank / micro_tp(),
                                tp_g_rank * micro_tp() + micro_dp_rank % micro_tp(), dp_rank});
}

std::vector<std::string> builtin_protocols() {
  return {"ONE_TO_ALL", "3D_PROTO",   "3D_ALL_MICRO_DP", "3D_PP_ONLY",       "DP_PROTO",
          "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_METRIC", "RANK_ZERO"};
}

ProtocolPlan protocol_plan(const std::string& name, int64_t pp, int64_t tp, int64_t dp,
                           int64_t pp_g, int64_t tp_g) {
  return protocol_plan(name, Layout(pp, tp, dp, pp_g, tp_g));
}

ProtocolPlan protocol_plan(const std::string& name, const Layout& l) {
  const int64_t w = l.world();
  ProtocolPlan plan;
  plan.name = name;
  plan.chunk_of_rank.assign(w, 0);
  if (name == "ONE_TO_ALL" || name == "ALL_TO_ALL") {
    // Broadcast the arguments (ALL_TO_ALL: pass them through as given, i.e. the same).
    plan.distribute = DistributeKind::kWhole;
    plan.collect_ranks = all_ranks(w);
    plan.collect = CollectKind::kList;
  } else if (name == "3D_PROTO") {
    // Split over DP replicas; every rank of a replica's TP x PP block gets its chunk; collect
    // from (pp = last, tp = 0) of every replica.
    plan.distribute = DistributeKind::kSplit;
    plan.num_chunks = l.dp();
    for (int64_t r = 0; r < w; ++r) plan.chunk_of_rank[r] = l.train_coords(r).dp;
    for (int64_t d = 0; d < l.dp(); ++d)
      plan.collect_ranks.push_back(l.train_rank(TrainCoords{l.pp() - 1, 0, d}));
    plan.collect = CollectKind::kConcat;
  } else if (name == "3D_ALL_MICRO_DP") {
    // Split over micro-DP groups (ordered by first rank); every member gets its group's chunk;
    // collect from the first member (micro-DP rank 0) of every group.
    plan.distribute = DistributeKind::kSplit;
    plan.num_chunks = w / l.micro_dp_size();
    plan.collect_ranks.assign(plan.num_chunks, -1);
    for (int64_t r = 0; r < w; ++r) {
      const GenCoords g = l.gen_coords(r);
      plan.chunk_of_rank[r] = micro_dp_group(l, g);
      if (g.micro_dp == 0) plan.collect_ranks[plan.chunk_of_rank[r]] = r;
    }
    plan.collect = CollectKind::kConcat;
  } else if (name == "3D_PP_ONLY") {
    // Broadcast; one output per pipeline stage, from (tp = 0, dp = 0) of that stage.
    plan.distribute = DistributeKind::kWhole;
    for (int64_t s = 0; s < l.pp(); ++s)
      plan.collect_ranks.push_back(l.train_rank(TrainCoords{s, 0, 0}));
    plan.collect = CollectKind::kList;
  } else if (name == "DP_PROTO" || name == "DP_COMPUTE_METRIC") {
    // Every rank of the pool is a data-parallel rank.
    plan.distribute = DistributeKind::kSplit;
    plan.num_chunks = w;
    plan.chunk_of_rank = all_ranks(w);
    plan.collect_ranks = all_ranks(w);
    plan.collect = name == "DP_PROTO" ? CollectKind::kConcat : CollectKind::kList;
  } else if (name == "DP_COMPUTE") {
    plan.distribute = DistributeKind::kPerRank;
    plan.num_chunks = w;
    plan.chunk_of_rank = all_ranks(w);
    plan.collect_ranks = all_ranks(w);
    plan.collect = CollectKind::kList;
  } else if (name == "RANK_ZERO") {
    plan.distribute = DistributeKind::kWhole;
    plan.chunk_of_rank.assign(w, -1);
    plan.chunk_of_rank[0] = 0;
    plan.collect_ranks = {0};
    plan.collect = CollectKind::kSingle;
  } else {
    throw std::invalid_argument("unknown protocol '" + name + "'");
  }
  return plan;
}

std::vector<int64_t> chunk_offsets(int64_t n, int64_t k) {
  if (n < 0 || k < 1)
    throw std::invalid_argument("chunk_offsets needs n >= 0 and k >= 1, got n=" +
                                std::to_string(n) + " k=" + std::to_string(k));
  const int64_t per_chunk = (n + k - 1) / k;
  std::vector<int64_t> off(k + 1);
  for (int64_t i = 0; i <= k; ++i) off[i] = i * per_chunk;
  return off;
}

std::vector<Segment> transfer_segments(const std::vector<int64_t>& src_counts, int64_t n_valid,
                                       int64_t start, int64_t end) {
  int64_t total = 0;
  for (int64_t c : src_counts) {
    if (c < 0) throw std::invalid_argument("negative source row count " + std::to_string(c));
    total += c;
  }
  if (n_valid < 0 || n_valid > total)
    throw std::invalid_argument("n_valid=" + std::to_string(n_valid) + " outside [0, " +
                                std::to_string(total) + "]");
  if (start < 0 || end < start || (end > start && n_valid == 0))
    throw std::invalid_argument("bad row range [" + std::to_string(start) + ", " +
                                std::to_string(end) + ") for n_valid=" + std::to_string(n_valid));
  // Prefix offsets of the sources in the logical batch.
  std::vector<int64_t> prefix(src_counts.size() + 1, 0);
  for (size_t i = 0; i < src_counts.size(); ++i) prefix[i + 1] = prefix[i] + src_counts[i];
  std::vector<Segment> out;
  int64_t row = start;
  while (row < end) {
    const int64_t logical = row % n_valid;
    // Longest run that stays inside one source and does not wrap around n_valid.
    size_t s = 0;
    while (prefix[s + 1] <= logical) ++s;
    const int64_t run_end_logical = std::min(prefix[s + 1], n_valid);
    const int64_t take = std::min(run_end_logical - logical, end - row);
    const int64_t off = logical - prefix[s];
    if (!out.empty() && out.back().src == static_cast<int64_t>(s) && out.back().src_end == off)
      out.back().src_end += take;
    else
      out.push_back(Segment{static_cast<int64_t>(s), off, off + take});
    row += take;
  }
  return out;
}

}  // namespace hybridflow
