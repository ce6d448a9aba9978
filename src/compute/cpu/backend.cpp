// CPU backend: cblas sgemm for gemm, our own kernels for everything else.
// What runs on the same inputs on every rank after a collective (orthogonalize,
// reconstruct_and_residual, the element-wise operations) must give the same bits
// on every rank whatever its CPU, BLAS build, kernel choice and thread count
// (docs/compute.md, "Bitwise-identical updates"). So these kernels never call
// BLAS or LAPACK, use a fixed number of vector lanes combined in a fixed order
// (never the host's vector width), no threads, and no FMA contraction (the layer
// builds with -ffp-contract=off).
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
#include "compute/cpu/kernels.hpp"
#include "compute/cpu/thread_pool.hpp"
#include "compute/degenerate.hpp"

namespace powersgd::compute {

namespace {

constexpr size_t kAlignment = 64;  // a cache line, and the widest SIMD register (AVX-512)

int to_blas_int(int64_t value, const char* what) {
  PSGD_REQUIRE(detail::fits_int32(value), InvalidArgumentError, "cpu backend: ", what, "=", value,
               " exceeds the 32-bit integer range of OpenBLAS");
  return static_cast<int>(value);
}

CBLAS_TRANSPOSE to_cblas(Transpose t) { return t == Transpose::No ? CblasNoTrans : CblasTrans; }

// Independent accumulators let the compiler vectorize reductions without
// -ffast-math (which would license reassociation everywhere).
constexpr size_t kLanes = 8;

double sum_squares(const float* x, size_t count) {
  double acc[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= count; i += kLanes)
    for (size_t l = 0; l < kLanes; ++l) acc[l] += static_cast<double>(x[i + l]) * static_cast<double>(x[i + l]);
  double sum = 0.0;
  for (; i < count; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  for (double a : acc) sum += a;
  return sum;
}

using v2d = double __attribute__((vector_size(16)));

// ---- fixed-order double kernels of the Householder QR ----
// Column-major, contiguous columns. Dot products keep 8 lane sums (element i
// in lane i mod 8) in four v2d registers, combined as ((l0 + l1) + (l2 + l3)) +
// ((l4 + l5) + (l6 + l7)), then the tail in index order: the same order on every
// host, and four independent chains hide the latency of the adds.
v2d load(const double* p) {
  v2d v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store(double* p, v2d v) { std::memcpy(p, &v, sizeof v); }

double dot(const double* x, const double* y, size_t n) {
  v2d a0 = {0.0, 0.0}, a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 += load(x + i) * load(y + i);
    a1 += load(x + i + 2) * load(y + i + 2);
    a2 += load(x + i + 4) * load(y + i + 4);
    a3 += load(x + i + 6) * load(y + i + 6);
  }
  double sum = ((a0[0] + a0[1]) + (a1[0] + a1[1])) + ((a2[0] + a2[1]) + (a3[0] + a3[1]));
  for (; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// y -= alpha * x, element by element (the same bits in the vector body and the tail).
void subtract_scaled(double* y, double alpha, const double* x, size_t n) {
  const v2d a = {alpha, alpha};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    store(y + i, load(y + i) - a * load(x + i));
    store(y + i + 2, load(y + i + 2) - a * load(x + i + 2));
  }
  for (; i < n; ++i) y[i] -= alpha * x[i];
}

// y = H y for H = I - tau v v^T, v = (1, v_rest): n elements of y, n - 1 of v_rest.
void apply_reflector(double* y, const double* v_rest, double tau, size_t n) {
  const double w = tau * (y[0] + dot(v_rest, y + 1, n - 1));
  y[0] -= w;
  subtract_scaled(y + 1, w, v_rest, n - 1);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const cpu::Kernels& kernels) : kernels_(kernels) {}

  DeviceKind kind() const override { return DeviceKind::Cpu; }

  std::string name() const override {
    const char* config = openblas_get_config();
    return powersgd::detail::concat("cpu (", config != nullptr ? config : "OpenBLAS", ", ", cpu_blas_threads(),
                                    " threads, ", kernels_.name, " kernels)");
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

  double squared_norm(const float* x, size_t count) override { return sum_squares(x, count); }

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
                     float epsilon, uint64_t seed) override {
    detail::check_orthogonalize_arguments(m, rows, cols, batch, stride, epsilon);
    if (rows == 0 || cols == 0 || batch == 0) return;
    for (int64_t item = 0; item < batch; ++item) {
      float* matrix = m + item * stride;
      if (method == OrthoMethod::GramSchmidt)
        gram_schmidt(matrix, rows, cols, epsilon, seed, item);
      else
        householder_qr(matrix, rows, cols, seed, item);
    }
  }

  // The fused passes stream M row by row while Q, transposed into qt_ (rank x
  // cols) so that every use is a contiguous vector, stays in cache: M crosses
  // the memory bus once per pass, where OpenBLAS sgemm with n = rank packs
  // (copies) M first. The row kernels are the table chosen at construction
  // (kernels.hpp); matrices of kThreaded floats and more run in row blocks on
  // the pool's threads, and those of kLarge floats and more write M and the
  // output with non-temporal stores (they leave the caches before the next pass anyway).
  double form_and_project(float* m, const float* a, const float* b, int64_t rows, int64_t cols, const float* q,
                          int64_t rank, float* p) override {
    detail::check_fused_arguments("form_and_project", rows, cols, rank,
                                  {{"m", m, rows * cols}, {"a", a, rows * cols}, {"q", q, cols * rank},
                                   {"p", p, rows * rank}});
    std::fill_n(p, rows * rank, 0.0f);
    if (rows == 0 || cols == 0) return 0.0;
    transpose_q(q, cols, rank);
    const auto n = static_cast<size_t>(cols);
    const auto r = static_cast<size_t>(rank);
    const bool stream = large(rows, cols);
    return over_rows(rows, cols, [&](size_t i0, size_t i1) {
      return kernels_.form_project(m + i0 * n, a + i0 * n, b != nullptr ? b + i0 * n : nullptr, i1 - i0, n,
                                   qt_.data(), r, p + i0 * r, stream);
    });
  }

  void project_transposed(const float* m, int64_t rows, int64_t cols, const float* p, int64_t rank,
                          float* q) override {
    detail::check_fused_arguments("project_transposed", rows, cols, rank,
                                  {{"m", m, rows * cols}, {"p", p, rows * rank}, {"q", q, cols * rank}});
    if (cols == 0 || rank == 0) return;
    const auto n = static_cast<size_t>(cols);
    const auto r = static_cast<size_t>(rank);
    // Row blocks, as form_and_project and reconstruct_and_residual split the
    // same matrix: each thread reads the rows whose lines its own core's caches
    // hold from the pass before and keeps for the pass after (a column split
    // made every core fetch the other's lines, which cost reconstruct a third
    // of its bandwidth). Each thread zeroes and sums into its own qt; the
    // partial sums are added in thread order (local products: the collective
    // sums them next). A thread takes at least 4 * rank rows: with fewer, its
    // partial qt (rank x cols) and the serial sum of the partials cost more
    // than its share of M saves (a 2 x 131072 matrix at rank 4 took 370 us on
    // 2 threads, 230 on one), and the scratch stays under a quarter of M.
    const int threads = threads_for(rows, cols, rows / (4 * rank));
    const auto total = static_cast<size_t>(rows);
    qt_.resize(r * n * static_cast<size_t>(threads));
    pool_.run(threads, [&](int t) {
      const size_t i0 = total * static_cast<size_t>(t) / static_cast<size_t>(threads);
      const size_t i1 = total * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
      float* part = qt_.data() + static_cast<size_t>(t) * r * n;
      std::fill_n(part, r * n, 0.0f);
      kernels_.project_cols(part, m + i0 * n, i1 - i0, n, 0, n, p + i0 * r, r);
    });
    for (int t = 1; t < threads; ++t) {
      const float* part = qt_.data() + static_cast<size_t>(t) * r * n;
      for (size_t i = 0; i < r * n; ++i) qt_[i] += part[i];
    }
    for (size_t j = 0; j < n; ++j)
      for (size_t k = 0; k < r; ++k) q[j * r + k] = qt_[k * n + j];
  }

  double reconstruct_and_residual(float* out, float* m, int64_t rows, int64_t cols, const float* p, const float* q,
                                  int64_t rank) override {
    detail::check_fused_arguments("reconstruct_and_residual", rows, cols, rank,
                                  {{"out", out, rows * cols}, {"m", m, rows * cols}, {"p", p, rows * rank},
                                   {"q", q, cols * rank}});
    if (rows == 0 || cols == 0) return 0.0;
    transpose_q(q, cols, rank);
    const auto n = static_cast<size_t>(cols);
    const auto r = static_cast<size_t>(rank);
    const bool stream = large(rows, cols);
    return over_rows(rows, cols, [&](size_t i0, size_t i1) {
      return kernels_.reconstruct(out + i0 * n, m + i0 * n, i1 - i0, n, p + i0 * r, qt_.data(), r, stream);
    });
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
  // The reference's _orthogonalize_gram_schmidt on a column-major copy
  // (contiguous columns): column i is divided by (its norm + epsilon), then its
  // projection is removed from every later column. Sums in double, in index
  // order. A column that lost most of its norm to the projections is projected
  // out once more (degenerate.hpp). A degenerate column becomes 0 there, so it
  // removes nothing from the later ones, and is replaced at the end; columns
  // after the first `rows` become 0.
  void gram_schmidt(float* matrix, int64_t rows, int64_t cols, float epsilon, uint64_t seed, int64_t item) {
    const auto n = static_cast<size_t>(rows);
    const auto k = static_cast<size_t>(std::min(rows, cols));
    colmajor_.resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) colmajor_[static_cast<size_t>(c * rows + r)] = matrix[r * cols + c];
    own_.resize(k);
    for (size_t i = 0; i < k; ++i) own_[i] = squares(colmajor_.data() + i * n, n);
    flagged_.assign(k, 0);
    for (size_t i = 0; i < static_cast<size_t>(cols); ++i) {
      float* q = colmajor_.data() + i * n;
      double sum = i < k ? squares(q, n) : 0.0;
      if (epsilon == 0.0f && i < k && degenerate::needs_second_projection(sum, own_[i])) {
        // Flagged columns are 0: they remove nothing.
        for (size_t j = 0; j < i; ++j) remove_component(q, colmajor_.data() + j * n, n);
        sum = squares(q, n);
      }
      if (i >= k || degenerate::is_degenerate(sum, own_[i])) {
        std::fill_n(q, n, 0.0f);
        if (i < k) flagged_[i] = 1;
        continue;
      }
      const float denom = static_cast<float>(std::sqrt(sum)) + epsilon;
      if (degenerate::normal_float(denom)) {
        for (size_t r = 0; r < n; ++r) q[r] /= denom;
      } else {  // a norm beyond float's range (Inf: the column became 0) or subnormal (not unit): in double
        const double wide = std::sqrt(sum) + static_cast<double>(epsilon);
        for (size_t r = 0; r < n; ++r) q[r] = static_cast<float>(static_cast<double>(q[r]) / wide);
      }
      for (size_t j = i + 1; j < k; ++j) remove_component(colmajor_.data() + j * n, q, n);
    }
    replace_degenerate(colmajor_.data(), n, k, seed, item);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) matrix[r * cols + c] = colmajor_[static_cast<size_t>(c * rows + r)];
  }

  // x -= d * unit over n elements, d the dot product of `unit` and x summed in
  // double in index order, rounded to T: one Gram-Schmidt projection, the same
  // bits on every host.
  template <typename T>
  static void remove_component(T* x, const T* unit, size_t n) {
    double d = 0.0;
    for (size_t r = 0; r < n; ++r) d += static_cast<double>(unit[r]) * static_cast<double>(x[r]);
    const auto dt = static_cast<T>(d);
    for (size_t r = 0; r < n; ++r) x[r] -= dt * unit[r];
  }

  // Sum of squares in double, in index order.
  template <typename T>
  static double squares(const T* x, size_t n) {
    double sum = 0.0;
    for (size_t r = 0; r < n; ++r) sum += static_cast<double>(x[r]) * static_cast<double>(x[r]);
    return sum;
  }

  // Each column j of q (column-major, rows x k) flagged in flagged_, in order,
  // becomes the first candidate (degenerate.hpp) that keeps more than the
  // tolerance of its norm after the unflagged columns (orthonormal) are
  // projected out of it twice, normalized; it then counts as unflagged. Sums in
  // double, in index order: the same bits on every host for the same input.
  template <typename T>
  void replace_degenerate(T* q, size_t rows, size_t k, uint64_t seed, int64_t item) {
    const auto attempts = degenerate::kDraws + static_cast<int64_t>(rows);
    for (size_t j = 0; j < k; ++j) {
      if (flagged_[j] == 0) continue;
      T* z = q + j * rows;
      bool found = false;
      for (int64_t attempt = 0; attempt < attempts && !found; ++attempt) {
        for (size_t r = 0; r < rows; ++r)
          z[r] = degenerate::candidate(seed, item, static_cast<int64_t>(j), attempt, static_cast<int64_t>(r));
        const double own = squares(z, rows);
        for (int pass = 0; pass < 2; ++pass)
          for (size_t c = 0; c < k; ++c)
            if (c != j && flagged_[c] == 0) remove_component(z, q + c * rows, rows);
        const double left = squares(z, rows);
        found = own > 0.0 && !degenerate::is_degenerate(left, own);
        if (found) {
          const double norm = std::sqrt(left);
          for (size_t r = 0; r < rows; ++r) z[r] = static_cast<T>(static_cast<double>(z[r]) / norm);
        }
      }
      if (!found) std::fill_n(z, rows, T{0});  // unreachable: some e_l keeps >= 1/rows of its norm
      flagged_[j] = 0;
    }
  }

  // Householder QR in double, LAPACK's algorithm (sgeqr2, then sorg2r) and sign
  // convention: reflector j maps column j from the diagonal down onto
  // -sign(a_jj) * its norm * e_1; a column already 0 below the diagonal gets
  // none. Q's first k = min(rows, cols) columns replace the matrix, later
  // columns (rows < cols) become 0. Column j is degenerate (degenerate.hpp)
  // when |R_jj|, what is left of it, is small next to its norm, ||R e_j||:
  // then rebuild_basis. Unblocked: the matrices are tall and at most 64
  // columns wide, and this is small next to the passes over M.
  void householder_qr(float* matrix, int64_t rows, int64_t cols, uint64_t seed, int64_t item) {
    const auto m = static_cast<size_t>(rows), n = static_cast<size_t>(cols), k = std::min(m, n);
    a_.resize(m * n);
    for (size_t r = 0; r < m; ++r)
      for (size_t c = 0; c < n; ++c) a_[c * m + r] = matrix[r * n + c];
    tau_.assign(k, 0.0);
    for (size_t j = 0; j < k; ++j) {
      double* x = a_.data() + j * m + j;  // alpha = x[0], then the tail
      const size_t len = m - j;
      const double tail2 = dot(x + 1, x + 1, len - 1);
      if (tail2 == 0.0) continue;  // H_j = I: tau_j = 0
      const double alpha = x[0];
      const double beta = -std::copysign(std::sqrt(alpha * alpha + tail2), alpha);
      tau_[j] = (beta - alpha) / beta;
      const double inv = 1.0 / (alpha - beta);
      for (size_t i = 1; i < len; ++i) x[i] *= inv;  // v = (1, tail / (alpha - beta))
      x[0] = beta;
      for (size_t c = j + 1; c < n; ++c) apply_reflector(a_.data() + c * m + j, x + 1, tau_[j], len);
    }
    bool any = false;
    for (size_t j = 0; j < k; ++j) {
      const double rjj = a_[j * m + j];
      any = any || degenerate::is_degenerate(rjj * rjj, squares(a_.data() + j * m, j + 1));
    }
    if (any) {
      rebuild_basis(matrix, m, n, k, seed, item);
    } else {
      // Q = H_0 ... H_{k-1} applied to the first k columns of I, right to left:
      // H_j changes only rows and columns >= j.
      q_.assign(m * k, 0.0);
      for (size_t c = 0; c < k; ++c) q_[c * m + c] = 1.0;
      for (size_t j = k; j-- > 0;) {
        if (tau_[j] == 0.0) continue;
        for (size_t c = j; c < k; ++c)
          apply_reflector(q_.data() + c * m + j, a_.data() + j * m + j + 1, tau_[j], m - j);
      }
    }
    for (size_t r = 0; r < m; ++r)
      for (size_t c = 0; c < n; ++c) matrix[r * n + c] = c < k ? static_cast<float>(q_[c * m + r]) : 0.0f;
  }

  // QR's basis when a column is degenerate. Q's column j is then a reflector's
  // image of e_j that the later columns may still need (R_jl != 0), so it
  // cannot simply be replaced: instead q_ (rows x k, column-major) is rebuilt
  // from the row-major input by Gram-Schmidt in double, every column projected
  // out twice ("twice is enough": orthonormal to rounding whatever the
  // conditioning), the degenerate ones left out and replaced at the end.
  void rebuild_basis(const float* matrix, size_t m, size_t n, size_t k, uint64_t seed, int64_t item) {
    q_.assign(m * k, 0.0);
    flagged_.assign(k, 0);
    for (size_t i = 0; i < k; ++i) {
      double* v = q_.data() + i * m;
      for (size_t r = 0; r < m; ++r) v[r] = matrix[r * n + i];
      const double own = dot(v, v, m);
      for (int pass = 0; pass < 2; ++pass)
        for (size_t c = 0; c < i; ++c)
          if (flagged_[c] == 0) subtract_scaled(v, dot(q_.data() + c * m, v, m), q_.data() + c * m, m);
      const double left = dot(v, v, m);
      if (degenerate::is_degenerate(left, own)) {
        std::fill_n(v, m, 0.0);
        flagged_[i] = 1;
      } else {
        const double norm = std::sqrt(left);
        for (size_t r = 0; r < m; ++r) v[r] /= norm;
      }
    }
    replace_degenerate(q_.data(), m, k, seed, item);
  }

  // Matrices of at least kLarge floats (1 MiB) are written with non-temporal
  // stores: smaller ones may stay in cache between passes. Matrices of at
  // least kThreaded floats (256 KiB, some tens of microseconds a pass) are
  // split over threads: below that a hand-off (about a microsecond while the
  // pool spins, tens when it sleeps) costs more than the split saves.
  static constexpr int64_t kLarge = int64_t{1} << 18;
  static constexpr int64_t kThreaded = int64_t{1} << 16;
  static bool large(int64_t rows, int64_t cols) { return rows * cols >= kLarge; }

  // Threads for a matrix that splits into `blocks` units: the backend's thread
  // count (cpu_blas_threads()) from kThreaded floats on, at most one per unit.
  int threads_for(int64_t rows, int64_t cols, int64_t blocks) const {
    if (rows * cols < kThreaded) return 1;
    return static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(cpu_blas_threads(), kMaxThreads), 1,
                                                std::max<int64_t>(blocks, 1)));
  }

