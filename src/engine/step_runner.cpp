#include "engine/step_runner.hpp"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>

#include "common/agreed_collectives.hpp"
#include "common/check.hpp"
#include "common/log.hpp"
#include "engine/half.hpp"
#include "engine/random.hpp"
#include "engine/rank_reports.hpp"

namespace powersgd::engine {

using compute::OrthoMethod;
using compute::Transpose;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// fp16 factors overflow far below float32's range: say so where a sum overflowed.
const char* overflow_hint(const Config& config) {
  return config.wire_dtype == WireDType::Float16 ? " (wire_dtype fp16 carries at most +-65504; bf16 has float32's range)"
                                                 : "";
}

OrthoMethod ortho_method(int64_t cols) { return cols <= 2 ? OrthoMethod::GramSchmidt : OrthoMethod::Qr; }

// Sum of squares of host floats, in double and in index order: computed from a
// collective's result, it is the same number on every rank.
double host_squared_sum(const float* x, int64_t count) {
  double sum = 0;
  for (int64_t i = 0; i < count; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return sum;
}

}  // namespace

// Prepares the queued reductions while `current` communicates, each whose
// buckets' state is final: no bucket of `current`, of an earlier queued
// reduction or unsettled (set_unsettled). A queued call may change any state,
// and a pending note the arenas' layout (reducer_worker.cpp): nothing after
// either. Purely local work.
void StepRunner::lookahead(const Reduction& current) {
  std::vector<int> busy = current.buckets;
  busy.insert(busy.end(), unsettled_.begin(), unsettled_.end());
  for (const std::shared_ptr<Reduction>& next : queued_()) {
    if (next == nullptr) return;
    if (next->poisoned) continue;  // refused: changes no state, and its bucket may be out of range
    for (int a : next->buckets)
      if (bucket(a).note_pending) return;
    const bool free = std::none_of(next->buckets.begin(), next->buckets.end(), [&](int a) {
      return std::find(busy.begin(), busy.end(), a) != busy.end();
    });
    busy.insert(busy.end(), next->buckets.begin(), next->buckets.end());
    if (free) prepare_once(*next);
  }
}

Work StepRunner::allreduce(void* data, size_t count, DataType type) {
  // Sizes agreed: the order guard compared them before the reduction's data collectives.
  return in_rank_order_ ? detail::allreduce_in_rank_order_agreed_async(comm_, data, count, type)
                        : detail::allreduce_agreed_async(comm_, data, count, type);
}

Work StepRunner::send(const Segment& seg, bool stage) {
  if (stage && seg.host != seg.dev) be_.copy_to_host(seg.host, seg.dev, seg.count);
  stats_.bytes_sent += seg.count * sizeof(float);
  return allreduce(seg.host, seg.count, DataType::Float32);
}

void StepRunner::send_first(const Reduction& job, const Segment& unc, const Ranges& factors,
                            std::vector<Work>& works) {
  if (config_.wire_dtype == WireDType::Float32) {
    works.push_back(send(unc, false));
    return;
  }
  wire_f32_.resize(float32_count(buckets_, job.buckets));
  gather_float32(job, unc);
  // Float32 first (never empty: each bucket has its flag), then the factors: the same two collectives, in the
  // same order, on every rank.
  stats_.bytes_sent += wire_f32_.size() * sizeof(float);
  works.push_back(allreduce(wire_f32_.data(), wire_f32_.size(), DataType::Float32));
  send_factors(unc, factors, works);
}

void StepRunner::send_q(const Segment& q, const Ranges& all_of_q, bool stage, std::vector<Work>& works) {
  if (config_.wire_dtype == WireDType::Float32) {
    works.push_back(send(q, stage));
    return;
  }
  if (stage && q.host != q.dev) be_.copy_to_host(q.host, q.dev, q.count);
  send_factors(q, all_of_q, works);
}

size_t StepRunner::factor_count(const Ranges& factors) {
  size_t count = 0;
  for (const auto& [offset, n] : factors) count += static_cast<size_t>(n);
  return count;
}

size_t StepRunner::factor_count(const Config& config, const std::vector<std::unique_ptr<BucketState>>& buckets,
                                std::span<const int> members) {
  size_t count = 0;
  for (int b : members) {
    const BucketState& s = *buckets[static_cast<size_t>(b)];
    count += static_cast<size_t>(in_q_half(config, s) ? s.plan.q_numel : s.plan.p_numel);
  }
  return count;
}

size_t StepRunner::float32_count(const std::vector<std::unique_ptr<BucketState>>& buckets,
                                 std::span<const int> members) {
  size_t count = 0;
  for (int b : members) count += static_cast<size_t>(buckets[static_cast<size_t>(b)]->plan.float32_part_numel());
  return count;
}

void StepRunner::gather_float32(const Reduction& job, const Segment& unc) noexcept {
  float* f32 = wire_f32_.data();
  for (size_t i = 0; i < job.buckets.size(); ++i)
    f32 = std::copy_n(unc.host + (job.unc_at[i] - job.unc_begin), bucket(job.buckets[i]).plan.float32_part_numel(), f32);
}

void StepRunner::send_factors(const Segment& seg, const Ranges& factors, std::vector<Work>& works) {
  wire_half_.resize(factor_count(factors));
  uint16_t* half = wire_half_.data();
  for (const auto& [offset, n] : factors) {
    encode(config_.wire_dtype, seg.host + offset, half, static_cast<size_t>(n));
    half += n;
  }
  if (wire_half_.empty()) return;
  stats_.bytes_sent += wire_half_.size() * sizeof(uint16_t);
  works.push_back(allreduce(wire_half_.data(), wire_half_.size(), wire_type(config_.wire_dtype)));
}

void StepRunner::wait_segment(std::vector<Work>& works, const Segment& seg, const Ranges& factors, bool copy_back) {
  if (config_.wire_dtype == WireDType::Float32) return wait_all(works, {seg}, copy_back);
  wait_all(works, {}, false);
  const float* f32 = wire_f32_.data();
  int64_t at = 0;
  for (const auto& [offset, n] : factors) {
    std::copy_n(f32, offset - at, seg.host + at);
    f32 += offset - at;
    at = offset + n;
  }
  std::copy_n(f32, static_cast<int64_t>(seg.count) - at, seg.host + at);
  widen_factors(seg, factors);
  if (copy_back && seg.host != seg.dev) be_.copy_from_host(seg.dev, seg.host, seg.count);
}

void StepRunner::widen_factors(const Segment& seg, const Ranges& factors) {
  const uint16_t* half = wire_half_.data();
  for (const auto& [offset, n] : factors) {
    decode(config_.wire_dtype, half, seg.host + offset, static_cast<size_t>(n));
    half += n;
  }
}

StepRunner::Ranges StepRunner::factor_ranges(const Reduction& job) {
  Ranges ranges;
  if (config_.wire_dtype == WireDType::Float32) return ranges;  // send_first and wait_segment ignore them
  for_each_factor_range(job, [&](int64_t offset, int64_t n) { ranges.emplace_back(offset, n); });
  return ranges;
}

void StepRunner::wait_all(std::vector<Work>& works, const std::vector<Segment>& segments, bool copy_back) {
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
  if (copy_back)
    for (const auto& seg : segments)
      if (seg.host != seg.dev) be_.copy_from_host(seg.dev, seg.host, seg.count);
  stats_.communicate_seconds += seconds_since(start);
}

void StepRunner::raise_local_failures(const Reduction& job, std::exception_ptr own) {
  std::string buckets;
  for (int b : job.buckets) buckets += (buckets.empty() ? "" : ", ") + std::to_string(b);
  const auto reports = gather_reports(comm_, own != nullptr ? report_failure(own) : RankReport{});
  // The reports are the same on every rank: if any failed, every rank throws here.
  failed_together_ = std::any_of(reports.begin(), reports.end(), [](const RankReport& r) { return r.failed(); });
  throw_if_any_failed(reports, own,
                      detail::concat("step ", job.iteration, ", bucket", job.buckets.size() > 1 ? "s " : " ", buckets),
                      "nothing written, error-feedback and warm-start state unchanged on every rank");
}

void StepRunner::fail_flagged(const Reduction& job, std::exception_ptr own) {
  raise_local_failures(job, own);
  PSGD_THROW(InternalError, "step ", job.iteration, ": a rank flagged a local failure but none reported one");
}

Segment StepRunner::stage_first(Reduction& job) noexcept {
  const Segment unc = arenas_.unc_segment(job.unc_begin, job.unc_count);
  if (!job.prepare_error && unc.host != unc.dev) {
    try {
      be_.copy_to_host(unc.host, unc.dev, unc.count);
    } catch (...) {
      job.prepare_error = std::current_exception();
    }
  }
  if (job.prepare_error)
    for (size_t i = 0; i < job.buckets.size(); ++i) flag(job, i, unc) = kFailedFlag;
  return unc;
}

bool StepRunner::reserve_carried(const CarriedCounts& counts) noexcept {
  if (config_.wire_dtype == WireDType::Float32) return true;
  try {
    wire_f32_.reserve(static_cast<size_t>(counts.floats));
    wire_half_.reserve(static_cast<size_t>(counts.halves));
    return true;
  } catch (...) {
    return false;
  }
}

StepRunner::Carried StepRunner::stage_carried(Reduction& job, bool halves) noexcept {
  const Segment unc = stage_first(job);
  if (config_.wire_dtype == WireDType::Float32) return {{unc.host, unc.count}, {}};
  // Within the capacity reserve_carried(OrderGuard::carried_counts) made for these buckets: no allocation.
  wire_f32_.resize(float32_count(buckets_, job.buckets));
  gather_float32(job, unc);
  size_t factors = 0;
  for_each_factor_range(job, [&](int64_t, int64_t n) { factors += static_cast<size_t>(n); });
  if (!halves || factors == 0 || factors > wire_half_.capacity()) return {wire_f32_, {}};
  // send_factors' encoding, from the same ranges (factor_ranges).
  wire_half_.resize(factors);
  uint16_t* half = wire_half_.data();
  for_each_factor_range(job, [&](int64_t offset, int64_t n) {
    encode(config_.wire_dtype, unc.host + offset, half, static_cast<size_t>(n));
    half += n;
  });
  return {wire_f32_, wire_half_};
}

void StepRunner::first_collective(Reduction& job, const Segment& unc, const Ranges& factors) {
  if (!job.first_summed) {
    std::vector<Work> works;
    stage_first(job);
    send_first(job, unc, factors, works);
    lookahead(job);
    wait_segment(works, unc, factors, !job.prepare_error);
    return;
  }
  if (config_.wire_dtype != WireDType::Float32) {
    // The announce carried the float32 parts (stage_carried), summed in place in wire_f32_, as send_first's
    // float32 collective would have; the 16-bit factors too where they fit (factors_summed), else they follow
    // in theirs, the same collective on every rank (first_summed and factors_summed are the same everywhere),
    // so the sums keep the bits and the bytes of the two collectives they replace.
    PSGD_ASSERT(wire_f32_.size() == unc.count - factor_count(factors), "the carried float32 parts, ",
                wire_f32_.size(), " floats, are the segment's ", unc.count - factor_count(factors));
    stats_.bytes_sent += wire_f32_.size() * sizeof(float);
    std::vector<Work> works;
    if (job.factors_summed) {
      // The announce carried the factors too (stage_carried), summed in place in wire_half_.
      PSGD_ASSERT(wire_half_.size() == factor_count(factors), "the carried factors, ", wire_half_.size(),
                  ", are the segment's ", factor_count(factors));
      stats_.bytes_sent += wire_half_.size() * sizeof(uint16_t);
    } else {
      send_factors(unc, factors, works);
    }
    wait_segment(works, unc, factors, !job.prepare_error);
    return;
  }
  stats_.bytes_sent += unc.count * sizeof(float);
  if (!job.prepare_error && unc.host != unc.dev) be_.copy_from_host(unc.dev, unc.host, unc.count);
}

void StepRunner::prepare(Reduction& job) {
  const auto start = Clock::now();
  const size_t n = job.buckets.size();
  job.m2.assign(n, 0.0);
  job.drew.assign(n, 0);
  job.q_half.assign(n, 0);
  job.out2.assign(n, 0.0);
  job.unc_at.assign(n, 0);
  job.q_at.assign(n, 0);
  if (job.compressed) {
    // One bucket: its own slots (a lookahead may fill another bucket's meanwhile).
    // Several (reduce_all, which never overlaps a lookahead): packed from offset 0,
    // so the collectives carry exactly this step's floats whatever each bucket's level and half.
    int64_t unc_end = 0, q_end = 0;
    for (size_t i = 0; i < n; ++i) {
      const BucketState& s = bucket(job.buckets[i]);
      job.q_half[i] = q_half_now(s);
      job.unc_at[i] = n == 1 ? s.unc_offset : unc_end;
      job.q_at[i] = n == 1 ? s.q_offset : q_end;
      unc_end = job.unc_at[i] + s.plan.float32_part_numel() + factor_numel(s, job.q_half[i]);
      q_end = job.q_at[i] + s.plan.q_numel;
    }
    job.unc_begin = job.unc_at[0];
    job.unc_count = unc_end - job.unc_begin;
    job.q_begin = job.q_at[0];
    job.q_count = q_end - job.q_begin;
  }
  // Only after the ranges above: a rank whose local work fails still sends them, poisoned.
  maybe_inject(fault_, FaultPoint::Prepare, job.iteration, job.buckets);
  for (size_t i = 0; i < n; ++i) {
    BucketState& s = bucket(job.buckets[i]);
    if (job.compressed)
      prepare_compressed(job, i, s);
    else
      prepare_plain(s, job.data[i]);
  }
  be_.synchronize();
  stats_.compress_seconds += seconds_since(start);
  job.prepared = true;
}

void StepRunner::prepare_plain(BucketState& s, const float* data) {
  const auto n = static_cast<size_t>(s.plan.numel);
  float* buf = s.plain_buffer();
  be_.copy(buf, data, n);
  be_.fill(buf + n, be_.all_finite(buf, n) ? 0.0f : 1.0f, 1);
}

// M = data + error, gathered into the work layout, and, when q is given,
// P = M Q: one pass over each matrix (form_and_project), which also returns
// ||M||^2 over the compressed matrices. Uncompressed tensors: in = data + error.
double StepRunner::form(BucketState& s, const float* data, const float* q, float* p) {
  const BucketPlan& plan = s.plan;
  float* in = s.in.data();
  const bool ef = config_.error_feedback;
  const float* nerr = ef ? s.nerr.data() : nullptr;
  if (plan.whole) {
    // M = padded(data) + error over the whole square, as the reference's batched
    // hook: the padding of M is its error (0 without error feedback).
    const auto padding = static_cast<size_t>(plan.compressed_numel - plan.numel);
    if (ef) {
      be_.subtract(in, data, nerr, static_cast<size_t>(plan.numel));
      be_.copy(in + plan.numel, nerr + plan.numel, padding);
      be_.scale(in + plan.numel, -1.0f, padding);
    } else {
      be_.copy(in, data, static_cast<size_t>(plan.numel));
    }
    const Group& g = plan.groups[0];
    if (q != nullptr)
      be_.gemm(Transpose::No, Transpose::No, g.rows, g.rank, g.cols, 1.0f, in, g.cols, 0, q, g.rank, 0, 0.0f, p,
               g.rank, 0, 1);
    return be_.squared_norm(in, static_cast<size_t>(plan.compressed_numel));
  }
  double m2 = 0;
  for (const auto& t : plan.tensors) {
    if (t.compressed) {
      const Group& g = plan.groups[static_cast<size_t>(t.group)];
      m2 += be_.form_and_project(in + t.work_offset, data + t.offset, ef ? nerr + t.work_offset : nullptr, g.rows,
                                 g.cols, q != nullptr ? q + t.q_offset : nullptr, q != nullptr ? g.rank : 0,
                                 q != nullptr ? p + t.p_offset : nullptr);
    } else if (ef) {
      be_.subtract(in + t.work_offset, data + t.offset, nerr + t.work_offset, static_cast<size_t>(t.numel));
    } else {
      be_.copy(in + t.work_offset, data + t.offset, static_cast<size_t>(t.numel));
    }
  }
  return m2;
}

// A zero or rank-deficient P or Q (a gradient that is 0 in a step, or of rank
// below r) has degenerate columns: the backend replaces them by vectors keyed
// by (seed, bucket, step, factor, group), so every rank gets the same bits and
// the power iteration never keeps a zero factor (docs/engine.md).
void StepRunner::orthogonalize(float* factor, const BucketPlan& plan, Factor which, int b, int64_t step) {
  const auto eps = static_cast<float>(config_.orthogonalization_epsilon);
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    const Group& g = plan.groups[gi];
    const bool p = which == Factor::P;
    const int64_t rows = p ? g.rows : g.cols;
    const uint64_t seed = orthogonalization_seed(config_.seed, static_cast<uint64_t>(b), static_cast<uint64_t>(step),
                                                 p ? 0 : 1, gi);
    be_.orthogonalize(factor + (p ? g.p_offset : g.q_offset), rows, g.rank, g.count, rows * g.rank,
                      ortho_method(g.rank), eps, seed);
  }
}

