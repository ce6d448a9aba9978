// CPU backend: cblas sgemm, LAPACK sgeqrf/sorgqr, and plain loops the compiler
// vectorizes for the element-wise operations.
#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "compute/arguments.hpp"
#include "compute/backend.hpp"
#include "compute/cpu/lapack.hpp"

namespace powersgd::compute {

namespace {

constexpr size_t kAlignment = 64;  // a cache line, and the widest SIMD register (AVX-512)

int to_blas_int(int64_t value, const char* what) {
  PSGD_REQUIRE(detail::fits_int32(value), InvalidArgumentError, "cpu backend: ", what, "=", value,
               " exceeds the 32-bit integer range of OpenBLAS");
  return static_cast<int>(value);
}

CBLAS_TRANSPOSE to_cblas(Transpose t) { return t == Transpose::No ? CblasNoTrans : CblasTrans; }

class CpuBackend final : public Backend {
 public:
  DeviceKind kind() const override { return DeviceKind::Cpu; }

  std::string name() const override {
    const char* config = openblas_get_config();
    return powersgd::detail::concat("cpu (", config != nullptr ? config : "OpenBLAS", ", ", cpu_blas_threads(), " threads)");
  }

  bool host_accessible() const override { return true; }

  void copy_from_host(float* device_dst, const float* host_src, size_t count) override {
    copy(device_dst, host_src, count);
  }
  void copy_to_host(float* host_dst, const float* device_src, size_t count) override {
    copy(host_dst, device_src, count);
  }
  void copy(float* device_dst, const float* device_src, size_t count) override {
    if (count > 0 && device_dst != device_src) std::memmove(device_dst, device_src, count * sizeof(float));
  }
  void fill(float* device_dst, float value, size_t count) override { std::fill_n(device_dst, count, value); }

  void add(float* y, const float* x, size_t count) override {
    for (size_t i = 0; i < count; ++i) y[i] += x[i];
  }
  void scale(float* x, float alpha, size_t count) override {
    for (size_t i = 0; i < count; ++i) x[i] *= alpha;
  }
  void subtract(float* out, const float* a, const float* b, size_t count) override {
    for (size_t i = 0; i < count; ++i) out[i] = a[i] - b[i];
  }

  double squared_norm(const float* x, size_t count) override {
    // Independent accumulators let the compiler vectorize a double reduction
    // without -ffast-math (which would license reassociation everywhere).
    constexpr size_t kLanes = 8;
    double acc[kLanes] = {};
    size_t i = 0;
    for (; i + kLanes <= count; i += kLanes)
      for (size_t l = 0; l < kLanes; ++l) acc[l] += static_cast<double>(x[i + l]) * static_cast<double>(x[i + l]);
    double sum = 0.0;
    for (; i < count; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    for (double a : acc) sum += a;
    return sum;
  }

  bool all_finite(const float* x, size_t count) override {
    // A float is NaN or Inf exactly when its exponent bits are all ones; OR-ing
    // that test over a chunk vectorizes, and the chunking still stops early.
    constexpr uint32_t kExponent = 0x7f800000u;
    constexpr size_t kChunk = 4096;
    for (size_t start = 0; start < count; start += kChunk) {
      const size_t end = std::min(count, start + kChunk);
      uint32_t bad = 0;
      for (size_t i = start; i < end; ++i) bad |= static_cast<uint32_t>((std::bit_cast<uint32_t>(x[i]) & kExponent) == kExponent);
      if (bad != 0) return false;
    }
    return true;
  }

  void gemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
            int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta, float* c,
            int64_t ldc, int64_t stride_c, int64_t batch) override {
    detail::check_gemm_arguments(trans_a, trans_b, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c,
                                 batch);
    if (m == 0 || n == 0 || batch == 0) return;
    const int im = to_blas_int(m, "m"), in = to_blas_int(n, "n"), ik = to_blas_int(k, "k");
    const int ilda = to_blas_int(lda, "lda"), ildb = to_blas_int(ldb, "ldb"), ildc = to_blas_int(ldc, "ldc");
    for (int64_t item = 0; item < batch; ++item) {
      float* c_item = c + item * stride_c;
      if (k == 0) {
        // BLAS leaves C untouched when k == 0 only if beta == 1; do the scaling
        // here so beta == 0 also clears NaN, the same on every backend.
        for (int64_t row = 0; row < m; ++row) {
          float* c_row = c_item + row * ldc;
          if (beta == 0.0f)
            std::fill_n(c_row, n, 0.0f);
          else
            for (int64_t col = 0; col < n; ++col) c_row[col] *= beta;
        }
        continue;
      }
      cblas_sgemm(CblasRowMajor, to_cblas(trans_a), to_cblas(trans_b), im, in, ik, alpha, a + item * stride_a, ilda,
                  b + item * stride_b, ildb, beta, c_item, ildc);
    }
  }

