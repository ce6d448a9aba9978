#include "engine/step_runner.hpp"

#include <chrono>
#include <cmath>
#include <limits>

#include "common/check.hpp"
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

OrthoMethod ortho_method(int64_t cols) { return cols <= 2 ? OrthoMethod::GramSchmidt : OrthoMethod::Qr; }

}  // namespace

// Prepares the next queued reduction while `current` communicates, when they
// share no bucket (the next one's state must be final). Purely local work.
void StepRunner::lookahead(const Reduction& current) {
  const std::shared_ptr<Reduction> next = next_();
  if (next == nullptr || next->prepared) return;
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

Work StepRunner::send(const Segment& seg, bool stage) {
  if (stage && seg.host != seg.dev) be_.copy_to_host(seg.host, seg.dev, seg.count);
  stats_.bytes_sent += seg.count * sizeof(float);
  return comm_.allreduce_async(seg.host, seg.count, DataType::Float32);
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
  throw_if_any_failed(reports, own,
                      detail::concat("step ", job.iteration, ", bucket", job.buckets.size() > 1 ? "s " : " ", buckets),
                      "nothing written, error-feedback and warm-start state unchanged on every rank");
}

void StepRunner::fail_flagged(const Reduction& job, std::exception_ptr own) {
  raise_local_failures(job, own);
  PSGD_THROW(InternalError, "step ", job.iteration, ": a rank flagged a local failure but none reported one");
}

void StepRunner::prepare(Reduction& job) {
  maybe_inject(fault_, FaultPoint::Prepare, job.iteration);
  const auto start = Clock::now();
  job.m2.assign(job.buckets.size(), 0.0);
  job.drew.assign(job.buckets.size(), 0);
  for (size_t i = 0; i < job.buckets.size(); ++i) {
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

void StepRunner::prepare_compressed(Reduction& job, size_t i, BucketState& s) {
  const BucketPlan& plan = s.plan;
  const float* data = job.data[i];
  float* in = s.in.data();
  const bool ef = config_.error_feedback;
  const float* nerr = ef ? s.nerr.data() : nullptr;

  float* q = arenas_.q_work.data() + s.q_offset;
  const auto qn = static_cast<size_t>(plan.q_numel);
  if (!config_.warm_start || !s.q_initialized) {
    std::vector<float> host(qn);
    engine::standard_normal(config_.seed, static_cast<uint64_t>(job.buckets[i]), s.draws, host);
    be_.copy_from_host(q, host.data(), qn);
    job.drew[i] = 1;
  } else {
    be_.copy(q, arenas_.q_state.data() + s.q_offset, qn);
  }
  float* p = arenas_.unc.data() + s.p_work_offset;
  const auto eps = static_cast<float>(config_.orthogonalization_epsilon);
  for (const auto& g : plan.groups)
    be_.orthogonalize(q + g.q_offset, g.cols, g.rank, g.count, g.cols * g.rank, ortho_method(g.rank), eps);

  // M = data + error, gathered into the work layout, and P = M Q: one pass
  // over each matrix (form_and_project), which also returns ||M||^2.
  // Squared norms in double are finite exactly when every element is: they are
  // the local half of the non-finite guard and the denominator of the stats.
  double m2 = 0;
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
    be_.gemm(Transpose::No, Transpose::No, g.rows, g.rank, g.cols, 1.0f, in, g.cols, 0, q, g.rank, 0, 0.0f, p,
            g.rank, 0, 1);
    m2 = be_.squared_norm(in, static_cast<size_t>(plan.compressed_numel));
  } else {
    for (const auto& t : plan.tensors) {
      if (t.compressed) {
        const Group& g = plan.groups[static_cast<size_t>(t.group)];
        m2 += be_.form_and_project(in + t.work_offset, data + t.offset, ef ? nerr + t.work_offset : nullptr, g.rows,
                                  g.cols, q + t.q_offset, g.rank, p + t.p_offset);
      } else if (ef) {
        be_.subtract(in + t.work_offset, data + t.offset, nerr + t.work_offset, static_cast<size_t>(t.numel));
      } else {
        be_.copy(in + t.work_offset, data + t.offset, static_cast<size_t>(t.numel));
      }
    }
  }
  const double u2 = be_.squared_norm(in + plan.compressed_numel, static_cast<size_t>(plan.packed_numel));
  job.m2[i] = m2;
  float* unc = arenas_.unc.data() + s.unc_offset;
  be_.copy(unc, in + plan.compressed_numel, static_cast<size_t>(plan.packed_numel));
  be_.fill(unc + plan.packed_numel, std::isfinite(m2) && std::isfinite(u2) ? 0.0f : 1.0f, 1);
}

void StepRunner::run(Reduction& job) {
  if (!job.prepared) {
    try {
      prepare(job);
    } catch (...) {
      job.prepare_error = std::current_exception();
      job.prepared = true;
    }
  }
  // A failed prepare still issues the step's first collective, poisoned (run_plain, run_compressed).
  if (job.compressed)
    run_compressed(job);
  else
    run_plain(job);
}

void StepRunner::throw_nonfinite(const Reduction& job, int bucket, const std::string& what) {
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
    if (seg.host[seg.count - 1] >= kFailedFlag) {
      fail_flagged(job, failed);
    }
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

void StepRunner::run_compressed(Reduction& job) {
  const int64_t one = job.buckets.size() == 1 ? 1 : 0;
  const BucketState& first = bucket(job.buckets[0]);
  // The reduction's range of each arena: one bucket's, or the whole arena for reduce_all.
  Segment unc = one ? arenas_.unc_segment(first.unc_offset, first.plan.packed_numel + 1 + first.plan.p_numel)
                    : arenas_.unc_segment(0, static_cast<int64_t>(arenas_.unc.size()));
  Segment q = one ? arenas_.q_segment(first.q_offset, first.plan.q_numel)
                  : arenas_.q_segment(0, static_cast<int64_t>(arenas_.q_work.size()));

  // Wire order: packed uncompressed tensors, finite flag and P in one
  // collective, then Q (reduce_all: all buckets' in one collective each).
  const std::exception_ptr prepare_failed = job.prepare_error;
  auto flag_of = [&](const BucketState& s) -> float& {
    return unc.host[s.unc_offset - (one ? first.unc_offset : 0) + s.plan.packed_numel];
  };
  if (prepare_failed)
    for (int b : job.buckets) flag_of(bucket(b)) = kFailedFlag;
  std::vector<Work> works{send(unc, !prepare_failed)};
  lookahead(job);
  wait_all(works, {unc}, !prepare_failed);
  for (int b : job.buckets)
    if (flag_of(bucket(b)) >= kFailedFlag) {
      fail_flagged(job, prepare_failed);
    }
  for (int b : job.buckets) {
    const float flag = flag_of(bucket(b));
    if (flag != 0.0f) throw_nonfinite(job, b, detail::concat("NaN or Inf in the gradients of ", flag, " rank(s)"));
  }
  // Every rank holds the same sums, so this check decides the same everywhere.
  if (!be_.all_finite(unc.dev, unc.count))
    throw_nonfinite(job, job.buckets[0], "the allreduced P or uncompressed tensors overflowed to Inf/NaN");

  // Buckets without compressed tensors have no Q and no work between the
  // collectives: the layout is the same on every rank, so all skip both.
  auto start = Clock::now();
  std::exception_ptr between_failed;
  if (q.count > 0) {
    try {
      maybe_inject(fault_, FaultPoint::Between, job.iteration);
      const auto eps = static_cast<float>(config_.orthogonalization_epsilon);
      for (int b : job.buckets) {
        BucketState& s = bucket(b);
        float* pb = arenas_.unc.data() + s.p_work_offset;
        float* qb = arenas_.q_work.data() + s.q_offset;
        for (const auto& g : s.plan.groups)
          be_.orthogonalize(pb + g.p_offset, g.rows, g.rank, g.count, g.rows * g.rank, ortho_method(g.rank), eps);
        // Q = M^T P, one streaming pass per matrix (the whole-bucket matrix is one group of one).
        for (const auto& g : s.plan.groups)
          for (int64_t k = 0; k < g.count; ++k)
            be_.project_transposed(s.in.data() + g.work_offset + k * g.rows * g.cols, g.rows, g.cols,
                                  pb + g.p_offset + k * g.rows * g.rank, g.rank, qb + g.q_offset + k * g.cols * g.rank);
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
  works.clear();
  if (q.count > 0) {
    if (between_failed) q.host[0] = std::numeric_limits<float>::quiet_NaN();
    works.push_back(send(q, !between_failed));
  }
  lookahead(job);
  wait_all(works, {q}, !between_failed);
  if (between_failed || !be_.all_finite(q.dev, q.count)) {
    raise_local_failures(job, between_failed);
    throw_nonfinite(job, job.buckets[0], "the allreduced Q overflowed to Inf/NaN");
  }

  // Commit point: from here on nothing can fail for a reason the ranks disagree on.
  start = Clock::now();
  const float inv = 1.0f / static_cast<float>(comm_.size());
  be_.scale(q.dev, inv, q.count);
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
  const float* p = arenas_.unc.data() + s.p_work_offset;
  const float* q = arenas_.q_work.data() + s.q_offset;
  const bool ef = config_.error_feedback;
  const float inv = 1.0f / static_cast<float>(comm_.size());

  // Uncompressed tensors: the exact mean; their error is local minus mean.
  float* unc = arenas_.unc.data() + s.unc_offset;
  const auto packed = static_cast<size_t>(plan.packed_numel);
  be_.scale(unc, inv, packed);
  for (const auto& t : plan.tensors)
    if (!t.compressed)
      be_.copy(data + t.offset, unc + (t.work_offset - plan.compressed_numel), static_cast<size_t>(t.numel));
  if (ef) be_.subtract(in + plan.compressed_numel, unc, in + plan.compressed_numel, packed);

  double e2 = 0;
  if (plan.whole) {
    const Group& g = plan.groups[0];
    float* out = s.tmp.data();
    const auto full = static_cast<size_t>(plan.side * plan.side);
    be_.gemm(Transpose::No, Transpose::Yes, g.rows, g.cols, g.rank, 1.0f, p, g.rank, 0, q, g.rank, 0, 0.0f, out,
            g.cols, 0, 1);
    be_.copy(data, out, static_cast<size_t>(plan.numel));
    be_.subtract(out, out, in, full);  // P Q^T - M, padding included
    e2 = be_.squared_norm(out, full);
    if (ef) be_.copy(s.nerr.data(), out, full);
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
  stats_.numel_after += static_cast<uint64_t>(plan.p_numel + plan.q_numel + plan.packed_numel);
}

}  // namespace powersgd::engine
