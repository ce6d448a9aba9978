// Reducer: the facade of the PowerSGD pipeline (docs/engine.md). The user thread
// validates calls and keeps the step bookkeeping (steps.hpp); every reduction
// and every access to device state runs on one SerialWorker thread (common/serial_worker.hpp)
// through the StepRunner (step_runner.hpp), in submission order. Buffers:
// arenas.hpp; fingerprints: fingerprint.hpp; the checkpoint format: checkpoint.hpp.
#include "powersgd/reducer.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <mutex>
#include <optional>

#include "common/check.hpp"
#include "common/comm_turns.hpp"
#include "common/comm_users.hpp"
#include "common/completion.hpp"
#include "common/serial_worker.hpp"
#include "compute/backend.hpp"
#include "engine/arenas.hpp"
#include "engine/checkpoint.hpp"
#include "engine/fault_injection.hpp"
#include "engine/fingerprint.hpp"
#include "engine/job_checkpoint.hpp"
#include "engine/order_guard.hpp"
#include "engine/plan.hpp"
#include "engine/policy.hpp"
#include "engine/rank_reports.hpp"
#include "engine/refused_calls.hpp"
#include "engine/step_runner.hpp"
#include "engine/steps.hpp"

namespace powersgd {

using engine::BucketState;
using engine::Reduction;

void ReduceHandle::wait() const {
  PSGD_REQUIRE(state_ != nullptr, InvalidArgumentError, "wait() on an empty ReduceHandle");
  state_->wait();
}

bool ReduceHandle::done() const {
  PSGD_REQUIRE(state_ != nullptr, InvalidArgumentError, "done() on an empty ReduceHandle");
  return state_->done();
}

ReduceTimes ReduceHandle::times() const {
  PSGD_REQUIRE(state_ != nullptr, InvalidArgumentError, "times() on an empty ReduceHandle");
  const Completion::Times t = state_->times();
  PSGD_REQUIRE(t.finished != Completion::Clock::time_point{}, InvalidArgumentError,
               "times() of a reduction still in flight: wait() for it first");
  const auto seconds = [](Completion::Clock::time_point p) {
    return std::chrono::duration<double>(p.time_since_epoch()).count();
  };
  return ReduceTimes{seconds(t.submitted), seconds(t.started), seconds(t.finished)};
}

class Reducer::Impl final : public detail::CommUser {
 public:
  Impl(Communicator& comm, const Config& config)
      : comm_(comm), turns_(detail::comm_turns(&comm)), config_(config) {
    config_.validate();
    // The finite flags (kFailedFlag) and the order guard's sums are exact below 4096 ranks.
    PSGD_REQUIRE(comm_.size() <= engine::kMaxWorldSize, InvalidArgumentError, "a world of ", comm_.size(),
                 " ranks: the reducer supports at most ", engine::kMaxWorldSize, " ranks");
    std::optional<engine::Fault> fault = engine::take_armed_fault();
    call([this, fault] {
      backend_ = compute::make_backend(
          config_.device == Device::Cpu ? compute::DeviceKind::Cpu : compute::DeviceKind::Cuda, config_.device_index);
      runner_ = std::make_unique<engine::StepRunner>(config_, comm_, *backend_, buckets_, arenas_, stats_,
                                                     log_, [this] { return next_reduction(); }, fault);
      guard_ = std::make_unique<engine::OrderGuard>(config_, comm_, *backend_, buckets_, arenas_, stats_);
    });
    detail::attach_comm_user(&comm_, this);
  }

  // Runs the queued reductions, then joins, before any member goes.
  ~Impl() {
    detail::detach_comm_user(&comm_, this);
    worker_.stop(nullptr);
  }

  // The communicator's destructor: reductions queued so far end first (on the
  // worker, in order); every task after this one is refused (require_comm).
  void communicator_destroyed() noexcept override {
    try {
      worker_.submit(WorkerTask{nullptr, [this] { comm_destroyed_ = true; }, {}})->wait();
    } catch (...) {  // a refused task sets nothing; the flag is then already set
    }
  }
  // Every task the worker runs, and every user-thread path that reaches comm_.
  void require_comm() const {
    PSGD_REQUIRE(!comm_destroyed_, InvalidArgumentError,
                 "the communicator of this reducer was destroyed: destroy a Reducer before its Communicator "
                 "(psgd_reducer_destroy before psgd_comm_destroy)");
  }

