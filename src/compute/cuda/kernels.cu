// Kernels of the CUDA backend. Grid-stride loops so one launch shape serves any
// size; reductions accumulate in double, per warp by shuffles, then one atomic
// per warp.
#include <cstdint>

#include "compute/backend.hpp"
#include "compute/cuda/check.hpp"
#include "compute/cuda/kernels.hpp"

namespace powersgd::compute::cuda {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;
// Enough blocks to fill an H200 (132 SMs x 8 resident blocks of 256 threads);
// grid-stride loops cover the rest.
constexpr size_t kMaxBlocks = 1056;

unsigned blocks_for(size_t count) {
  const size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

__device__ double warp_sum(double value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(kFullMask, value, offset);
  return value;
}

__global__ void fill_kernel(float* x, float value, size_t count) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x)
    x[i] = value;
}

__global__ void add_kernel(float* y, const float* x, size_t count) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x)
    y[i] += x[i];
}

__global__ void scale_kernel(float* x, float alpha, size_t count) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x)
    x[i] *= alpha;
}

__global__ void subtract_kernel(float* out, const float* a, const float* b, size_t count) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x)
    out[i] = a[i] - b[i];
}

__global__ void squared_norm_kernel(const float* x, size_t count, double* result) {
  double sum = 0.0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    const double v = x[i];
    sum += v * v;
  }
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) atomicAdd(result, sum);
}

__global__ void find_nonfinite_kernel(const float* x, size_t count, int* flag) {
  bool bad = false;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x)
    bad |= !isfinite(x[i]);
  // Every writer stores the same value, so plain stores suffice.
  if (bad) *flag = 1;
}

__global__ void scale_matrix_kernel(float* c, int64_t m, int64_t n, int64_t ldc, int64_t stride_c, int64_t batch,
                                    float beta) {
  const size_t count = static_cast<size_t>(m) * static_cast<size_t>(n);
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    float* item = c + b * stride_c;
    for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
      float& value = item[static_cast<int64_t>(i) / n * ldc + static_cast<int64_t>(i) % n];
      value = beta == 0.0f ? 0.0f : beta * value;
    }
  }
}

// One block per matrix. Thread t owns rows t, t + blockDim, ...; it both
// normalizes and updates those rows, so only the block-wide sums need barriers.
__global__ void gram_schmidt_kernel(float* matrices, int64_t rows, int64_t cols, int64_t stride, float epsilon) {
  __shared__ double sums[kMaxOrthoCols];  // one slot per column
  float* m = matrices + blockIdx.x * stride;
  for (int64_t i = 0; i < cols; ++i) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sums[j] = 0.0;
    __syncthreads();
    double own = 0.0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const double v = m[r * cols + i];
      own += v * v;
    }
    own = warp_sum(own);
    if (threadIdx.x % 32 == 0) atomicAdd(&sums[i], own);
    __syncthreads();
    const float denom = static_cast<float>(sqrt(sums[i])) + epsilon;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      float& q = m[r * cols + i];
      q = denom == 0.0f ? 0.0f : q / denom;
    }
    if (i + 1 == cols) break;
    for (int64_t j = i + 1; j < cols; ++j) {
      double dot = 0.0;
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
        dot += static_cast<double>(m[r * cols + i]) * static_cast<double>(m[r * cols + j]);
      dot = warp_sum(dot);
      if (threadIdx.x % 32 == 0) atomicAdd(&sums[j], dot);
    }
    __syncthreads();
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const float q = m[r * cols + i];
      for (int64_t j = i + 1; j < cols; ++j) m[r * cols + j] -= static_cast<float>(sums[j]) * q;
    }
    __syncthreads();  // sums[] is cleared for the next column
  }
}

constexpr int kTile = 32;

__global__ void transpose_kernel(float* dst, const float* src, int64_t rows, int64_t cols) {
  __shared__ float tile[kTile][kTile + 1];  // +1: no shared-memory bank conflicts on the transposed read
  // Rows on grid.x (up to 2^31 - 1 tiles): tall matrices are the common case.
  const int64_t row = blockIdx.x * int64_t{kTile} + threadIdx.y;
  const int64_t col = blockIdx.y * int64_t{kTile} + threadIdx.x;
  if (row < rows && col < cols) tile[threadIdx.y][threadIdx.x] = src[row * cols + col];
  __syncthreads();
  const int64_t out_row = blockIdx.y * int64_t{kTile} + threadIdx.y;  // a column of src
  const int64_t out_col = blockIdx.x * int64_t{kTile} + threadIdx.x;  // a row of src
  if (out_row < cols && out_col < rows) dst[out_row * rows + out_col] = tile[threadIdx.x][threadIdx.y];
}

}  // namespace

void launch_fill(float* x, float value, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  fill_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, value, count);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_add(float* y, const float* x, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  add_kernel<<<blocks_for(count), kThreads, 0, stream>>>(y, x, count);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_scale(float* x, float alpha, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  scale_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, alpha, count);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_subtract(float* out, const float* a, const float* b, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  subtract_kernel<<<blocks_for(count), kThreads, 0, stream>>>(out, a, b, count);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_squared_norm(const float* x, size_t count, double* result, cudaStream_t stream) {
  if (count == 0) return;
  squared_norm_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, count, result);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_find_nonfinite(const float* x, size_t count, int* flag, cudaStream_t stream) {
  if (count == 0) return;
  find_nonfinite_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, count, flag);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_scale_matrix(float* c, int64_t m, int64_t n, int64_t ldc, int64_t stride_c, int64_t batch, float beta,
                         cudaStream_t stream) {
  if (m == 0 || n == 0 || batch == 0) return;
  constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on grid.y; the kernel loops over the rest
  const dim3 grid(blocks_for(static_cast<size_t>(m * n)), static_cast<unsigned>(batch < kMaxGridY ? batch : kMaxGridY));
  scale_matrix_kernel<<<grid, kThreads, 0, stream>>>(c, m, n, ldc, stride_c, batch, beta);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_gram_schmidt(float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride, float epsilon,
                         cudaStream_t stream) {
  if (rows == 0 || cols == 0 || batch == 0) return;
  gram_schmidt_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(m, rows, cols, stride, epsilon);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_transpose(float* dst, const float* src, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((rows + kTile - 1) / kTile), static_cast<unsigned>((cols + kTile - 1) / kTile));
  transpose_kernel<<<grid, dim3(kTile, kTile), 0, stream>>>(dst, src, rows, cols);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace powersgd::compute::cuda
