// Reducer::Impl, the state behind the Reducer facade (docs/engine.md); private to
// src/engine. The user thread validates calls and keeps the step bookkeeping
// (steps.hpp); every reduction and every access to device state runs on one
// SerialWorker thread (common/serial_worker.hpp) through the StepRunner
// (step_runner.hpp), in submission order. Buffers: arenas.hpp; fingerprints:
// fingerprint.hpp; the checkpoint format: checkpoint.hpp.
//
// The members are defined by job:
//   reducer.cpp             construction, the facade's reads, Reducer::, ReduceHandle::, RefusedCalls::
//   reducer_submit.cpp      declaring buckets and submitting reductions; the refusal path
//   reducer_worker.cpp      the worker's side of a reduction; the learning-rate policy's glue
//   reducer_checkpoint.cpp  save, load, save_job, load_job and the state they gather and apply
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/comm_turns.hpp"
#include "common/comm_users.hpp"
#include "common/completion.hpp"
#include "common/env.hpp"
#include "common/serial_worker.hpp"
#include "compute/backend.hpp"
#include "engine/arenas.hpp"
#include "engine/checkpoint.hpp"
#include "engine/fault_injection.hpp"
#include "engine/fingerprint.hpp"
#include "engine/order_guard.hpp"
#include "engine/policy.hpp"
#include "engine/step_runner.hpp"
#include "engine/steps.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd {

class Reducer::Impl final : public detail::CommUser {
  using BucketState = engine::BucketState;
  using Reduction = engine::Reduction;

 public:
  Impl(Communicator& comm, const Config& config);
  // Runs the queued reductions, then joins, before any member goes.
  ~Impl();

  // The communicator's destructor: reductions queued so far end first (on the
  // worker, in order); every task after this one is refused (require_comm).
  void communicator_destroyed() noexcept override;
  // Every task the worker runs, and every user-thread path that reaches comm_.
  void require_comm() const {
    PSGD_REQUIRE(!comm_destroyed_, InvalidArgumentError,
                 "the communicator of this reducer was destroyed: destroy a Reducer before its Communicator "
                 "(psgd_reducer_destroy before psgd_comm_destroy)");
  }

  // `refused`: the call was refused before it got here (the C API's own checks).
  int add_bucket(std::span<const Shape> shapes, std::exception_ptr refused = nullptr);

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  size_t bucket_size(int b) const { return static_cast<size_t>(checked(b).numel); }
  std::span<const Shape> bucket_shapes(int b) const { return checked(b).shapes; }
  int bucket_rank(int b);

  // count: the buffer's elements, or kUnchecked (the pointer-only overloads).
  static constexpr size_t kUnchecked = static_cast<size_t>(-1);

  void reduce(int b, float* data, size_t count);
  // `refused`: as add_bucket's.
  std::shared_ptr<Completion> reduce_async(int b, float* data, size_t count, std::exception_ptr refused = nullptr);
  // counts: each buffer's elements, or empty (unchecked).
  void reduce_all(std::span<float* const> data, std::span<const size_t> counts);

  void note_lr_change();
  std::vector<RankDecision> decisions(size_t max);

  int64_t iteration();
  void error_feedback(int b, float* out, size_t count);
  Stats stats();
  const Config& config() const { return config_; }
  uint64_t fingerprint() const { return engine::reducer_fingerprint(layout_fingerprint_, config_); }
  std::string backend_name();

  void save(const std::string& path);
  void load(const std::string& path, bool shared = false);  // shared: Reducer::load_shared
  // `refused`: as add_bucket's.
  void save_job(const std::string& path, std::exception_ptr refused = nullptr);
  // `refused`: as add_bucket's.
  void load_job(const std::string& path, std::exception_ptr refused = nullptr);

 private:
  // What a checkpoint of this reducer holds per bucket. From the fields fixed at
  // add_bucket only (load calls it on the user thread, reductions may be in flight).
  std::vector<engine::CheckpointBucketShape> checkpoint_shapes() const;

  // One user-facing call at a time: a second thread's call is refused before
  // it submits anything (its reduction would race the first one's order).
  class OneCaller {
   public:
    OneCaller(std::mutex& mutex, const char* what) : lock_(mutex, std::try_to_lock) {
      PSGD_REQUIRE(lock_.owns_lock(), InvalidArgumentError, what,
                   " while another thread is inside a call of this Reducer: use a Reducer from one thread at a time "
                   "(ReduceHandle::wait may run on any thread); nothing was submitted");
    }

