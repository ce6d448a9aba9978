// Reducer: the PowerSGD pipeline. One worker thread owns the compute backend and
// runs every reduction in submission order; see docs/engine.md for the step,
// the buffers and the wire order.
#include "powersgd/reducer.hpp"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "common/check.hpp"
#include "common/completion.hpp"
#include "compute/backend.hpp"
#include "engine/checkpoint.hpp"
#include "engine/plan.hpp"
#include "engine/random.hpp"

namespace powersgd {

using compute::Backend;
using compute::DeviceBuffer;
using compute::OrthoMethod;
using compute::Transpose;
using engine::BucketPlan;

void Config::validate() const {
  PSGD_REQUIRE(rank >= 1 && rank <= 64, InvalidArgumentError, "config.rank = ", rank, ": expected 1 to 64");
  PSGD_REQUIRE(start_iter >= 0, InvalidArgumentError, "config.start_iter = ", start_iter, ": expected >= 0");
  PSGD_REQUIRE(std::isfinite(min_compression_rate) && min_compression_rate >= 0, InvalidArgumentError,
               "config.min_compression_rate = ", min_compression_rate, ": expected a finite value >= 0");
  PSGD_REQUIRE(std::isfinite(orthogonalization_epsilon) && orthogonalization_epsilon >= 0, InvalidArgumentError,
               "config.orthogonalization_epsilon = ", orthogonalization_epsilon, ": expected a finite value >= 0");
  PSGD_REQUIRE(device == Device::Cpu || device == Device::Cuda, InvalidArgumentError, "config.device = ",
               static_cast<int>(device), ": expected Cpu (0) or Cuda (1)");
  PSGD_REQUIRE(device_index >= 0, InvalidArgumentError, "config.device_index = ", device_index, ": expected >= 0");
}

// ---- ReduceHandle ----

struct ReduceHandle::State : Completion {};

void ReduceHandle::wait() const {
  PSGD_REQUIRE(state_ != nullptr, InvalidArgumentError, "wait() on an empty ReduceHandle");
  state_->wait();
}

bool ReduceHandle::done() const {
  PSGD_REQUIRE(state_ != nullptr, InvalidArgumentError, "done() on an empty ReduceHandle");
  return state_->done();
}

// ---- Reducer::Impl ----

namespace {

class Fnv {
 public:
  template <typename T>
  void add(const T& value) {
    const auto* p = reinterpret_cast<const unsigned char*>(&value);
    for (size_t i = 0; i < sizeof(T); ++i) hash_ = (hash_ ^ p[i]) * 0x100000001B3ULL;
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 0xCBF29CE484222325ULL;
};

// The fields every rank (and a checkpoint) must agree on; device and
// device_index may differ between ranks.
uint64_t config_fingerprint(const Config& c) {
  Fnv h;
  h.add(c.rank);
  h.add(c.start_iter);
  h.add(c.min_compression_rate);
  h.add(c.error_feedback);
  h.add(c.warm_start);
  h.add(c.orthogonalization_epsilon);
  h.add(c.seed);
  h.add(c.batch_same_shape);
  h.add(c.whole_bucket);
  return h.value();
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

OrthoMethod ortho_method(int64_t cols) { return cols <= 2 ? OrthoMethod::GramSchmidt : OrthoMethod::Qr; }

}  // namespace

class Reducer::Impl {
  using Group_ = engine::Group;

 public:
  Impl(Communicator& comm, const Config& config) : comm_(comm), config_(config) {
    config_.validate();
    worker_ = std::thread([this] { worker_loop(); });
    try {
      run_on_worker([this] {
        backend_ = compute::make_backend(
            config_.device == Device::Cpu ? compute::DeviceKind::Cpu : compute::DeviceKind::Cuda,
            config_.device_index);
      });
    } catch (...) {
      stop_worker();
      throw;
    }
  }

  ~Impl() {
    stop_worker();
  }

  int add_bucket(std::span<const Shape> shapes) {
    PSGD_REQUIRE(!started_, InvalidArgumentError, "add_bucket after the first reduce (or load): declare all ",
                 "buckets before reducing; bucket ", buckets_.size(), " refused");
    BucketPlan plan = engine::make_plan(shapes, config_);
    const int index = static_cast<int>(buckets_.size());
    Fnv h;
    h.add(layout_fingerprint_);
    h.add(index);
    h.add(shapes.size());
    for (const auto& shape : shapes) {
      h.add(shape.size());
      for (int64_t d : shape) h.add(d);
    }
    const uint64_t layout = h.value();
    Fnv both;
    both.add(layout);
    both.add(config_fingerprint(config_));
    comm_.check_same(both.value(), concat_what(index));
    layout_fingerprint_ = layout;
    auto bucket = std::make_unique<Bucket>();
    bucket->plan = std::move(plan);
    bucket->shapes.assign(shapes.begin(), shapes.end());
    buckets_.push_back(std::move(bucket));
    marks_.push_back(false);
    return index;
  }

