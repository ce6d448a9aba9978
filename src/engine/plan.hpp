// Bucket plan: how one bucket's flat buffer maps onto matrices, the P and Q
// buffers and the packed buffer of uncompressed tensors. Computed once per
// bucket (add_bucket) and reused every step. docs/engine.md draws the layouts.
#pragma once

#include <cstdint>
#include <vector>

#include "powersgd/reducer.hpp"

namespace powersgd::engine {

// One tensor of the bucket.
struct TensorPlan {
  Shape shape;
  int64_t numel = 0;
  int64_t offset = 0;       // in the bucket's flat buffer
  bool compressed = false;
  int group = -1;           // compressed: index into BucketPlan::groups
  int64_t work_offset = 0;  // in the work buffer (matrix for compressed; packed slot otherwise)
  int64_t p_offset = 0;     // compressed: rows * rank floats at this offset of the bucket's P
  int64_t q_offset = 0;     // compressed: cols * rank floats at this offset of the bucket's Q
};

// Compressed matrices of one shape, stored one after the other in the work
// buffer, P and Q, so one batched gemm covers them. Without same-shape batching
// every group holds one matrix.
struct Group {
  int64_t rows = 0, cols = 0, rank = 0;
  int64_t count = 0;
  int64_t work_offset = 0, p_offset = 0, q_offset = 0;
};

// The work buffer holds the compressed matrices group by group
// ([0, compressed_numel)), then the packed uncompressed tensors
// ([compressed_numel, compressed_numel + packed_numel)). With whole_bucket the
// whole bucket is one side x side matrix (zero-padded) and nothing is packed.
struct BucketPlan {
  std::vector<TensorPlan> tensors;
  std::vector<Group> groups;
  int64_t numel = 0;
  int64_t compressed_numel = 0;
  int64_t packed_numel = 0;
  int64_t p_numel = 0;
  int64_t q_numel = 0;
  bool whole = false;
  int64_t side = 0;  // whole bucket only

  // The float32 part of the bucket's range in its first collective: the packed tensors, then the finite flag
  // (its factor, P or Q, follows; 16-bit on a 16-bit wire).
  int64_t float32_part_numel() const { return packed_numel + 1; }
};

// Throws InvalidArgumentError for an empty bucket, a negative dimension or a
// bucket above 2^31 - 2 elements. `config` must be valid. The plan at `rank`
// (the compression test and the factors' width depend on it); without it, at config.rank.
BucketPlan make_plan(std::span<const Shape> shapes, const Config& config, int rank);
inline BucketPlan make_plan(std::span<const Shape> shapes, const Config& config) {
  return make_plan(shapes, config, config.rank);
}

// Calls f(key, rows, cols, rank, p_offset, q_offset) for every compressed
// matrix of the plan; `key` names the matrix the same way in every plan of the
// bucket (its tensor's index; 0 for the whole-bucket matrix).
template <typename F>
void for_each_matrix(const BucketPlan& plan, F&& f) {
  if (plan.whole) {
    const Group& g = plan.groups[0];
    f(size_t{0}, g.rows, g.cols, g.rank, int64_t{0}, int64_t{0});
    return;
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorPlan& t = plan.tensors[i];
    if (!t.compressed) continue;
    const Group& g = plan.groups[static_cast<size_t>(t.group)];
    f(i, g.rows, g.cols, g.rank, t.p_offset, t.q_offset);
  }
}

// The reference's compression test for an n x m matrix at rank r = min(n, m, rank).
bool should_compress(int64_t rows, int64_t cols, int rank, double min_compression_rate);

}  // namespace powersgd::engine