  // `refused`: the call was refused before it got here (the C API's own checks).
  int add_bucket(std::span<const Shape> shapes, std::exception_ptr refused = nullptr) {
    const OneCaller one(user_mutex_, "add_bucket");
    require_comm();
    const int index = num_buckets();
    // A rank that refuses the bucket still takes part in the layout check (a
    // fixed-size gather of reports), so every rank fails at once with its reason.
    std::vector<int> ranks;
    std::vector<engine::BucketPlan> levels;
    uint64_t layout = 0;
    if (refused == nullptr) {
      try {
        PSGD_REQUIRE(!started_, InvalidArgumentError, "add_bucket after the first reduce (or load): declare all ",
                     "buckets before reducing; bucket ", buckets_.size(), " refused");
        ranks = engine::rank_levels(config_);
        for (int rank : ranks) levels.push_back(engine::make_plan(shapes, config_, rank));
        layout = engine::extend_layout_fingerprint(layout_fingerprint_, index, shapes);
      } catch (...) {
        refused = std::current_exception();
      }
    }
    // On the worker, in its turn among the communicator's users: after the reductions in flight (a refused
    // add_bucket after reduce_async) and after every call made before it, other reducers' too.
    collective_call([&] {
      const auto reports = engine::gather_reports(
          comm_, refused != nullptr ? engine::report_failure(refused)
                                    : engine::report_values({engine::reducer_fingerprint(layout, config_)}));
      engine::throw_if_any_failed(reports, refused, detail::concat("add_bucket of bucket ", index));
      for (size_t r = 1; r < reports.size(); ++r)
        if (reports[r].values[0] != reports[0].values[0])
          engine::raise_layout_mismatch(comm_, config_, index, shapes, reports);  // every rank takes this branch
    });
    layout_fingerprint_ = layout;
    auto bucket = std::make_unique<BucketState>(std::vector<Shape>(shapes.begin(), shapes.end()), std::move(levels),
                                                ranks);
    bucket->rule_level = ranks.size() - 1;  // the adaptive rule starts high (its first window)
    const engine::LevelChoice first = engine::choose_level(config_, *bucket);
    bucket->level = first.level;
    bucket->reason = first.reason;
    bucket->plan = bucket->levels[first.level];
    bucket->current_rank = ranks[first.level];
    buckets_.push_back(std::move(bucket));
    steps_.add_bucket();
    return index;
  }

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  size_t bucket_size(int b) const { return static_cast<size_t>(checked(b).numel); }
  std::span<const Shape> bucket_shapes(int b) const { return checked(b).shapes; }
  int bucket_rank(int b) {
    const BucketState& s = checked(b);
    int rank = 0;
    call([&] { rank = s.current_rank; });
    return rank;
  }

  // count: the buffer's elements, or kUnchecked (the pointer-only overloads).
  static constexpr size_t kUnchecked = static_cast<size_t>(-1);

  void reduce(int b, float* data, size_t count) {
    const OneCaller one(user_mutex_, "reduce");  // held until the reduction is done
    submit(b, data, count)->wait();
  }

  // `refused`: as add_bucket's.
  std::shared_ptr<Completion> reduce_async(int b, float* data, size_t count, std::exception_ptr refused = nullptr) {
    const OneCaller one(user_mutex_, "reduce_async");
    return submit(b, data, count, refused);
  }

