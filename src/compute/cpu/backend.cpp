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

// Row kernels of the fused passes. Each touches every element of its row of M
// once, in one loop, with every rank's term computed from the loaded value: the
// pass runs at the speed of the memory streams. They are written with GCC/Clang
// vector extensions because the auto-vectorizer leaves the multi-accumulator
// loops scalar. qt is Q transposed (rank rows of n floats). R > 0 fixes the rank
// at compile time (accumulators in registers); R == 0 takes it from `rank`.
using v4f = float __attribute__((vector_size(16)));
using v2d = double __attribute__((vector_size(16)));
constexpr size_t kWidth = 4;  // floats per v4f

v4f load(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}
void store(float* p, v4f v) { std::memcpy(p, &v, sizeof v); }
float horizontal_sum(v4f v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// Sum of squares of vectors, accumulated in double.
class SquareSum {
 public:
  void add(v4f x) {
    const v2d lo = __builtin_convertvector(__builtin_shufflevector(x, x, 0, 1), v2d);
    const v2d hi = __builtin_convertvector(__builtin_shufflevector(x, x, 2, 3), v2d);
    lo_ += lo * lo;
    hi_ += hi * hi;
  }
  void add(float x) { tail_ += static_cast<double>(x) * static_cast<double>(x); }
  double total() const { return (lo_[0] + lo_[1]) + (hi_[0] + hi_[1]) + tail_; }

 private:
  v2d lo_ = {0.0, 0.0}, hi_ = {0.0, 0.0};
  double tail_ = 0.0;
};

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

template <int R>
constexpr size_t max_rank() {
  return R > 0 ? static_cast<size_t>(R) : static_cast<size_t>(kMaxOrthoCols);
}

// m = a - b (b null: m = a), p[k] = <m, qt_k>; returns the sum of m^2.
template <int R>
double form_project_row(float* m, const float* a, const float* b, const float* qt, size_t n, size_t rank,
                        float* p) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  SquareSum s0, s1;  // two chains hide the latency of the double adds
  v4f acc0[max_rank<R>()], acc1[max_rank<R>()];
  for (size_t k = 0; k < r; ++k) acc0[k] = acc1[k] = v4f{0, 0, 0, 0};
  size_t j = 0;
  for (; j + 2 * kWidth <= n; j += 2 * kWidth) {
    v4f x0 = load(a + j), x1 = load(a + j + kWidth);
    if (b != nullptr) {
      x0 -= load(b + j);
      x1 -= load(b + j + kWidth);
    }
    store(m + j, x0);
    store(m + j + kWidth, x1);
    s0.add(x0);
    s1.add(x1);
    for (size_t k = 0; k < r; ++k) {
      acc0[k] += x0 * load(qt + k * n + j);
      acc1[k] += x1 * load(qt + k * n + j + kWidth);
    }
  }
  float tail[max_rank<R>()];
  for (size_t k = 0; k < r; ++k) tail[k] = 0.0f;
  for (; j < n; ++j) {
    const float x = b != nullptr ? a[j] - b[j] : a[j];
    m[j] = x;
    s0.add(x);
    for (size_t k = 0; k < r; ++k) tail[k] += x * qt[k * n + j];
  }
  for (size_t k = 0; k < r; ++k) p[k] = horizontal_sum(acc0[k] + acc1[k]) + tail[k];
  return s0.total() + s1.total();
}

