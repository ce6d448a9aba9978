// Reducer: the facade of the PowerSGD pipeline (docs/engine.md). Reducer::Impl
// (reducer_impl.hpp) holds the state; this file constructs it, answers the
// reads (each on the worker, after the reductions queued before it) and
// forwards the public calls. Declaring buckets and submitting reductions:
// reducer_submit.cpp; the worker's side: reducer_worker.cpp; checkpoints:
// reducer_checkpoint.cpp.
#include "powersgd/reducer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "common/check.hpp"
#include "engine/fault_injection.hpp"
#include "engine/refused_calls.hpp"
#include "engine/reducer_impl.hpp"

namespace powersgd {

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

Reducer::Impl::Impl(Communicator& comm, const Config& config)
    : comm_(comm), turns_(detail::comm_turns(&comm)), config_(config) {
  config_.validate();
  // The finite flags (kFailedFlag) and the order guard's sums are exact below 4096 ranks.
  PSGD_REQUIRE(comm_.size() <= engine::kMaxWorldSize, InvalidArgumentError, "a world of ", comm_.size(),
               " ranks: the reducer supports at most ", engine::kMaxWorldSize, " ranks");
  std::optional<engine::Fault> fault = engine::take_armed_fault();
  call([this, fault] {
    backend_ = compute::make_backend(
        config_.device == Device::Cpu ? compute::DeviceKind::Cpu : compute::DeviceKind::Cuda, config_.device_index);
    runner_ = std::make_unique<engine::StepRunner>(config_, comm_, *backend_, buckets_, arenas_, stats_, log_,
                                                   [this] { return queued_reductions(); }, fault);
    fault_ = fault;
    guard_ = std::make_unique<engine::OrderGuard>(config_, comm_, *backend_, buckets_, arenas_, stats_);
  });
  detail::attach_comm_user(&comm_, this);
}

Reducer::Impl::~Impl() {
  detail::detach_comm_user(&comm_, this);
  worker_.stop(nullptr);
}

void Reducer::Impl::communicator_destroyed() noexcept {
  try {
    worker_.submit(WorkerTask{nullptr, [this] { comm_destroyed_ = true; }, {}})->wait();
  } catch (...) {  // a refused task sets nothing; the flag is then already set
  }
}

int Reducer::Impl::bucket_rank(int b) {
  const BucketState& s = checked(b);
  int rank = 0;
  call([&] { rank = s.current_rank; });
  return rank;
}

int64_t Reducer::Impl::iteration() {
  int64_t result = 0;
  call([&] { result = completed_steps_; });
  return result;
}

void Reducer::Impl::error_feedback(int b, float* out, size_t count) {
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

Stats Reducer::Impl::stats() {
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

std::string Reducer::Impl::backend_name() {
  std::string name;
  call([&] { name = backend_->name(); });
  return name;
}

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
void Reducer::load_shared(const std::string& path) { impl_->load(path, /*shared=*/true); }
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