  // counts: each buffer's elements, or empty (unchecked).
  void reduce_all(std::span<float* const> data, std::span<const size_t> counts) {
    const OneCaller one(user_mutex_, "reduce_all");
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "reduce_all before any add_bucket");
    auto reduction = std::make_shared<Reduction>();
    for (int b = 0; b < num_buckets(); ++b) reduction->buckets.push_back(b);
    try {
      PSGD_REQUIRE(data.size() == buckets_.size(), InvalidArgumentError, "reduce_all got ", data.size(),
                   " buffers: expected one per bucket, ", buckets_.size());
      for (size_t i = 0; i < data.size(); ++i) {
        PSGD_REQUIRE(data[i] != nullptr, InvalidArgumentError, "reduce_all: data[", i, "] is null");
        if (!counts.empty())
          PSGD_REQUIRE(counts[i] == bucket_size(static_cast<int>(i)), InvalidArgumentError, "reduce_all: data[", i,
                       "] has ", counts[i], " elements, bucket ", i, " has ", bucket_size(static_cast<int>(i)));
      }
    } catch (...) {
      // At a step boundary the refused step counts as done, as on the other ranks.
      refuse(std::move(reduction), std::current_exception(), steps_.at_boundary(), true);
    }
    start();
    reduction->data.assign(data.begin(), data.end());
    try {
      steps_.record(*reduction, config_.start_iter, true);
    } catch (...) {
      refuse(std::move(reduction), std::current_exception(), false, true);
    }
    worker_.submit(WorkerTask{std::move(reduction), nullptr, turns_->take()})->wait();
  }

