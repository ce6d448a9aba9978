// Reducer::Impl (reducer_impl.hpp), the worker's side of a reduction: the
// buffers allocated at the first reduce, one reduction run through the order
// guard and the step runner, the step closed; and the glue of the
// learning-rate policy (policy.hpp): the note the user thread makes, the boost
// the worker applies once every rank announced it, the decision log.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "engine/fault_injection.hpp"
#include "engine/job_checkpoint.hpp"
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

void Reducer::Impl::run(Reduction& reduction, const detail::CommTurns::Turn& turn) {
  if (reduction.buckets.size() == 1 && held_step_ != reduction.iteration && engine::holds(fault_, reduction.iteration)) {
    held_step_ = reduction.iteration;  // test only (fault_injection.hpp)
    worker_.wait_queued(buckets_.size() - 1, std::chrono::seconds(10));
    if (fault_->hold_prepares) runner_->lookahead(reduction);
  }
  Claimed claimed = claim_fusable(reduction, turn);
  bool carry = false;
  bool carried_flags = false;  // stage_first flagged a failure in every carried bucket's range
  // The claimed reductions' ranges hold the carried sums or flags, not what prepare wrote.
  const auto carried_over_claimed = [&] {
    return carry && !claimed.empty() &&
           (carried_flags || (runner_->carries_in_place() && guard_->carried_overwritten()));
  };
  try {
    std::vector<const Reduction*> proposals;
    for (const auto& c : claimed) proposals.push_back(c.item.reduction.get());
    // The announce may carry the first collective (OrderGuard::carry), sent after prepare: the reduction's, or
    // with proposals the fused one of the reduction and all of them (of use where every rank proposed them
    // all). Only proposals the lookahead prepared already: preparing them first would hold this rank's announce
    // back by their compute, where an announce sent at once hides behind it.
    Reduction with_proposals;  // what can_carry reads: the buckets, compressed
    with_proposals.compressed = reduction.compressed;
    with_proposals.buckets = reduction.buckets;
    for (const Reduction* p : proposals)
      with_proposals.buckets.insert(with_proposals.buckets.end(), p->buckets.begin(), p->buckets.end());
    carry = carry_first_ && !reduction.poisoned && !noted(reduction) &&
            std::all_of(proposals.begin(), proposals.end(), [](const Reduction* p) { return p->prepared; }) &&
            guard_->can_carry(with_proposals);
    const engine::CarriedCounts counts = carry ? guard_->carried_counts(with_proposals) : engine::CarriedCounts{};
    carry = carry && runner_->reserve_carried(counts);
    // A 16-bit wire's factors too, where they fit beside the float32 parts (the same decision on every rank
    // that proposed alike: else the parts differ, and nothing is summed).
    const bool carry_halves = carry && counts.halves > 0;
    // layout_fingerprint_ is final since the first reduce (start()).
    guard_->begin(reduction, layout_fingerprint_, loaded_on_worker_, proposals, carry);
    if (!reduction.poisoned && noted(reduction)) {
      // The note changes the buckets' levels, and so what prepare computes:
      // only once every rank announced it (the lookahead left this reduction alone).
      guard_->finish(reduction);
      loaded_on_worker_ = false;
      engine::lay_out_for_note(config_, comm_, *backend_, arenas_, buckets_);
      // Local work after the agreement (a level switch copies whole buckets): its failure on one rank is every
      // rank's, agreed before the reduction's collectives, what it changed put back.
      NotedBefore before;
      bool saved = false;  // save_noted changes nothing
      std::exception_ptr local;
      try {
        before = save_noted(reduction);
        saved = true;
        apply_note(reduction);
        engine::maybe_inject(fault_, engine::FaultPoint::Note, reduction.iteration);
      } catch (...) {
        local = std::current_exception();
      }
      try {
        engine::agree_on_outcome(comm_, local, detail::concat("step ", reduction.iteration,
                                                              ": applying a learning-rate note (note_lr_change)"));
      } catch (...) {
        try {
          if (saved) restore_noted(before);  // on every rank: the note stays pending, nothing switched
        } catch (...) {  // what stays changed differs from the peers': their next announce says so
        }
        throw;
      }
      try {
        runner_->run(reduction);
      } catch (...) {
        restore_noted(before);
        throw;
      }
    } else {
      // While the announce travels; the proposals too (local work, nothing lasting: any not agreed runs
      // later as prepared, like the lookahead's).
      runner_->prepare_once(reduction);
      for (auto& c : claimed) runner_->prepare_once(*c.item.reduction);
      if (carry && claimed.empty()) {
        const auto carried = runner_->stage_carried(reduction, carry_halves);
        guard_->carry(carried.floats, carried.halves);
        runner_->lookahead(reduction);  // while the announce and the first collective travel
      } else if (carry) {
        // No lookahead: the reduction queued next may be of a claimed bucket, or not next once some go back.
        // Staged from the members' state now; run_fused fuses them again from theirs then (prepared again
        // where this carry was not summed for them).
        Reduction speculative = engine::StepRunner::fuse(together(reduction, claimed));
        const bool prepared_ok = speculative.prepare_error == nullptr;
        const auto carried = runner_->stage_carried(speculative, carry_halves);
        carried_flags = speculative.prepare_error != nullptr;
        // A failed staging is this rank's failure of the reduction (a member's own failed prepare stays its own).
        if (prepared_ok && carried_flags) reduction.prepare_error = speculative.prepare_error;
        guard_->carry(carried.floats, carried.halves);
      }
      const size_t fused = guard_->finish(reduction);
      reduction.first_summed = guard_->first_summed();
      reduction.factors_summed = guard_->factors_summed();
      // Carried with proposals and not summed for the reductions that run: what prepare wrote into the carried
      // ranges is gone where the sums came back or stage_first flagged a failure in them, so prepared again.
      if (!reduction.first_summed && carried_over_claimed())
        for (Reduction* r : together(reduction, claimed)) {
          unprepare(*r);
          runner_->prepare_once(*r);
        }
      loaded_on_worker_ = false;
      // The claimed reductions not agreed go back first, so the lookahead sees the true next one.
      Claimed members(std::make_move_iterator(claimed.begin()),
                      std::make_move_iterator(claimed.begin() + static_cast<std::ptrdiff_t>(fused - 1)));
      claimed.erase(claimed.begin(), claimed.begin() + static_cast<std::ptrdiff_t>(fused - 1));
      worker_.requeue_front(std::move(claimed));
      claimed.clear();
      if (!members.empty()) return run_fused(reduction, members);
      runner_->run(reduction);
    }
    guard_->after_success(reduction);
  } catch (...) {
    guard_->settle();
    if (carried_over_claimed())  // prepared again when they run from the queue
      for (auto& c : claimed) unprepare(*c.item.reduction);
    if (!claimed.empty()) worker_.requeue_front(std::move(claimed));  // not announced: they run as queued
    if (reduction.closes_step) close_step(reduction);
    throw;
  }
  if (reduction.closes_step) close_step(reduction);
}

