// Kernels of the CUDA backend. Grid-stride loops so one launch shape serves any
// size; reductions accumulate in double, per warp by shuffles, then one atomic
// per warp.
#include <cstdint>

#include "compute/backend.hpp"
#include "compute/cuda/check.hpp"
#include "compute/degenerate.hpp"
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

constexpr int kWarps = kThreads / 32;

// The warps' sums slots[w * stride] (w < blockDim.x / 32) added in warp order: the same bits on every run.
__device__ double in_warp_order(const double* slots, int64_t stride) {
  double total = 0.0;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) total += slots[w * stride];
  return total;
}

// The sum of every thread's `own` over the block (at most kThreads threads), returned to every thread: each
// warp's sum (a fixed shuffle tree) in a slot of its own, the slots added in warp order, so the same bits on
// every run (an atomicAdd per warp added them in the order the warps finished: replicas drifted apart).
// slots: kWarps doubles of shared scratch. Every thread of the block must call it.
__device__ double block_sum(double own, double* slots) {
  own = warp_sum(own);
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = own;
  __syncthreads();
  const double total = in_warp_order(slots, 1);
  __syncthreads();  // read by all before the slots are written again
  return total;
}

// Projects the columns c < `columns` other than `i` (orthonormal; those flagged are skipped) out of column
// i, `passes` times, and returns what is left of its squared norm. Element r of column c is m[r * rs + c *
// cs]; thread t owns rows t, t + blockDim, ... Every thread of the block calls it; slot: block_sum's scratch.
__device__ double project_out_others(float* m, int64_t rows, int64_t rs, int64_t cs, int64_t i, int64_t columns,
                                     const int* flags, int passes, double* slot) {
  for (int pass = 0; pass < passes; ++pass)
    for (int64_t c = 0; c < columns; ++c) {
      if (c == i || flags[c] != 0) continue;
      double dot = 0.0;
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
        dot += static_cast<double>(m[r * rs + c * cs]) * static_cast<double>(m[r * rs + i * cs]);
      const auto d = static_cast<float>(block_sum(dot, slot));
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) m[r * rs + i * cs] -= d * m[r * rs + c * cs];
    }
  double left = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const double v = m[r * rs + i * cs];
    left += v * v;
  }
  return block_sum(left, slot);
}

// The CPU backend's replace_degenerate (cpu/backend.cpp) for one block: each
// column j < k of the rows x k matrix m (element (r, c) at m[r * rs + c * cs])
// flagged in the shared flags[] becomes the first candidate that keeps more
// than the tolerance of its norm once the unflagged (orthonormal) columns are
// projected out twice, normalized. Thread t owns rows t, t + blockDim, ...
__device__ void replace_degenerate(float* m, int64_t rows, int64_t k, int64_t rs, int64_t cs, int* flags,
                                   double* slot, uint64_t seed, int64_t item) {
  const int64_t attempts = degenerate::kDraws + rows;
  for (int64_t j = 0; j < k; ++j) {
    if (flags[j] == 0) continue;
    bool found = false;
    for (int64_t attempt = 0; attempt < attempts && !found; ++attempt) {
      double own = 0.0;
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        const float v = degenerate::candidate(seed, item, j, attempt, r);
        m[r * rs + j * cs] = v;
        own += static_cast<double>(v) * v;
      }
      own = block_sum(own, slot);
      const double left = project_out_others(m, rows, rs, cs, j, k, flags, 2, slot);
      found = own > 0.0 && !degenerate::is_degenerate(left, own);
      if (found) {
        const double norm = sqrt(left);
        for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
          m[r * rs + j * cs] = static_cast<float>(m[r * rs + j * cs] / norm);
      }
    }
    if (!found)  // unreachable: some e_l keeps >= 1/rows of its norm
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) m[r * rs + j * cs] = 0.0f;
    __syncthreads();  // every thread has read flags[j] before it changes
    if (threadIdx.x == 0) flags[j] = 0;
    __syncthreads();
  }
}

