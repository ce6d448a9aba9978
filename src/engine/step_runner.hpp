// StepRunner: the PowerSGD math of one reduction, on the worker thread. Local
// compute (prepare), the collectives in wire order (docs/engine.md), and the
// output and the error memory (decompress). It prepares the next queued
// reduction while its own collectives are in flight when the two share no bucket.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "compute/backend.hpp"
#include "engine/arenas.hpp"
#include "engine/fault_injection.hpp"
#include "engine/policy.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::engine {

// Whether the bucket's next compressed step is an alternating Q half (else a P half,
// or not alternating): it decides the first collective's factor and size.
inline bool in_q_half(const Config& config, const BucketState& s) {
  return config.alternating && s.compressed_steps % 2 == 1;
}

// One reduction: one bucket (reduce) or all of them (reduce_all).
struct Reduction {
  std::vector<int> buckets;
  std::vector<float*> data;  // the user's buffer of each bucket
  int64_t iteration = 0;
  bool closes_step = false;  // the last reduction of its step
  bool compressed = false;   // iteration >= start_iter
  // A call refused on the user thread (a local argument error): the reduction
  // only announces the failure (order_guard.hpp), so every rank fails with it.
  std::exception_ptr poisoned;
  // Filled by prepare, possibly ahead of time while the previous reduction communicates.
  bool prepared = false;
  // Several queued reductions run as one (StepRunner::fuse): every collective in rank order.
  bool fused = false;
  std::exception_ptr prepare_error;
  std::vector<double> m2;  // ||M||^2 over compressed matrices, per bucket of the reduction
  std::vector<char> drew;  // whether Q came from the generator, per bucket
  // Where each bucket's ranges lie in the arenas this step (prepare): its
  // [packed | flag | factor] range of the first-collective arena and its Q
  // range of the Q work arena, and the reduction's whole ranges.
  std::vector<int64_t> unc_at, q_at;
  int64_t unc_begin = 0, unc_count = 0, q_begin = 0, q_count = 0;
  // Alternating: whether the bucket's step is a Q half (else a P half).
  std::vector<char> q_half;
  // Adaptive: ||sum over ranks of the output's factors and packed tensors||^2, per bucket.
  std::vector<double> out2;
  // The order guard's announce carried the first collective (with a 16-bit wire its float32 parts) and every
  // rank's came back summed (OrderGuard::carry, StepRunner::stage_carried): run() goes on from there.
  bool first_summed = false;
  // With a 16-bit wire: the announce carried the 16-bit factors too, summed (first_summed is then true).
  bool factors_summed = false;
};

// What an order guard's announce carries of a reduction's first collective (OrderGuard::carried_counts):
// float32 values, and a 16-bit wire's factors.
struct CarriedCounts {
  uint64_t floats = 0;
  uint64_t halves = 0;
};

class StepRunner {
 public:
  using QueuedReductions = std::function<std::vector<std::shared_ptr<Reduction>>()>;

  // Everything by reference is owned by the Reducer and outlives the runner;
  // `queued` returns the first reductions queued after the running one, in order (null for a queued call).
  StepRunner(const Config& config, Communicator& comm, compute::Backend& backend,
             std::vector<std::unique_ptr<BucketState>>& buckets, Arenas& arenas, Stats& stats, DecisionLog& log,
             QueuedReductions queued, std::optional<Fault> fault = std::nullopt)
      : config_(config), comm_(comm), be_(backend), buckets_(buckets), arenas_(arenas), stats_(stats), log_(log),
        queued_(std::move(queued)), fault_(fault) {}

  // Throws NonFiniteError (the same decision on every rank) before changing any
  // state, or the collectives' errors. A local failure (prepare, or the compute
  // between the P and Q collectives) on any rank fails the reduction on every
  // rank, before any state changes: the failing rank still issues the step's
  // collectives, poisoned (kFailedFlag in the finite flag, NaN in Q), and then
  // every rank takes part in one fixed-size gather of reports (rank_reports.hpp).
  // The caller has passed the order guard's check (order_guard.hpp) first.
  void run(Reduction& job);

