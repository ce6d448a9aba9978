#include "engine/steps.hpp"

#include <algorithm>

#include "common/check.hpp"

namespace powersgd::engine {

void StepTracker::record(Reduction& r, int64_t start_iter, bool whole_step) {
  if (whole_step)
    PSGD_REQUIRE(count_ == 0, InvalidArgumentError, "reduce_all must start a step: ", count_,
                 " bucket(s) already reduced in step ", submitted_);
  for (int b : r.buckets)
    PSGD_REQUIRE(!reduced_[static_cast<size_t>(b)], InvalidArgumentError, "bucket ", b,
                 " was already reduced in step ", submitted_, ": reduce every bucket once per step");
  for (int b : r.buckets) reduced_[static_cast<size_t>(b)] = true;
  count_ += r.buckets.size();
  r.iteration = submitted_;
  r.compressed = submitted_ >= start_iter;
  r.closes_step = count_ == reduced_.size();
  if (r.closes_step) {
    std::fill(reduced_.begin(), reduced_.end(), false);
    count_ = 0;
    ++submitted_;
  }
}

void StepTracker::require_boundary(const char* what) const {
  PSGD_REQUIRE(count_ == 0, InvalidArgumentError, what, " in the middle of step ", submitted_, ": ", count_, " of ",
               reduced_.size(), " buckets reduced; ", what, " at a step boundary");
}

}  // namespace powersgd::engine
