#include "engine/arenas.hpp"

#include <algorithm>
#include <utility>

#include "common/check.hpp"

namespace powersgd::engine {

void Arenas::allocate(compute::Backend& be, std::vector<std::unique_ptr<BucketState>>& buckets, bool error_feedback,
                      bool alternating, size_t level_count) {
  host_accessible = be.host_accessible();
  alternating_ = alternating;
  for (auto& sp : buckets) {
    BucketState& s = *sp;
    const BucketPlan& plan = s.plan;
    const auto work = static_cast<size_t>(plan.whole ? plan.side * plan.side : plan.numel);
    s.in = be.allocate(work + 1);
    if (error_feedback) s.nerr = be.allocate(plan.whole ? work : work + 1);
    if (plan.whole) s.tmp = be.allocate(std::max(work, static_cast<size_t>(plan.numel) + 1));
    if (!host_accessible) s.host_plain.resize(static_cast<size_t>(plan.numel) + 1);
  }
  lay_out(be, buckets, level_count);
}

void Arenas::fit_levels(compute::Backend& be, std::vector<std::unique_ptr<BucketState>>& buckets, size_t level_count) {
  if (level_count <= levels) return;
  compute::DeviceBuffer old_p = std::move(p_state), old_q = std::move(q_state);
  std::vector<std::pair<int64_t, int64_t>> old_offsets;
  for (const auto& s : buckets) old_offsets.emplace_back(s->p_offset, s->q_offset);
  try {
    lay_out(be, buckets, level_count);
  } catch (...) {
    p_state = std::move(old_p);  // nothing else was changed
    q_state = std::move(old_q);
    throw;
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    const BucketState& s = *buckets[b];
    be.copy(p_state.data() + s.p_offset, old_p.data() + old_offsets[b].first, static_cast<size_t>(s.plan.p_numel));
    be.copy(q_state.data() + s.q_offset, old_q.data() + old_offsets[b].second, static_cast<size_t>(s.plan.q_numel));
  }
  be.synchronize();  // before the old arenas go
}

// Allocates the new arenas before it changes anything, so a failed allocation leaves the layout as it was.
void Arenas::lay_out(compute::Backend& be, std::vector<std::unique_ptr<BucketState>>& buckets, size_t level_count) {
  struct Offsets {
    int64_t unc, p, q;
  };
  std::vector<Offsets> offsets;
  int64_t unc_count = 0, p_count = 0, q_count = 0;
  for (const auto& sp : buckets) {
    const BucketState& s = *sp;
    const size_t laid = std::min(level_count, s.levels.size());
    PSGD_ASSERT(s.level < laid, "bucket at rank level ", s.level, " laid out for ", level_count, " level(s)");
    // Slots fit every level laid out (the work buffer is the same size at every level; the packing is not).
    int64_t packed = 0, p_numel = 0, q_numel = 0;
    for (size_t l = 0; l < laid; ++l) {
      packed = std::max(packed, s.levels[l].packed_numel);
      p_numel = std::max(p_numel, s.levels[l].p_numel);
      q_numel = std::max(q_numel, s.levels[l].q_numel);
    }
    offsets.push_back({unc_count, p_count, q_count});
    unc_count += packed + 1 + (alternating_ ? std::max(p_numel, q_numel) : p_numel);
    p_count += p_numel;
    q_count += q_numel;
  }
  compute::DeviceBuffer new_unc = be.allocate(static_cast<size_t>(unc_count));
  compute::DeviceBuffer new_q_work = be.allocate(static_cast<size_t>(q_count));
  compute::DeviceBuffer new_p_state = be.allocate(static_cast<size_t>(p_count));
  compute::DeviceBuffer new_q_state = be.allocate(static_cast<size_t>(q_count));
  compute::DeviceBuffer new_p_work;
  if (alternating_) new_p_work = be.allocate(static_cast<size_t>(p_count));
  std::vector<float> new_unc_host, new_q_host;
  if (!host_accessible) {
    new_unc_host.resize(static_cast<size_t>(unc_count));
    new_q_host.resize(static_cast<size_t>(q_count));
  }
  // Nothing throws from here on.
  for (size_t b = 0; b < buckets.size(); ++b) {
    buckets[b]->unc_offset = offsets[b].unc;
    buckets[b]->p_offset = offsets[b].p;
    buckets[b]->q_offset = offsets[b].q;
  }
  unc = std::move(new_unc);
  q_work = std::move(new_q_work);
  p_state = std::move(new_p_state);
  q_state = std::move(new_q_state);
  p_work = std::move(new_p_work);
  unc_host = std::move(new_unc_host);
  q_host = std::move(new_q_host);
  levels = level_count;
}

size_t Arenas::floats(const std::vector<std::unique_ptr<BucketState>>& buckets) const {
  size_t total = unc.size() + q_work.size() + p_state.size() + q_state.size() + p_work.size();
  for (const auto& s : buckets) total += s->in.size() + s->nerr.size() + s->tmp.size();
  return total;
}

Segment Arenas::segment(compute::DeviceBuffer& arena, std::vector<float>& host, int64_t offset, int64_t count) const {
  float* dev = arena.data() + offset;
  return {dev, host_accessible ? dev : host.data() + offset, static_cast<size_t>(count)};
}

Segment Arenas::plain_segment(BucketState& s) const {
  float* buf = s.plain_buffer();
  return {buf, host_accessible ? buf : s.host_plain.data(), static_cast<size_t>(s.plan.numel) + 1};
}

namespace {

// Calls f(memory_index, work_index) for every element of the error memory:
// where it lies in the bucket's own order (then, whole bucket, the padding)
// and where in the work layout (the same for the whole-bucket variant, else
// regrouped by tensor).
template <typename F>
void for_each_element(const BucketPlan& plan, F&& f) {
  if (plan.whole) {
    for (size_t k = 0; k < error_memory_size(plan); ++k) f(k, k);
    return;
  }
  for (const auto& t : plan.tensors)
    for (int64_t k = 0; k < t.numel; ++k) f(static_cast<size_t>(t.offset + k), static_cast<size_t>(t.work_offset + k));
}

}  // namespace

std::vector<float> read_error(compute::Backend& backend, const BucketState& s) {
  std::vector<float> nerr(s.nerr.size());
  backend.copy_to_host(nerr.data(), s.nerr.data(), nerr.size());
  std::vector<float> error(error_memory_size(s.plan));
  for_each_element(s.plan, [&](size_t i, size_t w) { error[i] = -nerr[w]; });
  return error;
}

std::vector<float> error_in_work_layout(const BucketPlan& plan, size_t work_size, const std::vector<float>& error) {
  PSGD_ASSERT(error.size() == error_memory_size(plan), "error memory of ", error.size(),
              " floats for a bucket whose memory holds ", error_memory_size(plan));
  std::vector<float> nerr(work_size, 0.0f);
  for_each_element(plan, [&](size_t i, size_t w) { nerr[w] = -error[i]; });
  return nerr;
}

}  // namespace powersgd::engine