  int num_buckets() const { return static_cast<int>(buckets_.size()); }

  size_t bucket_size(int b) const { return static_cast<size_t>(checked(b).plan.numel); }
  std::span<const Shape> bucket_shapes(int b) const { return checked(b).shapes; }

  ReduceHandle reduce_async(int b, float* data) {
    checked(b);
    PSGD_REQUIRE(data != nullptr, InvalidArgumentError, "reduce of bucket ", b, ": data is null");
    start();
    PSGD_REQUIRE(!marks_[static_cast<size_t>(b)], InvalidArgumentError, "bucket ", b,
                 " was already reduced in step ", submitted_steps_, ": reduce every bucket once per step");
    marks_[static_cast<size_t>(b)] = true;
    ++marked_;
    auto job = std::make_shared<Job>();
    job->buckets = {b};
    job->data = {data};
    return submit(std::move(job));
  }

  void reduce_all(std::span<float* const> data) {
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "reduce_all before any add_bucket");
    PSGD_REQUIRE(data.size() == buckets_.size(), InvalidArgumentError, "reduce_all got ", data.size(),
                 " buffers: expected one per bucket, ", buckets_.size());
    for (size_t i = 0; i < data.size(); ++i)
      PSGD_REQUIRE(data[i] != nullptr, InvalidArgumentError, "reduce_all: data[", i, "] is null");
    start();
    PSGD_REQUIRE(marked_ == 0, InvalidArgumentError, "reduce_all must start a step: ", marked_,
                 " bucket(s) already reduced in step ", submitted_steps_);
    auto job = std::make_shared<Job>();
    for (size_t i = 0; i < data.size(); ++i) job->buckets.push_back(static_cast<int>(i));
    job->data.assign(data.begin(), data.end());
    std::fill(marks_.begin(), marks_.end(), true);
    marked_ = buckets_.size();
    submit(std::move(job)).wait();
  }

  int64_t iteration() {
    int64_t result = 0;
    run_on_worker([&] { result = completed_steps_; });
    return result;
  }

  void error_feedback(int b, float* out) {
    const Bucket& s = checked(b);
    PSGD_REQUIRE(out != nullptr, InvalidArgumentError, "error_feedback of bucket ", b, ": out is null");
    run_on_worker([&] {
      const auto numel = static_cast<size_t>(s.plan.numel);
      if (s.nerr.empty()) {
        std::fill(out, out + numel, 0.0f);
        return;
      }
      std::vector<float> error = read_error(s);
      std::copy(error.begin(), error.end(), out);
    });
  }

  Stats stats() {
    Stats result;
    run_on_worker([&] {
      result = stats_;
      double m2 = 0, e2 = 0;
      result.relative_error.clear();
      for (const auto& s : buckets_) {
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
  uint64_t fingerprint() const {
    Fnv both;
    both.add(layout_fingerprint_);
    both.add(config_fingerprint(config_));
    return both.value();
  }
  std::string backend_name() {
    std::string name;
    run_on_worker([&] { name = backend_->name(); });
    return name;
  }

  void save(const std::string& path);
  void load(const std::string& path);

 private:
  struct Bucket {
    BucketPlan plan;
    std::vector<Shape> shapes;
    // Work buffer (layout in plan.hpp) plus one float: the finite flag of plain steps.
    DeviceBuffer in;
    // Negated error-feedback memory, in the work buffer's layout (error = in - out;
    // keeping out - in lets one gemm produce it and one subtract consume it).
    DeviceBuffer nerr;
    // Whole bucket only: the side x side output, and the plain step's buffer.
    DeviceBuffer tmp;
    // In the first-collective arena: the packed uncompressed tensors, the finite
    // flag, then P (packed_numel + 1 + p_numel floats from unc_offset).
    int64_t unc_offset = 0, p_work_offset = 0;
    int64_t p_offset = 0, q_offset = 0;  // in the P state arena; in the Q arenas
    bool q_initialized = false;
    uint64_t draws = 0;
    std::vector<float> host_plain;  // staging of plain steps when the backend is not host-accessible
    double last_m2 = std::nan(""), last_e2 = std::nan("");
  };

  struct Job {
    std::vector<int> buckets;
    std::vector<float*> data;
    std::function<void()> task;  // set: a task run on the worker (not a reduction)
    int64_t iteration = 0;
    bool closes_step = false;
    bool compressed = false;
    std::shared_ptr<ReduceHandle::State> handle = std::make_shared<ReduceHandle::State>();
    // Filled by prepare(), possibly ahead of time while the previous job communicates.
    bool prepared = false;
    std::exception_ptr prepare_error;
    std::vector<double> m2;    // ||M||^2 over compressed matrices, per bucket of the job
    std::vector<char> drew;    // whether Q came from the generator, per bucket
  };

  // A range of an arena: device pointer, and where it is staged on the host.
  struct Segment {
    float* dev;
    float* host;
    size_t count;
  };

  static std::string concat_what(int index) {
    return detail::concat("layout of buckets 0..", index, " and reducer configuration");
  }

  const Bucket& checked(int b) const {
    PSGD_REQUIRE(b >= 0 && b < num_buckets(), InvalidArgumentError, "bucket index ", b, ": expected 0 to ",
                 num_buckets() - 1);
    return *buckets_[static_cast<size_t>(b)];
  }

  // ---- worker thread ----

  ReduceHandle submit(std::shared_ptr<Job> job) {
    if (job->task == nullptr) {
      job->iteration = submitted_steps_;
      job->compressed = submitted_steps_ >= config_.start_iter;
      if (marked_ == buckets_.size()) {
        job->closes_step = true;
        std::fill(marks_.begin(), marks_.end(), false);
        marked_ = 0;
        ++submitted_steps_;
      }
    }
    ReduceHandle handle(job->handle);
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(job));
    }
    cv_.notify_one();
    return handle;
  }

  void run_on_worker(std::function<void()> fn) {
    auto job = std::make_shared<Job>();
    job->task = std::move(fn);
    submit(std::move(job)).wait();
  }

  void stop_worker() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (worker_.joinable()) worker_.join();
  }

  void worker_loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = queue_.front();
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        if (job->task)
          job->task();
        else
          run_reduce(*job);
      } catch (...) {
        error = std::current_exception();
      }
      if (job->closes_step) completed_steps_ = job->iteration + 1;
      job->handle->finish(std::move(error));
    }
  }