  void orthogonalize(float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride, OrthoMethod method,
                     float epsilon) override {
    detail::check_orthogonalize_arguments(m, rows, cols, batch, stride, epsilon);
    if (rows == 0 || cols == 0 || batch == 0) return;
    // Both methods work on a column-major copy: contiguous columns for the
    // Gram-Schmidt sweeps, and the layout LAPACK expects.
    colmajor_.resize(static_cast<size_t>(rows * cols));
    for (int64_t item = 0; item < batch; ++item) {
      float* matrix = m + item * stride;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) colmajor_[static_cast<size_t>(c * rows + r)] = matrix[r * cols + c];
      if (method == OrthoMethod::GramSchmidt)
        gram_schmidt(rows, cols, epsilon);
      else
        householder_qr(rows, cols);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) matrix[r * cols + c] = colmajor_[static_cast<size_t>(c * rows + r)];
    }
  }

  void synchronize() override {}

 protected:
  float* allocate_raw(size_t count) override {
    PSGD_REQUIRE(count <= (SIZE_MAX - kAlignment) / sizeof(float), InvalidArgumentError,
                 "cpu backend: cannot allocate ", count, " floats (size overflows)");
    const size_t bytes = (count * sizeof(float) + kAlignment - 1) / kAlignment * kAlignment;
    void* ptr = std::aligned_alloc(kAlignment, bytes);
    PSGD_REQUIRE(ptr != nullptr, IoError, "cpu backend: out of memory allocating ", count, " floats (", bytes,
                 " bytes)");
    std::memset(ptr, 0, bytes);
    return static_cast<float*>(ptr);
  }
  void deallocate_raw(float* ptr) noexcept override { std::free(ptr); }

 private:
  // The reference's _orthogonalize_gram_schmidt on colmajor_: column i is divided
  // by (its norm + epsilon), then its projection is removed from every later
  // column. Sums in double; an all-zero column with epsilon 0 stays 0.
  void gram_schmidt(int64_t rows, int64_t cols, float epsilon) {
    const auto n = static_cast<size_t>(rows);
    for (int64_t i = 0; i < cols; ++i) {
      float* q = colmajor_.data() + static_cast<size_t>(i) * n;
      double sum = 0.0;
      for (size_t r = 0; r < n; ++r) sum += static_cast<double>(q[r]) * q[r];
      const float denom = static_cast<float>(std::sqrt(sum)) + epsilon;
      if (denom == 0.0f)
        std::fill_n(q, n, 0.0f);
      else
        for (size_t r = 0; r < n; ++r) q[r] /= denom;
      for (int64_t j = i + 1; j < cols; ++j) {
        float* v = colmajor_.data() + static_cast<size_t>(j) * n;
        double dot = 0.0;
        for (size_t r = 0; r < n; ++r) dot += static_cast<double>(q[r]) * v[r];
        const auto d = static_cast<float>(dot);
        for (size_t r = 0; r < n; ++r) v[r] -= d * q[r];
      }
    }
  }

  // Householder QR through LAPACK; Q's first min(rows, cols) columns replace the
  // matrix, later columns (rows < cols) become 0.
  void householder_qr(int64_t rows, int64_t cols) {
    const int m = static_cast<int>(rows), n = static_cast<int>(cols), k = std::min(m, n);
    to_blas_int(rows * cols, "rows * cols");
    tau_.resize(static_cast<size_t>(k));
    int info = 0;
    int lwork = -1;  // workspace query
    float query_geqrf = 0.0f, query_orgqr = 0.0f;
    sgeqrf_(&m, &n, colmajor_.data(), &m, tau_.data(), &query_geqrf, &lwork, &info);
    PSGD_ASSERT(info == 0, "sgeqrf_ workspace query failed with info=", info);
    sorgqr_(&m, &k, &k, colmajor_.data(), &m, tau_.data(), &query_orgqr, &lwork, &info);
    PSGD_ASSERT(info == 0, "sorgqr_ workspace query failed with info=", info);
    lwork = std::max({1, static_cast<int>(query_geqrf), static_cast<int>(query_orgqr)});
    work_.resize(static_cast<size_t>(lwork));
    sgeqrf_(&m, &n, colmajor_.data(), &m, tau_.data(), work_.data(), &lwork, &info);
    PSGD_ASSERT(info == 0, "sgeqrf_(m=", m, ", n=", n, ") failed with info=", info);
    sorgqr_(&m, &k, &k, colmajor_.data(), &m, tau_.data(), work_.data(), &lwork, &info);
    PSGD_ASSERT(info == 0, "sorgqr_(m=", m, ", n=", k, ") failed with info=", info);
    std::fill(colmajor_.begin() + static_cast<ptrdiff_t>(k) * m, colmajor_.end(), 0.0f);
  }

  // Scratch reused across calls (a backend is used from one thread at a time).
  std::vector<float> colmajor_, tau_, work_;
};

}  // namespace

int cpu_blas_threads() { return openblas_get_num_threads(); }

void set_cpu_blas_threads(int threads) {
  PSGD_REQUIRE(threads >= 1, InvalidArgumentError, "BLAS thread count must be >= 1, got ", threads);
  openblas_set_num_threads(threads);
}

std::unique_ptr<Backend> make_cpu_backend() {
  if (env::get("PSGD_BLAS_THREADS")) set_cpu_blas_threads(static_cast<int>(env::get_int("PSGD_BLAS_THREADS", 1, 1024)));
  return std::make_unique<CpuBackend>();
}

}  // namespace powersgd::compute