// Q = M^T P per matrix, one streaming pass each (the whole-bucket matrix is one group of one).
void StepRunner::project_all(const BucketState& s, const float* p, float* q) {
  for (const auto& g : s.plan.groups)
    for (int64_t k = 0; k < g.count; ++k)
      be_.project_transposed(s.in.data() + g.work_offset + k * g.rows * g.cols, g.rows, g.cols,
                             p + g.p_offset + k * g.rows * g.rank, g.rank, q + g.q_offset + k * g.cols * g.rank);
}

void StepRunner::prepare_compressed(Reduction& job, size_t i, BucketState& s) {
  const BucketPlan& plan = s.plan;
  const float* data = job.data[i];
  float* in = s.in.data();
  float* factor_out = factor(job, i);
  double m2 = 0;
  if (job.q_half[i]) {
    // Alternating Q half: P^ = the warm P orthonormalized, then Q = M^T P^ (sent).
    float* p = arenas_.p_work.data() + s.p_offset;
    be_.copy(p, arenas_.p_state.data() + s.p_offset, static_cast<size_t>(plan.p_numel));
    orthogonalize(p, plan, Factor::P, job.buckets[i], job.iteration);
    m2 = form(s, data, nullptr, nullptr);
    project_all(s, p, factor_out);
  } else {
    // Default step, or alternating P half: Q^ = the warm (or a drawn) Q orthonormalized, then P = M Q^ (sent).
    float* q = arenas_.q_work.data() + job.q_at[i];
    const auto qn = static_cast<size_t>(plan.q_numel);
    if (!config_.warm_start || !s.q_initialized) {
      std::vector<float> host(qn);
      engine::standard_normal(config_.seed, static_cast<uint64_t>(job.buckets[i]), s.draws, host);
      be_.copy_from_host(q, host.data(), qn);
      job.drew[i] = 1;
    } else {
      be_.copy(q, arenas_.q_state.data() + s.q_offset, qn);
    }
    orthogonalize(q, plan, Factor::Q, job.buckets[i], job.iteration);
    m2 = form(s, data, q, factor_out);
  }
  // Squared norms in double are finite exactly when every element is: they are
  // the local half of the non-finite guard and the denominator of the stats.
  const double u2 = be_.squared_norm(in + plan.compressed_numel, static_cast<size_t>(plan.packed_numel));
  job.m2[i] = m2;
  float* unc = arenas_.unc.data() + job.unc_at[i];
  be_.copy(unc, in + plan.compressed_numel, static_cast<size_t>(plan.packed_numel));
  be_.fill(unc + plan.packed_numel, std::isfinite(m2) && std::isfinite(u2) ? 0.0f : 1.0f, 1);
}