  // Prepares `job` now unless it is (a failure is kept in job.prepare_error and
  // sent poisoned, as run does). Local; no lasting state changes.
  void prepare_once(Reduction& job);
  // The first collective of a prepared compressed `job` as it is sent, issued on its own or carried by the
  // order guard's announce: its host range, staged from the device, after a local failure (a failed staging
  // becomes job.prepare_error) as it is with kFailedFlag in every bucket's finite flag. Throws nothing: the
  // collective, or the announce, must leave.
  Segment stage_first(Reduction& job) noexcept;
  // What the order guard's announce carries of a prepared compressed `job`'s first collective, staged
  // (stage_first): with the float32 wire its host range, summed there; with a 16-bit wire its float32 parts
  // (each bucket's packed tensors and flag), gathered in send_first's order (gather_float32) into the capacity that
  // reserve_carried(OrderGuard::carried_counts) made, and summed there, first_collective scattering them back,
  // and where `halves` its 16-bit factors, encoded as send_factors encodes them (else, or where they exceed the
  // reserved capacity, none: they follow in their own collective). Throws nothing, allocates nothing: the
  // announce must leave.
  struct Carried {
    std::span<float> floats;
    std::span<uint16_t> halves;
  };
  Carried stage_carried(Reduction& job, bool halves) noexcept;
  // Makes room for the carried float32 parts and factors of a 16-bit wire; false where that fails (the announce
  // then carries nothing). Before the announce is begun.
  bool reserve_carried(const CarriedCounts& counts) noexcept;
  // The float32 parts' elements of the buckets `members` (each's float32_part_numel): what a 16-bit wire's
  // float32 collective of their fused first collective sends, and so what its announce carries.
  static size_t float32_count(const std::vector<std::unique_ptr<BucketState>>& buckets, std::span<const int> members);
  // The factors' elements of the buckets `members` this step (P, or Q in an alternating Q half): what a 16-bit
  // wire's factor collective of their fused first collective sends.
  static size_t factor_count(const Config& config, const std::vector<std::unique_ptr<BucketState>>& buckets,
                             std::span<const int> members);
  // Whether stage_carried's span is the reduction's own host range (the float32 wire), which sums that come back
  // and are not kept then overwrite; else it is a gathered copy.
  bool carries_in_place() const { return config_.wire_dtype == WireDType::Float32; }
  // Prepares the reductions queued after `current`, in order, up to the first queued call or pending
  // learning-rate note: each unless it shares a bucket with `current`, an earlier queued reduction or one not
  // settled (its state is not final). Local work while `current`'s collectives travel; a reduction claimed
  // later as a proposal is then ready to be carried (reducer_worker.cpp).
  void lookahead(const Reduction& current);

  // Fusing queued reductions (docs/engine.md, "Fusing queued reductions"):
  // whether single-bucket compressed reductions of `buckets` (in any order)
  // can run as one (fuse) with the same bits as one after the other: in the
  // arenas' order each bucket's slots follow the previous one's (so their
  // ranges are one segment), and each bucket's own collectives add each
  // element over the ranks in a fixed order independent of its offset (rank
  // order, or host-staged: hosts' ranks, then hosts; Communicator::sums_in_rank_order),
  // as the fused ones then do (allreduce_in_rank_order_async), moving the same
  // bytes in one round. A pure function of the buckets' agreed state and the communicator.
  bool can_fuse(std::vector<int> buckets) const;
  // One reduction of the prepared `members` (can_fuse of their buckets): their
  // ranges in the arenas' order, so run() sends each collective once for all.
  static Reduction fuse(std::vector<Reduction*> members);
  // Buckets whose state is not final though no running reduction holds them:
  // the members of a failed fused reduction still to rerun one by one (their
  // reruns change their state and fill their slots). The lookahead leaves
  // reductions of them alone; empty otherwise.
  void set_unsettled(std::vector<int> buckets) { unsettled_ = std::move(buckets); }
  // Whether the last run() failed on every rank alike: NonFiniteError, or a
  // rank's local failure reported to every rank (raise_local_failures), as
  // opposed to a failed collective (which ranks may see differently).
  bool failed_together() const { return failed_together_; }

  // A rank whose local work failed puts this into its finite flags: the sum is
  // kFailedFlag * (failed ranks) + (ranks with NaN/Inf), exact while the world
  // has fewer than 4096 ranks (floats hold integers exactly up to 2^24).
  static constexpr float kFailedFlag = 4096.0f;

 private:
  BucketState& bucket(int b) { return *buckets_[static_cast<size_t>(b)]; }
  const BucketState& bucket(int b) const { return *buckets_[static_cast<size_t>(b)]; }
  bool q_half_now(const BucketState& s) const { return in_q_half(config_, s); }

  void prepare(Reduction& job);
  void prepare_plain(BucketState& s, const float* data);
  void prepare_compressed(Reduction& job, size_t i, BucketState& s);
  double form(BucketState& s, const float* data, const float* q, float* p);
  void project_all(const BucketState& s, const float* p, float* q);
  // Orthonormalizes every group's P or Q in `factor` (the bucket's P or Q range) in place.
  enum class Factor { P, Q };
  void orthogonalize(float* factor, const BucketPlan& plan, Factor which, int b, int64_t step);

  void run_plain(Reduction& job);
  void run_compressed(Reduction& job);
  void run_alternating(Reduction& job);
  void check_flags(const Reduction& job, const Segment& unc);
  void decompress(const Reduction& job, size_t i);
  bool commit_adaptive(const Reduction& job, size_t i);

 public:
  // The bucket's plan becomes levels[level], its warm start and error memory
  // carried over (local work, no collective); the policy's switches use it.
  // A failure leaves the bucket as it was. `step`: the step whose commit
  // switches (test-only FaultPoint::Switch), -1 for a note's switch.
  void switch_level(BucketState& s, int bucket, size_t level, int64_t step = -1);

 private:

