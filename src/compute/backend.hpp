// The compute backend seam: everything the PowerSGD engine computes goes
// through this interface, so one engine serves CPU (OpenBLAS) and GPU (cuBLAS).
//
// Contract for every method:
// - Pointers named `device` memory belong to this backend (host memory for the
//   CPU backend, CUDA device memory for the CUDA backend). Only copy_from_host /
//   copy_to_host touch host memory on a non-host backend.
// - Calls are ordered: each call observes the effects of earlier calls made from
//   the same thread. Methods that return a value to the host (squared_norm,
//   all_finite, copy_to_host) complete all earlier work first. synchronize()
//   waits for everything issued so far.
// - A backend object is used from one thread at a time.
// - Matrices are row-major. Sizes are element counts of float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace powersgd::compute {

enum class DeviceKind { Cpu, Cuda };

enum class Transpose { No, Yes };

// How orthogonalize() works: Gram-Schmidt (the reference's choice for r <= 2)
// or Householder QR (for larger r).
enum class OrthoMethod { GramSchmidt, Qr };

// Widest matrix orthogonalize() accepts (PowerSGD ranks are small).
inline constexpr int64_t kMaxOrthoCols = 64;

class Backend;

// Owning, move-only handle to `size` floats of a backend's memory.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* backend, float* data, size_t size) : backend_(backend), data_(data), size_(size) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  float* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  void reset();

 private:
  Backend* backend_ = nullptr;
  float* data_ = nullptr;
  size_t size_ = 0;
};

// Floats allocated through Backend::allocate and not yet freed, every backend
// of the process together: a gauge of the engine's memory for tests and
// benchmarks. Any thread.
size_t allocated_floats();

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind kind() const = 0;
  virtual std::string name() const = 0;  // e.g. "cpu (OpenBLAS 0.3.21, 2 threads)"
  // True when device memory is ordinary host memory (no staging needed for I/O).
  virtual bool host_accessible() const = 0;

  // ---- memory ----
  // Zero-initialized. Throws on exhaustion (IoError naming the size).
  DeviceBuffer allocate(size_t count);
  // copy_from_host returns once host_src may be reused; copy_to_host once host_dst holds the data.
  virtual void copy_from_host(float* device_dst, const float* host_src, size_t count) = 0;
  virtual void copy_to_host(float* host_dst, const float* device_src, size_t count) = 0;
  virtual void copy(float* device_dst, const float* device_src, size_t count) = 0;
  virtual void fill(float* device_dst, float value, size_t count) = 0;

  // ---- element-wise ----
  virtual void add(float* y, const float* x, size_t count) = 0;                       // y += x
  virtual void scale(float* x, float alpha, size_t count) = 0;                        // x *= alpha
  virtual void subtract(float* out, const float* a, const float* b, size_t count) = 0;  // out = a - b
  virtual double squared_norm(const float* x, size_t count) = 0;  // sum of x^2, accumulated in double
  virtual bool all_finite(const float* x, size_t count) = 0;      // no NaN, no Inf

  // ---- dense linear algebra ----
  // Batched GEMM: for b in [0, batch):
  //   C_b = alpha * op(A_b) * op(B_b) + beta * C_b,   X_b = X + b * stride_x,
  // op(A) is m x k, op(B) is k x n, C is m x n; lda/ldb/ldc are row strides of the
  // stored (untransposed) matrices, at least their column counts (and >= 1).
  // batch == 1 ignores the strides; for batch > 1 the C items must not overlap.
  // m, n or k == 0 is allowed (k == 0 scales C by beta); beta == 0 never reads C,
  // so NaN in C is overwritten (BLAS semantics). C must not overlap A or B.
  virtual void gemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b,
                    float beta, float* c, int64_t ldc, int64_t stride_c, int64_t batch) = 0;

  // Orthonormalizes in place the columns of each rows x cols row-major matrix
  // (batch of them, `stride` floats apart; batch == 1 ignores the stride).
  // cols <= kMaxOrthoCols; epsilon finite and >= 0.
  // GramSchmidt: as the reference, column i /= (||column i|| + epsilon), then removed
  // from the later columns; with epsilon 0, a column that lost more than 3/4 of
  // its squared norm to those projections is projected out once more first
  // (degenerate.hpp). Qr: Householder QR, Q's columns written back (sign
  // convention of LAPACK). Either way the first min(rows, cols) columns come out
  // orthonormal for ANY input: a degenerate column (what is left of it after
  // projecting out the columns before it is at most 1e-4 of its own norm: a zero
  // column, a dependent one) is replaced by the first candidate vector
  // (compute/degenerate.hpp: pseudo-random ones keyed by seed, batch item and
  // column, then e_0, e_1, ...) that keeps more than 1e-4 of its norm once the
  // other columns are projected out (twice), normalized. Its direction is
  // rounding noise in the reference (NaN, or 0, for a zero column), and a factor
  // kept at 0 stops the power iteration for good (docs/engine.md). Columns
  // after the first `rows` become 0. The same input and seed give the same bits
  // on every run of a backend. Sums (norms, dot products) accumulate in double.
  virtual void orthogonalize(float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride,
                             OrthoMethod method, float epsilon, uint64_t seed) = 0;

  // ---- fused PowerSGD passes ----
  // One streaming pass over M each, where the gemm compositions named beside
  // them take two or three (docs/compute.md, Performance). M is a rows x cols
  // matrix, contiguous (row stride cols); Q is cols x rank and P rows x rank,
  // both contiguous; 0 <= rank <= kMaxOrthoCols. Sums (the returned squared
  // norms) accumulate in double, products in float as gemm does; results agree
  // with the compositions up to float rounding order. No argument may overlap
  // another, except where stated.

  // m = a - b (b == nullptr: m = a; a may equal m), then p = m * q.
  // Returns the sum of m^2. Same as subtract + gemm(No, No) + squared_norm.
  virtual double form_and_project(float* m, const float* a, const float* b, int64_t rows, int64_t cols,
                                  const float* q, int64_t rank, float* p) = 0;
  // q = m^T * p. Same as gemm(Yes, No).
  virtual void project_transposed(const float* m, int64_t rows, int64_t cols, const float* p, int64_t rank,
                                  float* q) = 0;
  // out = p * q^T, then m = out - m in place. Returns the sum of the new m^2.
  // Same as gemm(No, Yes) into out + gemm(No, Yes, beta = -1) into m + squared_norm.
  virtual double reconstruct_and_residual(float* out, float* m, int64_t rows, int64_t cols, const float* p,
                                          const float* q, int64_t rank) = 0;

  virtual void synchronize() = 0;

 protected:
  virtual float* allocate_raw(size_t count) = 0;
  virtual void deallocate_raw(float* ptr) noexcept = 0;
  friend class DeviceBuffer;
};