void StepRunner::prepare_once(Reduction& job) {
  if (job.prepared) return;
  try {
    prepare(job);
  } catch (...) {
    job.prepare_error = std::current_exception();
    job.prepared = true;
  }
}

bool StepRunner::can_fuse(std::vector<int> buckets) const {
  // In the arenas' order (a DDP-like caller reduces the last bucket first).
  std::sort(buckets.begin(), buckets.end(), [&](int a, int b) { return bucket(a).unc_offset < bucket(b).unc_offset; });
  const auto in_rank_order = [&](int64_t count, DataType type) {
    return count == 0 || comm_.sums_in_rank_order(static_cast<size_t>(count), type);
  };
  for (size_t i = 0; i < buckets.size(); ++i) {
    const BucketState& s = bucket(buckets[i]);
    const int64_t factor = factor_numel(s, q_half_now(s));
    const int64_t q = config_.alternating ? 0 : s.plan.q_numel;
    if (i > 0) {
      const BucketState& before = bucket(buckets[i - 1]);
      if (before.unc_offset + before.plan.float32_part_numel() + factor_numel(before, q_half_now(before)) !=
              s.unc_offset ||
          before.q_offset + before.plan.q_numel != s.q_offset)
        return false;
    }
    // Each of the bucket's own collectives (run alone) in rank order: then the
    // fused ones, sent in rank order too, keep the bits and move the same bytes.
    const bool alone_in_rank_order =
        config_.wire_dtype == WireDType::Float32
            ? in_rank_order(s.plan.float32_part_numel() + factor, DataType::Float32) && in_rank_order(q, DataType::Float32)
            : in_rank_order(s.plan.float32_part_numel(), DataType::Float32) &&
                  in_rank_order(factor, wire_type(config_.wire_dtype)) && in_rank_order(q, wire_type(config_.wire_dtype));
    if (!alone_in_rank_order) return false;
  }
  return true;
}