   private:
    std::unique_lock<std::mutex> lock_;
  };

  // One bucket's reduction. A refused call (a bad index, null data, a wrong
  // size, a bucket reduced twice, or `refused` before it got here) submits a
  // poisoned reduction and throws (refuse), so every other rank fails with
  // this rank's reason instead of waiting or pairing its reduction with this
  // rank's next one.
  std::shared_ptr<Completion> submit(int b, float* data, size_t count, std::exception_ptr refused = nullptr);

  // Submits `reduction` carrying `error` (order_guard.hpp), waits until it is
  // done and throws `error`: a refused call, reduce_async's included (it
  // returns no handle to wait for), has finished its collectives when it
  // throws, so the caller's next collective on the communicator cannot race
  // them. `record`: it counts in the step bookkeeping. Nothing to poison before
  // any bucket (no rank can reduce then).
  [[noreturn]] void refuse(std::shared_ptr<Reduction> reduction, std::exception_ptr error, bool record,
                           bool whole_step);

  // Worker thread, first in a collective call whose refusal on one rank must
  // fail every rank (save_job, load_job): one gather of reports; throws on every
  // rank when any refused (`refused` on the refusing rank).
  void agree_on_refusal(std::exception_ptr refused, const char* what);

  const BucketState& checked(int b) const {
    PSGD_REQUIRE(b >= 0 && b < num_buckets(), InvalidArgumentError, "bucket index ", b, ": expected 0 to ",
                 num_buckets() - 1);
    return *buckets_[static_cast<size_t>(b)];
  }

  // First reduce, save or load: the layout is final from here on; allocates every buffer unless this rank
  // has them. Local: a failed allocation throws here and is tried again by the next call, so a caller that
  // issues collectives turns it into a refusal every rank takes part in (refuse, agree_on_refusal).
  void start();

  // Worker thread: runs one reduction, fused with the reductions queued right
  // after it where every rank has them queued too (docs/engine.md, "Fusing
  // queued reductions"); a step's last one completes the step, failed or not.
  // `turn`: the reduction's place on the communicator.
  void run(Reduction& reduction, const detail::CommTurns::Turn& turn);

  // Worker thread: whether a bucket of the reduction carries a learning-rate note.
  bool noted(const Reduction& reduction) const;

  // Worker thread, after every rank announced the note: the boost starts with this step.
  void apply_note(const Reduction& reduction);
  // What apply_note changes: the noted buckets' policy and level, their warm P and Q and their error memory
  // (the level's layout), and the decision log. Saved before it (each bucket as its checkpoint holds it) and
  // put back where the step then fails: a failed step leaves the warm start, the error memory and the rank
  // policy as they were, its note still pending for the next step (on every rank alike: every rank fails it).
  struct NotedBefore {
    std::vector<std::pair<int, engine::CheckpointBucket>> buckets;
    engine::DecisionLog log;
  };
  NotedBefore save_noted(const Reduction& reduction);
  void restore_noted(NotedBefore& before);

  // Worker thread.
  void close_step(const Reduction& reduction);

  // Worker thread: this rank's state, for the checkpoint.
  engine::CheckpointContents gather();
  engine::CheckpointBucket gather_bucket(const engine::BucketState& s);

  // Worker thread: the inverse of gather (contents checked by decode_checkpoint), in two parts so that a
  // failure changes nothing: prepare_apply does what can fail (the buffers of the levels the file uses, each
  // bucket's error memory in its work layout); commit_apply only assigns and copies. apply does both.
  // apply_bucket needs the bucket's level laid out; `work_error`: the error in that level's work layout.
  struct PreparedApply {
    std::vector<std::vector<float>> work_errors;  // per bucket
  };
  PreparedApply prepare_apply(const engine::CheckpointContents& c);
  void commit_apply(const engine::CheckpointContents& c, PreparedApply& prepared);
  void apply(const engine::CheckpointContents& c);
  std::vector<float> work_error_of(const engine::BucketState& s, const engine::CheckpointBucket& b) const;
  void apply_bucket(engine::BucketState& s, const engine::CheckpointBucket& b, const std::vector<float>& work_error);

  Communicator& comm_;
  // The order of the collectives of this communicator's reducers (comm_turns.hpp): every task that issues
  // collectives takes a turn when it is submitted, in the user's call order, and waits for it on the worker.
  const std::shared_ptr<detail::CommTurns> turns_;
  std::atomic<bool> comm_destroyed_{false};  // set on the worker by communicator_destroyed
  Config config_;
  std::unique_ptr<compute::Backend> backend_;  // before every buffer: destroyed after them