  // Prepares the next queued reduction while `current` communicates, when they
  // share no bucket (the next one's state must be final). Purely local work.
  void lookahead(const Job& current) {
    std::shared_ptr<Job> next;
    {
      std::lock_guard lock(mu_);
      if (queue_.empty()) return;
      next = queue_.front();
    }
    if (next->task || next->prepared) return;
    for (int a : next->buckets)
      for (int b : current.buckets)
        if (a == b) return;
    try {
      prepare(*next);
    } catch (...) {
      next->prepare_error = std::current_exception();
      next->prepared = true;
    }
  }

  // ---- buffers ----

  // First reduce (or load): allocate every buffer; the layout is final from here on.
  void start() {
    if (started_) return;
    PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "reduce before any add_bucket");
    started_ = true;
    run_on_worker([this] { allocate(); });
  }

  void allocate() {
    Backend& be = *backend_;
    host_ = be.host_accessible();
    int64_t unc = 0, p = 0, q = 0;
    for (auto& sp : buckets_) {
      Bucket& s = *sp;
      const BucketPlan& plan = s.plan;
      const auto work = static_cast<size_t>(plan.whole ? plan.side * plan.side : plan.numel);
      s.in = be.allocate(work + 1);
      if (config_.error_feedback) s.nerr = be.allocate(plan.whole ? static_cast<size_t>(plan.numel) : work + 1);
      if (plan.whole) s.tmp = be.allocate(std::max(work, static_cast<size_t>(plan.numel) + 1));
      if (!host_) s.host_plain.resize(static_cast<size_t>(plan.numel) + 1);
      s.unc_offset = unc;
      s.p_work_offset = unc + plan.packed_numel + 1;
      s.p_offset = p;
      s.q_offset = q;
      unc += plan.packed_numel + 1 + plan.p_numel;
      p += plan.p_numel;
      q += plan.q_numel;
    }
    unc_ = be.allocate(static_cast<size_t>(unc));
    q_work_ = be.allocate(static_cast<size_t>(q));
    p_state_ = be.allocate(static_cast<size_t>(p));
    q_state_ = be.allocate(static_cast<size_t>(q));
    if (!host_) {
      unc_host_.resize(static_cast<size_t>(unc));
      q_host_.resize(static_cast<size_t>(q));
    }
  }

  float* plain_buffer(Bucket& s) { return s.plan.whole ? s.tmp.data() : s.in.data(); }

  Segment segment(DeviceBuffer& arena, std::vector<float>& host, int64_t offset, int64_t count) {
    float* dev = arena.data() + offset;
    return {dev, host_ ? dev : host.data() + offset, static_cast<size_t>(count)};
  }
  // The job's range of an arena: one bucket's, or the whole arena for reduce_all.
  Segment job_segment(const Job& job, DeviceBuffer& arena, std::vector<float>& host, int64_t Bucket::*offset,
                      int64_t count_of_one) {
    if (job.buckets.size() == 1) {
      const Bucket& s = *buckets_[static_cast<size_t>(job.buckets[0])];
      return segment(arena, host, s.*offset, count_of_one);
    }
    return segment(arena, host, 0, static_cast<int64_t>(arena.size()));
  }

  Work send(const Segment& seg) {
    if (seg.host != seg.dev) backend_->copy_to_host(seg.host, seg.dev, seg.count);
    stats_.bytes_sent += seg.count * sizeof(float);
    return comm_.allreduce_async(seg.host, seg.count, DataType::Float32);
  }

  void wait_all(std::vector<Work>& works, const std::vector<Segment>& segments) {
    const auto start = Clock::now();
    std::exception_ptr first;
    for (auto& w : works) {
      try {
        w.wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    for (const auto& seg : segments)
      if (seg.host != seg.dev) backend_->copy_from_host(seg.dev, seg.host, seg.count);
    stats_.communicate_seconds += seconds_since(start);
  }

  // ---- one reduction ----

  void prepare(Job& job) {
    const auto start = Clock::now();
    job.m2.assign(job.buckets.size(), 0.0);
    job.drew.assign(job.buckets.size(), 0);
    for (size_t i = 0; i < job.buckets.size(); ++i) {
      Bucket& s = *buckets_[static_cast<size_t>(job.buckets[i])];
      if (job.compressed)
        prepare_compressed(job, i, s);
      else
        prepare_plain(s, job.data[i]);
    }
    backend_->synchronize();
    stats_.compress_seconds += seconds_since(start);
    job.prepared = true;
  }

  void prepare_plain(Bucket& s, const float* data) {
    Backend& be = *backend_;
    const auto n = static_cast<size_t>(s.plan.numel);
    float* buf = plain_buffer(s);
    be.copy(buf, data, n);
    be.fill(buf + n, be.all_finite(buf, n) ? 0.0f : 1.0f, 1);
  }

  void prepare_compressed(Job& job, size_t i, Bucket& s) {
    Backend& be = *backend_;
    const BucketPlan& plan = s.plan;
    const float* data = job.data[i];
    float* in = s.in.data();
    const bool ef = config_.error_feedback;
    const float* nerr = ef ? s.nerr.data() : nullptr;

    float* q = q_work_.data() + s.q_offset;
    const auto qn = static_cast<size_t>(plan.q_numel);
    if (!config_.warm_start || !s.q_initialized) {
      std::vector<float> host(qn);
      engine::standard_normal(config_.seed, static_cast<uint64_t>(job.buckets[i]), s.draws, host);
      be.copy_from_host(q, host.data(), qn);
      job.drew[i] = 1;
    } else {
      be.copy(q, q_state_.data() + s.q_offset, qn);
    }
    float* p = unc_.data() + s.p_work_offset;
    const auto eps = static_cast<float>(config_.orthogonalization_epsilon);
    for (const auto& g : plan.groups)
      be.orthogonalize(q + g.q_offset, g.cols, g.rank, g.count, g.cols * g.rank, ortho_method(g.rank), eps);

    // M = data + error, gathered into the work layout, and P = M Q: one pass
    // over each matrix (form_and_project), which also returns ||M||^2.
    // Squared norms in double are finite exactly when every element is: they are
    // the local half of the non-finite guard and the denominator of the stats.
    double m2 = 0;
    if (plan.whole) {
      if (ef)
        be.subtract(in, data, nerr, static_cast<size_t>(plan.numel));
      else
        be.copy(in, data, static_cast<size_t>(plan.numel));
      const Group_& g = plan.groups[0];
      be.gemm(Transpose::No, Transpose::No, g.rows, g.rank, g.cols, 1.0f, in, g.cols, 0, q, g.rank, 0, 0.0f, p,
              g.rank, 0, 1);
      m2 = be.squared_norm(in, static_cast<size_t>(plan.compressed_numel));
    } else {
      for (const auto& t : plan.tensors) {
        if (t.compressed) {
          const Group_& g = plan.groups[static_cast<size_t>(t.group)];
          m2 += be.form_and_project(in + t.work_offset, data + t.offset, ef ? nerr + t.work_offset : nullptr, g.rows,
                                    g.cols, q + t.q_offset, g.rank, p + t.p_offset);
        } else if (ef) {
          be.subtract(in + t.work_offset, data + t.offset, nerr + t.work_offset, static_cast<size_t>(t.numel));
        } else {
          be.copy(in + t.work_offset, data + t.offset, static_cast<size_t>(t.numel));
        }
      }
    }
    const double u2 = be.squared_norm(in + plan.compressed_numel, static_cast<size_t>(plan.packed_numel));
    job.m2[i] = m2;
    float* unc = unc_.data() + s.unc_offset;
    be.copy(unc, in + plan.compressed_numel, static_cast<size_t>(plan.packed_numel));
    be.fill(unc + plan.packed_numel, std::isfinite(m2) && std::isfinite(u2) ? 0.0f : 1.0f, 1);
  }

  void run_reduce(Job& job) {
    if (!job.prepared) prepare(job);
    if (job.prepare_error) std::rethrow_exception(job.prepare_error);
    if (job.compressed)
      run_compressed(job);
    else
      run_plain(job);
  }

  [[noreturn]] void throw_nonfinite(const Job& job, int bucket, const std::string& what) {
    PSGD_THROW(NonFiniteError, "step ", job.iteration, ", bucket ", bucket, ": ", what,
               "; nothing written, error-feedback and warm-start state unchanged");
  }

  void run_plain(Job& job) {
    std::vector<Segment> segs;
    std::vector<Work> works;
    for (int b : job.buckets) {
      Bucket& s = *buckets_[static_cast<size_t>(b)];
      float* buf = plain_buffer(s);
      const auto n = static_cast<size_t>(s.plan.numel) + 1;
      segs.push_back({buf, host_ ? buf : s.host_plain.data(), n});
      works.push_back(send(segs.back()));
    }
    lookahead(job);
    wait_all(works, segs);
    for (size_t i = 0; i < job.buckets.size(); ++i) {
      const float flag = segs[i].host[segs[i].count - 1];
      if (flag != 0.0f) throw_nonfinite(job, job.buckets[i], detail::concat("NaN or Inf in the gradients of ", flag, " rank(s)"));
    }
    const auto start = Clock::now();
    const float inv = 1.0f / static_cast<float>(comm_.size());
    for (size_t i = 0; i < job.buckets.size(); ++i) {
      const auto n = segs[i].count - 1;
      backend_->scale(segs[i].dev, inv, n);
      backend_->copy(job.data[i], segs[i].dev, n);
    }
    backend_->synchronize();
    stats_.decompress_seconds += seconds_since(start);
  }

  void run_compressed(Job& job) {
    Backend& be = *backend_;
    const int64_t one = job.buckets.size() == 1 ? 1 : 0;
    const Bucket& first = *buckets_[static_cast<size_t>(job.buckets[0])];
    Segment unc = job_segment(job, unc_, unc_host_, &Bucket::unc_offset,
                              one * (first.plan.packed_numel + 1 + first.plan.p_numel));
    Segment q = job_segment(job, q_work_, q_host_, &Bucket::q_offset, one * first.plan.q_numel);

    // Wire order: packed uncompressed tensors, finite flag and P in one
    // collective, then Q (reduce_all: all buckets' in one collective each).
    std::vector<Work> works{send(unc)};
    lookahead(job);
    wait_all(works, {unc});
    for (int b : job.buckets) {
      const Bucket& s = *buckets_[static_cast<size_t>(b)];
      const float flag = unc.host[s.unc_offset - (one ? first.unc_offset : 0) + s.plan.packed_numel];
      if (flag != 0.0f) throw_nonfinite(job, b, detail::concat("NaN or Inf in the gradients of ", flag, " rank(s)"));
    }
    // Every rank holds the same sums, so this check decides the same everywhere.
    if (!be.all_finite(unc.dev, unc.count))
      throw_nonfinite(job, job.buckets[0], "the allreduced P or uncompressed tensors overflowed to Inf/NaN");

    auto start = Clock::now();
    const auto eps = static_cast<float>(config_.orthogonalization_epsilon);
    for (int b : job.buckets) {
      Bucket& s = *buckets_[static_cast<size_t>(b)];
      float* pb = unc_.data() + s.p_work_offset;
      float* qb = q_work_.data() + s.q_offset;
      for (const auto& g : s.plan.groups)
        be.orthogonalize(pb + g.p_offset, g.rows, g.rank, g.count, g.rows * g.rank, ortho_method(g.rank), eps);
      // Q = M^T P, one streaming pass per matrix (the whole-bucket matrix is one group of one).
      for (const auto& g : s.plan.groups)
        for (int64_t k = 0; k < g.count; ++k)
          be.project_transposed(s.in.data() + g.work_offset + k * g.rows * g.cols, g.rows, g.cols,
                                pb + g.p_offset + k * g.rows * g.rank, g.rank, qb + g.q_offset + k * g.cols * g.rank);
    }
    be.synchronize();
    stats_.compress_seconds += seconds_since(start);

    // Buckets without compressed tensors have no Q: the layout is the same on every rank, so all skip it.
    works.clear();
    if (q.count > 0) works.push_back(send(q));
    lookahead(job);
    wait_all(works, {q});
    if (!be.all_finite(q.dev, q.count)) throw_nonfinite(job, job.buckets[0], "the allreduced Q overflowed to Inf/NaN");

    // Commit point: from here on nothing can fail for a reason the ranks disagree on.
    start = Clock::now();
    const float inv = 1.0f / static_cast<float>(comm_.size());
    be.scale(q.dev, inv, q.count);
    for (size_t i = 0; i < job.buckets.size(); ++i) decompress(job, i);
    be.synchronize();
    stats_.decompress_seconds += seconds_since(start);
  }

  void decompress(const Job& job, size_t i) {
    Backend& be = *backend_;
    const int b = job.buckets[i];
    Bucket& s = *buckets_[static_cast<size_t>(b)];
    const BucketPlan& plan = s.plan;
    float* data = job.data[i];
    float* in = s.in.data();
    const float* p = unc_.data() + s.p_work_offset;
    const float* q = q_work_.data() + s.q_offset;
    const bool ef = config_.error_feedback;
    const float inv = 1.0f / static_cast<float>(comm_.size());

    // Uncompressed tensors: the exact mean; their error is local minus mean.
    float* unc = unc_.data() + s.unc_offset;
    const auto packed = static_cast<size_t>(plan.packed_numel);
    be.scale(unc, inv, packed);
    for (const auto& t : plan.tensors)
      if (!t.compressed)
        be.copy(data + t.offset, unc + (t.work_offset - plan.compressed_numel), static_cast<size_t>(t.numel));
    if (ef) be.subtract(in + plan.compressed_numel, unc, in + plan.compressed_numel, packed);

    double e2 = 0;
    if (plan.whole) {
      const Group_& g = plan.groups[0];
      float* out = s.tmp.data();
      const auto full = static_cast<size_t>(plan.side * plan.side);
      be.gemm(Transpose::No, Transpose::Yes, g.rows, g.cols, g.rank, 1.0f, p, g.rank, 0, q, g.rank, 0, 0.0f, out,
              g.cols, 0, 1);
      be.copy(data, out, static_cast<size_t>(plan.numel));
      be.subtract(out, out, in, full);  // P Q^T - M (the padding of M is 0)
      e2 = be.squared_norm(out, full);
      if (ef) be.copy(s.nerr.data(), out, static_cast<size_t>(plan.numel));
    } else {
      // Output P Q^T into the user's buffer and, in the same pass, the work
      // buffer becomes P Q^T - M: the negated error of the compressed part.
      for (const auto& t : plan.tensors) {
        if (!t.compressed) continue;
        const Group_& g = plan.groups[static_cast<size_t>(t.group)];
        e2 += be.reconstruct_and_residual(data + t.offset, in + t.work_offset, g.rows, g.cols, p + t.p_offset,
                                          q + t.q_offset, g.rank);
      }
      if (ef) std::swap(s.in, s.nerr);
    }
    be.copy(p_state_.data() + s.p_offset, p, static_cast<size_t>(plan.p_numel));
    be.copy(q_state_.data() + s.q_offset, q, static_cast<size_t>(plan.q_numel));
    s.q_initialized = true;
    if (job.drew[i]) ++s.draws;
    s.last_m2 = job.m2[i];
    s.last_e2 = e2;
    stats_.numel_before += static_cast<uint64_t>(plan.numel);
    stats_.numel_after += static_cast<uint64_t>(plan.p_numel + plan.q_numel + plan.packed_numel);
  }
  // Calls f(bucket_index, work_index) for every element of the bucket: where it
  // lies in the user's buffer and where in the work layout (the bucket's own
  // order for the whole-bucket variant, else regrouped by tensor).
  template <typename F>
  static void for_each_element(const BucketPlan& plan, F&& f) {
    if (plan.whole) {
      for (size_t k = 0; k < static_cast<size_t>(plan.numel); ++k) f(k, k);
      return;
    }
    for (const auto& t : plan.tensors)
      for (int64_t k = 0; k < t.numel; ++k) f(static_cast<size_t>(t.offset + k), static_cast<size_t>(t.work_offset + k));
  }

  // This rank's error memory in the bucket's layout (host). Worker thread.
  std::vector<float> read_error(const Bucket& s) {
    std::vector<float> nerr(s.nerr.size());
    backend_->copy_to_host(nerr.data(), s.nerr.data(), nerr.size());
    std::vector<float> error(static_cast<size_t>(s.plan.numel));
    for_each_element(s.plan, [&](size_t i, size_t w) { error[i] = -nerr[w]; });
    return error;
  }

  void write_error(Bucket& s, const std::vector<float>& error) {
    PSGD_ASSERT(error.size() == static_cast<size_t>(s.plan.numel), "error memory of ", error.size(),
                " floats for a bucket of ", s.plan.numel);
    std::vector<float> nerr(s.nerr.size(), 0.0f);
    for_each_element(s.plan, [&](size_t i, size_t w) { nerr[w] = -error[i]; });
    backend_->copy_from_host(s.nerr.data(), nerr.data(), nerr.size());
  }

  Communicator& comm_;
  Config config_;
  std::unique_ptr<Backend> backend_;
  bool host_ = true;

  // User thread only.
  std::vector<std::unique_ptr<Bucket>> buckets_;
  uint64_t layout_fingerprint_ = 0;
  bool started_ = false;
  std::vector<bool> marks_;
  size_t marked_ = 0;
  int64_t submitted_steps_ = 0;

  // Worker thread only (read by the user thread through run_on_worker).
  int64_t completed_steps_ = 0;
  Stats stats_;
  DeviceBuffer unc_, q_work_, p_state_, q_state_;  // unc_: packed tensors, flags and P of every bucket
  std::vector<float> unc_host_, q_host_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

// ---- checkpoint ----

namespace {

// Config fields in file order, each with the name an error message uses.
void put_config(engine::Writer& w, const Config& c) {
  w.put(static_cast<int32_t>(c.rank));
  w.put(c.start_iter);
  w.put(c.min_compression_rate);
  w.put(static_cast<uint8_t>(c.error_feedback));
  w.put(static_cast<uint8_t>(c.warm_start));
  w.put(c.orthogonalization_epsilon);
  w.put(c.seed);
  w.put(static_cast<uint8_t>(c.batch_same_shape));
  w.put(static_cast<uint8_t>(c.whole_bucket));
}

template <typename T, typename U>
void expect_field(engine::Reader& r, const char* name, const U& mine, const std::string& path) {
  const T theirs = r.get<T>(name);
  PSGD_REQUIRE(theirs == static_cast<T>(mine), MismatchError, "checkpoint ", path, " was written with config.", name,
               " = ", +theirs, ", this reducer has ", +static_cast<T>(mine));
}

void expect_config(engine::Reader& r, const Config& c, const std::string& path) {
  expect_field<int32_t>(r, "rank", c.rank, path);
  expect_field<int64_t>(r, "start_iter", c.start_iter, path);
  expect_field<double>(r, "min_compression_rate", c.min_compression_rate, path);
  expect_field<uint8_t>(r, "error_feedback", c.error_feedback, path);
  expect_field<uint8_t>(r, "warm_start", c.warm_start, path);
  expect_field<double>(r, "orthogonalization_epsilon", c.orthogonalization_epsilon, path);
  expect_field<uint64_t>(r, "seed", c.seed, path);
  expect_field<uint8_t>(r, "batch_same_shape", c.batch_same_shape, path);
  expect_field<uint8_t>(r, "whole_bucket", c.whole_bucket, path);
}

std::vector<float> get_floats(engine::Reader& r, size_t expected, const char* field, int bucket,
                              const std::string& path) {
  const auto count = r.get<uint64_t>(field);
  PSGD_REQUIRE(count == expected, MismatchError, "checkpoint ", path, ": bucket ", bucket, " has ", count, " ", field,
               " values, this reducer expects ", expected);
  std::vector<float> values(expected);
  r.get_bytes(values.data(), expected * sizeof(float), field);
  return values;
}

}  // namespace

void Reducer::Impl::save(const std::string& path) {
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "save before any add_bucket: nothing to checkpoint");
  PSGD_REQUIRE(marked_ == 0, InvalidArgumentError, "save in the middle of step ", submitted_steps_, ": ", marked_,
               " of ", buckets_.size(), " buckets reduced; save at a step boundary");
  start();
  run_on_worker([&] {
    engine::Writer w;
    put_config(w, config_);
    w.put(layout_fingerprint_);
    w.put(static_cast<uint32_t>(buckets_.size()));
    for (const auto& s : buckets_) w.put(static_cast<uint64_t>(s->plan.numel));
    w.put(static_cast<int32_t>(comm_.size()));
    w.put(static_cast<int32_t>(comm_.rank()));
    w.put(completed_steps_);
    w.put(stats_.numel_before);
    w.put(stats_.numel_after);
    w.put(stats_.bytes_sent);
    for (const auto& sp : buckets_) {
      const Bucket& s = *sp;
      w.put(static_cast<uint8_t>(s.q_initialized));
      w.put(s.draws);
      std::vector<float> error = s.nerr.empty() ? std::vector<float>() : read_error(s);
      w.put(static_cast<uint64_t>(error.size()));
      w.put_bytes(error.data(), error.size() * sizeof(float));
      for (const auto* arena : {&p_state_, &q_state_}) {
        const auto count = static_cast<size_t>(arena == &p_state_ ? s.plan.p_numel : s.plan.q_numel);
        std::vector<float> values(count);
        backend_->copy_to_host(values.data(), arena->data() + (arena == &p_state_ ? s.p_offset : s.q_offset), count);
        w.put(static_cast<uint64_t>(count));
        w.put_bytes(values.data(), count * sizeof(float));
      }
    }
    engine::write_checkpoint(path, w.bytes());
  });
}

void Reducer::Impl::load(const std::string& path) {
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "load before any add_bucket: declare the buckets first");
  PSGD_REQUIRE(marked_ == 0, InvalidArgumentError, "load in the middle of step ", submitted_steps_, ": ", marked_,
               " of ", buckets_.size(), " buckets reduced; load at a step boundary");
  const std::vector<char> payload = engine::read_checkpoint(path);
  engine::Reader r(payload, path);
  expect_config(r, config_, path);
  const auto layout = r.get<uint64_t>("layout fingerprint");
  const auto count = r.get<uint32_t>("bucket count");
  PSGD_REQUIRE(count == buckets_.size(), MismatchError, "checkpoint ", path, " has ", count,
               " buckets, this reducer declares ", buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto numel = r.get<uint64_t>("bucket size");
    PSGD_REQUIRE(numel == static_cast<uint64_t>(buckets_[b]->plan.numel), MismatchError, "checkpoint ", path,
                 ": bucket ", b, " has ", numel, " elements, this reducer's has ", buckets_[b]->plan.numel);
  }
  PSGD_REQUIRE(layout == layout_fingerprint_, MismatchError, "checkpoint ", path,
               " was written for another bucket layout (tensor shapes differ; fingerprint ", layout, " vs ",
               layout_fingerprint_, ")");
  r.get<int32_t>("world size");  // informational: a checkpoint may be loaded at another world size
  r.get<int32_t>("rank");
  const auto iteration = r.get<int64_t>("iteration");
  PSGD_REQUIRE(iteration >= 0, IoError, "checkpoint ", path, " is malformed: iteration ", iteration);
  Stats counters;
  counters.numel_before = r.get<uint64_t>("numel_before");
  counters.numel_after = r.get<uint64_t>("numel_after");
  counters.bytes_sent = r.get<uint64_t>("bytes_sent");
  struct Loaded {
    bool q_initialized;
    uint64_t draws;
    std::vector<float> error, p, q;
  };
  std::vector<Loaded> loaded;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketPlan& plan = buckets_[b]->plan;
    Loaded l;
    l.q_initialized = r.get<uint8_t>("q_initialized") != 0;
    l.draws = r.get<uint64_t>("draws");
    const size_t error_count = config_.error_feedback ? static_cast<size_t>(plan.numel) : 0;
    l.error = get_floats(r, error_count, "error", static_cast<int>(b), path);
    l.p = get_floats(r, static_cast<size_t>(plan.p_numel), "P", static_cast<int>(b), path);
    l.q = get_floats(r, static_cast<size_t>(plan.q_numel), "Q", static_cast<int>(b), path);
    loaded.push_back(std::move(l));
  }
  PSGD_REQUIRE(r.at_end(), IoError, "checkpoint ", path, " is malformed: bytes after the last bucket");

  // Everything parsed and checked: apply.
  start();
  run_on_worker([&] {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& s = *buckets_[b];
      Loaded& l = loaded[b];
      s.q_initialized = l.q_initialized;
      s.draws = l.draws;
      if (!s.nerr.empty()) write_error(s, l.error);
      backend_->copy_from_host(p_state_.data() + s.p_offset, l.p.data(), l.p.size());
      backend_->copy_from_host(q_state_.data() + s.q_offset, l.q.data(), l.q.size());
      s.last_m2 = s.last_e2 = std::nan("");
    }
    completed_steps_ = iteration;
    stats_.numel_before = counters.numel_before;
    stats_.numel_after = counters.numel_after;
    stats_.bytes_sent = counters.bytes_sent;
    backend_->synchronize();
  });
  submitted_steps_ = iteration;
}