Reduction StepRunner::fuse(std::vector<Reduction*> members) {
  std::sort(members.begin(), members.end(), [](const Reduction* a, const Reduction* b) {
    return a->unc_begin < b->unc_begin;  // the arenas' order: one segment (can_fuse)
  });
  Reduction fused;
  const Reduction& first = *members.front();
  fused.fused = true;
  fused.iteration = first.iteration;
  fused.compressed = true;
  fused.prepared = true;
  fused.unc_begin = first.unc_begin;
  fused.q_begin = first.q_begin;
  for (const Reduction* m : members) {
    const auto append = [](auto& to, const auto& from) { to.insert(to.end(), from.begin(), from.end()); };
    append(fused.buckets, m->buckets);
    append(fused.data, m->data);
    append(fused.m2, m->m2);
    append(fused.drew, m->drew);
    append(fused.unc_at, m->unc_at);
    append(fused.q_at, m->q_at);
    append(fused.q_half, m->q_half);
    append(fused.out2, m->out2);
    fused.unc_count += m->unc_count;
    fused.q_count += m->q_count;
    fused.closes_step = fused.closes_step || m->closes_step;
    if (!fused.prepare_error) fused.prepare_error = m->prepare_error;
  }
  return fused;
}

void StepRunner::run(Reduction& job) {
  failed_together_ = false;
  prepare_once(job);
  in_rank_order_ = job.fused;
  // A failed prepare still issues the step's collectives, poisoned (run_plain, check_flags).
  if (!job.compressed)
    run_plain(job);
  else if (config_.alternating)
    run_alternating(job);
  else
    run_compressed(job);
  if (fault_at(fault_, FaultPoint::Output, job.iteration)) {
    float first;
    be_.copy_to_host(&first, job.data[0], 1);
    first = std::bit_cast<float>(std::bit_cast<uint32_t>(first) ^ 1u);
    be_.copy_from_host(job.data[0], &first, 1);
  }
}