  void note_lr_change() {
    const OneCaller one(user_mutex_, "note_lr_change");
    require_comm();
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError,
                 "note_lr_change before any add_bucket: declare the buckets first");
    steps_.require_boundary("note_lr_change");
    call([this] {
      for (auto& s : buckets_) s->note_pending = true;
    });
  }

  std::vector<RankDecision> decisions(size_t max) {
    std::vector<RankDecision> out;
    call([&] { out = log_.take(max); });
    return out;
  }

  int64_t iteration() {
    int64_t result = 0;
    call([&] { result = completed_steps_; });
    return result;
  }

  void error_feedback(int b, float* out, size_t count) {
    const BucketState& s = checked(b);
    PSGD_REQUIRE(out != nullptr, InvalidArgumentError, "error_feedback of bucket ", b, ": out is null");
    PSGD_REQUIRE(count == kUnchecked || count == static_cast<size_t>(s.numel), InvalidArgumentError,
                 "error_feedback of bucket ", b, ": the buffer has ", count, " elements, the bucket has ", s.numel);
    call([&] {
      if (s.nerr.empty()) {
        std::fill(out, out + s.numel, 0.0f);
        return;
      }
      // The bucket's elements; a whole bucket's padding error stays internal.
      const std::vector<float> error = engine::read_error(*backend_, s);
      std::copy_n(error.begin(), s.numel, out);
    });
  }

  Stats stats() {
    Stats result;
    call([&] {
      result = stats_;
      double m2 = 0, e2 = 0;
      result.relative_error.clear();
      result.current_rank.clear();
      for (const auto& s : buckets_) {
        result.current_rank.push_back(s->current_rank);
        result.relative_error.push_back(s->last_m2 > 0 ? std::sqrt(s->last_e2 / s->last_m2)
                                        : std::isnan(s->last_m2) ? std::nan("")
                                                                 : 0.0);
        if (!std::isnan(s->last_m2)) {
          m2 += s->last_m2;
          e2 += s->last_e2;
        }
      }
      result.total_relative_error = m2 > 0 ? std::sqrt(e2 / m2) : 0.0;
    });
    return result;
  }

  const Config& config() const { return config_; }
  uint64_t fingerprint() const { return engine::reducer_fingerprint(layout_fingerprint_, config_); }

  std::string backend_name() {
    std::string name;
    call([&] { name = backend_->name(); });
    return name;
  }

  void save(const std::string& path) {
    const OneCaller one(user_mutex_, "save");
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "save before any add_bucket: nothing to checkpoint");
    steps_.require_boundary("save");
    start();
    call([&] { engine::write_checkpoint_file(path, engine::encode_checkpoint(gather())); });
  }

  void load(const std::string& path) {
    const OneCaller one(user_mutex_, "load");
    require_comm();
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "load before any add_bucket: declare the buckets first");
    steps_.require_boundary("load");
    engine::CheckpointContents contents = engine::decode_checkpoint(engine::read_checkpoint_file(path), path, config_,
                                                                    layout_fingerprint_, checkpoint_shapes());
    // A per-rank checkpoint holds this rank's own error memory: resuming from
    // another rank's file would apply one rank's error W times and lose the rest.
    PSGD_REQUIRE(contents.rank == comm_.rank() && contents.world_size == comm_.size(), MismatchError, "checkpoint ",
                 path, " was saved by rank ", contents.rank, " of ", contents.world_size, "; this is rank ",
                 comm_.rank(), " of ", comm_.size(),
                 ": a per-rank checkpoint resumes on the same rank of the same world size (save one file per rank, "
                 "e.g. step.rank<RANK>.ckpt)");
    // Everything parsed and checked: apply.
    start();
    call([&] { apply(contents); });
    steps_.restart_at(contents.iteration);
  }

  // `refused`: as add_bucket's.
  void save_job(const std::string& path, std::exception_ptr refused = nullptr) {
    const OneCaller one(user_mutex_, "save_job");
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "save_job before any add_bucket: nothing to checkpoint");
    if (refused == nullptr) refused = detail::exception_of([&] { steps_.require_boundary("save_job"); });
    if (refused == nullptr) start();
    collective_call([&] {
      agree_on_refusal(refused, "save_job");
      engine::CheckpointContents contents;
      std::exception_ptr local;
      try {
        contents = gather();
      } catch (...) {
        local = std::current_exception();
      }
      engine::agree_on_outcome(comm_, local, "save_job: reading the reducer state");
      // The mean is only meaningful over ranks at the same step with the same warm-start state.
      engine::Fnv state;
      state.add(contents.iteration);
      for (const auto& b : contents.buckets) {
        state.add(b.q_initialized);
        state.add(b.draws);
        state.add(b.rank);
        state.add(b.compressed_steps);
        state.add(b.boost_left);
        state.add(b.note_pending);
      }
      comm_.check_same(state.value(), detail::concat("save_job: the step count (this rank: ", contents.iteration,
                                                      ") and warm-start state"));
      engine::average_error_memories(comm_, contents.buckets);
      contents.rank = -1;
      engine::write_on_rank0(comm_, path,
                             [&] { return engine::encode_checkpoint(contents, engine::CheckpointKind::Job); });
    });
  }

  // `refused`: as add_bucket's.
  void load_job(const std::string& path, std::exception_ptr refused = nullptr) {
    const OneCaller one(user_mutex_, "load_job");
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "load_job before any add_bucket: declare the buckets first");
    if (refused == nullptr) refused = detail::exception_of([&] { steps_.require_boundary("load_job"); });
    engine::CheckpointContents contents;
    collective_call([&] {
      agree_on_refusal(refused, "load_job");
      const std::vector<char> file = engine::read_on_rank0(comm_, path);
      std::exception_ptr local;
      try {
        contents = engine::decode_checkpoint(file, path, config_, layout_fingerprint_, checkpoint_shapes(),
                                             engine::CheckpointKind::Job);
      } catch (...) {
        local = std::current_exception();
      }
      // Applied only when every rank parsed and checked it: a refusal leaves every rank's state as it was.
      engine::agree_on_outcome(comm_, local, "load_job of " + path);
    });
    start();
    call([&] { apply(contents); });
    steps_.restart_at(contents.iteration);
  }

 private:
  // What a checkpoint of this reducer holds per bucket. From the fields fixed at
  // add_bucket only (load calls it on the user thread, reductions may be in flight).
  std::vector<engine::CheckpointBucketShape> checkpoint_shapes() const {
    std::vector<engine::CheckpointBucketShape> expected;
    for (const auto& s : buckets_) {
      const engine::BucketPlan& any_level = s->levels.front();  // the error memory's size is every level's
      engine::CheckpointBucketShape shape;
      shape.numel = static_cast<uint64_t>(s->numel);
      shape.error = config_.error_feedback ? engine::error_memory_size(any_level) : 0;
      shape.error_without_padding = config_.error_feedback && any_level.whole ? static_cast<size_t>(s->numel) : 0;
      for (size_t l = 0; l < s->levels.size(); ++l)
        shape.levels.push_back({s->level_ranks[l], static_cast<size_t>(s->levels[l].p_numel),
                                static_cast<size_t>(s->levels[l].q_numel)});
      expected.push_back(std::move(shape));
    }
    return expected;
  }

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
  std::shared_ptr<Completion> submit(int b, float* data, size_t count, std::exception_ptr refused = nullptr) {
    auto reduction = std::make_shared<Reduction>();
    reduction->buckets = {b};
    const bool valid = b >= 0 && b < num_buckets();
    try {
      if (refused != nullptr) std::rethrow_exception(refused);
      checked(b);
      PSGD_REQUIRE(data != nullptr, InvalidArgumentError, "reduce of bucket ", b, ": data is null");
      PSGD_REQUIRE(count == kUnchecked || count == bucket_size(b), InvalidArgumentError, "reduce of bucket ", b,
                   ": the buffer has ", count, " elements, the bucket has ", bucket_size(b));
    } catch (...) {
      // A valid bucket not yet reduced in this step counts as reduced, as on the other ranks.
      refuse(std::move(reduction), std::current_exception(), valid && !steps_.reduced(b), false);
    }
    start();
    reduction->data = {data};
    try {
      steps_.record(*reduction, config_.start_iter, false);
    } catch (...) {
      refuse(std::move(reduction), std::current_exception(), false, false);
    }
    return worker_.submit(WorkerTask{std::move(reduction), nullptr, turns_->take()});
  }

  // Submits `reduction` carrying `error` (order_guard.hpp), waits until it is
  // done and throws `error`: a refused call, reduce_async's included (it
  // returns no handle to wait for), has finished its collectives when it
  // throws, so the caller's next collective on the communicator cannot race
  // them. `record`: it counts in the step bookkeeping. Nothing to poison before
  // any bucket (no rank can reduce then).
  [[noreturn]] void refuse(std::shared_ptr<Reduction> reduction, std::exception_ptr error, bool record,
                           bool whole_step) {
    if (!buckets_.empty()) {
      start();
      reduction->poisoned = error;
      reduction->prepared = true;  // the runner's lookahead leaves it alone
      reduction->data.clear();
      if (record)
        steps_.record(*reduction, config_.start_iter, whole_step);
      else
        reduction->iteration = steps_.submitted_steps();
      try {
        worker_.submit(WorkerTask{std::move(reduction), nullptr, turns_->take()})->wait();
      } catch (...) {  // this rank's outcome is `error` (a broken communicator fails the next call)
      }
    }
    std::rethrow_exception(error);
  }

  // Worker thread, first in a collective call whose refusal on one rank must
  // fail every rank (save_job, load_job): one gather of reports; throws on every
  // rank when any refused (`refused` on the refusing rank).
  void agree_on_refusal(std::exception_ptr refused, const char* what) {
    const auto reports =
        engine::gather_reports(comm_, refused != nullptr ? engine::report_failure(refused) : engine::RankReport{});
    engine::throw_if_any_failed(reports, refused, what, "nothing saved or loaded on any rank");
  }

  const BucketState& checked(int b) const {
    PSGD_REQUIRE(b >= 0 && b < num_buckets(), InvalidArgumentError, "bucket index ", b, ": expected 0 to ",
                 num_buckets() - 1);
    return *buckets_[static_cast<size_t>(b)];
  }

  // First reduce (or load): allocate every buffer; the layout is final from here on.
  void start() {
    if (started_) return;
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "reduce before any add_bucket");
    started_ = true;
    call([this] {
      arenas_.allocate(*backend_, buckets_, config_.error_feedback, config_.alternating,
                       engine::levels_before_note(config_));
    });
  }

  // Worker thread: runs one reduction; a step's last one completes the step, failed or not.
  void run(Reduction& reduction) {
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

  // Worker thread: whether a bucket of the reduction carries a learning-rate note.
  bool noted(const Reduction& reduction) const {
    return std::any_of(reduction.buckets.begin(), reduction.buckets.end(),
                       [&](int b) { return buckets_[static_cast<size_t>(b)]->note_pending; });
  }

  // Worker thread, after every rank announced the note: the boost starts with this step.
  void apply_note(const Reduction& reduction) {
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

  // Worker thread.
  void close_step(const Reduction& reduction) {
    completed_steps_ = reduction.iteration + 1;
    stats_.last_step_bytes = stats_.bytes_sent - bytes_before_step_;
    bytes_before_step_ = stats_.bytes_sent;
  }

  // Worker thread: this rank's state, for the checkpoint.
  engine::CheckpointContents gather() {
    engine::CheckpointContents c;
    c.config = config_;
    c.layout_fingerprint = layout_fingerprint_;
    c.world_size = comm_.size();
    c.rank = comm_.rank();
    c.iteration = completed_steps_;
    c.numel_before = stats_.numel_before;
    c.numel_after = stats_.numel_after;
    c.bytes_sent = stats_.bytes_sent;
    for (const auto& s : buckets_) {
      engine::CheckpointBucket b;
      b.numel = static_cast<uint64_t>(s->plan.numel);
      b.q_initialized = s->q_initialized;
      b.draws = s->draws;
      b.rank = s->current_rank;
      b.level = static_cast<uint32_t>(s->level);
      b.compressed_steps = s->compressed_steps;
      b.window_sum = s->window_sum;
      b.previous_window = s->previous_window;
      b.note_pending = s->note_pending;
      b.boost_left = s->boost_left;
      b.rule_level = static_cast<uint32_t>(s->rule_level);
      b.rule_reason = s->rule_reason;
      b.reason = s->reason;
      if (!s->nerr.empty()) b.error = engine::read_error(*backend_, *s);
      b.p.resize(static_cast<size_t>(s->plan.p_numel));
      b.q.resize(static_cast<size_t>(s->plan.q_numel));
      backend_->copy_to_host(b.p.data(), arenas_.p_state.data() + s->p_offset, b.p.size());
      backend_->copy_to_host(b.q.data(), arenas_.q_state.data() + s->q_offset, b.q.size());
      c.buckets.push_back(std::move(b));
    }
    return c;
  }

  // Worker thread: the inverse of gather (contents checked by decode_checkpoint).
  void apply(const engine::CheckpointContents& c) {
    size_t levels = 1;  // a file saved mid-boost needs the high level's buffers (lay_out_for_note)
    for (const auto& b : c.buckets) levels = std::max<size_t>(levels, b.level + 1);
    arenas_.fit_levels(*backend_, buckets_, levels);
    for (size_t i = 0; i < buckets_.size(); ++i) {
      BucketState& s = *buckets_[i];
      const engine::CheckpointBucket& b = c.buckets[i];
      s.q_initialized = b.q_initialized;
      s.draws = b.draws;
      // The level first: the error memory's work layout is the level's plan.
      s.level = b.level;
      s.plan = s.levels[s.level];
      s.current_rank = b.rank;
      s.compressed_steps = b.compressed_steps;
      s.window_sum = b.window_sum;
      s.previous_window = b.previous_window;
      s.note_pending = b.note_pending;
      s.boost_left = b.boost_left;
      s.rule_level = b.rule_level;
      s.rule_reason = b.rule_reason;
      s.reason = b.reason;
      if (!s.nerr.empty()) engine::write_error(*backend_, s, b.error);
      backend_->copy_from_host(arenas_.p_state.data() + s.p_offset, b.p.data(), b.p.size());
      backend_->copy_from_host(arenas_.q_state.data() + s.q_offset, b.q.data(), b.q.size());
      s.last_m2 = s.last_e2 = std::nan("");
    }
    completed_steps_ = c.iteration;
    loaded_on_worker_ = true;
    stats_.numel_before = c.numel_before;
    stats_.numel_after = c.numel_after;
    stats_.bytes_sent = c.bytes_sent;
    stats_.last_step_bytes = 0;
    bytes_before_step_ = c.bytes_sent;
    backend_->synchronize();
  }

  Communicator& comm_;
  // The order of the collectives of this communicator's reducers (comm_turns.hpp): every task that issues
  // collectives takes a turn when it is submitted, in the user's call order, and waits for it on the worker.
  const std::shared_ptr<detail::CommTurns> turns_;
  std::atomic<bool> comm_destroyed_{false};  // set on the worker by communicator_destroyed
  Config config_;
  std::unique_ptr<compute::Backend> backend_;  // before every buffer: destroyed after them

  // User thread only.
  uint64_t layout_fingerprint_ = 0;
  bool started_ = false;
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
  // Runs fn on the worker after everything queued before it; rethrows its exception.
  void call(std::function<void()> fn) { worker_.submit(WorkerTask{nullptr, std::move(fn), {}})->wait(); }
  // The same for a call that issues collectives: in its turn among the communicator's users.
  void collective_call(std::function<void()> fn) {
    worker_.submit(WorkerTask{nullptr, std::move(fn), turns_->take()})->wait();
  }
  // The reduction queued after the running one (the step runner's lookahead); null when a call is next.
  std::shared_ptr<Reduction> next_reduction() const {
    // Only the pointer: the task's std::function is not copied on this per-reduction path.
    return worker_.peek_next([](const WorkerTask& task) { return task.reduction; }).value_or(nullptr);
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
                                       run(*task.reduction);
                                   }};
};

