// The generator of initial Q matrices: splitmix64 and Box-Muller on the host, so
// every rank and every device sees the same bits. Not cryptographic.
#pragma once

#include <cstdint>
#include <span>

namespace powersgd::engine {

// Fills `out` with standard normal floats, a pure function of (seed, bucket,
// draw): `draw` counts the initializations of the bucket's Q so far (one without
// warm start per compressed step, else one).
void standard_normal(uint64_t seed, uint64_t bucket, uint64_t draw, std::span<float> out);

// The seed of Backend::orthogonalize's replacement vectors for one group of one
// factor (0: P, 1: Q) of a bucket in one step: a pure function of its
// arguments, so every rank replaces a degenerate column by the same vector,
// and a new step draws new ones.
uint64_t orthogonalization_seed(uint64_t seed, uint64_t bucket, uint64_t step, uint64_t factor, uint64_t group);

}  // namespace powersgd::engine
