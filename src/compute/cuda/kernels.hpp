// Launchers for the CUDA backend's kernels (kernels.cu). Every launcher enqueues
// on `stream`, returns without waiting, and checks the launch itself.
// Pointers are device memory. Private to compute/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace powersgd::compute::cuda {

void launch_fill(float* x, float value, size_t count, cudaStream_t stream);
void launch_add(float* y, const float* x, size_t count, cudaStream_t stream);
void launch_scale(float* x, float alpha, size_t count, cudaStream_t stream);
void launch_subtract(float* out, const float* a, const float* b, size_t count, cudaStream_t stream);

// *result += sum of x^2, accumulated in double (result is device memory, cleared by the caller).
void launch_squared_norm(const float* x, size_t count, double* result, cudaStream_t stream);
// Sets *flag to 1 when x holds a NaN or Inf (flag is device memory, cleared by the caller).
void launch_find_nonfinite(const float* x, size_t count, int* flag, cudaStream_t stream);

// For each k in [0, m) x [0, n) of every batch item: c = beta * c (beta == 0 writes 0).
void launch_scale_matrix(float* c, int64_t m, int64_t n, int64_t ldc, int64_t stride_c, int64_t batch, float beta,
                         cudaStream_t stream);

// Reference Gram-Schmidt (backend.hpp) on each rows x cols row-major matrix of the batch, one block per matrix,
// degenerate columns replaced (batch item b: the candidates of item b).
void launch_gram_schmidt(float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride, float epsilon,
                         uint64_t seed, cudaStream_t stream);

// Around cuSOLVER's QR (column-major, k = min(rows, cols) <= kMaxOrthoCols):
// after geqrf, flags[j] (device) = whether column j is degenerate, from R (the
// upper triangle of r, leading dimension ld); after orgqr, when any is, Q
// (rows x k, leading dimension rows) rebuilt from the row-major input (rows x
// cols) as Backend::orthogonalize says, by one block.
void launch_flag_degenerate(const float* r, int64_t ld, int64_t k, int* flags, cudaStream_t stream);
void launch_rebuild_if_degenerate(const float* input, int64_t rows, int64_t cols, float* q, int64_t k,
                                  const int* flags, uint64_t seed, int64_t item, cudaStream_t stream);

// dst (cols x rows, row-major) = transpose of src (rows x cols, row-major): the
// row-major <-> column-major conversion around cuSOLVER.
void launch_transpose(float* dst, const float* src, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace powersgd::compute::cuda