  // The factor the bucket's first-collective range carries this step: P, or Q in an alternating Q half.
  int64_t factor_numel(const BucketState& s, bool q_half) const { return q_half ? s.plan.q_numel : s.plan.p_numel; }
  float* factor(const Reduction& job, size_t i) {
    return arenas_.unc.data() + job.unc_at[i] + bucket(job.buckets[i]).plan.float32_part_numel();
  }
  // Bucket i's finite flag in the reduction's first-collective segment `unc`.
  float& flag(const Reduction& job, size_t i, const Segment& unc) {
    return unc.host[job.unc_at[i] - job.unc_begin + bucket(job.buckets[i]).plan.packed_numel];
  }

  // stage: copy the device range to its host staging first; a rank whose local
  // work failed sends its host buffer as it is (its device may be what failed).
  Work send(const Segment& seg, bool stage = true);
  // The job's allreduce: in rank order for a fused job (in_rank_order_), else the communicator's choice.
  Work allreduce(void* data, size_t count, DataType type);
  bool in_rank_order_ = false;  // the running job is fused (set by run)
  std::vector<int> unsettled_;  // set_unsettled
  bool failed_together_ = false;  // failed_together; reset by run
  // A segment whose `factors` ranges ([offset, count) from the segment's start,
  // ascending) hold P or Q: with a 16-bit wire_dtype those travel in their own
  // collective, rounded once (engine/half.hpp), after one float32 collective of
  // the rest (gather_float32); with float32, the whole segment in one.
  // send_first sends the job's first collective (unc, staged by stage_first), send_q its Q (all factor;
  // stage: copied from the device first). wait_segment waits for `works`, puts the sums back into the
  // segment's host range (the factors widened to float32) and, with copy_back, into its device range.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  void send_first(const Reduction& job, const Segment& unc, const Ranges& factors, std::vector<Work>& works);
  void send_q(const Segment& q, const Ranges& all_of_q, bool stage, std::vector<Work>& works);
  void wait_segment(std::vector<Work>& works, const Segment& seg, const Ranges& factors, bool copy_back);
  // The 16-bit half of the sends and wait_segment: the factors encoded into
  // wire_half_ and, where there are any, their collective; the sums widened back.
  void send_factors(const Segment& seg, const Ranges& factors, std::vector<Work>& works);
  static size_t factor_count(const Ranges& factors);  // the elements of the ranges
  void widen_factors(const Segment& seg, const Ranges& factors);
  // Each bucket's float32 part of the job's first-collective segment `unc`, in bucket order, into wire_f32_,
  // which the caller sized for them (float32_count).
  void gather_float32(const Reduction& job, const Segment& unc) noexcept;
  // The factor ranges of the reduction's first-collective segment (none with a float32 wire),
  // computed once per step for send_first and wait_segment.
  Ranges factor_ranges(const Reduction& job);
  // f(offset, n) for each bucket's factor range of the job's first-collective segment that is not empty, in
  // bucket order (offset: from the segment's start): what factor_ranges lists, without allocating.
  template <typename F>
  void for_each_factor_range(const Reduction& job, F f) const {
    for (size_t i = 0; i < job.buckets.size(); ++i) {
      const BucketState& s = bucket(job.buckets[i]);
      const int64_t n = factor_numel(s, job.q_half[i]);
      if (n > 0) f(job.unc_at[i] - job.unc_begin + s.plan.float32_part_numel(), n);
    }
  }
  void wait_all(std::vector<Work>& works, const std::vector<Segment>& segments, bool copy_back = true);
  // Collective, on the error path only (every rank saw from the sums that one
  // failed, or that Q is not finite): throws the failure on every rank when a
  // rank reports one (`own` on the failing rank); returns when none did.
  void raise_local_failures(const Reduction& job, std::exception_ptr own);
  // The compressed step's first collective (stage_first, sent, waited for), or where the announce carried it
  // (job.first_summed) its sums copied back to the device (with a 16-bit wire the float32 parts scattered from
  // wire_f32_ and the factors widened from wire_half_, after the factors' own collective where the announce did
  // not carry them: job.factors_summed).
  void first_collective(Reduction& job, const Segment& unc, const Ranges& factors);
  // The first collective's flags said a rank failed locally: raise it on every rank.
  [[noreturn]] void fail_flagged(const Reduction& job, std::exception_ptr own);
  [[noreturn]] void throw_nonfinite(const Reduction& job, int bucket, const std::string& what);

  const Config& config_;
  Communicator& comm_;
  compute::Backend& be_;
  std::vector<std::unique_ptr<BucketState>>& buckets_;
  Arenas& arenas_;
  Stats& stats_;
  DecisionLog& log_;
  QueuedReductions queued_;
  std::optional<Fault> fault_;  // test-only fault injection (fault_injection.hpp)
  // The 16-bit wire's buffers: one segment's float32 ranges and its factors,
  // valid from send_first or send_q (or stage_carried) until wait_segment (one segment in flight at a time).
  std::vector<float> wire_f32_;
  std::vector<uint16_t> wire_half_;
};

}  // namespace powersgd::engine
