// Step bookkeeping on the user thread: which buckets were reduced in the step
// being submitted, and the iteration each reduction belongs to. A step closes
// when every bucket was reduced once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/step_runner.hpp"

namespace powersgd::engine {

class StepTracker {
 public:
  void add_bucket() { reduced_.push_back(false); }

  // Records that `reduction` reduces its buckets in the step being submitted and
  // stamps it (iteration, compressed, closes_step). Throws InvalidArgumentError,
  // recording nothing, when a bucket was already reduced in this step or, for a
  // whole step (reduce_all), when the step was already begun.
  void record(Reduction& reduction, int64_t start_iter, bool whole_step);

  // No bucket reduced yet in the step being submitted. `what` names the caller in the error.
  void require_boundary(const char* what) const;

  int64_t submitted_steps() const { return submitted_; }
  bool at_boundary() const { return count_ == 0; }
  // Whether bucket b (a valid index) was reduced in the step being submitted.
  bool reduced(int b) const { return reduced_[static_cast<size_t>(b)]; }
  // After a load: the next step is `iteration`.
  void restart_at(int64_t iteration) { submitted_ = iteration; }

 private:
  std::vector<bool> reduced_;
  size_t count_ = 0;
  int64_t submitted_ = 0;
};

}  // namespace powersgd::engine
