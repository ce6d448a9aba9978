#include "engine/random.hpp"

#include <cmath>
#include <numbers>

namespace powersgd::engine {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in (0, 1]: never 0, so log() stays finite.
double uniform(uint64_t& state) { return (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53; }

}  // namespace

void standard_normal(uint64_t seed, uint64_t bucket, uint64_t draw, std::span<float> out) {
  // Mix the three inputs through the generator itself so nearby seeds give unrelated streams.
  uint64_t state = seed;
  state = splitmix64(state) ^ bucket;
  state = splitmix64(state) ^ draw;
  state = splitmix64(state);
  for (size_t i = 0; i < out.size(); i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform(state)));
    const double angle = 2.0 * std::numbers::pi * uniform(state);
    out[i] = static_cast<float>(radius * std::cos(angle));
    if (i + 1 < out.size()) out[i + 1] = static_cast<float>(radius * std::sin(angle));
  }
}

}  // namespace powersgd::engine
