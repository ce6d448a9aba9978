// The rank policy (docs/engine.md, "Rank policy and decision log"): which rank
// level each bucket's next compressed step uses, and why, from state every rank
// holds identically (the bucket's successful compressed steps, the boost left
// after an agreed learning-rate note, the adaptive rule's last window), so the
// decisions need no collective of their own. Worker thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "engine/arenas.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::engine {

// The rank levels of a bucket: {rank}, with adaptive {rank_low, rank_high},
// with a fixed rank the policy may boost (warmup_steps or lr_boost_steps > 0)
// and rank_high > rank: {rank, rank_high}. The last level is the high rank.
std::vector<int> rank_levels(const Config& config);

// How many of a bucket's levels it can reach before any learning-rate note: all
// with adaptive or a warm-up; otherwise (a fixed rank that only a note boosts)
// the first. The arenas fit these from the start; a reducer that never notes
// allocates no buffer for rank_high (Arenas::fit_levels lays it out at the
// first applied note).
size_t levels_before_note(const Config& config);

// Collective, after every rank announced a learning-rate note (so on every rank
// alike): lays out the buffers of the levels beyond levels_before_note
// (Arenas::fit_levels). The outcome is agreed, one small collective per applied
// note whatever this rank's layout (a rank resumed from a file saved mid-boost
// has them already), so an allocation failing on one rank fails the reduction
// on every rank, the note still pending. Nothing when every level is laid out
// from the start or notes are ignored. Worker thread, before the reduction is prepared.
void lay_out_for_note(const Config& config, Communicator& comm, compute::Backend& backend, Arenas& arenas,
                      std::vector<std::unique_ptr<BucketState>>& buckets);

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
