// Backend::orthogonalize's rule for degenerate columns, one definition for the
// CPU backend and the CUDA kernels (nvcc compiles it too): when a column counts
// as degenerate, and the candidate vectors that replace it. Private to the
// compute layer.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PSGD_HOST_DEVICE __host__ __device__
#else
#define PSGD_HOST_DEVICE
#endif

namespace powersgd::compute::degenerate {

// A column is degenerate when the squared norm left after projecting out the
// columns before it is at most kTolerance^2 times its own (a zero column
// included): its direction is then float rounding noise (about 1e-7 of its
// norm), not data.
inline constexpr double kTolerance = 1e-4;
PSGD_HOST_DEVICE inline bool is_degenerate(double remaining2, double own2) {
  return remaining2 <= kTolerance * kTolerance * own2;
}

// Gram-Schmidt in float leaves a column that lost most of its norm to the
// projections with a component along the earlier columns of about 1e-7 of its
// own norm: next to a remainder of 1e-3 of it, a column 1e-4 from orthogonal,
// and the product P Q^T then no longer reproduces what P spans. Such a column
// (remaining squared norm below a quarter of its own, not degenerate) is
// projected out a second time ("twice is enough", Kahan), which leaves it
// orthogonal to rounding. Other columns take one pass: their bits do not change.
// Only with epsilon 0 (the default): with epsilon > 0 the columns divided by
// (norm + epsilon) are not unit vectors, and the reference's one pass is the contract.
inline constexpr double kSecondProjection = 0.25;
PSGD_HOST_DEVICE inline bool needs_second_projection(double remaining2, double own2) {
  return remaining2 < kSecondProjection * own2 && !is_degenerate(remaining2, own2);
}

// Whether a column's norm (+ epsilon) divides it in float: a normal float. Beyond float's range the norm is Inf
// (the column would become 0) and a subnormal one is too coarse (the column would not be unit): those columns
// are divided in double instead; every other column keeps its bits.
PSGD_HOST_DEVICE inline bool normal_float(float denom) { return denom >= 1.17549435e-38f && denom <= 3.40282347e38f; }

// Pseudo-random candidates tried before the canonical basis vectors.
inline constexpr int64_t kDraws = 4;

// splitmix64's finalizer.
PSGD_HOST_DEVICE inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Element `row` of candidate `attempt` for column `col` of batch item `item`.
// Attempts below kDraws: uniform in [-1, 1) on a 2^-23 grid (exact in float),
// from integer operations only, so every backend and host draws the same bits;
// attempt kDraws + l: the canonical vector e_l (some e_l always keeps at least
// 1/rows of its squared norm outside fewer than `rows` orthonormal columns).
PSGD_HOST_DEVICE inline float candidate(uint64_t seed, int64_t item, int64_t col, int64_t attempt, int64_t row) {
  if (attempt >= kDraws) return row == attempt - kDraws ? 1.0f : 0.0f;
  const uint64_t key = mix(seed ^ mix((static_cast<uint64_t>(item) << 16) ^ (static_cast<uint64_t>(col) << 4) ^
                                      static_cast<uint64_t>(attempt)));
  const uint64_t h = mix(key + static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ULL);
  return static_cast<float>(static_cast<int64_t>(h >> 40) - (int64_t{1} << 23)) * 0x1.0p-23f;
}

}  // namespace powersgd::compute::degenerate
