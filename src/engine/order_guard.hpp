// The order guard and the divergence detector (docs/engine.md, "Order guard and
// divergence detector"), on the worker thread.
//
// Order guard: ranks that reduce different buckets (another order, a skipped
// bucket, a local error followed by the next bucket, two user threads) would
// pass Gloo collectives of different sizes (Gloo aborts the process) or, with
// equal sizes, average different buckets into each other. So before a
// reduction's data collectives every rank announces, in one fixed-size Float64
// allreduce, what it is about to reduce: the step, the buckets, the size of the
// first data collective, configuration, layout, warm-start and rank-policy state, a pending
// divergence hash, a pending learning-rate note, and whether its own call already failed locally (a poisoned
// reduction). Sums are identical on every rank, so every rank takes the same
// branch: when all announced the same, the data collectives follow; otherwise
// every rank takes part in one fixed-size gather of reports (rank_reports.hpp)
// and throws, naming the ranks and what differs. Nothing changed before.
//
// Divergence detector: every config.divergence_check_interval steps of a
// bucket (after step t with (t + 1) % interval == 0) each rank hashes the
// bucket's output and its warm-start P and Q; the bucket's next reduction
// carries the hash in its announce, so replicas that drifted apart get a
// MismatchError on every rank naming the ranks, the step and the bucket. A hash
// stays pending until an announce compared it: one that agreed, or reported the
// divergence. A poisoned announce carries none, and one that failed for another
// reason (a refusal, another bucket) leaves it to the bucket's next announce,
// so a refusal raises no false alarm and delays no real one.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <vector>

#include "compute/backend.hpp"
#include "engine/arenas.hpp"
#include "engine/fingerprint.hpp"
#include "engine/rank_reports.hpp"
#include "engine/step_runner.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::engine {

// The largest world the guard's and the finite flags' encodings are exact for:
// the Reducer refuses a larger one.
inline constexpr int kMaxWorldSize = 4095;

// 64-bit hash of `count` floats' bits, in index order (independent of the host's
// vector width), at memory speed. Not cryptographic: it detects drift, not tampering.
uint64_t hash_floats(const float* x, size_t count, uint64_t seed = 0);

// Whether every rank's 64-bit `value` is the same, from sums of 16-bit chunks x
// and x^2 (Cauchy-Schwarz: n * sum(x^2) == (sum x)^2 iff all x are equal; exact
// in double for n <= kMaxWorldSize). `sums` is the allreduced output of encode.
inline constexpr size_t kChunks = 4;
void encode_agreement(uint64_t value, double* out);  // 2 * kChunks doubles
bool all_agree(const double* sums, int world);

// Collective, on add_bucket's error path (the ranks' fingerprints of
// configuration and layout differ, `fingerprints` says so on every rank): rank
// 0 broadcasts a description of its configuration and of bucket `index`, each
// rank finds its first difference, and one report gather tells every rank.
// Throws MismatchError on every rank, e.g. "bucket 0 tensor 0: [8,9] on rank 1,
// [8,8] on rank 0" or "config.rank 2 on rank 1, 1 on rank 0".
[[noreturn]] void raise_layout_mismatch(Communicator& comm, const Config& config, int index,
                                        std::span<const Shape> shapes, const std::vector<RankReport>& fingerprints);

// Adds to `h` the bucket state that decides the sizes and the meaning of the
// bucket's next data collectives (warm start, the adaptive level and the
// alternating half, the rank policy): identical on every rank that is in step.
// The guard compares it before every reduction; save_job before averaging.
void add_warm_state(Fnv& h, const BucketState& s);

// An announce may also propose queued reductions to run fused with its own
// (docs/engine.md, "Fusing queued reductions"): at most this many in all. Part
// of the announce's fixed size (equal on every rank: the version check).
inline constexpr size_t kMaxFused = 8;

class OrderGuard {
 public:
  // Everything by reference is owned by the Reducer and outlives the guard.
  OrderGuard(const Config& config, Communicator& comm, compute::Backend& backend,
             const std::vector<std::unique_ptr<BucketState>>& buckets, const Arenas& arenas, Stats& stats);