  // User thread only.
  uint64_t layout_fingerprint_ = 0;
  // started_: the layout is final (no add_bucket), on every rank alike from its first reduce, save or load,
  // refused or not. allocated_: this rank's buffers exist; an allocation that failed is tried again by the
  // next call (start()).
  bool started_ = false;
  bool allocated_ = false;
  std::optional<engine::Fault> fault_;  // test only (fault_injection.hpp): read on the worker at an allocation
  int64_t allocation_attempts_ = 0;     // worker
  int64_t held_step_ = -1;              // worker: the last step FaultPoint::Hold held
  engine::StepTracker steps_;
  std::mutex user_mutex_;  // OneCaller

  // Buckets: declared on the user thread before the first reduce; their device
  // state is the worker's from then on (read by the user thread through worker_.call).
  std::vector<std::unique_ptr<BucketState>> buckets_;
  engine::Arenas arenas_;
  int64_t completed_steps_ = 0;
  bool loaded_on_worker_ = false;  // a load since the last agreed announce (its message speaks of resumed state)
  std::unique_ptr<engine::OrderGuard> guard_;
  Stats stats_;
  uint64_t bytes_before_step_ = 0;  // stats_.bytes_sent when the step being run began
  engine::DecisionLog log_;  // before runner_, which writes to it
  std::unique_ptr<engine::StepRunner> runner_;

  // One entry of the worker's queue: a reduction, or a call that reads or
  // changes worker-owned state for the user thread; `turn`: its place among the
  // communicator's collectives, when it issues any (a reduction, a collective call).
  struct WorkerTask {
    std::shared_ptr<Reduction> reduction;
    std::function<void()> call;
    detail::CommTurns::Turn turn;
  };
  using SerialWorkerClaimed = SerialWorker<WorkerTask>::Claimed;
  using Claimed = std::vector<SerialWorkerClaimed>;
  // Worker thread: takes out of the queue the reductions that may run fused
  // with `reduction` (StepRunner::can_fuse), at most kMaxFused - 1.
  Claimed claim_fusable(const Reduction& reduction, const detail::CommTurns::Turn& turn);
  // Worker thread, after every rank agreed: `reduction` and `members` as one,
  // each member's handle finished with its outcome; rethrows the reduction's.
  void run_fused(Reduction& reduction, Claimed& members);
  // Marks `r` to be prepared again: a carry not summed for it overwrote its ranges.
  static void unprepare(Reduction& r);
  // `reduction`, then the claimed ones in the queue's order.
  static std::vector<Reduction*> together(Reduction& reduction, Claimed& claimed);
  // Read once, when the Reducer is made: PSGD_FUSE_REDUCTIONS=0 turns fusing off on this rank (bench A/B; any
  // rank that proposes nothing makes every rank run its reductions one by one).
  const bool fuse_ = env::get_switch("PSGD_FUSE_REDUCTIONS", "on, the default", "off");
  // PSGD_CARRY_FIRST=0: this rank's announces never carry the first collective (OrderGuard::carry; bench A/B;
  // a rank that carries nothing makes every rank issue the first collective of its own).
  const bool carry_first_ = env::get_switch("PSGD_CARRY_FIRST", "on, the default", "off");
  // Runs fn on the worker after everything queued before it; rethrows its exception.
  void call(std::function<void()> fn) { worker_.submit(WorkerTask{nullptr, std::move(fn), {}})->wait(); }
  // The same for a call that issues collectives: in its turn among the communicator's users.
  void collective_call(std::function<void()> fn) {
    worker_.submit(WorkerTask{nullptr, std::move(fn), turns_->take()})->wait();
  }
  // The first reductions queued after the running one, in order (the step runner's lookahead); null for a call.
  std::vector<std::shared_ptr<Reduction>> queued_reductions() const {
    // Only the pointers: the tasks' std::function is not copied on this per-reduction path.
    return worker_.peek_front(engine::kMaxFused, [](const WorkerTask& task) { return task.reduction; });
  }
  SerialWorker<WorkerTask> worker_{"reducer", [this](WorkerTask& task) {
                                     // Released when the task ends, run or refused (a cancelled task's
                                     // turn goes with the task).
                                     const detail::CommTurns::Turn turn = std::move(task.turn);
                                     require_comm();
                                     turn.wait();
                                     if (task.call)
                                       task.call();
                                     else
                                       run(*task.reduction, turn);
                                   }};
};

}  // namespace powersgd
