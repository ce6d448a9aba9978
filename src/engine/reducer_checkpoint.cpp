// Reducer::Impl (reducer_impl.hpp), checkpoints: the per-rank save and load,
// the job checkpoint's collective save_job and load_job (job_checkpoint.hpp),
// and the state they gather from and apply to the worker. The format:
// checkpoint.hpp (docs/engine.md, "Checkpoints: per rank and per job").
#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "engine/checkpoint.hpp"
#include "engine/fingerprint.hpp"
#include "engine/job_checkpoint.hpp"
#include "engine/order_guard.hpp"
#include "engine/reducer_impl.hpp"
#include "engine/refused_calls.hpp"

namespace powersgd {

void Reducer::Impl::save(const std::string& path) {
  const OneCaller one(user_mutex_, "save");
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "save before any add_bucket: nothing to checkpoint");
  steps_.require_boundary("save");
  start();
  call([&] { engine::write_checkpoint_file(path, engine::encode_checkpoint(gather())); });
}

void Reducer::Impl::load(const std::string& path, bool shared) {
  const OneCaller one(user_mutex_, shared ? "load_shared" : "load");
  require_comm();
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "load before any add_bucket: declare the buckets first");
  steps_.require_boundary("load");
  engine::CheckpointContents contents = engine::decode_checkpoint(engine::read_checkpoint_file(path), path, config_,
                                                                  layout_fingerprint_, checkpoint_shapes());
  // A per-rank checkpoint holds this rank's own error memory: resuming from
  // another rank's file would apply one rank's error W times and lose the rest.
  PSGD_REQUIRE(shared || (contents.rank == comm_.rank() && contents.world_size == comm_.size()), MismatchError,
               "checkpoint ",
               path, " was saved by rank ", contents.rank, " of ", contents.world_size, "; this is rank ",
               comm_.rank(), " of ", comm_.size(),
               ": a per-rank checkpoint resumes on the same rank of the same world size (save one file per rank, "
               "e.g. step.rank<RANK>.ckpt)");
  // Shared: only what every rank of the saving job held alike; the error memory
  // starts from zero as at the first compressed step (docs/engine.md).
  if (shared)
    for (auto& b : contents.buckets) std::fill(b.error.begin(), b.error.end(), 0.0f);
  // Everything parsed and checked: apply.
  start();
  call([&] { apply(contents); });
  steps_.restart_at(contents.iteration);
}

void Reducer::Impl::save_job(const std::string& path, std::exception_ptr refused) {
  const OneCaller one(user_mutex_, "save_job");
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "save_job before any add_bucket: nothing to checkpoint");
  if (refused == nullptr) refused = detail::exception_of([&] { steps_.require_boundary("save_job"); });
  if (refused == nullptr) refused = detail::exception_of([&] { start(); });
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
    for (const auto& s : buckets_) {
      engine::add_warm_state(state, *s);
      state.add(s->note_pending);
    }
    comm_.check_same(state.value(), detail::concat("save_job: the step count (this rank: ", contents.iteration,
                                                    ") and warm-start state"));
    engine::average_error_memories(comm_, contents.buckets);
    contents.rank = -1;
    engine::write_on_rank0(comm_, path,
                           [&] { return engine::encode_checkpoint(contents, engine::CheckpointKind::Job); });
  });
}

void Reducer::Impl::load_job(const std::string& path, std::exception_ptr refused) {
  const OneCaller one(user_mutex_, "load_job");
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "load_job before any add_bucket: declare the buckets first");
  if (refused == nullptr) refused = detail::exception_of([&] { steps_.require_boundary("load_job"); });
  // Before the collective: applied only where every rank has its buffers.
  if (refused == nullptr) refused = detail::exception_of([&] { start(); });
  engine::CheckpointContents contents;
  collective_call([&] {
    agree_on_refusal(refused, "load_job");
    const std::vector<char> file = engine::read_on_rank0(comm_, path);
    std::exception_ptr local;
    PreparedApply prepared;
    try {
      contents = engine::decode_checkpoint(file, path, config_, layout_fingerprint_, checkpoint_shapes(),
                                           engine::CheckpointKind::Job);
      prepared = prepare_apply(contents);
    } catch (...) {
      local = std::current_exception();
    }
    // Applied only when every rank parsed, checked and prepared it (what can fail: a rank short of memory):
    // a refusal leaves every rank's state as it was.
    engine::agree_on_outcome(comm_, local, "load_job of " + path);
    commit_apply(contents, prepared);
  });
  steps_.restart_at(contents.iteration);
}