// ---- Reducer ----

Reducer::Reducer(Communicator& comm, const Config& config) : impl_(std::make_unique<Impl>(comm, config)) {}
Reducer::~Reducer() = default;
int Reducer::add_bucket(std::span<const Shape> shapes) { return impl_->add_bucket(shapes); }
int Reducer::num_buckets() const { return impl_->num_buckets(); }
size_t Reducer::bucket_size(int bucket) const { return impl_->bucket_size(bucket); }
std::span<const Shape> Reducer::bucket_shapes(int bucket) const { return impl_->bucket_shapes(bucket); }
void Reducer::reduce(int bucket, float* data) { impl_->reduce_async(bucket, data).wait(); }
ReduceHandle Reducer::reduce_async(int bucket, float* data) { return impl_->reduce_async(bucket, data); }
void Reducer::reduce_all(std::span<float* const> data) { impl_->reduce_all(data); }
int64_t Reducer::iteration() const { return impl_->iteration(); }
void Reducer::error_feedback(int bucket, float* out) const { impl_->error_feedback(bucket, out); }
Stats Reducer::stats() const { return impl_->stats(); }
const Config& Reducer::config() const { return impl_->config(); }
uint64_t Reducer::fingerprint() const { return impl_->fingerprint(); }
std::string Reducer::backend_name() const { return impl_->backend_name(); }
void Reducer::save(const std::string& path) const { impl_->save(path); }
void Reducer::load(const std::string& path) { impl_->load(path); }

}  // namespace powersgd