  // Runs rows(i0, i1) over contiguous row blocks, one per thread, and returns the
  // sum of their results in block order (the squared norms: local statistics).
  template <typename Rows>
  double over_rows(int64_t rows, int64_t cols, Rows&& body) {
    const int threads = threads_for(rows, cols, rows);
    double sums[kMaxThreads] = {};
    const auto total = static_cast<size_t>(rows);
    pool_.run(threads, [&](int t) {
      const size_t i0 = total * static_cast<size_t>(t) / static_cast<size_t>(threads);
      const size_t i1 = total * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
      sums[t] = body(i0, i1);
      kernels_.store_fence();  // non-temporal stores visible before the caller (or another pass) reads them
    });
    double sum = 0.0;
    for (int t = 0; t < threads; ++t) sum += sums[t];
    return sum;
  }

  // qt_ = q^T: rank rows of cols floats.
  void transpose_q(const float* q, int64_t cols, int64_t rank) {
    const auto n = static_cast<size_t>(cols);
    const auto r = static_cast<size_t>(rank);
    qt_.resize(r * n);
    for (size_t j = 0; j < n; ++j)
      for (size_t k = 0; k < r; ++k) qt_[k * n + j] = q[j * r + k];
  }

  static constexpr int kMaxThreads = 16;
  static_assert(kMaxThreads <= cpu::ThreadPool::kMaxCount);
  const cpu::Kernels& kernels_;
  cpu::ThreadPool pool_;
  // Scratch reused across calls (a backend is used from one thread at a time).
  std::vector<float> colmajor_, qt_;
  std::vector<double> a_, q_, tau_;  // the QR's column-major copy, Q, and reflector scales
  std::vector<double> own_;          // Gram-Schmidt: the input's squared column norms
  std::vector<char> flagged_;        // the degenerate columns still to replace
};

}  // namespace