void StepRunner::throw_nonfinite(const Reduction& job, int bucket, const std::string& what) {
  failed_together_ = true;
  PSGD_THROW(NonFiniteError, "step ", job.iteration, ", bucket ", bucket, ": ", what,
             "; nothing written, error-feedback and warm-start state unchanged");
}

void StepRunner::run_plain(Reduction& job) {
  const std::exception_ptr failed = job.prepare_error;
  std::vector<Segment> segs;
  std::vector<Work> works;
  for (int b : job.buckets) {
    BucketState& s = bucket(b);
    segs.push_back(arenas_.plain_segment(s));
    if (failed) segs.back().host[segs.back().count - 1] = kFailedFlag;
    works.push_back(send(segs.back(), !failed));
  }
  lookahead(job);
  wait_all(works, segs, !failed);
  // The flags' sums are the same on every rank, so every rank takes the same branch.
  for (const Segment& seg : segs)
    if (seg.host[seg.count - 1] >= kFailedFlag) fail_flagged(job, failed);
  for (size_t i = 0; i < job.buckets.size(); ++i) {
    const float flag = segs[i].host[segs[i].count - 1];
    if (flag != 0.0f) throw_nonfinite(job, job.buckets[i], detail::concat("NaN or Inf in the gradients of ", flag, " rank(s)"));
  }
  // Finite inputs can still overflow in the sum: refused as on the compressed
  // path, before any bucket of the reduction is written (identical sums: the same decision everywhere).
  for (size_t i = 0; i < job.buckets.size(); ++i)
    if (!be_.all_finite(segs[i].dev, segs[i].count - 1))
      throw_nonfinite(job, job.buckets[i], "the allreduced gradients overflowed to Inf/NaN");
  const auto start = Clock::now();
  const float inv = 1.0f / static_cast<float>(comm_.size());
  for (size_t i = 0; i < job.buckets.size(); ++i) {
    const auto n = segs[i].count - 1;
    be_.scale(segs[i].dev, inv, n);
    be_.copy(job.data[i], segs[i].dev, n);
  }
  be_.synchronize();
  stats_.decompress_seconds += seconds_since(start);
}