// qt_k[j] += sum_i p_i[k] * m_i[j] over `Rows` consecutive rows i of M (n
// apart, `len` columns; p_i rank apart): several rows per sweep of the
// accumulators cut their loads and stores, which bound this pass otherwise.
template <int R, int Rows>
void accumulate_rows(float* qt, const float* m, const float* p, size_t n, size_t len, size_t rank) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  // Local copies: stores through qt may alias p as far as the compiler knows,
  // which would reload the coefficients in every iteration.
  float coef[Rows][max_rank<R>()];
  for (int i = 0; i < Rows; ++i)
    for (size_t k = 0; k < r; ++k) coef[i][k] = p[static_cast<size_t>(i) * r + k];
  size_t j = 0;
  for (; j + kWidth <= len; j += kWidth) {
    v4f x[Rows];
    for (int i = 0; i < Rows; ++i) x[i] = load(m + static_cast<size_t>(i) * n + j);
    for (size_t k = 0; k < r; ++k) {
      v4f t = load(qt + k * n + j);
      for (int i = 0; i < Rows; ++i) t += coef[i][k] * x[i];
      store(qt + k * n + j, t);
    }
  }
  for (; j < len; ++j)
    for (size_t k = 0; k < r; ++k)
      for (int i = 0; i < Rows; ++i) qt[k * n + j] += p[static_cast<size_t>(i) * r + k] * m[static_cast<size_t>(i) * n + j];
}

// out = sum_k p[k] qt_k, m = out - m; returns the sum of the new m^2.
template <int R>
double reconstruct_row(float* out, float* m, const float* p, const float* qt, size_t n, size_t rank) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  float coef[max_rank<R>()];  // local: stores through out and m may alias p
  for (size_t k = 0; k < r; ++k) coef[k] = p[k];
  SquareSum s0, s1;
  size_t j = 0;
  auto vector_at = [&](size_t at, SquareSum& s) {
    v4f o = {0, 0, 0, 0};
    for (size_t k = 0; k < r; ++k) o += coef[k] * load(qt + k * n + at);
    store(out + at, o);
    const v4f d = o - load(m + at);
    store(m + at, d);
    s.add(d);
  };
  for (; j + 2 * kWidth <= n; j += 2 * kWidth) {
    vector_at(j, s0);
    vector_at(j + kWidth, s1);
  }
  for (; j < n; ++j) {
    float o = 0.0f;
    for (size_t k = 0; k < r; ++k) o += p[k] * qt[k * n + j];
    out[j] = o;
    const float d = o - m[j];
    m[j] = d;
    s0.add(d);
  }
  return s0.total() + s1.total();
}