Reducer::Reducer(Communicator& comm, const Config& config) : impl_(std::make_unique<Impl>(comm, config)) {}
Reducer::~Reducer() = default;
int Reducer::add_bucket(std::span<const Shape> shapes) { return impl_->add_bucket(shapes); }
int Reducer::num_buckets() const { return impl_->num_buckets(); }
size_t Reducer::bucket_size(int bucket) const { return impl_->bucket_size(bucket); }
std::span<const Shape> Reducer::bucket_shapes(int bucket) const { return impl_->bucket_shapes(bucket); }
int Reducer::bucket_rank(int bucket) const { return impl_->bucket_rank(bucket); }
void Reducer::reduce(int bucket, float* data) { impl_->reduce(bucket, data, Impl::kUnchecked); }
void Reducer::reduce(int bucket, std::span<float> data) { impl_->reduce(bucket, data.data(), data.size()); }
ReduceHandle Reducer::reduce_async(int bucket, float* data) {
  return ReduceHandle(impl_->reduce_async(bucket, data, Impl::kUnchecked));
}
ReduceHandle Reducer::reduce_async(int bucket, std::span<float> data) {
  return ReduceHandle(impl_->reduce_async(bucket, data.data(), data.size()));
}
void Reducer::reduce_all(std::span<float* const> data) { impl_->reduce_all(data, {}); }
void Reducer::reduce_all(std::span<const std::span<float>> data) {
  std::vector<float*> pointers;
  std::vector<size_t> counts;
  for (const auto& d : data) {
    pointers.push_back(d.data());
    counts.push_back(d.size());
  }
  impl_->reduce_all(pointers, counts);
}
void Reducer::note_lr_change() { impl_->note_lr_change(); }
std::vector<RankDecision> Reducer::decisions() { return impl_->decisions(kMaxDecisions); }
std::vector<RankDecision> Reducer::decisions(size_t max) { return impl_->decisions(max); }
int64_t Reducer::iteration() const { return impl_->iteration(); }
void Reducer::error_feedback(int bucket, float* out) const { impl_->error_feedback(bucket, out, Impl::kUnchecked); }
void Reducer::error_feedback(int bucket, std::span<float> out) const {
  impl_->error_feedback(bucket, out.data(), out.size());
}
Stats Reducer::stats() const { return impl_->stats(); }
const Config& Reducer::config() const { return impl_->config(); }
uint64_t Reducer::fingerprint() const { return impl_->fingerprint(); }
std::string Reducer::backend_name() const { return impl_->backend_name(); }
void Reducer::save(const std::string& path) const { impl_->save(path); }
void Reducer::load(const std::string& path) { impl_->load(path); }
void Reducer::save_job(const std::string& path) const { impl_->save_job(path); }
void Reducer::load_job(const std::string& path) { impl_->load_job(path); }

void detail::RefusedCalls::add_bucket(Reducer& reducer, std::exception_ptr error) {
  reducer.impl_->add_bucket({}, error);
  PSGD_ASSERT(false, "a refused add_bucket returned");
}
void detail::RefusedCalls::reduce_async(Reducer& reducer, int bucket, std::exception_ptr error) {
  reducer.impl_->reduce_async(bucket, nullptr, Reducer::Impl::kUnchecked, error);
  PSGD_ASSERT(false, "a refused reduce_async returned");
}
void detail::RefusedCalls::save_job(const Reducer& reducer, std::exception_ptr error) {
  reducer.impl_->save_job("", error);
  PSGD_ASSERT(false, "a refused save_job returned");
}
void detail::RefusedCalls::load_job(Reducer& reducer, std::exception_ptr error) {
  reducer.impl_->load_job("", error);
  PSGD_ASSERT(false, "a refused load_job returned");
}

}  // namespace powersgd
