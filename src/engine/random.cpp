#include "engine/random.hpp"

#include <array>
#include <cmath>
#include <initializer_list>
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

// log and sin/cos of our own, from IEEE +, -, *, / and exact steps (frexp,
// nearbyint) in a fixed order: glibc's libm picks FMA or non-FMA code at run
// time, so its results can differ by an ulp between hosts, and a drawn Q feeds
// the output directly in alternating mode and after an adaptive level switch.
// Both agree with glibc to < 5e-16 relative; over 4e7 draws every float came
// out the same as with glibc (docs/compute.md, "Bitwise-identical updates").

// ln(u) for u in (0, 1].
double log_unit(double u) {
  int e = 0;
  double m = std::frexp(u, &e);  // u = m * 2^e, m in [0.5, 1)
  if (m < std::numbers::sqrt2 / 2) {
    m *= 2.0;
    --e;
  }
  // m in [sqrt(1/2), sqrt(2)): ln m = 2 atanh(s), |s| <= 0.1716, series to s^27 (< 1e-21 relative).
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double series = 1.0 / 27.0;
  for (int k = 25; k >= 1; k -= 2) series = series * s2 + 1.0 / k;
  // ln 2 split so that e * kLn2Hi is exact.
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  const double de = static_cast<double>(e);
  return de * kLn2Hi + (2.0 * s * series + de * kLn2Lo);
}

// cos(2 pi v) and sin(2 pi v) for v in (0, 1], reduced exactly on v (quarter turns).
void sincos_turns(double v, double& cosine, double& sine) {
  const double quadrant = std::nearbyint(v * 4.0);
  const double x = 2.0 * std::numbers::pi * (v - quadrant * 0.25);  // |x| <= pi/4
  const double x2 = x * x;
  // Taylor series to x^21 and x^22 (< 1e-22 for |x| <= pi/4), Horner from the highest term.
  constexpr int kTerms = 23;
  constexpr auto inverse_factorials = [] {
    std::array<double, kTerms> f{};
    double value = 1.0;
    for (int n = 0; n < kTerms; ++n) {
      if (n > 0) value /= n;
      f[static_cast<size_t>(n)] = value;
    }
    return f;
  }();
  auto term = [&](int n) { return (n / 2) % 2 ? -inverse_factorials[static_cast<size_t>(n)] : inverse_factorials[static_cast<size_t>(n)]; };
  double sp = 0, cp = 0;
  for (int n = kTerms - 2; n >= 1; n -= 2) sp = sp * x2 + term(n);
  for (int n = kTerms - 1; n >= 0; n -= 2) cp = cp * x2 + term(n);
  const double s = sp * x, c = cp;
  switch (static_cast<int>(quadrant) & 3) {
    case 0: cosine = c; sine = s; break;
    case 1: cosine = -s; sine = c; break;
    case 2: cosine = -c; sine = -s; break;
    default: cosine = s; sine = -c; break;
  }
}

}  // namespace

void standard_normal(uint64_t seed, uint64_t bucket, uint64_t draw, std::span<float> out) {
  // Mix the three inputs through the generator itself so nearby seeds give unrelated streams.
  uint64_t state = seed;
  state = splitmix64(state) ^ bucket;
  state = splitmix64(state) ^ draw;
  state = splitmix64(state);
  for (size_t i = 0; i < out.size(); i += 2) {
    const double radius = std::sqrt(-2.0 * log_unit(uniform(state)));  // sqrt: correctly rounded (IEEE)
    double cosine = 0, sine = 0;
    sincos_turns(uniform(state), cosine, sine);
    out[i] = static_cast<float>(radius * cosine);
    if (i + 1 < out.size()) out[i + 1] = static_cast<float>(radius * sine);
  }
}

uint64_t orthogonalization_seed(uint64_t seed, uint64_t bucket, uint64_t step, uint64_t factor, uint64_t group) {
  uint64_t state = seed;
  for (uint64_t part : {bucket, step, factor, group}) {
    state ^= part;
    state = splitmix64(state);
  }
  return state;
}

}  // namespace powersgd::engine