// After the first collective: any rank's flag set, or sums that overflowed,
// fail the reduction on every rank (the sums are identical everywhere).
void StepRunner::check_flags(const Reduction& job, const Segment& unc) {
  for (size_t i = 0; i < job.buckets.size(); ++i)
    if (flag(job, i, unc) >= kFailedFlag) fail_flagged(job, job.prepare_error);
  for (size_t i = 0; i < job.buckets.size(); ++i) {
    const float count = flag(job, i, unc);
    if (count != 0.0f)
      throw_nonfinite(job, job.buckets[i], detail::concat("NaN or Inf in the gradients of ", count, " rank(s)"));
  }
  if (!be_.all_finite(unc.dev, unc.count))
    throw_nonfinite(job, job.buckets[0],
                    detail::concat(config_.alternating
                                       ? "the allreduced P or Q or uncompressed tensors overflowed to Inf/NaN"
                                       : "the allreduced P or uncompressed tensors overflowed to Inf/NaN",
                                   overflow_hint(config_)));
}

void StepRunner::run_compressed(Reduction& job) {
  Segment unc = arenas_.unc_segment(job.unc_begin, job.unc_count);
  Segment q = arenas_.q_segment(job.q_begin, job.q_count);

  // Wire order: packed uncompressed tensors, finite flag and P in one
  // collective, then Q (reduce_all: all buckets' in one collective each).
  const Ranges factors = factor_ranges(job);
  first_collective(job, unc, factors);
  check_flags(job, unc);
  if (config_.adaptive)
    for (size_t i = 0; i < job.buckets.size(); ++i)
      job.out2[i] = host_squared_sum(unc.host + (job.unc_at[i] - job.unc_begin),
                                     bucket(job.buckets[i]).plan.packed_numel);

  // Buckets without compressed tensors have no Q and no work between the
  // collectives: the layout is the same on every rank, so all skip both.
  auto start = Clock::now();
  std::exception_ptr between_failed;
  if (q.count > 0) {
    try {
      maybe_inject(fault_, FaultPoint::Between, job.iteration, job.buckets);
      for (size_t i = 0; i < job.buckets.size(); ++i) {
        BucketState& s = bucket(job.buckets[i]);
        float* pb = factor(job, i);
        orthogonalize(pb, s.plan, Factor::P, job.buckets[i], job.iteration);
        project_all(s, pb, arenas_.q_work.data() + job.q_at[i]);
      }
      be_.synchronize();
    } catch (...) {
      between_failed = std::current_exception();
    }
  }
  stats_.compress_seconds += seconds_since(start);

  // A rank whose work between the collectives failed poisons Q with NaN: every
  // rank then sees a non-finite sum and takes part in the report gather, which
  // tells a local failure from an overflow.
  std::vector<Work> works;
  const Ranges all_of_q{{0, static_cast<int64_t>(q.count)}};  // Q is all factor
  if (q.count > 0) {
    if (between_failed) q.host[0] = std::numeric_limits<float>::quiet_NaN();
    send_q(q, all_of_q, !between_failed, works);
  }
  lookahead(job);
  if (q.count > 0) wait_segment(works, q, all_of_q, !between_failed);
  if (between_failed || !be_.all_finite(q.dev, q.count)) {
    raise_local_failures(job, between_failed);
    throw_nonfinite(job, job.buckets[0], detail::concat("the allreduced Q overflowed to Inf/NaN", overflow_hint(config_)));
  }
  // ||output|| = ||P^ Q^T|| = ||Q|| (P^ orthonormal).
  if (config_.adaptive)
    for (size_t i = 0; i < job.buckets.size(); ++i)
      job.out2[i] += host_squared_sum(q.host + (job.q_at[i] - job.q_begin), bucket(job.buckets[i]).plan.q_numel);

  // Commit point: from here on nothing can fail for a reason the ranks disagree on.
  start = Clock::now();
  const float inv = 1.0f / static_cast<float>(comm_.size());
  be_.scale(q.dev, inv, q.count);
  for (size_t i = 0; i < job.buckets.size(); ++i) decompress(job, i);
  be_.synchronize();
  stats_.decompress_seconds += seconds_since(start);
}

