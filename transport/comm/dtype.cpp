#include "comm/dtype.hpp"

#include <gloo/types.h>

#include <bit>
#include <cmath>

#include "common/check.hpp"
#include "powersgd/comm.hpp"

namespace powersgd {

size_t size_of(DataType type) {
  switch (type) {
    case DataType::Float32:
      return 4;
    case DataType::Float64:
      return 8;
    case DataType::Float16:
    case DataType::BFloat16:
      return 2;
  }
  PSGD_THROW(InvalidArgumentError, "unknown DataType ", static_cast<int>(type));
}

const char* to_string(DataType type) {
  switch (type) {
    case DataType::Float32:
      return "float32";
    case DataType::Float64:
      return "float64";
    case DataType::Float16:
      return "float16";
    case DataType::BFloat16:
      return "bfloat16";
  }
  return "unknown";
}

}  // namespace powersgd

namespace powersgd::transport {

float bfloat16_to_float(uint16_t value) { return std::bit_cast<float>(static_cast<uint32_t>(value) << 16); }

uint16_t float_to_bfloat16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // stay a (quiet) NaN
  uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

namespace {

float float16_to_float(uint16_t bits) {
  gloo::float16 h;
  h.x = bits;
  return gloo::cpu_half2float(h);
}

uint16_t float_to_float16(float value) { return gloo::cpu_float2half_rn(value).x; }

// A 16-bit type stored as uint16_t: the float sum of the two, rounded to the type. That is the correctly rounded
// sum: float's 24 bits are at least 2 x 11 + 2 (float16) and 2 x 8 + 2 (bfloat16), so rounding the exact sum
// first to float then to the type rounds as once (Figueroa).
template <float (*to_float)(uint16_t), uint16_t (*from_float)(float)>
void sum_16(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<uint16_t*>(c);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = from_float(to_float(x[i]) + to_float(y[i]));
}

template <typename T>
void sum_of(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

}  // namespace

void bfloat16_sum(void* c, const void* a, const void* b, size_t n) {
  sum_16<bfloat16_to_float, float_to_bfloat16>(c, a, b, n);
}
void bfloat16_sum_inplace(uint16_t* x, const uint16_t* y, size_t n) { bfloat16_sum(x, x, y, n); }

void float16_sum(void* c, const void* a, const void* b, size_t n) {
  sum_16<float16_to_float, float_to_float16>(c, a, b, n);
}
void float16_sum_inplace(uint16_t* x, const uint16_t* y, size_t n) { float16_sum(x, x, y, n); }

void float_sum(void* c, const void* a, const void* b, size_t n) { sum_of<float>(c, a, b, n); }
void double_sum(void* c, const void* a, const void* b, size_t n) { sum_of<double>(c, a, b, n); }

}  // namespace powersgd::transport