// Calls body.template operator()<R>() with R the rank for ranks 1 to 4 (the
// common PowerSGD ranks, unrolled), 0 (taken at run time) otherwise.
template <typename Body>
void with_rank(int64_t rank, Body&& body) {
  switch (rank) {
    case 1: body.template operator()<1>(); break;
    case 2: body.template operator()<2>(); break;
    case 3: body.template operator()<3>(); break;
    case 4: body.template operator()<4>(); break;
    default: body.template operator()<0>(); break;
  }
}

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
                     float epsilon) override {
    detail::check_orthogonalize_arguments(m, rows, cols, batch, stride, epsilon);
    if (rows == 0 || cols == 0 || batch == 0) return;
    for (int64_t item = 0; item < batch; ++item) {
      float* matrix = m + item * stride;
      if (method == OrthoMethod::GramSchmidt)
        gram_schmidt(matrix, rows, cols, epsilon);
      else
        householder_qr(matrix, rows, cols);
    }
  }

  // The fused passes stream M row by row while Q, transposed
  // into qt_ (rank x cols) so that every use is a contiguous vector, stays in
  // cache: M crosses the memory bus once per pass, where OpenBLAS sgemm with
  // n = rank packs (copies) M first.
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
    double sum = 0.0;
    with_rank(rank, [&]<int R>() {
      for (size_t i = 0; i < static_cast<size_t>(rows); ++i)
        sum += form_project_row<R>(m + i * n, a + i * n, b != nullptr ? b + i * n : nullptr, qt_.data(), n, r,
                                   p + i * r);
    });
    return sum;
  }

  void project_transposed(const float* m, int64_t rows, int64_t cols, const float* p, int64_t rank,
                          float* q) override {
    detail::check_fused_arguments("project_transposed", rows, cols, rank,
                                  {{"m", m, rows * cols}, {"p", p, rows * rank}, {"q", q, cols * rank}});
    if (cols == 0 || rank == 0) return;
    const auto n = static_cast<size_t>(cols);
    const auto r = static_cast<size_t>(rank);
    qt_.assign(r * n, 0.0f);
    // Column blocks keep the rank x block accumulators within L2 (256 KiB)
    // for very wide matrices; ResNet-sized ones are a single block.
    const size_t block = std::max<size_t>(kLanes, (size_t{64} << 10) / r);
    with_rank(rank, [&]<int R>() {
      for (size_t c0 = 0; c0 < n; c0 += block) {
        const size_t len = std::min(block, n - c0);
        size_t i = 0;
        for (; i + 4 <= static_cast<size_t>(rows); i += 4)
          accumulate_rows<R, 4>(qt_.data() + c0, m + i * n + c0, p + i * r, n, len, r);
        for (; i < static_cast<size_t>(rows); ++i)
          accumulate_rows<R, 1>(qt_.data() + c0, m + i * n + c0, p + i * r, n, len, r);
      }
    });
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
    double sum = 0.0;
    with_rank(rank, [&]<int R>() {
      for (size_t i = 0; i < static_cast<size_t>(rows); ++i)
        sum += reconstruct_row<R>(out + i * n, m + i * n, p + i * r, qt_.data(), n, r);
    });
    return sum;
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
  // order; an all-zero column with epsilon 0 stays 0.
  void gram_schmidt(float* matrix, int64_t rows, int64_t cols, float epsilon) {
    const auto n = static_cast<size_t>(rows);
    colmajor_.resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) colmajor_[static_cast<size_t>(c * rows + r)] = matrix[r * cols + c];
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
        double projection = 0.0;
        for (size_t r = 0; r < n; ++r) projection += static_cast<double>(q[r]) * v[r];
        const auto d = static_cast<float>(projection);
        for (size_t r = 0; r < n; ++r) v[r] -= d * q[r];
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) matrix[r * cols + c] = colmajor_[static_cast<size_t>(c * rows + r)];
  }

  // Householder QR in double, LAPACK's algorithm (sgeqr2, then sorg2r) and sign
  // convention: reflector j maps column j from the diagonal down onto
  // -sign(a_jj) * its norm * e_1; a column already 0 below the diagonal gets
  // none. Q's first k = min(rows, cols) columns replace the matrix, later
  // columns (rows < cols) become 0. Unblocked: the matrices are tall and at
  // most 64 columns wide, and this is small next to the passes over M.
  void householder_qr(float* matrix, int64_t rows, int64_t cols) {
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
    // Q = H_0 ... H_{k-1} applied to the first k columns of I, right to left:
    // H_j changes only rows and columns >= j.
    q_.assign(m * k, 0.0);
    for (size_t c = 0; c < k; ++c) q_[c * m + c] = 1.0;
    for (size_t j = k; j-- > 0;) {
      if (tau_[j] == 0.0) continue;
      for (size_t c = j; c < k; ++c) apply_reflector(q_.data() + c * m + j, a_.data() + j * m + j + 1, tau_[j], m - j);
    }
    for (size_t r = 0; r < m; ++r)
      for (size_t c = 0; c < n; ++c) matrix[r * n + c] = c < k ? static_cast<float>(q_[c * m + r]) : 0.0f;
  }

  // qt_ = q^T: rank rows of cols floats.
  void transpose_q(const float* q, int64_t cols, int64_t rank) {
    const auto n = static_cast<size_t>(cols);
    const auto r = static_cast<size_t>(rank);
    qt_.resize(r * n);
    for (size_t j = 0; j < n; ++j)
      for (size_t k = 0; k < r; ++k) qt_[k * n + j] = q[j * r + k];
  }

  // Scratch reused across calls (a backend is used from one thread at a time).
  std::vector<float> colmajor_, qt_;
  std::vector<double> a_, q_, tau_;  // the QR's column-major copy, Q, and reflector scales
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