int cpu_blas_threads() { return openblas_get_num_threads(); }

void set_cpu_blas_threads(int threads) {
  PSGD_REQUIRE(threads >= 1, InvalidArgumentError, "BLAS thread count must be >= 1, got ", threads);
  openblas_set_num_threads(threads);
}

namespace {

// The kernel tables this CPU runs, widest first.
std::vector<const cpu::Kernels*> runnable_kernels() {
  std::vector<const cpu::Kernels*> tables;
#ifdef PSGD_CPU_KERNELS_X86
  if (const cpu::Kernels* k = cpu::kernels_avx512()) tables.push_back(k);
  if (const cpu::Kernels* k = cpu::kernels_avx2()) tables.push_back(k);
#endif
  tables.push_back(&cpu::kernels_baseline());
  return tables;
}

const cpu::Kernels& find_kernels(std::string_view variant, const char* source) {
  std::string names;
  for (const cpu::Kernels* k : runnable_kernels()) {
    if (variant == k->name) return *k;
    names += powersgd::detail::concat(names.empty() ? "" : ", ", k->name);
  }
  PSGD_THROW(UnsupportedError, source, "'", std::string(variant), "': not a kernel variant this CPU runs; expected one of ",
             names);
}

}  // namespace

std::vector<std::string> cpu_kernel_variants() {
  std::vector<std::string> names;
  for (const cpu::Kernels* k : runnable_kernels()) names.emplace_back(k->name);
  return names;
}

std::unique_ptr<Backend> make_cpu_backend(std::string_view kernels) {
  if (env::get("PSGD_BLAS_THREADS")) set_cpu_blas_threads(static_cast<int>(env::get_int("PSGD_BLAS_THREADS", 1, 1024)));
  if (!kernels.empty()) return std::make_unique<CpuBackend>(find_kernels(kernels, "cpu backend: kernels "));
  if (const auto chosen = env::get("PSGD_CPU_KERNELS"); chosen && !chosen->empty())
    return std::make_unique<CpuBackend>(find_kernels(*chosen, "PSGD_CPU_KERNELS="));
  return std::make_unique<CpuBackend>(*runnable_kernels().front());
}

}  // namespace powersgd::compute
