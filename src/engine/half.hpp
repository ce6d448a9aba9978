// 16-bit floats for the factors on the wire (Config::wire_dtype): bfloat16 and
// IEEE binary16 stored as uint16_t, converted from float32 with round to
// nearest even. Pure functions, any thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "powersgd/comm.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::engine {

// bfloat16: float32's upper half. NaN stays a quiet NaN (sign kept), +-Inf
// stays Inf; a finite value whose rounding passes the largest bfloat16 becomes
// Inf. Denormals are kept (rounded like any other value).
uint16_t to_bfloat16(float value);
float from_bfloat16(uint16_t bits);
// binary16: 5 exponent, 10 fraction bits. |value| >= 65520 (the midpoint past
// 65504) becomes Inf; values below 2^-14 become binary16 denormals, below
// 2^-25 zero (sign kept); NaN stays a quiet NaN (sign kept).
uint16_t to_float16(float value);
float from_float16(uint16_t bits);

// The collectives' type of a 16-bit wire type (not Float32).
DataType wire_type(WireDType type);

// Bulk forms of the above for a 16-bit wire type (not Float32): n elements.
void encode(WireDType type, const float* in, uint16_t* out, size_t n);
void decode(WireDType type, const uint16_t* in, float* out, size_t n);

}  // namespace powersgd::engine