  // Collective (one Float64 allreduce of kMaxFused blocks of 2 * kChunks + 1
  // values, or the lead exchange of the same values: below), in two
  // halves around the reduction's local prepare, so the announce's latency
  // hides behind it: begin() issues the announce (nothing of the reduction has
  // run: prepare changes no lasting state); finish(), before the data
  // collectives, waits for it and returns when every rank announced the same
  // reduction and none failed; else it throws on every rank, after one report
  // gather: a local failure (reduction.poisoned) on its rank, the others an
  // error of its code naming the rank and the reason; a disagreement a
  // MismatchError naming the ranks and what differs. `layout` is the layout
  // fingerprint; `loaded` whether this rank loaded a checkpoint since its last
  // agreed reduction (the message then speaks of resumed state). A world of one
  // announces nothing (finish rethrows a poisoned reduction's error).
  //
  // `proposals`: queued reductions (at most kMaxFused - 1, in queue order) this
  // rank offers to run fused with `reduction`, each described in the announce
  // like a reduction of its own (step, bucket, sizes, pending divergence hash);
  // finish() returns how many of them, as a prefix, every rank offered alike
  // plus one: the same number on every rank, from the sums. The others were not
  // announced (they announce when they run).
  //
  // The lead exchange (Communicator::lead_exchange_capacity holds the
  // announce; docs/engine.md, "The announce carries P"): the announce travels
  // as a lead, every rank's arriving at every rank, which adds them in rank
  // order into the sums the allreduce would give. `carry` (can_carry of the
  // reduction with its proposals): begin() only prepares the announce, and
  // carry() sends it with the first collective behind it, after prepare: the
  // reduction's, or with proposals the fused one of the reduction and all of
  // them (StepRunner::fuse). first_summed() then says, the same on every rank,
  // whether every rank carried alike and it came back summed: the same sizes,
  // and every rank proposed exactly the proposals agreed, so each carried the
  // same reductions (else every rank issues the first collective as usual).
  // Between begin(carry) and carry() nothing may throw.
  void begin(const Reduction& reduction, uint64_t layout, bool loaded,
             std::span<const Reduction* const> proposals = {}, bool carry = false);
  // Whether this rank's announce of `reduction` can carry its first collective: the lead exchange, a compressed
  // reduction whose carried floats (carried_counts) fit beside the announce and sum in rank order (so their bits
  // are those of the collective they replace). A pure function of agreed state and this rank's call.
  bool can_carry(const Reduction& reduction) const;
  // What an announce of `reduction` carries (StepRunner::stage_carried): with the float32 wire its whole first
  // collective (`floats`); with a 16-bit wire its float32 parts (`floats`: each bucket's packed tensors and flag,
  // gathered) and, where they fit beside them and sum in rank order, its 16-bit factors (`halves`; else 0, and
  // they follow in a collective of their own: StepRunner::first_collective).
  CarriedCounts carried_counts(const Reduction& reduction) const;
  // Sends the announce begun with `carry`, the carried floats and halves (StepRunner::stage_carried; halves
  // empty: none) behind it: summed in place when first_summed().
  void carry(std::span<float> floats, std::span<uint16_t> halves);
  size_t finish(const Reduction& reduction);
  // After finish(): whether the announce carried the first collective and it came back summed (with a 16-bit
  // wire the float32 parts, and the factors where factors_summed()).
  bool first_summed() const { return first_summed_; }
  bool factors_summed() const { return first_summed_ && carried_halves_; }
  // After finish() (returned or threw): whether the carried data came back summed, valid or not (first_summed):
  // it then holds sums, not what prepare wrote (with the float32 wire that is the reduction's host range:
  // StepRunner::carries_in_place).
  bool carried_overwritten() const { return carried_overwritten_; }
  // Waits for an announce begun and not finished (its buffer is this object's). For error paths (in a catch
  // block: an announce begun with carry and not sent leaves as this rank's failure, with the error handled).
  void settle() noexcept;

  // After a reduction succeeded: hashes each bucket's output, P and Q when its
  // step is due (divergence_check_interval), for its next announce.
  void after_success(const Reduction& reduction);
  // A load replaced the state the pending hashes are of: none is compared (every rank loads before the next
  // reduction, so every rank forgets them alike).
  void forget_pending() { pending_.assign(pending_.size(), Pending{}); }

 private:
  struct Pending {
    uint64_t hash = 0;
    int64_t step = -1;  // the step the hash is of; -1: none pending
  };

  uint64_t first_collective_count(const Reduction& reduction) const;
  // Hash of what decides a reduction's collectives beyond the state every
  // announce covers; the buckets whose pending divergence hash it carries go to `carried`.
  uint64_t identity_hash(const Reduction& reduction, std::vector<int>& carried, uint64_t& numel,
                         int64_t& check_step, uint64_t& check) const;
  // The announce (sums_) as this rank's lead in the lead exchange, `parts` behind it.
  Work send_lead(std::span<const LeadPart> parts);
  // The announce in flight compared the pending hashes it carried: they are consumed.
  void compared();
  [[noreturn]] void raise(const Reduction& reduction, const std::vector<uint64_t>& mine, bool loaded);

  const Config& config_;
  Communicator& comm_;
  compute::Backend& be_;
  const std::vector<std::unique_ptr<BucketState>>& buckets_;
  const Arenas& arenas_;
  Stats& stats_;
  std::vector<Pending> pending_;    // per bucket
  std::vector<int> carried_;        // the buckets whose pending hash the announce in flight carries
  std::vector<std::vector<int>> proposal_carried_;  // the same for each proposal
  // The announce in flight between begin and finish.
  std::vector<uint64_t> mine_;
  bool loaded_ = false;
  // Block 0: the reduction's hash chunks and failure flag; block j > 0: proposal
  // j's hash chunks and whether this rank proposes it.
  static constexpr size_t kBlock = 2 * kChunks + 1;
  static constexpr size_t kAnnounceBytes = kMaxFused * kBlock * sizeof(double);
  double sums_[kMaxFused * kBlock] = {};
  Work announced_;
  // The lead exchange: every rank's sums_ (size() * kMaxFused * kBlock), its
  // capacity (0: none, the announce is an allreduce), and the announce begun with carry and not sent yet.
  std::vector<double> leads_;
  size_t lead_capacity_ = 0;
  bool deferred_ = false;
  bool first_summed_ = false;  // written by the communication thread until announced_ completed
  bool carried_halves_ = false;  // the announce in flight carries 16-bit factors
  bool carried_overwritten_ = false;  // carried_overwritten()
  std::vector<float> host_scratch_;  // device outputs staged for hashing
};

}  // namespace powersgd::engine
