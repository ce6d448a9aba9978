#include "engine/plan.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "common/check.hpp"

namespace powersgd::engine {

bool should_compress(int64_t rows, int64_t cols, int rank, double min_compression_rate) {
  const int64_t r = std::min({rows, cols, static_cast<int64_t>(rank)});
  // In double: n * m can exceed what (n + m) * r * rate is exact for in integers.
  return static_cast<double>(rows + cols) * static_cast<double>(r) * min_compression_rate <
         static_cast<double>(rows) * static_cast<double>(cols);
}

BucketPlan make_plan(std::span<const Shape> shapes, const Config& config, int rank) {
  PSGD_REQUIRE(!shapes.empty(), InvalidArgumentError, "bucket has no tensors: expected at least one shape");
  // The backends take 32-bit-safe counts per gemm dimension; one flag float follows the bucket.
  constexpr int64_t kMaxNumel = std::numeric_limits<int32_t>::max() - 1;
  BucketPlan plan;
  plan.whole = config.whole_bucket;
  for (size_t i = 0; i < shapes.size(); ++i) {
    TensorPlan t;
    t.shape = shapes[i];
    t.numel = 1;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      const int64_t dim = t.shape[d];
      PSGD_REQUIRE(dim >= 0, InvalidArgumentError, "tensor ", i, " of the bucket has dimension ", d, " = ", dim,
                   ": expected >= 0");
      PSGD_REQUIRE(dim == 0 || t.numel <= kMaxNumel / dim, InvalidArgumentError, "tensor ", i,
                   " of the bucket is too large: more than ", kMaxNumel, " elements");
      t.numel *= dim;
    }
    t.offset = plan.numel;
    plan.numel += t.numel;
    PSGD_REQUIRE(plan.numel <= kMaxNumel, InvalidArgumentError, "bucket too large: ", plan.numel,
                 " elements after tensor ", i, ", at most ", kMaxNumel, " supported");
    plan.tensors.push_back(std::move(t));
  }
  PSGD_REQUIRE(plan.numel > 0, InvalidArgumentError, "bucket of ", shapes.size(),
               " tensors has 0 elements: expected at least one element");

  if (plan.whole) {
    // The reference's batched variant: the bucket, zero-padded, is one square matrix.
    int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(plan.numel))));
    while (side * side < plan.numel) ++side;
    while (side > 1 && (side - 1) * (side - 1) >= plan.numel) --side;
    plan.side = side;
    Group g;
    g.rows = g.cols = side;
    g.rank = std::min<int64_t>(side, rank);
    g.count = 1;
    plan.groups.push_back(g);
    plan.compressed_numel = side * side;
    plan.p_numel = side * g.rank;
    plan.q_numel = side * g.rank;
    for (auto& t : plan.tensors) {
      t.compressed = true;
      t.group = 0;
      t.work_offset = t.offset;
    }
    return plan;
  }

  // Groups in order of first appearance; with batching, same (rows, cols) share one.
  std::map<std::pair<int64_t, int64_t>, int> group_of_shape;
  std::vector<std::vector<int>> members;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    TensorPlan& t = plan.tensors[i];
    if (t.shape.size() <= 1 || t.numel == 0) continue;  // the reference never compresses 0-D and 1-D tensors
    const int64_t rows = t.shape[0];
    const int64_t cols = t.numel / rows;
    if (!should_compress(rows, cols, rank, config.min_compression_rate)) continue;
    t.compressed = true;
    auto key = std::make_pair(rows, cols);
    auto found = group_of_shape.find(key);
    if (config.batch_same_shape && found != group_of_shape.end()) {
      t.group = found->second;
    } else {
      t.group = static_cast<int>(plan.groups.size());
      Group g;
      g.rows = rows;
      g.cols = cols;
      g.rank = std::min({rows, cols, static_cast<int64_t>(rank)});
      plan.groups.push_back(g);
      members.emplace_back();
      group_of_shape[key] = t.group;
    }
    members[static_cast<size_t>(t.group)].push_back(static_cast<int>(i));
  }
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    Group& g = plan.groups[gi];
    g.count = static_cast<int64_t>(members[gi].size());
    g.work_offset = plan.compressed_numel;
    g.p_offset = plan.p_numel;
    g.q_offset = plan.q_numel;
    for (int64_t k = 0; k < g.count; ++k) {
      TensorPlan& t = plan.tensors[static_cast<size_t>(members[gi][static_cast<size_t>(k)])];
      t.work_offset = g.work_offset + k * g.rows * g.cols;
      t.p_offset = g.p_offset + k * g.rows * g.rank;
      t.q_offset = g.q_offset + k * g.cols * g.rank;
    }
    plan.compressed_numel += g.count * g.rows * g.cols;
    plan.p_numel += g.count * g.rows * g.rank;
    plan.q_numel += g.count * g.cols * g.rank;
  }
  for (auto& t : plan.tensors) {
    if (t.compressed) continue;
    t.work_offset = plan.compressed_numel + plan.packed_numel;
    plan.packed_numel += t.numel;
  }
  return plan;
}

}  // namespace powersgd::engine
