#include "engine/half.hpp"

#include <bit>

#include "common/check.hpp"

namespace powersgd::engine {

uint16_t to_bfloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  // A NaN's payload may lie in the low half only: set the quiet bit so truncation keeps it a NaN.
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Round to nearest even on the 16 dropped bits; a carry into the exponent is the correct rounding (up to Inf).
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

float from_bfloat16(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t to_float16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x03FFu));  // quiet NaN
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 (and Inf): Inf
  if (abs >= 0x38800000u) {
    // Normal binary16 (>= 2^-14): rebias the exponent (127 -> 15), round the 13 dropped bits to nearest even;
    // a carry out of the fraction moves to the next binade, correctly.
    const uint32_t rebased = abs - (112u << 23);
    return static_cast<uint16_t>(sign | ((rebased + 0x0FFFu + ((rebased >> 13) & 1u)) >> 13));
  }
  if (abs < 0x33000000u) return sign;  // below 2^-25 (half the smallest denormal, 2^-24): rounds to zero
  // Denormal: the value in units of 2^-24 is mantissa (with its implicit bit) >> shift, rounded to nearest even.
  const uint32_t mantissa = (abs & 0x007FFFFFu) | 0x00800000u;
  const uint32_t shift = 126u - (abs >> 23);  // 14 .. 24 for exponents 2^-15 .. 2^-25
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  uint32_t result = mantissa >> shift;
  if (rest > half || (rest == half && (result & 1u) != 0)) ++result;  // may carry into the smallest normal: correct
  return static_cast<uint16_t>(sign | result);
}

float from_float16(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t fraction = bits & 0x03FFu;
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (fraction << 13));  // Inf, NaN
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (fraction << 13));
  // Zero or denormal: fraction * 2^-24, exact in float32.
  const float magnitude = static_cast<float>(fraction) * 0x1p-24f;
  return sign != 0 ? -magnitude : magnitude;
}

DataType wire_type(WireDType type) {
  return type == WireDType::BFloat16 ? DataType::BFloat16 : DataType::Float16;
}

void encode(WireDType type, const float* in, uint16_t* out, size_t n) {
  PSGD_ASSERT(type != WireDType::Float32, "encode: float32 is not a 16-bit wire type");
  if (type == WireDType::BFloat16)
    for (size_t i = 0; i < n; ++i) out[i] = to_bfloat16(in[i]);
  else
    for (size_t i = 0; i < n; ++i) out[i] = to_float16(in[i]);
}

void decode(WireDType type, const uint16_t* in, float* out, size_t n) {
  PSGD_ASSERT(type != WireDType::Float32, "decode: float32 is not a 16-bit wire type");
  if (type == WireDType::BFloat16)
    for (size_t i = 0; i < n; ++i) out[i] = from_bfloat16(in[i]);
  else
    for (size_t i = 0; i < n; ++i) out[i] = from_float16(in[i]);
}

}  // namespace powersgd::engine
