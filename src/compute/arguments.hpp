// Argument validation shared by every backend, so all of them reject the same
// calls with the same messages (InvalidArgumentError naming the value and the
// expected range). Private to the compute layer.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "compute/backend.hpp"

namespace powersgd::compute::detail {

// Checks the sizes, leading dimensions and batch strides of Backend::gemm.
// Batch items of C must not overlap (batched GEMM may run them concurrently).
void check_gemm_arguments(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                          int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b,
                          const float* c, int64_t ldc, int64_t stride_c, int64_t batch);

// Checks the arguments of Backend::orthogonalize (cols <= kMaxOrthoCols, epsilon
// finite and >= 0, non-overlapping batch items).
void check_orthogonalize_arguments(const float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride,
                                   float epsilon);

// Checks the sizes and pointers of the fused PowerSGD passes: rows, cols >= 0,
// 0 <= rank <= kMaxOrthoCols, and each pointer non-null when its element count
// (M: rows * cols, P: rows * rank, Q: cols * rank) is not 0.
struct FusedOperand {
  const char* name;
  const float* data;
  int64_t count;
};
void check_fused_arguments(const char* what, int64_t rows, int64_t cols, int64_t rank,
                           std::initializer_list<FusedOperand> operands);

// True when every size is representable as a 32-bit BLAS integer.
bool fits_int32(int64_t value);

}  // namespace powersgd::compute::detail
