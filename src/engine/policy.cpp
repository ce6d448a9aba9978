#include "engine/policy.hpp"

#include <algorithm>
#include <exception>

#include "engine/job_checkpoint.hpp"

namespace powersgd::engine {

std::vector<int> rank_levels(const Config& config) {
  if (config.adaptive) return {config.rank_low, config.rank_high};
  const bool may_boost = config.warmup_steps > 0 || config.lr_boost_steps > 0;
  if (may_boost && config.rank_high > config.rank) return {config.rank, config.rank_high};
  return {config.rank};
}

size_t levels_before_note(const Config& config) {
  return config.adaptive || config.warmup_steps > 0 ? rank_levels(config).size() : 1;
}

void lay_out_for_note(const Config& config, Communicator& comm, compute::Backend& backend, Arenas& arenas,
                      std::vector<std::unique_ptr<BucketState>>& buckets) {
  const size_t all = rank_levels(config).size();
  if (config.lr_boost_steps == 0 || levels_before_note(config) == all) return;
  std::exception_ptr local;
  try {
    arenas.fit_levels(backend, buckets, all);
  } catch (...) {
    local = std::current_exception();
  }
  agree_on_outcome(comm, local, "laying out the buffers of rank_high for a learning-rate note");
}

LevelChoice choose_level(const Config& config, const BucketState& s) {
  const size_t high = s.levels.size() - 1;
  if (s.compressed_steps < static_cast<uint64_t>(config.warmup_steps)) return {high, RankReason::Warmup};
  if (s.boost_left > 0) return {high, RankReason::LrNote};
  if (config.adaptive) return {s.rule_level, s.rule_reason};
  return {0, RankReason::Fixed};
}

void DecisionLog::add(int64_t step, int bucket, const BucketState& s) {
  if (entries_.size() == Reducer::kMaxDecisions) entries_.pop_front();
  entries_.push_back(RankDecision{step, bucket, s.current_rank, s.reason});
}

std::vector<RankDecision> DecisionLog::take(size_t max) {
  const auto end = entries_.begin() + static_cast<std::ptrdiff_t>(std::min(max, entries_.size()));
  std::vector<RankDecision> out(entries_.begin(), end);
  entries_.erase(entries_.begin(), end);
  return out;
}

}  // namespace powersgd::engine

const char* powersgd::rank_reason_name(RankReason reason) {
  switch (reason) {
    case RankReason::Fixed: return "fixed";
    case RankReason::Warmup: return "warmup";
    case RankReason::LrNote: return "lr_note";
    case RankReason::FirstWindow: return "first_window";
    case RankReason::NormChangeHigh: return "norm_change_high";
    case RankReason::NormChangeLow: return "norm_change_low";
  }
  return "unknown";
}