Reducer::Impl::Claimed Reducer::Impl::claim_fusable(const Reduction& r, const detail::CommTurns::Turn& turn) {
  if (!fuse_ || comm_.size() == 1 || r.poisoned || !r.compressed || r.buckets.size() != 1 || noted(r)) return {};
  std::vector<int> buckets = r.buckets;
  return worker_.claim_front(engine::kMaxFused - 1, [&](const WorkerTask* previous, const WorkerTask& task) {
    const Reduction* next = task.reduction.get();
    if (next == nullptr || next->poisoned || !next->compressed || next->buckets.size() != 1 ||
        next->iteration != r.iteration || noted(*next) || !task.turn.follows(previous ? previous->turn : turn))
      return false;
    buckets.push_back(next->buckets[0]);
    if (runner_->can_fuse(buckets)) return true;
    buckets.pop_back();
    return false;
  });
}

void Reducer::Impl::unprepare(Reduction& r) {
  // A reduction whose prepare failed keeps its error: its ranges are sent flagged whatever they hold.
  r.prepared = r.prepare_error != nullptr;
}

std::vector<engine::Reduction*> Reducer::Impl::together(Reduction& reduction, Claimed& claimed) {
  std::vector<Reduction*> all{&reduction};
  for (auto& c : claimed) all.push_back(c.item.reduction.get());
  return all;
}

