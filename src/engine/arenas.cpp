#include "engine/arenas.hpp"

#include <algorithm>

#include "common/check.hpp"

namespace powersgd::engine {

void Arenas::allocate(compute::Backend& be, std::vector<std::unique_ptr<BucketState>>& buckets, bool error_feedback,
                      bool alternating) {
  host_accessible = be.host_accessible();
  int64_t unc_count = 0, p_count = 0, q_count = 0;
  for (auto& sp : buckets) {
    BucketState& s = *sp;
    const BucketPlan& plan = s.plan;
    const auto work = static_cast<size_t>(plan.whole ? plan.side * plan.side : plan.numel);
    s.in = be.allocate(work + 1);
    if (error_feedback) s.nerr = be.allocate(plan.whole ? static_cast<size_t>(plan.numel) : work + 1);
    if (plan.whole) s.tmp = be.allocate(std::max(work, static_cast<size_t>(plan.numel) + 1));
    if (!host_accessible) s.host_plain.resize(static_cast<size_t>(plan.numel) + 1);
    // Slots fit every level (the work buffer and packing are the same size at every level).
    int64_t packed = 0, p_numel = 0, q_numel = 0;
    for (const auto& level : s.levels) {
      packed = std::max(packed, level.packed_numel);
      p_numel = std::max(p_numel, level.p_numel);
      q_numel = std::max(q_numel, level.q_numel);
    }
    s.unc_offset = unc_count;
    s.p_offset = p_count;
    s.q_offset = q_count;
    unc_count += packed + 1 + (alternating ? std::max(p_numel, q_numel) : p_numel);
    p_count += p_numel;
    q_count += q_numel;
  }
  unc = be.allocate(static_cast<size_t>(unc_count));
  q_work = be.allocate(static_cast<size_t>(q_count));
  p_state = be.allocate(static_cast<size_t>(p_count));
  q_state = be.allocate(static_cast<size_t>(q_count));
  if (alternating) p_work = be.allocate(static_cast<size_t>(p_count));
  if (!host_accessible) {
    unc_host.resize(static_cast<size_t>(unc_count));
    q_host.resize(static_cast<size_t>(q_count));
  }
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

// Calls f(bucket_index, work_index) for every element of the bucket: where it
// lies in the user's buffer and where in the work layout (the bucket's own
// order for the whole-bucket variant, else regrouped by tensor).
template <typename F>
void for_each_element(const BucketPlan& plan, F&& f) {
  if (plan.whole) {
    for (size_t k = 0; k < static_cast<size_t>(plan.numel); ++k) f(k, k);
    return;
  }
  for (const auto& t : plan.tensors)
    for (int64_t k = 0; k < t.numel; ++k) f(static_cast<size_t>(t.offset + k), static_cast<size_t>(t.work_offset + k));
}

}  // namespace

std::vector<float> read_error(compute::Backend& backend, const BucketState& s) {
  std::vector<float> nerr(s.nerr.size());
  backend.copy_to_host(nerr.data(), s.nerr.data(), nerr.size());
  std::vector<float> error(static_cast<size_t>(s.plan.numel));
  for_each_element(s.plan, [&](size_t i, size_t w) { error[i] = -nerr[w]; });
  return error;
}

void write_error(compute::Backend& backend, BucketState& s, const std::vector<float>& error) {
  PSGD_ASSERT(error.size() == static_cast<size_t>(s.plan.numel), "error memory of ", error.size(),
              " floats for a bucket of ", s.plan.numel);
  std::vector<float> nerr(s.nerr.size(), 0.0f);
  for_each_element(s.plan, [&](size_t i, size_t w) { nerr[w] = -error[i]; });
  backend.copy_from_host(s.nerr.data(), nerr.data(), nerr.size());
}

}  // namespace powersgd::engine