// One block per matrix. Thread t owns rows t, t + blockDim, ...; it both
// normalizes and updates those rows, so only the block-wide sums need barriers.
// A degenerate column becomes 0 (it removes nothing from the later ones) and is
// replaced at the end; columns after the first `rows` become 0.
__global__ void gram_schmidt_kernel(float* matrices, int64_t rows, int64_t cols, int64_t stride, float epsilon,
                                    uint64_t seed) {
  __shared__ double sums[kMaxOrthoCols];  // one slot per column
  __shared__ double own[kMaxOrthoCols];   // the input's squared column norms
  __shared__ int flags[kMaxOrthoCols];
  __shared__ double slot[kWarps];
  __shared__ double partial[kWarps][kMaxOrthoCols];  // each warp's sums, added in warp order (block_sum)
  float* m = matrices + blockIdx.x * stride;
  const int64_t k = rows < cols ? rows : cols;
  for (int64_t i = 0; i < k; ++i) {
    double part = 0.0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const double v = m[r * cols + i];
      part += v * v;
    }
    part = block_sum(part, slot);
    if (threadIdx.x == 0) {
      own[i] = part;
      flags[i] = 0;
    }
  }
  for (int64_t i = 0; i < cols; ++i) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sums[j] = 0.0;
    __syncthreads();
    double norm2 = 0.0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const double v = m[r * cols + i];
      norm2 += v * v;
    }
    norm2 = warp_sum(norm2);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32][i] = norm2;
    __syncthreads();
    if (threadIdx.x == 0) sums[i] += in_warp_order(&partial[0][i], kMaxOrthoCols);
    __syncthreads();
    // The CPU backend's second projection (degenerate.hpp): sums[i] and own[i] are the same on every thread.
    if (epsilon == 0.0f && i < k && degenerate::needs_second_projection(sums[i], own[i])) {
      const double again = project_out_others(m, rows, cols, 1, i, i, flags, 1, slot);
      if (threadIdx.x == 0) sums[i] = again;
      __syncthreads();
    }
    if (i >= k || degenerate::is_degenerate(sums[i], own[i])) {
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) m[r * cols + i] = 0.0f;
      if (threadIdx.x == 0 && i < k) flags[i] = 1;
      __syncthreads();  // sums[i] read by all before the next column clears it
      continue;
    }
    const float denom = static_cast<float>(sqrt(sums[i])) + epsilon;
    const bool narrow = degenerate::normal_float(denom);  // else in double, as the CPU backend
    const double wide = sqrt(sums[i]) + static_cast<double>(epsilon);
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      float& q = m[r * cols + i];
      q = narrow ? q / denom : static_cast<float>(static_cast<double>(q) / wide);
    }
    if (i + 1 == cols) break;
    for (int64_t j = i + 1; j < cols; ++j) {
      double dot = 0.0;
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
        dot += static_cast<double>(m[r * cols + i]) * static_cast<double>(m[r * cols + j]);
      dot = warp_sum(dot);
      if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32][j] = dot;
    }
    __syncthreads();
    for (int64_t j = i + 1 + threadIdx.x; j < cols; j += blockDim.x)
      sums[j] += in_warp_order(&partial[0][j], kMaxOrthoCols);
    __syncthreads();
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const float q = m[r * cols + i];
      for (int64_t j = i + 1; j < cols; ++j) m[r * cols + j] -= static_cast<float>(sums[j]) * q;
    }
    __syncthreads();  // sums[] is cleared for the next column
  }
  __syncthreads();
  replace_degenerate(m, rows, k, cols, 1, flags, slot, seed, blockIdx.x);
}

// After geqrf: flags[j] = whether column j of the column-major R (upper
// triangle of r, leading dimension ld) is degenerate: |R_jj| small next to
// ||R e_j||, the input column's norm. One thread per column.
__global__ void flag_degenerate_kernel(const float* r, int64_t ld, int64_t k, int* flags) {
  const int64_t j = threadIdx.x;
  if (j >= k) return;
  double own = 0.0;
  for (int64_t i = 0; i <= j; ++i) {
    const double v = r[j * ld + i];
    own += v * v;
  }
  const double rjj = r[j * ld + j];
  flags[j] = degenerate::is_degenerate(rjj * rjj, own) ? 1 : 0;
}

