// Data types on the wire: size_of/to_string(DataType) (declared in powersgd/comm.hpp),
// bfloat16 conversions, and the element-wise sums Gloo lacks (bfloat16). Private.
#pragma once

#include <cstddef>
#include <cstdint>

namespace powersgd::transport {

// bfloat16 stored as uint16_t: c[i] = a[i] + b[i], computed in float32 and
// rounded to nearest even. Signature of Gloo's new-style reduce function.
void bfloat16_sum(void* c, const void* a, const void* b, size_t n);
// x[i] += y[i]; signature of Gloo's old-style ReductionFunction.
void bfloat16_sum_inplace(uint16_t* x, const uint16_t* y, size_t n);

float bfloat16_to_float(uint16_t value);
uint16_t float_to_bfloat16(float value);

}  // namespace powersgd::transport
