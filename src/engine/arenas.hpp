// Where the engine's floats live: each bucket's device buffers, the arenas the
// collectives reduce (all buckets' ranges side by side, so reduce_all sends one
// collective per arena), and their host staging when the backend's memory is
// not host-accessible. Laid out once, at the first reduce (or load).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "compute/backend.hpp"
#include "engine/plan.hpp"

namespace powersgd::engine {

// One bucket: its plan, its device buffers and its slice of every arena.
struct BucketState {
  // levels: one plan per rank level, level_ranks their ranks: {config.rank}, with adaptive {rank_low,
  // rank_high}, with a fixed rank that the policy may boost {rank, rank_high} (policy.hpp).
  BucketState(std::vector<Shape> shapes_, std::vector<BucketPlan> levels_, std::vector<int> level_ranks_)
      : shapes(std::move(shapes_)),
        numel(levels_.front().numel),
        levels(std::move(levels_)),
        level_ranks(std::move(level_ranks_)) {}

  // Fixed at add_bucket: the user thread reads these while reductions run on
  // the worker (bucket_size, bucket_shapes, the size checks of reduce,
  // reduce_all and error_feedback, a checkpoint's expected layout), so nothing
  // writes them after (const). Every level has the bucket's numel.
  const std::vector<Shape> shapes;
  const int64_t numel;
  const std::vector<BucketPlan> levels;
  const std::vector<int> level_ranks;
  // From here on the worker's once reductions run. plan: the current level's,
  // levels[level]; the level switch (step_runner.cpp) assigns it.
  BucketPlan plan;
  size_t level = 0;
  // Work buffer (layout in plan.hpp) plus one float: the finite flag of plain steps.
  compute::DeviceBuffer in;
  // Negated error-feedback memory, in the work buffer's layout (error = in - out;
  // keeping out - in lets one gemm produce it and one subtract consume it).
  // Whole bucket: the side x side square, padding included (the reference's
  // batched hook carries the padding's error too).
  compute::DeviceBuffer nerr;
  // Whole bucket only: the side x side output, and the plain step's buffer.
  compute::DeviceBuffer tmp;
  // The bucket's slot in the first-collective arena, where a reduction of this
  // bucket alone places [packed uncompressed | finite flag | P, or with
  // alternating P or Q] (sized for the largest level); reduce_all packs the
  // buckets' ranges one after the other from offset 0 instead (step_runner.cpp).
  int64_t unc_offset = 0;
  int64_t p_offset = 0, q_offset = 0;  // slots in the P arenas; in the Q arenas
  bool q_initialized = false;
  uint64_t draws = 0;
  std::vector<float> host_plain;  // staging of plain steps when the backend is not host-accessible
  double last_m2 = std::nan(""), last_e2 = std::nan("");
  int current_rank = 1;  // level_ranks[level]: Stats::current_rank
  // Successful compressed steps (identical on every rank): the alternating
  // half (even: P, odd: Q) and the adaptive window.
  uint64_t compressed_steps = 0;
  // Adaptive: sum of the averaged output's norm over this window's steps, and
  // the previous window's sum (NaN: no window completed yet).
  double window_sum = 0.0;
  double previous_window = std::nan("");
  // Rank policy (policy.hpp), identical on every rank: a learning-rate note not
  // yet applied (it rides on the bucket's next announce), the boosted compressed
  // steps left, the adaptive rule's own choice (in force once no warm-up or
  // boost overrides it) and the reason of the level in force.
  bool note_pending = false;
  uint64_t boost_left = 0;
  size_t rule_level = 0;
  RankReason rule_reason = RankReason::FirstWindow;
  RankReason reason = RankReason::Fixed;

  // The buffer a plain (uncompressed) step reduces: numel floats and the flag.
  float* plain_buffer() const { return plan.whole ? tmp.data() : in.data(); }
};

// A range of an arena: device pointer, and where it is staged on the host (the
// same pointer when the backend is host-accessible).
struct Segment {
  float* dev;
  float* host;
  size_t count;
};

struct Arenas {
  // Allocates every bucket's buffers and the arenas, and sets each bucket's
  // offsets. The arenas' slots fit each bucket's first `levels` rank levels
  // (policy.hpp, levels_before_note).
  void allocate(compute::Backend& backend, std::vector<std::unique_ptr<BucketState>>& buckets, bool error_feedback,
                bool alternating, size_t levels);
  // Lays the arenas out again so that each bucket's slots fit its first
  // `levels` levels (nothing when they already do), moving every bucket's warm
  // P and Q (its current level's) to its new offsets; the per-step arenas start
  // empty, so no reduction may be prepared in them. A pure function of the
  // buckets' plans: every rank lays out the same, and the state keeps its bits.
  void fit_levels(compute::Backend& backend, std::vector<std::unique_ptr<BucketState>>& buckets, size_t levels);
  // Floats held by the arenas and the buckets' buffers (the engine's memory, staging excluded).
  size_t floats(const std::vector<std::unique_ptr<BucketState>>& buckets) const;

  Segment unc_segment(int64_t offset, int64_t count) { return segment(unc, unc_host, offset, count); }
  Segment q_segment(int64_t offset, int64_t count) { return segment(q_work, q_host, offset, count); }
  Segment plain_segment(BucketState& s) const;

  bool host_accessible = true;
  size_t levels = 0;  // each bucket's slots fit its levels[0, levels)
  compute::DeviceBuffer unc;      // packed tensors, flags and P (alternating: P or Q) of this step, every bucket
  compute::DeviceBuffer q_work;   // this step's Q of every bucket (alternating: the orthonormalized Q of a P half)
  compute::DeviceBuffer p_state;  // warm-start P and Q, kept between steps
  compute::DeviceBuffer q_state;
  compute::DeviceBuffer p_work;   // alternating: the orthonormalized P of a Q half
  std::vector<float> unc_host, q_host;
  bool alternating_ = false;

 private:
  void lay_out(compute::Backend& backend, std::vector<std::unique_ptr<BucketState>>& buckets, size_t levels);
  Segment segment(compute::DeviceBuffer& arena, std::vector<float>& host, int64_t offset, int64_t count) const;
};

// Floats of a bucket's error memory: its elements, and for the whole-bucket
// variant the padding of the square after them (side * side in all).
inline size_t error_memory_size(const BucketPlan& plan) {
  return static_cast<size_t>(plan.whole ? plan.side * plan.side : plan.numel);
}

// This rank's error memory (host), error_memory_size floats: the bucket's own
// element order, then the whole bucket's padding. Worker thread.
std::vector<float> read_error(compute::Backend& backend, const BucketState& s);
// Its inverse's host part: the negated error in `plan`'s work layout, `work_size` floats (what the bucket's
// nerr buffer holds).
std::vector<float> error_in_work_layout(const BucketPlan& plan, size_t work_size, const std::vector<float>& error);

}  // namespace powersgd::engine