// After orgqr, when a column was flagged: the CPU backend's rebuild_basis
// (cpu/backend.cpp) for one block. Q's flagged column (a reflector's image of
// e_j) may carry data the later columns need, so q (column-major, rows x k) is
// rebuilt from the row-major input (rows x cols) by Gram-Schmidt, each column
// projected out twice, the degenerate ones replaced at the end.
__global__ void rebuild_basis_kernel(const float* input, int64_t rows, int64_t cols, float* q, int64_t k,
                                     const int* flags, uint64_t seed, int64_t item) {
  __shared__ int shared_flags[kMaxOrthoCols];
  __shared__ int any;
  __shared__ double slot[kWarps];
  if (threadIdx.x == 0) {
    any = 0;
    for (int64_t j = 0; j < k; ++j) any |= flags[j];
  }
  __syncthreads();
  if (any == 0) return;  // the same branch for every thread of the block
  for (int64_t i = 0; i < k; ++i) {
    double own = 0.0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const float v = input[r * cols + i];
      q[i * rows + r] = v;
      own += static_cast<double>(v) * v;
    }
    own = block_sum(own, slot);
    const double left = project_out_others(q, rows, 1, rows, i, i, shared_flags, 2, slot);
    const bool flagged = degenerate::is_degenerate(left, own);
    const double norm = sqrt(left);
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
      q[i * rows + r] = flagged ? 0.0f : static_cast<float>(q[i * rows + r] / norm);
    if (threadIdx.x == 0) shared_flags[i] = flagged ? 1 : 0;
    __syncthreads();
  }
  replace_degenerate(q, rows, k, 1, rows, shared_flags, slot, seed, item);
}

constexpr int kTile = 32;

__global__ void transpose_kernel(float* dst, const float* src, int64_t rows, int64_t cols, bool rows_on_x) {
  __shared__ float tile[kTile][kTile + 1];  // +1: no shared-memory bank conflicts on the transposed read
  // The longer side's tiles on grid.x (up to 2^31 - 1), the other's on grid.y (up to 65535): a tall matrix
  // and its transpose (wide) both launch.
  const int64_t tile_row = rows_on_x ? blockIdx.x : blockIdx.y;
  const int64_t tile_col = rows_on_x ? blockIdx.y : blockIdx.x;
  const int64_t row = tile_row * kTile + threadIdx.y;
  const int64_t col = tile_col * kTile + threadIdx.x;
  if (row < rows && col < cols) tile[threadIdx.y][threadIdx.x] = src[row * cols + col];
  __syncthreads();
  const int64_t out_row = tile_col * kTile + threadIdx.y;  // a column of src
  const int64_t out_col = tile_row * kTile + threadIdx.x;  // a row of src
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
                         uint64_t seed, cudaStream_t stream) {
  if (rows == 0 || cols == 0 || batch == 0) return;
  gram_schmidt_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(m, rows, cols, stride, epsilon, seed);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_flag_degenerate(const float* r, int64_t ld, int64_t k, int* flags, cudaStream_t stream) {
  if (k == 0) return;
  flag_degenerate_kernel<<<1, static_cast<unsigned>(kMaxOrthoCols), 0, stream>>>(r, ld, k, flags);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_rebuild_if_degenerate(const float* input, int64_t rows, int64_t cols, float* q, int64_t k,
                                  const int* flags, uint64_t seed, int64_t item, cudaStream_t stream) {
  if (rows == 0 || k == 0) return;
  rebuild_basis_kernel<<<1, kThreads, 0, stream>>>(input, rows, cols, q, k, flags, seed, item);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

void launch_transpose(float* dst, const float* src, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const bool rows_on_x = row_tiles >= col_tiles;
  const int64_t x_tiles = rows_on_x ? row_tiles : col_tiles, y_tiles = rows_on_x ? col_tiles : row_tiles;
  // The shorter side is a factor's rank (at most kMaxOrthoCols): y_tiles is at most 2, far below grid.y's 65535.
  const dim3 grid(static_cast<unsigned>(x_tiles), static_cast<unsigned>(y_tiles));
  transpose_kernel<<<grid, dim3(kTile, kTile), 0, stream>>>(dst, src, rows, cols, rows_on_x);
  PSGD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace powersgd::compute::cuda
