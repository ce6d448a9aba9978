// The rank policy (docs/engine.md, "Rank policy and decision log"): which rank
// level each bucket's next compressed step uses, and why, from state every rank
// holds identically (the bucket's successful compressed steps, the boost left
// after an agreed learning-rate note, the adaptive rule's last window), so the
// decisions need no collective of their own. Worker thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "engine/arenas.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::engine {

// The rank levels of a bucket: {rank}, with adaptive {rank_low, rank_high},
// with a fixed rank the policy may boost (warmup_steps or lr_boost_steps > 0)
// and rank_high > rank: {rank, rank_high}. The last level is the high rank.
std::vector<int> rank_levels(const Config& config);

// Level and reason in force for the bucket's next compressed step, in this
// order: warm-up (compressed_steps < warmup_steps), a boost left after a note,
// the adaptive rule's own choice, the fixed rank.
struct LevelChoice {
  size_t level;
  RankReason reason;
};
LevelChoice choose_level(const Config& config, const BucketState& s);

// The bounded log behind Reducer::decisions() and psgd_reducer_decisions (the only copy: at most
// Reducer::kMaxDecisions entries, the oldest dropped).
class DecisionLog {
 public:
  void add(int64_t step, int bucket, const BucketState& s);
  // Removes and returns the min(max, size) oldest entries.
  std::vector<RankDecision> take(size_t max);

 private:
  std::deque<RankDecision> entries_;
};

}  // namespace powersgd::engine