// One collective: [packed | flag | P] in a P half, [packed | flag | Q] in a Q half
// (each bucket by its own parity; docs/engine.md).
void StepRunner::run_alternating(Reduction& job) {
  Segment unc = arenas_.unc_segment(job.unc_begin, job.unc_count);
  const Ranges factors = factor_ranges(job);
  first_collective(job, unc, factors);
  check_flags(job, unc);

  // Commit point. ||output|| = ||P Q^^T|| = ||P|| in a P half, ||P^ Q^T|| = ||Q|| in a Q half.
  const auto start = Clock::now();
  const float inv = 1.0f / static_cast<float>(comm_.size());
  for (size_t i = 0; i < job.buckets.size(); ++i) {
    const BucketState& s = bucket(job.buckets[i]);
    const int64_t count = factor_numel(s, job.q_half[i]);
    if (config_.adaptive) {
      const float* range = unc.host + (job.unc_at[i] - job.unc_begin);
      job.out2[i] = host_squared_sum(range, s.plan.packed_numel) +
                    host_squared_sum(range + s.plan.float32_part_numel(), count);
    }
    be_.scale(factor(job, i), inv, static_cast<size_t>(count));
  }
  for (size_t i = 0; i < job.buckets.size(); ++i) decompress(job, i);
  be_.synchronize();
  stats_.decompress_seconds += seconds_since(start);
}

void StepRunner::decompress(const Reduction& job, size_t i) {
  const int b = job.buckets[i];
  BucketState& s = bucket(b);
  const BucketPlan& plan = s.plan;
  float* data = job.data[i];
  float* in = s.in.data();
  // The output is p q^T with one factor orthonormal and the other averaged:
  // default: P^ (orthonormalized sum) and the mean Q; alternating P half: the
  // mean P and Q^; Q half: P^ and the mean Q.
  const float* p = job.q_half[i] ? arenas_.p_work.data() + s.p_offset : factor(job, i);
  const float* q = job.q_half[i] ? factor(job, i) : arenas_.q_work.data() + job.q_at[i];
  const bool ef = config_.error_feedback;
  const float inv = 1.0f / static_cast<float>(comm_.size());

  // Uncompressed tensors: the exact mean; their error is local minus mean.
  float* unc = arenas_.unc.data() + job.unc_at[i];
  const auto packed = static_cast<size_t>(plan.packed_numel);
  be_.scale(unc, inv, packed);
  for (const auto& t : plan.tensors)
    if (!t.compressed)
      be_.copy(data + t.offset, unc + (t.work_offset - plan.compressed_numel), static_cast<size_t>(t.numel));
  if (ef) be_.subtract(in + plan.compressed_numel, unc, in + plan.compressed_numel, packed);

  double e2 = 0;
  if (plan.whole) {
    // P Q^T through the backend's fixed-order kernel, not gemm: every rank
    // must write the same bits (docs/compute.md). `in` becomes P Q^T - M,
    // padding included; without error feedback its padding is M's next step (0).
    const Group& g = plan.groups[0];
    float* out = s.tmp.data();
    const auto full = static_cast<size_t>(plan.side * plan.side);
    e2 = be_.reconstruct_and_residual(out, in, g.rows, g.cols, p, q, g.rank);
    be_.copy(data, out, static_cast<size_t>(plan.numel));
    if (ef)
      be_.copy(s.nerr.data(), in, full);
    else
      be_.fill(in + plan.numel, 0.0f, full - static_cast<size_t>(plan.numel));
  } else {
    // Output P Q^T into the user's buffer and, in the same pass, the work
    // buffer becomes P Q^T - M: the negated error of the compressed part.
    for (const auto& t : plan.tensors) {
      if (!t.compressed) continue;
      const Group& g = plan.groups[static_cast<size_t>(t.group)];
      e2 += be_.reconstruct_and_residual(data + t.offset, in + t.work_offset, g.rows, g.cols, p + t.p_offset,
                                        q + t.q_offset, g.rank);
    }
    if (ef) std::swap(s.in, s.nerr);
  }
  be_.copy(arenas_.p_state.data() + s.p_offset, p, static_cast<size_t>(plan.p_numel));
  be_.copy(arenas_.q_state.data() + s.q_offset, q, static_cast<size_t>(plan.q_numel));
  s.q_initialized = true;
  if (job.drew[i]) ++s.draws;
  s.last_m2 = job.m2[i];
  s.last_e2 = e2;
  stats_.numel_before += static_cast<uint64_t>(plan.numel);
  stats_.numel_after += static_cast<uint64_t>(
      plan.packed_numel + (config_.alternating ? factor_numel(s, job.q_half[i]) : plan.p_numel + plan.q_numel));
  const bool first = s.compressed_steps == 0;
  ++s.compressed_steps;
  if (s.boost_left > 0) --s.boost_left;
  const bool window_end = config_.adaptive && commit_adaptive(job, i);
  if (first) log_.add(job.iteration, b, s);
  // The policy's level for the next compressed step (policy.hpp): logged when
  // it changes and at each window the adaptive rule decides.
  const LevelChoice next = choose_level(config_, s);
  const bool rule_decides = window_end && next.reason == s.rule_reason && next.level == s.rule_level;
  if (next.level != s.level || next.reason != s.reason || rule_decides) {
    if (next.level != s.level) {
      // After the commit point: a switch that fails on this rank (out of memory) leaves the bucket at its level
      // and the step done, as on every rank; the next announce finds the ranks' states apart and fails on every
      // rank (MismatchError: restore from a checkpoint), this rank's log says why.
      try {
        switch_level(s, b, next.level, job.iteration);
      } catch (const std::exception& e) {
        PSGD_LOG(Error, "step ", job.iteration, ", bucket ", b, ": switching to rank ", s.level_ranks[next.level],
                 " failed on this rank, whose bucket stays at rank ", s.current_rank,
                 " (the ranks' states are apart: the next reduction fails on every rank): ", e.what());
        return;  // neither the reason nor the log changes: the bucket is as it was
      }
    }
    s.reason = next.reason;
    log_.add(job.iteration + 1, b, s);
  }
}

