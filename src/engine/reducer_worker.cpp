// Reducer::Impl (reducer_impl.hpp), the worker's side of a reduction: the
// buffers allocated at the first reduce, one reduction run through the order
// guard and the step runner, the step closed; and the glue of the
// learning-rate policy (policy.hpp): the note the user thread makes, the boost
// the worker applies once every rank announced it, the decision log.
#include <algorithm>
#include <vector>

#include "engine/fault_injection.hpp"
#include "engine/policy.hpp"
#include "engine/reducer_impl.hpp"

namespace powersgd {

void Reducer::Impl::start() {
  if (allocated_) return;
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "reduce before any add_bucket");
  started_ = true;
  call([this] {
    engine::maybe_inject(fault_, engine::FaultPoint::Allocate, allocation_attempts_++);
    arenas_.allocate(*backend_, buckets_, config_.error_feedback, config_.alternating,
                     engine::levels_before_note(config_));
  });
  allocated_ = true;
}

void Reducer::Impl::run(Reduction& reduction) {
  try {
    // layout_fingerprint_ is final since the first reduce (start()).
    guard_->begin(reduction, layout_fingerprint_, loaded_on_worker_);
    const auto agreed = [&] {
      guard_->finish(reduction);
      loaded_on_worker_ = false;
    };
    if (!reduction.poisoned && noted(reduction)) {
      // The note changes the buckets' levels, and so what prepare computes:
      // only once every rank announced it (the lookahead left this reduction alone).
      agreed();
      engine::lay_out_for_note(config_, comm_, *backend_, arenas_, buckets_);
      apply_note(reduction);
      runner_->run(reduction);
    } else {
      runner_->run(reduction, agreed);
    }
    guard_->after_success(reduction);
  } catch (...) {
    guard_->settle();
    if (reduction.closes_step) close_step(reduction);
    throw;
  }
  if (reduction.closes_step) close_step(reduction);
}

void Reducer::Impl::close_step(const Reduction& reduction) {
  completed_steps_ = reduction.iteration + 1;
  stats_.last_step_bytes = stats_.bytes_sent - bytes_before_step_;
  bytes_before_step_ = stats_.bytes_sent;
}

void Reducer::Impl::note_lr_change() {
  const OneCaller one(user_mutex_, "note_lr_change");
  require_comm();
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError,
               "note_lr_change before any add_bucket: declare the buckets first");
  steps_.require_boundary("note_lr_change");
  call([this] {
    for (auto& s : buckets_) s->note_pending = true;
  });
}

bool Reducer::Impl::noted(const Reduction& reduction) const {
  return std::any_of(reduction.buckets.begin(), reduction.buckets.end(),
                     [&](int b) { return buckets_[static_cast<size_t>(b)]->note_pending; });
}

void Reducer::Impl::apply_note(const Reduction& reduction) {
  for (int b : reduction.buckets) {
    BucketState& s = *buckets_[static_cast<size_t>(b)];
    if (!s.note_pending) continue;
    s.note_pending = false;
    if (config_.lr_boost_steps == 0) continue;
    s.boost_left = static_cast<uint64_t>(config_.lr_boost_steps);
    const engine::LevelChoice choice = engine::choose_level(config_, s);
    if (choice.level != s.level) runner_->switch_level(s, b, choice.level);
    s.reason = choice.reason;
    log_.add(reduction.iteration, b, s);
  }
}

std::vector<RankDecision> Reducer::Impl::decisions(size_t max) {
  std::vector<RankDecision> out;
  call([&] { out = log_.take(max); });
  return out;
}

}  // namespace powersgd