void Reducer::Impl::run_fused(Reduction& reduction, Claimed& members) {
  for (auto& m : members) m.done->start();
  const std::vector<Reduction*> all = together(reduction, members);
  const auto finish_members = [&](std::exception_ptr error) {
    for (auto& m : members) m.done->finish(error);
  };
  Reduction fused = engine::StepRunner::fuse(all);
  fused.first_summed = reduction.first_summed;  // the announce carried every member's first collective
  fused.factors_summed = reduction.factors_summed;
  try {
    runner_->run(fused);
    guard_->after_success(fused);
  } catch (...) {
    if (!runner_->failed_together()) {  // a failed collective: the ranks may not agree on more
      finish_members(std::current_exception());
      if (fused.closes_step) close_step(fused);
      throw;
    }
    // NaN or Inf, or a rank's local failure: every rank saw the same sums or
    // reports, so every rank is here, nothing changed. Each reduction runs on its
    // own (agreed already), so that only those that fail alone fail, each with its
    // own error (a NaN in one bucket fails that bucket's reduction only).
    // The members not yet rerun keep the lookahead off their buckets (a later
    // step's reduction queued next must be prepared from their state after their rerun).
    std::exception_ptr own;
    for (size_t k = 0; k < all.size(); ++k) {
      Reduction* one = all[k];
      std::vector<int> unsettled;
      for (size_t later = k + 1; later < all.size(); ++later)
        unsettled.insert(unsettled.end(), all[later]->buckets.begin(), all[later]->buckets.end());
      runner_->set_unsettled(std::move(unsettled));
      std::exception_ptr error;
      try {
        one->prepared = false;  // the failed collectives overwrote its prepared ranges
        one->first_summed = false;
        one->factors_summed = false;
        one->prepare_error = nullptr;
        runner_->run(*one);
        guard_->after_success(*one);
      } catch (...) {
        error = std::current_exception();
      }
      if (one == &reduction)
        own = error;
      else
        for (auto& m : members)
          if (m.item.reduction.get() == one) m.done->finish(error);
      if (one->closes_step) close_step(*one);
    }
    runner_->set_unsettled({});
    if (own) std::rethrow_exception(own);
    return;
  }
  finish_members(nullptr);
  if (fused.closes_step) close_step(fused);
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

Reducer::Impl::NotedBefore Reducer::Impl::save_noted(const Reduction& reduction) {
  NotedBefore before{{}, log_};
  for (int b : reduction.buckets)
    if (buckets_[static_cast<size_t>(b)]->note_pending)
      before.buckets.emplace_back(b, gather_bucket(*buckets_[static_cast<size_t>(b)]));
  return before;
}

void Reducer::Impl::restore_noted(NotedBefore& before) {
  // What can fail first (the error memories in their work layouts), so that a failure restores no bucket
  // rather than some.
  std::vector<std::vector<float>> work_errors;
  for (const auto& [b, saved] : before.buckets)
    work_errors.push_back(work_error_of(*buckets_[static_cast<size_t>(b)], saved));
  for (size_t i = 0; i < before.buckets.size(); ++i) {
    const auto& [b, saved] = before.buckets[i];
    apply_bucket(*buckets_[static_cast<size_t>(b)], saved, work_errors[i]);
  }
  log_ = std::move(before.log);
}

std::vector<RankDecision> Reducer::Impl::decisions(size_t max) {
  std::vector<RankDecision> out;
  call([&] { out = log_.take(max); });
  return out;
}

}  // namespace powersgd