std::vector<engine::CheckpointBucketShape> Reducer::Impl::checkpoint_shapes() const {
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

engine::CheckpointContents Reducer::Impl::gather() {
  engine::CheckpointContents c;
  c.config = config_;
  c.layout_fingerprint = layout_fingerprint_;
  c.world_size = comm_.size();
  c.rank = comm_.rank();
  c.iteration = completed_steps_;
  c.numel_before = stats_.numel_before;
  c.numel_after = stats_.numel_after;
  c.bytes_sent = stats_.bytes_sent;
  for (const auto& s : buckets_) c.buckets.push_back(gather_bucket(*s));
  return c;
}

engine::CheckpointBucket Reducer::Impl::gather_bucket(const engine::BucketState& s) {
  engine::CheckpointBucket b;
  b.numel = static_cast<uint64_t>(s.plan.numel);
  b.q_initialized = s.q_initialized;
  b.draws = s.draws;
  b.rank = s.current_rank;
  b.level = static_cast<uint32_t>(s.level);
  b.compressed_steps = s.compressed_steps;
  b.window_sum = s.window_sum;
  b.previous_window = s.previous_window;
  b.note_pending = s.note_pending;
  b.boost_left = s.boost_left;
  b.rule_level = static_cast<uint32_t>(s.rule_level);
  b.rule_reason = s.rule_reason;
  b.reason = s.reason;
  if (!s.nerr.empty()) b.error = engine::read_error(*backend_, s);
  b.p.resize(static_cast<size_t>(s.plan.p_numel));
  b.q.resize(static_cast<size_t>(s.plan.q_numel));
  backend_->copy_to_host(b.p.data(), arenas_.p_state.data() + s.p_offset, b.p.size());
  backend_->copy_to_host(b.q.data(), arenas_.q_state.data() + s.q_offset, b.q.size());
  return b;
}

Reducer::Impl::PreparedApply Reducer::Impl::prepare_apply(const engine::CheckpointContents& c) {
  size_t levels = 1;  // a file saved mid-boost needs the high level's buffers (lay_out_for_note)
  for (const auto& b : c.buckets) levels = std::max<size_t>(levels, b.level + 1);
  arenas_.fit_levels(*backend_, buckets_, levels);  // more levels laid out, their contents kept: no change of state
  PreparedApply prepared;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    prepared.work_errors.push_back(work_error_of(*buckets_[i], c.buckets[i]));
    if (i == 0) engine::maybe_inject(fault_, engine::FaultPoint::Apply, c.iteration);
  }
  return prepared;
}

void Reducer::Impl::apply(const engine::CheckpointContents& c) {
  PreparedApply prepared = prepare_apply(c);
  commit_apply(c, prepared);
}

void Reducer::Impl::commit_apply(const engine::CheckpointContents& c, PreparedApply& prepared) {
  for (size_t i = 0; i < buckets_.size(); ++i) {
    apply_bucket(*buckets_[i], c.buckets[i], prepared.work_errors[i]);
    buckets_[i]->last_m2 = buckets_[i]->last_e2 = std::nan("");
  }
  completed_steps_ = c.iteration;
  loaded_on_worker_ = true;
  guard_->forget_pending();  // of outputs this state replaced (a drift the load repaired is not reported)
  stats_.numel_before = c.numel_before;
  stats_.numel_after = c.numel_after;
  stats_.bytes_sent = c.bytes_sent;
  stats_.last_step_bytes = 0;
  bytes_before_step_ = c.bytes_sent;
  backend_->synchronize();
}

std::vector<float> Reducer::Impl::work_error_of(const BucketState& s, const engine::CheckpointBucket& b) const {
  if (s.nerr.empty()) return {};
  return engine::error_in_work_layout(s.levels[b.level], s.nerr.size(), b.error);
}

void Reducer::Impl::apply_bucket(BucketState& s, const engine::CheckpointBucket& b,
                                 const std::vector<float>& work_error) {
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
  if (!s.nerr.empty()) backend_->copy_from_host(s.nerr.data(), work_error.data(), work_error.size());
  backend_->copy_from_host(arenas_.p_state.data() + s.p_offset, b.p.data(), b.p.size());
  backend_->copy_from_host(arenas_.q_state.data() + s.q_offset, b.q.data(), b.q.size());
}

}  // namespace powersgd
