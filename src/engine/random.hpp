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

}  // namespace powersgd::engine
