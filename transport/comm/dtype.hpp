// Data types on the wire: size_of/to_string(DataType) (declared in powersgd/comm.hpp),
// bfloat16 conversions, and the element-wise sums of the new API's algorithms and of the legacy API's 16-bit
// types (Gloo's: one lacking, one wrong, all int-indexed). Private.
#pragma once

#include <cstddef>
#include <cstdint>

namespace powersgd::transport {

// bfloat16 stored as uint16_t: c[i] = a[i] + b[i], computed in float32 and
// rounded to nearest even. Signature of Gloo's new-style reduce function.
void bfloat16_sum(void* c, const void* a, const void* b, size_t n);
// x[i] += y[i]; signature of Gloo's old-style ReductionFunction.
void bfloat16_sum_inplace(uint16_t* x, const uint16_t* y, size_t n);
// float16 (IEEE binary16, stored as uint16_t) the same way. Not gloo::sum<gloo::float16>: its assignment skips
// the store where the sum's bits equal the old value's bits converted as an integer (2^-24 + 1 gave 2^-24).
void float16_sum(void* c, const void* a, const void* b, size_t n);
void float16_sum_inplace(uint16_t* x, const uint16_t* y, size_t n);
// float32 and float64: c[i] = a[i] + b[i] with a size_t index (gloo::sum's is an int: over 2^31 elements
// undefined).
void float_sum(void* c, const void* a, const void* b, size_t n);
void double_sum(void* c, const void* a, const void* b, size_t n);

float bfloat16_to_float(uint16_t value);
uint16_t float_to_bfloat16(float value);

}  // namespace powersgd::transport