// ---- factories: one per backend, with a runtime availability probe ----

// Always available. `kernels` names the fused-kernel variant (one of
// cpu_kernel_variants()); empty: PSGD_CPU_KERNELS when set, else the widest.
// A variant this CPU does not run is an UnsupportedError naming the ones it does.
std::unique_ptr<Backend> make_cpu_backend(std::string_view kernels = {});
// The CPU backend's fused-kernel variants this CPU runs, widest first: "avx512",
// "avx2" (x86-64 builds, where the CPU has them), then "sse2" ("portable"
// elsewhere). reconstruct_and_residual writes the same bits with every variant
// and thread count (docs/compute.md).
std::vector<std::string> cpu_kernel_variants();
// OpenBLAS threads used by the CPU backend (runtime probe), and a way to set it.
int cpu_blas_threads();
void set_cpu_blas_threads(int threads);

// True when the CUDA module loads (compute/cuda_module.hpp) and a usable device
// exists on this host. Never throws.
bool cuda_available();
// Empty when cuda_available(); else why not: the UnsupportedError message
// (missing module, CUDA libraries or GPU; a mismatched module). Never throws
// but bad_alloc.
std::string cuda_unavailable_reason();
// Loads the CUDA module on first use; throws UnsupportedError (naming what is
// missing) when unavailable.
std::unique_ptr<Backend> make_cuda_backend(int device_index);

// Dispatches on kind.
std::unique_ptr<Backend> make_backend(DeviceKind kind, int device_index = 0);

}  // namespace powersgd::compute