// Accordion's rule at the end of each window of adaptive_interval compressed
// steps: the window's summed output norm against the previous window's; a
// relative change >= adaptive_threshold, or no previous window, selects
// rank_high, else rank_low. Inputs are sums computed on the host from the
// collectives' results, so every rank decides the same. The rule keeps
// measuring while a warm-up or boost overrides its choice (choose_level), so
// its latest choice is in force when the override ends. Returns whether a
// window ended.
bool StepRunner::commit_adaptive(const Reduction& job, size_t i) {
  BucketState& s = bucket(job.buckets[i]);
  s.window_sum += std::sqrt(job.out2[i]) / static_cast<double>(comm_.size());
  if (s.compressed_steps % static_cast<uint64_t>(config_.adaptive_interval) != 0) return false;
  const double current = s.window_sum, previous = s.previous_window;
  s.window_sum = 0;
  s.previous_window = current;
  const double change = previous > 0 ? std::abs(current - previous) / previous
                        : current > 0 ? std::numeric_limits<double>::infinity()
                                      : 0.0;
  const bool high = std::isnan(previous) || change >= config_.adaptive_threshold;
  s.rule_level = high ? 1 : 0;
  s.rule_reason = std::isnan(previous) ? RankReason::FirstWindow
                  : high              ? RankReason::NormChangeHigh
                                      : RankReason::NormChangeLow;
  return true;
}

// The bucket's plan becomes levels[level]. The error memory is carried through
// the bucket's own order (the work layout depends on the level); the warm P and
// Q keep each matrix's first min(old, new rank) columns, the others drawn from
// the generator (draw `draws`, then draws + 1), so every rank gets the same bits.
// Local work only: no collective. Whatever can fail (host memory, copies to the
// host) comes before the bucket changes: a failure leaves it as it was.
void StepRunner::switch_level(BucketState& s, int b, size_t level, int64_t step) {
  PSGD_ASSERT(level < arenas_.levels, "bucket ", b, " switches to rank level ", level, ", whose buffers are not laid out");
  const BucketPlan& from = s.plan;
  const BucketPlan& to = s.levels[level];
  std::vector<float> nerr;  // the error memory in `to`'s work layout
  if (!s.nerr.empty()) nerr = error_in_work_layout(to, s.nerr.size(), read_error(be_, s));
  std::vector<float> fresh;  // the warm Q, then P, of `to`
  if (s.q_initialized) {
    std::vector<float> old_p(static_cast<size_t>(from.p_numel)), old_q(static_cast<size_t>(from.q_numel));
    be_.copy_to_host(old_p.data(), arenas_.p_state.data() + s.p_offset, old_p.size());
    be_.copy_to_host(old_q.data(), arenas_.q_state.data() + s.q_offset, old_q.size());
    fresh.resize(static_cast<size_t>(to.p_numel + to.q_numel));
    engine::standard_normal(config_.seed, static_cast<uint64_t>(b), s.draws, fresh);
    float* new_q = fresh.data();
    float* new_p = fresh.data() + to.q_numel;
    struct Old {
      int64_t rank, p_offset, q_offset;
    };
    std::map<size_t, Old> old;
    for_each_matrix(from, [&](size_t key, int64_t, int64_t, int64_t rank, int64_t p_offset, int64_t q_offset) {
      old[key] = {rank, p_offset, q_offset};
    });
    for_each_matrix(to, [&](size_t key, int64_t rows, int64_t cols, int64_t rank, int64_t p_offset, int64_t q_offset) {
      const auto found = old.find(key);
      if (found == old.end()) return;  // newly compressed at this level: all columns drawn
      const Old& o = found->second;
      const int64_t keep = std::min(rank, o.rank);
      for (int64_t r = 0; r < cols; ++r)
        std::copy_n(old_q.data() + o.q_offset + r * o.rank, keep, new_q + q_offset + r * rank);
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(old_p.data() + o.p_offset + r * o.rank, keep, new_p + p_offset + r * rank);
    });
  }
  maybe_inject(fault_, FaultPoint::Switch, step, {b});  // test only: after the copies, before any change
  // The switch: copies into buffers laid out for every level (arenas), nothing allocated.
  if (s.q_initialized) {
    be_.copy_from_host(arenas_.q_state.data() + s.q_offset, fresh.data(), static_cast<size_t>(to.q_numel));
    be_.copy_from_host(arenas_.p_state.data() + s.p_offset, fresh.data() + to.q_numel, static_cast<size_t>(to.p_numel));
    ++s.draws;
  }
  if (!nerr.empty()) be_.copy_from_host(s.nerr.data(), nerr.data(), nerr.size());
  s.plan = to;
  s.level = level;
  s.current_rank = s.level_ranks[level];
}

}  // namespace powersgd::engine
