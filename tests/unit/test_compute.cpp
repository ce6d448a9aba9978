// Conformance tests of the compute seam (src/compute/backend.hpp): every
// operation against a naive double-precision reference computed here.
//
// The same cases run on every backend: this file builds `test_compute` (CPU
// backend, suite unit) and, compiled with PSGD_TEST_COMPUTE_CUDA, the
// `test_compute_cuda` binary (tests/cuda, whose main exits 77 without a GPU).
#ifndef PSGD_TEST_COMPUTE_CUDA
#define DOCTEST_CONFIG_IMPLEMENT
#endif
#include <doctest/doctest.h>
#ifndef PSGD_TEST_COMPUTE_CUDA
#include "support/doctest_main.hpp"
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "compute/backend.hpp"
#ifndef PSGD_TEST_COMPUTE_CUDA
#include <atomic>
#include <chrono>
#include <thread>

#include "compute/cpu/thread_pool.hpp"
#endif
#include "powersgd/error.hpp"
#include "error_of.hpp"

namespace powersgd::compute {
namespace {

// ---- backends under test ----

std::unique_ptr<Backend> make_backend_under_test() {
#ifdef PSGD_TEST_COMPUTE_CUDA
  return make_cuda_backend(0);
#else
  return make_cpu_backend();
#endif
}

// Runs `body` once per backend under test, naming it in failure messages.
void for_each_backend(const std::function<void(Backend&)>& body) {
  auto backend = make_backend_under_test();
  INFO("backend: " << backend->name());
  body(*backend);
}

// The fused passes: on the CPU once per kernel variant this CPU runs (AVX-512,
// AVX2, SSE2) and per thread count (1 and 2; threads split matrices of 2^16
// floats and more), else as for_each_backend.
void for_each_fused_backend(const std::function<void(Backend&)>& body) {
#ifdef PSGD_TEST_COMPUTE_CUDA
  for_each_backend(body);
#else
  const int original = cpu_blas_threads();
  for (const std::string& variant : cpu_kernel_variants())
    for (int threads : {1, 2}) {
      set_cpu_blas_threads(threads);
      auto backend = make_cpu_backend(variant);
      INFO("backend: " << backend->name());
      body(*backend);
    }
  set_cpu_blas_threads(original);
#endif
}

// ---- host <-> backend helpers ----

DeviceBuffer upload(Backend& be, const std::vector<float>& host) {
  DeviceBuffer buf = be.allocate(host.size());
  be.copy_from_host(buf.data(), host.data(), host.size());
  return buf;
}

std::vector<float> download(Backend& be, const DeviceBuffer& buf) {
  std::vector<float> host(buf.size());
  be.copy_to_host(host.data(), buf.data(), buf.size());
  return host;
}

std::vector<float> random_vector(size_t count, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(count);
  for (auto& x : v) x = dist(gen);
  return v;
}

constexpr float kSentinel = 12345.0f;  // marks padding that no operation may touch
constexpr double kUnitRoundoff = 6.0e-8;  // float32

// ---- GEMM ----

struct GemmShape {
  Transpose ta, tb;
  int64_t m, n, k;
  int64_t pad;    // extra columns in every leading dimension
  int64_t batch;
  int64_t gap;    // extra floats between batch items
  float alpha, beta;
};

// Runs one GEMM on the backend and checks every element of C (including the
// padding, which must keep its sentinel) against a double reference.
void check_gemm(Backend& be, const GemmShape& s, uint32_t seed) {
  CAPTURE(s.m);
  CAPTURE(s.n);
  CAPTURE(s.k);
  CAPTURE(s.batch);
  CAPTURE(static_cast<int>(s.ta));
  CAPTURE(static_cast<int>(s.tb));
  const int64_t a_rows = s.ta == Transpose::No ? s.m : s.k, a_cols = s.ta == Transpose::No ? s.k : s.m;
  const int64_t b_rows = s.tb == Transpose::No ? s.k : s.n, b_cols = s.tb == Transpose::No ? s.n : s.k;
  const int64_t lda = std::max<int64_t>(1, a_cols) + s.pad, ldb = std::max<int64_t>(1, b_cols) + s.pad;
  const int64_t ldc = std::max<int64_t>(1, s.n) + s.pad;
  const int64_t stride_a = a_rows * lda + s.gap, stride_b = b_rows * ldb + s.gap, stride_c = s.m * ldc + s.gap;
  const auto batch = static_cast<size_t>(s.batch);
  std::vector<float> a = random_vector(static_cast<size_t>(stride_a) * batch, seed);
  std::vector<float> b = random_vector(static_cast<size_t>(stride_b) * batch, seed + 1);
  std::vector<float> c = random_vector(static_cast<size_t>(stride_c) * batch, seed + 2);
  // Padding of C must survive: mark everything outside the m x n items.
  for (int64_t item = 0; item < s.batch; ++item)
    for (int64_t i = 0; i < stride_c; ++i) {
      const int64_t row = i / ldc, col = i % ldc;
      if (row >= s.m || col >= s.n) c[static_cast<size_t>(item * stride_c + i)] = kSentinel;
    }
  if (s.beta == 0.0f)  // beta == 0 must not read C: NaN there must vanish
    for (int64_t item = 0; item < s.batch; ++item)
      if (s.m > 0 && s.n > 0) c[static_cast<size_t>(item * stride_c)] = std::numeric_limits<float>::quiet_NaN();

  DeviceBuffer da = upload(be, a), db = upload(be, b), dc = upload(be, c);
  be.gemm(s.ta, s.tb, s.m, s.n, s.k, s.alpha, da.data(), lda, stride_a, db.data(), ldb, stride_b, s.beta, dc.data(),
          ldc, stride_c, s.batch);
  const std::vector<float> got = download(be, dc);

  for (int64_t item = 0; item < s.batch; ++item) {
    const float* ai = a.data() + item * stride_a;
    const float* bi = b.data() + item * stride_b;
    for (int64_t i = 0; i < stride_c; ++i) {
      const auto idx = static_cast<size_t>(item * stride_c + i);
      const int64_t row = i / ldc, col = i % ldc;
      if (row >= s.m || col >= s.n) {
        REQUIRE(got[idx] == kSentinel);
        continue;
      }
      double sum = 0.0, magnitude = 0.0;
      for (int64_t l = 0; l < s.k; ++l) {
        const double av = s.ta == Transpose::No ? ai[row * lda + l] : ai[l * lda + row];
        const double bv = s.tb == Transpose::No ? bi[l * ldb + col] : bi[col * ldb + l];
        sum += av * bv;
        magnitude += std::fabs(av * bv);
      }
      const double c0 = s.beta == 0.0f ? 0.0 : c[idx];
      const double expected = s.alpha * sum + s.beta * c0;
      // Error bound of a k-term float dot product plus the beta term: the
      // worst case grows like k, the usual (blocked or pairwise) case like sqrt(k);
      // the smaller keeps long dot products tight enough to catch a wrong stride.
      const double terms = std::min(static_cast<double>(s.k), 8.0 * std::sqrt(static_cast<double>(s.k))) + 4.0;
      const double tol =
          terms * 2.0 * kUnitRoundoff * (std::fabs(s.alpha) * magnitude + std::fabs(s.beta * c0)) + 1e-30;
      if (!(std::fabs(got[idx] - expected) <= tol)) {
        CAPTURE(item);
        CAPTURE(row);
        CAPTURE(col);
        CAPTURE(got[idx]);
        CAPTURE(expected);
        CAPTURE(tol);
        REQUIRE(std::fabs(got[idx] - expected) <= tol);
      }
    }
  }
}

TEST_CASE("gemm: every transposition, padded leading dimensions, strided batches") {
  for_each_backend([](Backend& be) {
    uint32_t seed = 1;
    for (Transpose ta : {Transpose::No, Transpose::Yes})
      for (Transpose tb : {Transpose::No, Transpose::Yes}) {
        // Non-square, pairwise different sizes: any swapped dimension or
        // transposition changes the result far beyond the tolerance.
        check_gemm(be, {ta, tb, 5, 7, 3, 0, 1, 0, 1.0f, 0.0f}, seed++);
        check_gemm(be, {ta, tb, 5, 7, 3, 3, 1, 0, 1.5f, 0.5f}, seed++);
        check_gemm(be, {ta, tb, 6, 4, 9, 2, 3, 5, -0.75f, 1.0f}, seed++);
        check_gemm(be, {ta, tb, 33, 17, 65, 1, 4, 0, 1.0f, 0.0f}, seed++);
        check_gemm(be, {ta, tb, 1, 1, 1, 0, 1, 0, 2.0f, 0.0f}, seed++);
        check_gemm(be, {ta, tb, 3, 2, 1, 5, 2, 1, 1.0f, -1.0f}, seed++);
      }
  });
}

TEST_CASE("gemm: tall-skinny shapes of PowerSGD (P = M Q, Q = M^T P)") {
  for_each_backend([](Backend& be) {
    check_gemm(be, {Transpose::No, Transpose::No, 100000, 4, 4, 0, 1, 0, 1.0f, 0.0f}, 11);
    check_gemm(be, {Transpose::Yes, Transpose::No, 4, 3, 100000, 0, 1, 0, 1.0f, 0.0f}, 12);
    check_gemm(be, {Transpose::No, Transpose::No, 300, 4, 200, 0, 3, 7, 1.0f, 0.0f}, 13);
    check_gemm(be, {Transpose::Yes, Transpose::No, 200, 4, 300, 0, 3, 7, 1.0f, 0.0f}, 14);
    check_gemm(be, {Transpose::No, Transpose::Yes, 300, 200, 4, 0, 2, 0, 1.0f, 0.0f}, 15);
  });
}

TEST_CASE("gemm: empty sizes; k == 0 scales C by beta") {
  for_each_backend([](Backend& be) {
    for (float beta : {0.0f, 1.0f, 2.5f}) {
      CAPTURE(beta);
      check_gemm(be, {Transpose::No, Transpose::No, 4, 3, 0, 1, 1, 0, 1.0f, beta}, 21);
      check_gemm(be, {Transpose::Yes, Transpose::Yes, 4, 3, 0, 2, 3, 2, 1.0f, beta}, 22);
    }
    check_gemm(be, {Transpose::No, Transpose::No, 0, 3, 5, 0, 1, 0, 1.0f, 0.0f}, 23);
    check_gemm(be, {Transpose::No, Transpose::No, 3, 0, 5, 0, 2, 0, 1.0f, 0.0f}, 24);
    // batch == 0 touches nothing, even with null pointers.
    be.gemm(Transpose::No, Transpose::No, 2, 2, 2, 1.0f, nullptr, 2, 4, nullptr, 2, 4, 0.0f, nullptr, 2, 4, 0);
  });
}

TEST_CASE("gemm: rejects bad leading dimensions, sizes and overlapping batches") {
  for_each_backend([](Backend& be) {
    DeviceBuffer buf = be.allocate(256);
    float* p = buf.data();
    using T = Transpose;
    // A is stored 4 x 3 (m=4, k=3): lda must be >= 3; transposed it is 3 x 4: lda >= 4.
    CHECK_THROWS_AS(be.gemm(T::No, T::No, 4, 2, 3, 1, p, 2, 0, p, 2, 0, 0, p, 2, 0, 1), InvalidArgumentError);
    CHECK_THROWS_AS(be.gemm(T::Yes, T::No, 4, 2, 3, 1, p, 3, 0, p, 2, 0, 0, p, 2, 0, 1), InvalidArgumentError);
    CHECK_THROWS_AS(be.gemm(T::No, T::Yes, 4, 2, 3, 1, p, 3, 0, p, 2, 0, 0, p, 2, 0, 1), InvalidArgumentError);
    CHECK_THROWS_AS(be.gemm(T::No, T::No, 4, 2, 3, 1, p, 3, 0, p, 2, 0, 0, p, 1, 0, 1), InvalidArgumentError);
    CHECK_THROWS_AS(be.gemm(T::No, T::No, -1, 2, 3, 1, p, 3, 0, p, 2, 0, 0, p, 2, 0, 1), InvalidArgumentError);
    CHECK_THROWS_AS(be.gemm(T::No, T::No, 4, 2, 3, 1, p, 3, 12, p, 2, 6, 0, p, 2, 7, 2), InvalidArgumentError);
    CHECK_THROWS_AS(be.gemm(T::No, T::No, 4, 2, 3, 1, p, 3, 12, p, 2, 6, 0, p, 2, 8, -1), InvalidArgumentError);
    // The same call with a valid stride_c runs.
    be.gemm(T::No, T::No, 4, 2, 3, 1, p, 3, 12, p, 2, 6, 0, p + 100, 2, 8, 2);
  });
}

// ---- element-wise ----

// ---- fused PowerSGD passes ----

// Error bound of a float dot product of `terms` products whose absolute values
// sum to `magnitude` (the rule of check_gemm).
double dot_tolerance(int64_t terms, double magnitude) {
  const double k = static_cast<double>(terms);
  return (std::min(k, 8.0 * std::sqrt(k)) + 4.0) * 2.0 * kUnitRoundoff * magnitude + 1e-30;
}

// The reference of one fused-pass element: the sum of term(l) for l < n in
// double, and the sum of |term(l)| (the scale dot_tolerance takes).
template <typename Term>
std::pair<double, double> reference_dot(int64_t n, Term term) {
  double dot = 0.0, magnitude = 0.0;
  for (int64_t l = 0; l < n; ++l) {
    const double t = term(l);
    dot += t;
    magnitude += std::fabs(t);
  }
  return {dot, magnitude};
}

// A buffer of `count` values followed by sentinels that no operation may touch.
struct Guarded {
  std::vector<float> host;
  DeviceBuffer dev;
  size_t count;
  Guarded(Backend& be, std::vector<float> values) : count(values.size()) {
    host = std::move(values);
    host.resize(count + 8, kSentinel);
    dev = upload(be, host);
  }
  float* data() const { return dev.data(); }
  std::vector<float> read(Backend& be) const {
    std::vector<float> all = download(be, dev);
    for (size_t i = count; i < all.size(); ++i) REQUIRE(all[i] == kSentinel);
    all.resize(count);
    return all;
  }
};

struct FusedShape {
  int64_t rows, cols, rank;
};

// Covers compile-time ranks 1 to 8 and the run-time path (9, 16), row lengths
// with and without a vector tail (of 4, 8 and 16 floats), the 4- and 8-row
// blocking of project_transposed (odd row counts), 1 x n and n x 1, PowerSGD-
// sized matrices, empty sizes, matrices of 2^16 floats and more (threads; in
// project_transposed only with 4 * rank rows per thread) and of 2^18 and more
// (non-temporal stores: rows not starting on a vector boundary).
const std::vector<FusedShape> kFusedShapes = {
    {1, 1, 1},      {3, 5, 2},     {7, 13, 3},      {9, 16, 4},      {5, 9, 5},   {4, 17, 7},    {64, 147, 2},
    {33, 1000, 4},  {513, 37, 1},  {31, 600, 16},   {0, 5, 2},       {5, 0, 2},   {6, 4, 0},     {11, 23, 6},
    {17, 31, 8},    {1, 77, 2},    {77, 1, 3},      {13, 45, 9},     {520, 509, 2}, {1, 262147, 3}, {262147, 1, 1},
    {600, 441, 9},  {257, 300, 3}, {3, 40000, 2}};  // the last two: split over threads, written without streaming (the projection
                                        // of the last on one thread: 3 rows)

TEST_CASE("form_and_project: m = a - b (or a, in place too), p = m q, returns ||m||^2") {
  for_each_fused_backend([](Backend& be) {
    uint32_t seed = 500;
    for (const auto& s : kFusedShapes) {
      for (int variant = 0; variant < 3; ++variant) {  // 0: m = a - b; 1: m = a (copy); 2: m = a - b in place
        CAPTURE(s.rows);
        CAPTURE(s.cols);
        CAPTURE(s.rank);
        CAPTURE(variant);
        const auto mn = static_cast<size_t>(s.rows * s.cols);
        const std::vector<float> a = random_vector(mn, ++seed, -4.0f, 4.0f);
        const std::vector<float> b = random_vector(mn, ++seed, -4.0f, 4.0f);
        const std::vector<float> q = random_vector(static_cast<size_t>(s.cols * s.rank), ++seed);
        Guarded da(be, a), db(be, b), dm(be, std::vector<float>(mn, kSentinel)), dq(be, q),
            dp(be, std::vector<float>(static_cast<size_t>(s.rows * s.rank), kSentinel));
        float* m = variant == 2 ? da.data() : dm.data();
        const double sum =
            be.form_and_project(m, da.data(), variant == 1 ? nullptr : db.data(), s.rows, s.cols, dq.data(), s.rank, dp.data());
        const std::vector<float> got_m = variant == 2 ? da.read(be) : dm.read(be);
        const std::vector<float> got_p = dp.read(be);
        double expected_sum = 0.0;
        for (size_t i = 0; i < mn; ++i) {
          const float expected = variant == 1 ? a[i] : a[i] - b[i];
          REQUIRE(got_m[i] == expected);
          expected_sum += static_cast<double>(expected) * expected;
        }
        CHECK(sum == doctest::Approx(expected_sum).epsilon(1e-12));
        for (int64_t i = 0; i < s.rows; ++i)
          for (int64_t k = 0; k < s.rank; ++k) {
            const auto [dot, magnitude] = reference_dot(s.cols, [&](int64_t j) {
              return static_cast<double>(got_m[static_cast<size_t>(i * s.cols + j)]) * q[static_cast<size_t>(j * s.rank + k)];
            });
            const float got = got_p[static_cast<size_t>(i * s.rank + k)];
            CAPTURE(i);
            CAPTURE(k);
            REQUIRE(std::fabs(got - dot) <= dot_tolerance(s.cols, magnitude));
          }
      }
    }
  });
}

// Checks project_transposed's q (cols x rank) against m^T p in double.
void check_project_transposed(const std::vector<float>& got, const std::vector<float>& m, const std::vector<float>& p,
                              const FusedShape& s) {
  for (int64_t j = 0; j < s.cols; ++j)
    for (int64_t k = 0; k < s.rank; ++k) {
      const auto [dot, magnitude] = reference_dot(s.rows, [&](int64_t i) {
        return static_cast<double>(m[static_cast<size_t>(i * s.cols + j)]) * p[static_cast<size_t>(i * s.rank + k)];
      });
      CAPTURE(j);
      CAPTURE(k);
      REQUIRE(std::fabs(got[static_cast<size_t>(j * s.rank + k)] - dot) <= dot_tolerance(s.rows, magnitude));
    }
}

TEST_CASE("project_transposed: q = m^T p") {
  for_each_fused_backend([](Backend& be) {
    uint32_t seed = 600;
    for (const auto& s : kFusedShapes) {
      CAPTURE(s.rows);
      CAPTURE(s.cols);
      CAPTURE(s.rank);
      const std::vector<float> m = random_vector(static_cast<size_t>(s.rows * s.cols), ++seed, -4.0f, 4.0f);
      const std::vector<float> p = random_vector(static_cast<size_t>(s.rows * s.rank), ++seed);
      Guarded dm(be, m), dp(be, p), dq(be, std::vector<float>(static_cast<size_t>(s.cols * s.rank), kSentinel));
      be.project_transposed(dm.data(), s.rows, s.cols, dp.data(), s.rank, dq.data());
      const std::vector<float> got = dq.read(be);
      CHECK(dm.read(be) == m);
      check_project_transposed(got, m, p, s);
    }
  });
}

// A reconstruct case's inputs for shape s: M (rows x cols, in [-4, 4]), P, Q; seeds seed+1..seed+3 (advanced).
struct ReconstructInputs {
  size_t mn;
  std::vector<float> m, p, q;
};
template <class Shape>
ReconstructInputs reconstruct_inputs(const Shape& s, uint32_t& seed) {
  const auto mn = static_cast<size_t>(s.rows * s.cols);
  std::vector<float> m = random_vector(mn, ++seed, -4.0f, 4.0f);
  std::vector<float> p = random_vector(static_cast<size_t>(s.rows * s.rank), ++seed);
  std::vector<float> q = random_vector(static_cast<size_t>(s.cols * s.rank), ++seed);
  return {mn, std::move(m), std::move(p), std::move(q)};
}

TEST_CASE("reconstruct_and_residual: out = p q^T, m = out - m, returns ||m||^2") {
  for_each_fused_backend([](Backend& be) {
    uint32_t seed = 700;
    for (const auto& s : kFusedShapes) {
      CAPTURE(s.rows);
      CAPTURE(s.cols);
      CAPTURE(s.rank);
      const auto [mn, m, p, q] = reconstruct_inputs(s, seed);
      Guarded dm(be, m), dp(be, p), dq(be, q), dout(be, std::vector<float>(mn, std::nanf("")));
      const double sum = be.reconstruct_and_residual(dout.data(), dm.data(), s.rows, s.cols, dp.data(), dq.data(), s.rank);
      const std::vector<float> out = dout.read(be), residual = dm.read(be);
      double got_sum = 0.0;
      for (int64_t i = 0; i < s.rows; ++i)
        for (int64_t j = 0; j < s.cols; ++j) {
          const auto [dot, magnitude] = reference_dot(s.rank, [&](int64_t k) {
            return static_cast<double>(p[static_cast<size_t>(i * s.rank + k)]) * q[static_cast<size_t>(j * s.rank + k)];
          });
          const auto idx = static_cast<size_t>(i * s.cols + j);
          const double tol = dot_tolerance(s.rank, magnitude);
          CAPTURE(i);
          CAPTURE(j);
          REQUIRE(std::fabs(out[idx] - dot) <= tol);
          const double expected = dot - m[idx];
          REQUIRE(std::fabs(residual[idx] - expected) <= tol + 2.0 * kUnitRoundoff * (std::fabs(dot) + std::fabs(m[idx])));
          got_sum += static_cast<double>(residual[idx]) * residual[idx];
        }
      CHECK(sum == doctest::Approx(got_sum).epsilon(1e-12));
    }
  });
}

#ifndef PSGD_TEST_COMPUTE_CUDA
TEST_CASE("cpu: reconstruct_and_residual writes the same bits with every kernel variant and thread count") {
  // The output and the new error after the last collective must not depend on
  // the CPU's vector width or the thread count (docs/compute.md): each variant
  // and 1 or 2 threads against the baseline variant on one thread, byte for byte.
  const int original = cpu_blas_threads();
  std::vector<std::string> variants = cpu_kernel_variants();
  std::reverse(variants.begin(), variants.end());  // the baseline first: the reference
  uint32_t seed = 900;
  for (const auto& s : kFusedShapes) {
    CAPTURE(s.rows);
    CAPTURE(s.cols);
    CAPTURE(s.rank);
    const auto [mn, m, p, q] = reconstruct_inputs(s, seed);
    std::vector<float> ref_out, ref_m;
    for (const std::string& v : variants)
      for (int threads : {1, 2}) {
        CAPTURE(v);
        CAPTURE(threads);
        set_cpu_blas_threads(threads);
        auto be = make_cpu_backend(v);
        // Offset by one float: rows start off the vector boundary (non-temporal stores' head loop).
        DeviceBuffer dm = be->allocate(mn + 1), dout = be->allocate(mn + 1), dp = upload(*be, p), dq = upload(*be, q);
        be->copy_from_host(dm.data() + 1, m.data(), mn);
        be->reconstruct_and_residual(dout.data() + 1, dm.data() + 1, s.rows, s.cols, dp.data(), dq.data(), s.rank);
        std::vector<float> out(mn), res(mn);
        be->copy_to_host(out.data(), dout.data() + 1, mn);
        be->copy_to_host(res.data(), dm.data() + 1, mn);
        if (ref_out.empty()) {
          ref_out = out;
          ref_m = res;
        }
        // mn may be 0 (an empty vector's data() may be null, which memcmp must not get).
        REQUIRE((mn == 0 || std::memcmp(out.data(), ref_out.data(), mn * sizeof(float)) == 0));
        REQUIRE((mn == 0 || std::memcmp(res.data(), ref_m.data(), mn * sizeof(float)) == 0));
      }
  }
  set_cpu_blas_threads(original);
}

// Also under ThreadSanitizer (test compute-threads, suite tsan).
TEST_CASE("cpu: thread pool: every index once per run, runs of every size, back to back and after sleeping") {
  constexpr int kPool = 4;
  std::atomic<int> calls[kPool] = {};
  std::atomic<int> wrong{0};
  int expected[kPool] = {};
  {
    cpu::ThreadPool pool;
    for (int round = 0; round < 600; ++round) {
      // Sizes 1..4 in a pattern: smaller runs after larger ones leave workers
      // outside the run, which must neither run its task nor be waited for.
      const int count = 1 + (round * 7 + round / 5) % kPool;
      int local = 0;  // written by task 0 only (the caller): plain memory, ordered by run()
      pool.run(count, [&](int index) {
        if (index < 0 || index >= count) wrong.fetch_add(1);
        calls[index].fetch_add(1);
        if (index == 0) local = 1;
      });
      for (int i = 0; i < count; ++i) ++expected[i];
      REQUIRE(local == 1);
      // Every 50th round the workers outlast their spin and sleep on the condition variable.
      if (round % 50 == 49) std::this_thread::sleep_for(cpu::ThreadPool::kSpin * 4);
    }
    pool.run(kPool, [&](int index) { calls[index].fetch_add(1); });  // destroyed right after a run
    for (int& e : expected) ++e;
  }
  CHECK(wrong.load() == 0);
  for (int i = 0; i < kPool; ++i) {
    CAPTURE(i);
    CHECK(calls[i].load() == expected[i]);
  }
  {
    cpu::ThreadPool idle;  // never run: no threads to join
  }
}

// Also under ThreadSanitizer (test compute-threads, suite tsan).
TEST_CASE("project_transposed: any thread count (3 to 16 partial sums), the count changing between calls") {
  // for_each_fused_backend runs 1 and 2 threads; a host with more cores adds 3 to 16 partial sums
  // in thread order, on one backend whose scratch grows and shrinks with the count.
  const int original = cpu_blas_threads();
  auto be = make_cpu_backend();
  uint32_t seed = 1600;
  // A thread takes at least 4 * rank rows: the first, second and last shapes stay on one thread whatever
  // the count, the others split into up to 16.
  const std::vector<FusedShape> shapes = {{3, 40000, 2}, {17, 4000, 5}, {600, 441, 9}, {1100, 64, 4},
                                          {2000, 40, 1}, {40, 2048, 16}};
  for (const auto& s : shapes) {
    CAPTURE(s.rows);
    CAPTURE(s.cols);
    CAPTURE(s.rank);
    const std::vector<float> m = random_vector(static_cast<size_t>(s.rows * s.cols), ++seed, -4.0f, 4.0f);
    const std::vector<float> p = random_vector(static_cast<size_t>(s.rows * s.rank), ++seed);
    for (int threads : {16, 3, 1, 7, 2, 5, 16}) {
      CAPTURE(threads);
      set_cpu_blas_threads(threads);
      Guarded dm(*be, m), dp(*be, p), dq(*be, std::vector<float>(static_cast<size_t>(s.cols * s.rank), kSentinel));
      be->project_transposed(dm.data(), s.rows, s.cols, dp.data(), s.rank, dq.data());
      const std::vector<float> got = dq.read(*be);
      // The same bits as a fresh backend at this thread count: nothing left over from the call before.
      auto fresh = make_cpu_backend();
      Guarded fq(*fresh, std::vector<float>(static_cast<size_t>(s.cols * s.rank), kSentinel));
      fresh->project_transposed(dm.data(), s.rows, s.cols, dp.data(), s.rank, fq.data());
      REQUIRE(fq.read(*fresh) == got);
      check_project_transposed(got, m, p, s);
    }
  }
  set_cpu_blas_threads(original);
}

// Also under ThreadSanitizer (test compute-threads, suite tsan).
TEST_CASE("cpu: thread pool: run() returns after every task's plain writes; more workers than cores") {
  // The test above counts calls in atomics and checks them after the pool is
  // joined, so it passes even if run() returned before its last worker did.
  // Here each task writes plain memory that the caller reads right after run():
  // a run() that returned early shows a stale mark (and a data race to TSan).
  constexpr int kPool = 16;  // the backend's kMaxThreads: more workers than CI's cores
  int mark[kPool] = {};
  int expected[kPool] = {};
  cpu::ThreadPool pool;
  std::mt19937 gen(2020);
  for (int round = 1; round <= 2000; ++round) {
    const int count = 1 + static_cast<int>(gen() % kPool);
    const int slow = static_cast<int>(gen() % static_cast<unsigned>(count));  // finishes last, often
    pool.run(count, [&](int index) {
      if (index == slow && round % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
      mark[index] = round;
    });
    for (int i = 0; i < count; ++i) expected[i] = round;
    for (int i = 0; i < kPool; ++i)
      if (mark[i] != expected[i]) {
        CAPTURE(round);
        CAPTURE(count);
        CAPTURE(i);
        REQUIRE(mark[i] == expected[i]);
      }
    if (round % 500 == 0) std::this_thread::sleep_for(cpu::ThreadPool::kSpin * 4);  // workers asleep
  }
  // A count beyond run_'s 8 bits is refused before any task runs (it used to wait forever).
  bool ran = false;
  CHECK_THROWS(pool.run(cpu::ThreadPool::kMaxCount + 1, [&](int) { ran = true; }));
  CHECK(!ran);
}

TEST_CASE("cpu: kernel variants: the widest by default, PSGD_CPU_KERNELS and the argument choose, others refused") {
  const std::vector<std::string> variants = cpu_kernel_variants();
  REQUIRE(!variants.empty());
  CHECK(make_cpu_backend()->name().find(variants.front() + " kernels") != std::string::npos);
  for (const std::string& v : variants) {
    CHECK(make_cpu_backend(v)->name().find(v + " kernels") != std::string::npos);
    REQUIRE(setenv("PSGD_CPU_KERNELS", v.c_str(), 1) == 0);
    CHECK(make_cpu_backend()->name().find(v + " kernels") != std::string::npos);
  }
  REQUIRE(setenv("PSGD_CPU_KERNELS", "avx1024", 1) == 0);
  const std::string message = test::error_of([] { make_cpu_backend(); });
  CHECK(message.find("PSGD_CPU_KERNELS='avx1024'") != std::string::npos);
  CHECK(message.find(variants.back()) != std::string::npos);
  REQUIRE(unsetenv("PSGD_CPU_KERNELS") == 0);
  CHECK_THROWS_AS(make_cpu_backend("avx1024"), UnsupportedError);
}
#endif

TEST_CASE("fused passes reject bad sizes, ranks and null operands") {
  for_each_backend([](Backend& be) {
    DeviceBuffer buf = be.allocate(64);
    float* d = buf.data();
    CHECK_THROWS_AS(be.form_and_project(d, d + 8, nullptr, -1, 2, d + 16, 2, d + 24), InvalidArgumentError);
    CHECK_THROWS_AS(be.form_and_project(d, d + 8, nullptr, 2, 2, d + 16, kMaxOrthoCols + 1, d + 24),
                    InvalidArgumentError);
    CHECK_THROWS_AS(be.form_and_project(d, nullptr, nullptr, 2, 2, d + 16, 2, d + 24), InvalidArgumentError);
    CHECK_THROWS_AS(be.project_transposed(d, 2, -3, d + 16, 2, d + 24), InvalidArgumentError);
    CHECK_THROWS_AS(be.project_transposed(d, 2, 2, d + 16, 2, nullptr), InvalidArgumentError);
    CHECK_THROWS_AS(be.reconstruct_and_residual(d, d + 8, 2, 2, nullptr, d + 24, 1), InvalidArgumentError);
    CHECK_THROWS_AS(be.reconstruct_and_residual(d, d + 8, 2, 2, d + 16, d + 24, -1), InvalidArgumentError);
    // Empty operands may be null.
    CHECK(be.form_and_project(nullptr, nullptr, nullptr, 0, 3, d, 2, nullptr) == 0.0);
    CHECK(be.reconstruct_and_residual(nullptr, nullptr, 3, 0, d, nullptr, 2) == 0.0);
  });
}

TEST_CASE("element-wise: fill, copy, add, scale, subtract match the reference") {
  for_each_backend([](Backend& be) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000003}}) {
      CAPTURE(count);
      const std::vector<float> x = random_vector(count, 31, -10.0f, 10.0f);
      const std::vector<float> y = random_vector(count, 32, -10.0f, 10.0f);
      DeviceBuffer dx = upload(be, x), dy = upload(be, y), dout = be.allocate(count);

      be.add(dy.data(), dx.data(), count);
      std::vector<float> got = download(be, dy);
      for (size_t i = 0; i < count; ++i) REQUIRE(got[i] == y[i] + x[i]);

      be.scale(dy.data(), -0.5f, count);
      got = download(be, dy);
      for (size_t i = 0; i < count; ++i) REQUIRE(got[i] == (y[i] + x[i]) * -0.5f);

      be.subtract(dout.data(), dx.data(), dy.data(), count);
      got = download(be, dout);
      for (size_t i = 0; i < count; ++i) REQUIRE(got[i] == x[i] - (y[i] + x[i]) * -0.5f);

      be.copy(dout.data(), dx.data(), count);
      CHECK(download(be, dout) == x);

      be.fill(dout.data(), 3.25f, count);
      got = download(be, dout);
      CHECK(std::all_of(got.begin(), got.end(), [](float v) { return v == 3.25f; }));
    }
  });
}

TEST_CASE("element-wise: operations honour the count (neighbours untouched)") {
  for_each_backend([](Backend& be) {
    std::vector<float> host(10, kSentinel);
    DeviceBuffer buf = upload(be, host);
    be.fill(buf.data() + 2, 1.0f, 5);
    be.scale(buf.data() + 3, 2.0f, 3);
    be.add(buf.data() + 4, buf.data() + 2, 1);
    const std::vector<float> got = download(be, buf);
    const std::vector<float> expected = {kSentinel, kSentinel, 1, 2, 3, 2, 1, kSentinel, kSentinel, kSentinel};
    CHECK(got == expected);
  });
}

TEST_CASE("squared_norm accumulates in double") {
  for_each_backend([](Backend& be) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{13}, size_t{1 << 20}}) {
      CAPTURE(count);
      std::vector<float> x = random_vector(count, 41, -3.0f, 3.0f);
      double expected = 0.0;
      for (float v : x) expected += static_cast<double>(v) * v;
      DeviceBuffer dx = upload(be, x);
      CHECK(be.squared_norm(dx.data(), count) == doctest::Approx(expected).epsilon(1e-12));
    }
    // 2^24 + 1 ones: a float accumulator stops at 2^24 (16777216).
    const size_t ones = (size_t{1} << 24) + 1;
    DeviceBuffer big = be.allocate(ones);
    be.fill(big.data(), 1.0f, ones);
    CHECK(be.squared_norm(big.data(), ones) == static_cast<double>(ones));
    // Squares beyond float range stay finite in double.
    std::vector<float> huge = {3e20f, -4e20f};
    DeviceBuffer dh = upload(be, huge);
    CHECK(be.squared_norm(dh.data(), 2) == doctest::Approx(25e40).epsilon(1e-6));
  });
}

TEST_CASE("all_finite finds NaN and Inf at the first and the last position") {
  for_each_backend([](Backend& be) {
    const float kBad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN()};
    for (size_t count : {size_t{1}, size_t{2}, size_t{4097}, size_t{1000003}}) {
      CAPTURE(count);
      std::vector<float> x = random_vector(count, 51);
      x[0] = std::numeric_limits<float>::max();
      x[count - 1] = std::numeric_limits<float>::denorm_min();
      DeviceBuffer dx = upload(be, x);
      CHECK(be.all_finite(dx.data(), count));
      for (float bad : kBad)
        for (size_t pos : {size_t{0}, count - 1}) {
          CAPTURE(pos);
          std::vector<float> y = x;
          y[pos] = bad;
          be.copy_from_host(dx.data(), y.data(), count);
          CHECK_FALSE(be.all_finite(dx.data(), count));
          // A NaN just past the range is not looked at.
          if (pos == count - 1 && count > 1) CHECK(be.all_finite(dx.data(), count - 1));
        }
    }
    CHECK(be.all_finite(nullptr, 0));
  });
}

// ---- memory ----

TEST_CASE("allocate: zero-initialized, sized, and reusable") {
  for_each_backend([](Backend& be) {
    for (size_t count : {size_t{1}, size_t{17}, size_t{1 << 22}}) {
      CAPTURE(count);
      {
        DeviceBuffer dirty = be.allocate(count);
        be.fill(dirty.data(), -7.0f, count);
        be.synchronize();
      }
      DeviceBuffer buf = be.allocate(count);
      REQUIRE(buf.size() == count);
      const std::vector<float> got = download(be, buf);
      CHECK(std::all_of(got.begin(), got.end(), [](float v) { return v == 0.0f; }));
      if (be.host_accessible()) CHECK(reinterpret_cast<uintptr_t>(buf.data()) % 64 == 0);
    }
    DeviceBuffer empty = be.allocate(0);
    CHECK(empty.empty());
    DeviceBuffer moved = be.allocate(8);
    float* p = moved.data();
    DeviceBuffer target = std::move(moved);
    CHECK(target.data() == p);
    CHECK(moved.empty());  // NOLINT(bugprone-use-after-move): the moved-from state is the contract
  });
}

TEST_CASE("copy_from_host / copy_to_host round-trip at an offset") {
  for_each_backend([](Backend& be) {
    const std::vector<float> x = random_vector(100, 61);
    DeviceBuffer buf = be.allocate(200);
    be.copy_from_host(buf.data() + 50, x.data(), x.size());
    std::vector<float> back(100);
    be.copy_to_host(back.data(), buf.data() + 50, back.size());
    CHECK(back == x);
    std::vector<float> head(50, 1.0f);
    be.copy_to_host(head.data(), buf.data(), head.size());
    CHECK(std::all_of(head.begin(), head.end(), [](float v) { return v == 0.0f; }));
  });
}

// ---- orthogonalization ----

struct Matrix {
  int64_t rows, cols;
  std::vector<float> data;  // row-major
  double at(int64_t r, int64_t c) const { return data[static_cast<size_t>(r * cols + c)]; }
};

Matrix random_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  return {rows, cols, random_vector(static_cast<size_t>(rows * cols), seed)};
}

double column_norm(const Matrix& m, int64_t c) {
  double sum = 0.0;
  for (int64_t r = 0; r < m.rows; ++r) sum += m.at(r, c) * m.at(r, c);
  return std::sqrt(sum);
}

// Max |Q^T Q - I| over the first `cols` columns.
double orthogonality_error(const Matrix& q, int64_t cols) {
  double worst = 0.0;
  for (int64_t i = 0; i < cols; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      double dot = 0.0;
      for (int64_t r = 0; r < q.rows; ++r) dot += q.at(r, i) * q.at(r, j);
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  return worst;
}

// Span check: for each j < cols, column j of A lies in the span of Q's first
// j + 1 columns (Q^T A is upper triangular and Q Q^T A = A), relative to ||A_j||.
// It fails for a permuted, transposed or wrongly strided Q.
double span_error(const Matrix& q, const Matrix& a, int64_t cols) {
  double worst = 0.0;
  for (int64_t j = 0; j < cols; ++j) {
    const double norm = column_norm(a, j);
    if (norm == 0.0) continue;
    std::vector<double> residual(static_cast<size_t>(a.rows));
    for (int64_t r = 0; r < a.rows; ++r) residual[static_cast<size_t>(r)] = a.at(r, j);
    for (int64_t i = 0; i <= j && i < q.cols; ++i) {
      double dot = 0.0;
      for (int64_t r = 0; r < a.rows; ++r) dot += q.at(r, i) * a.at(r, j);
      for (int64_t r = 0; r < a.rows; ++r) residual[static_cast<size_t>(r)] -= dot * q.at(r, i);
    }
    double rn = 0.0;
    for (double v : residual) rn += v * v;
    worst = std::max(worst, std::sqrt(rn) / norm);
  }
  return worst;
}

Matrix orthogonalized(Backend& be, const Matrix& a, OrthoMethod method, float epsilon, uint64_t seed = 0) {
  DeviceBuffer buf = upload(be, a.data);
  be.orthogonalize(buf.data(), a.rows, a.cols, 1, 0, method, epsilon, seed);
  return {a.rows, a.cols, download(be, buf)};
}

// The reference's Gram-Schmidt in double.
Matrix reference_gram_schmidt(const Matrix& a, double epsilon) {
  std::vector<double> m(a.data.begin(), a.data.end());
  auto at = [&](int64_t r, int64_t c) -> double& { return m[static_cast<size_t>(r * a.cols + c)]; };
  for (int64_t i = 0; i < a.cols; ++i) {
    double sum = 0.0;
    for (int64_t r = 0; r < a.rows; ++r) sum += at(r, i) * at(r, i);
    const double denom = std::sqrt(sum) + epsilon;
    for (int64_t r = 0; r < a.rows; ++r) at(r, i) = denom == 0.0 ? 0.0 : at(r, i) / denom;
    for (int64_t j = i + 1; j < a.cols; ++j) {
      double dot = 0.0;
      for (int64_t r = 0; r < a.rows; ++r) dot += at(r, i) * at(r, j);
      for (int64_t r = 0; r < a.rows; ++r) at(r, j) -= dot * at(r, i);
    }
  }
  Matrix out{a.rows, a.cols, std::vector<float>(m.size())};
  for (size_t i = 0; i < m.size(); ++i) out.data[i] = static_cast<float>(m[i]);
  return out;
}

bool all_finite(const Matrix& m) {
  return std::all_of(m.data.begin(), m.data.end(), [](float v) { return std::isfinite(v); });
}

constexpr double kOrthoTol = 1e-5;

TEST_CASE("orthogonalize: full-rank random matrices, both methods") {
  struct Shape {
    int64_t rows, cols;
  };
  for_each_backend([](Backend& be) {
    uint32_t seed = 100;
    for (Shape s : {Shape{1, 1}, Shape{7, 7}, Shape{100, 5}, Shape{1000, 64}, Shape{100000, 4}, Shape{37, 2}})
      for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr}) {
        CAPTURE(s.rows);
        CAPTURE(s.cols);
        CAPTURE(static_cast<int>(method));
        const Matrix a = random_matrix(s.rows, s.cols, seed++);
        const Matrix q = orthogonalized(be, a, method, 0.0f);
        CHECK(orthogonality_error(q, s.cols) < kOrthoTol);
        // Square matrices of size 64 are ill-conditioned enough to lose digits in
        // Gram-Schmidt; the span check scales with the condition number.
        CHECK(span_error(q, a, s.cols) < 1e-4);
        if (method == OrthoMethod::GramSchmidt && s.rows >= 4 * s.cols) {
          const Matrix ref = reference_gram_schmidt(a, 0.0);
          for (size_t i = 0; i < q.data.size(); ++i) REQUIRE(std::fabs(q.data[i] - ref.data[i]) < 1e-4);
        }
      }
  });
}

// Taller than 65535 tiles of 32 rows: the CUDA backend's QR transposes the matrix back with the long side on
// the grid's y dimension, whose limit that is (every step of such a bucket failed to launch: rank >= 3 on a
// 2.1M-row embedding). Both methods; on the CPU backend a plain case.
TEST_CASE("orthogonalize: a matrix of 2.1 million rows, both methods") {
  for_each_backend([](Backend& be) {
    const Matrix a = random_matrix(2100000, 4, 7);
    for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr}) {
      CAPTURE(static_cast<int>(method));
      const Matrix q = orthogonalized(be, a, method, 0.0f);
      CHECK(orthogonality_error(q, 4) < kOrthoTol);
      CHECK(span_error(q, a, 4) < 1e-4);
    }
  });
}

// LAPACK's Householder QR (sgeqr2 + sorg2r) in double, plainly: reflector j
// maps column j from the diagonal down onto -sign(a_jj) * its norm * e_1, none
// where that column is already 0 below the diagonal. Q's first min(rows, cols)
// columns, the rest 0.
Matrix reference_householder(const Matrix& a) {
  const int64_t m = a.rows, n = a.cols, k = std::min(m, n);
  std::vector<double> r(a.data.begin(), a.data.end());  // row-major
  auto at = [&](int64_t i, int64_t j) -> double& { return r[static_cast<size_t>(i * n + j)]; };
  std::vector<std::vector<double>> vs;
  std::vector<double> taus;
  for (int64_t j = 0; j < k; ++j) {
    double tail = 0.0;
    for (int64_t i = j + 1; i < m; ++i) tail += at(i, j) * at(i, j);
    std::vector<double> v(static_cast<size_t>(m - j), 0.0);
    v[0] = 1.0;
    double tau = 0.0;
    if (tail != 0.0) {
      const double alpha = at(j, j), beta = -std::copysign(std::sqrt(alpha * alpha + tail), alpha);
      tau = (beta - alpha) / beta;
      for (int64_t i = j + 1; i < m; ++i) v[static_cast<size_t>(i - j)] = at(i, j) / (alpha - beta);
      for (int64_t c = j; c < n; ++c) {
        double w = 0.0;
        for (int64_t i = j; i < m; ++i) w += v[static_cast<size_t>(i - j)] * at(i, c);
        for (int64_t i = j; i < m; ++i) at(i, c) -= tau * w * v[static_cast<size_t>(i - j)];
      }
    }
    vs.push_back(v);
    taus.push_back(tau);
  }
  std::vector<double> q(static_cast<size_t>(m * n), 0.0);  // row-major, first k columns of I
  for (int64_t c = 0; c < k; ++c) q[static_cast<size_t>(c * n + c)] = 1.0;
  for (int64_t j = k - 1; j >= 0; --j)
    for (int64_t c = 0; c < k; ++c) {
      double w = 0.0;
      for (int64_t i = j; i < m; ++i) w += vs[static_cast<size_t>(j)][static_cast<size_t>(i - j)] * q[static_cast<size_t>(i * n + c)];
      for (int64_t i = j; i < m; ++i)
        q[static_cast<size_t>(i * n + c)] -= taus[static_cast<size_t>(j)] * w * vs[static_cast<size_t>(j)][static_cast<size_t>(i - j)];
    }
  Matrix out{m, n, std::vector<float>(q.size())};
  for (size_t i = 0; i < q.size(); ++i) out.data[i] = static_cast<float>(q[i]);
  return out;
}

TEST_CASE("orthogonalize: QR is LAPACK's Householder QR, signs included") {
  struct Shape {
    int64_t rows, cols;
  };
  for_each_backend([](Backend& be) {
    uint32_t seed = 700;
    for (Shape s : {Shape{1, 1}, Shape{2, 2}, Shape{7, 7}, Shape{100, 5}, Shape{1000, 64}, Shape{4608, 4}, Shape{3, 5}})
      for (float sign : {1.0f, -1.0f}) {  // both signs of the diagonal entries
        CAPTURE(s.rows);
        CAPTURE(s.cols);
        CAPTURE(sign);
        Matrix a = random_matrix(s.rows, s.cols, seed++);
        for (float& v : a.data) v *= sign;
        const Matrix q = orthogonalized(be, a, OrthoMethod::Qr, 0.0f);
        const Matrix ref = reference_householder(a);
        double worst = 0.0;
        for (size_t i = 0; i < q.data.size(); ++i) worst = std::max(worst, std::fabs(double(q.data[i]) - ref.data[i]));
        CHECK(worst < 1e-4);
      }
  });
}

TEST_CASE("orthogonalize: 1 x 1 normalizes the sign-carrying scalar") {
  for_each_backend([](Backend& be) {
    const Matrix a{1, 1, {-3.0f}};
    CHECK(orthogonalized(be, a, OrthoMethod::GramSchmidt, 0.0f).data[0] == -1.0f);
    CHECK(std::fabs(orthogonalized(be, a, OrthoMethod::Qr, 0.0f).data[0]) == doctest::Approx(1.0f));
    // epsilon divides by (|x| + epsilon), as the reference.
    CHECK(orthogonalized(be, a, OrthoMethod::GramSchmidt, 1.0f).data[0] == doctest::Approx(-0.75f));
  });
}

// Gram-Schmidt divided by the norm rounded to float: beyond float's range it was Inf (the column became 0,
// unflagged: P^ = 0, a zero output), subnormal it was too coarse (a column of norm 1.414).
TEST_CASE("orthogonalize: columns whose norm is beyond float's range or subnormal come out unit") {
  for_each_backend([](Backend& be) {
    for (const float v : {3e38f, -2.5e38f, 1.4e-45f, 3e-41f}) {
      CAPTURE(v);
      const Matrix a{2, 1, {v, v}};
      const Matrix q = orthogonalized(be, a, OrthoMethod::GramSchmidt, 0.0f);
      REQUIRE(all_finite(q));
      CHECK(column_norm(q, 0) == doctest::Approx(1.0).epsilon(1e-6));
      CHECK(q.data[0] == doctest::Approx(v > 0 ? 0.70710678 : -0.70710678).epsilon(1e-6));
    }
    // A normal norm keeps its bits: divided in float, as before.
    const Matrix a{2, 1, {3.0f, 4.0f}};
    const Matrix q = orthogonalized(be, a, OrthoMethod::GramSchmidt, 0.0f);
    CHECK(q.data[0] == 3.0f / 5.0f);
    CHECK(q.data[1] == 4.0f / 5.0f);
  });
}

TEST_CASE("orthogonalize: an all-zero column") {
  for_each_backend([](Backend& be) {
    Matrix a = random_matrix(50, 4, 200);
    for (int64_t r = 0; r < a.rows; ++r) a.data[static_cast<size_t>(r * a.cols + 1)] = 0.0f;
    for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr})
      for (float epsilon : {0.0f, 1e-8f}) {
        CAPTURE(static_cast<int>(method));
        CAPTURE(epsilon);
        // The zero column is replaced (not NaN, not 0): Q is orthonormal and its span covers A.
        const Matrix q = orthogonalized(be, a, method, epsilon);
        REQUIRE(all_finite(q));
        CHECK(orthogonality_error(q, 4) < kOrthoTol);
        CHECK(span_error(q, a, 4) < 1e-4);
        CHECK(column_norm(q, 1) == doctest::Approx(1.0).epsilon(1e-5));
      }
  });
}

TEST_CASE("orthogonalize: rank-deficient input") {
  for_each_backend([](Backend& be) {
    Matrix a = random_matrix(60, 3, 300);
    for (int64_t r = 0; r < a.rows; ++r) a.data[static_cast<size_t>(r * 3 + 2)] = static_cast<float>(a.at(r, 0) - 2 * a.at(r, 1));
    for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr}) {
      CAPTURE(static_cast<int>(method));
      // The dependent column (rounding noise in the reference's Gram-Schmidt) is replaced: Q is orthonormal.
      const Matrix q = orthogonalized(be, a, method, 0.0f);
      REQUIRE(all_finite(q));
      CHECK(orthogonality_error(q, 3) < kOrthoTol);
      CHECK(span_error(q, a, 3) < 1e-4);
    }
  });
}

// Zero, rank-1 and duplicated-column inputs, small and large scales, single and
// batched: an orthonormal basis with both methods; the independent columns'
// span is kept (span_error), so P^ P^T M still reproduces a rank-deficient M.
TEST_CASE("orthogonalize: zero and rank-deficient inputs give an orthonormal basis, both methods") {
  struct Case {
    const char* name;
    int64_t rows, cols;
    std::function<float(int64_t, int64_t)> at;
  };
  const Matrix u = random_matrix(4096, 3, 800);
  const std::vector<Case> cases = {
      {"zero 64 x 1", 64, 1, [](int64_t, int64_t) { return 0.0f; }},
      {"zero 64 x 2", 64, 2, [](int64_t, int64_t) { return 0.0f; }},
      {"zero 48 x 4", 48, 4, [](int64_t, int64_t) { return 0.0f; }},
      {"zero 2 x 2", 2, 2, [](int64_t, int64_t) { return 0.0f; }},
      {"rank 1, 64 x 2", 64, 2, [&](int64_t r, int64_t c) { return float(u.at(r, 0) * (c + 1)); }},
      {"rank 1, 64 x 4", 64, 4, [&](int64_t r, int64_t c) { return float(u.at(r, 0) * (c % 2 == 0 ? 3 : -1)); }},
      {"rank 1, 4096 x 4, scale 1e-30", 4096, 4, [&](int64_t r, int64_t c) { return float(u.at(r, 0) * 1e-30 * (c + 1)); }},
      {"rank 1, 4096 x 4, scale 1e30", 4096, 4, [&](int64_t r, int64_t c) { return float(u.at(r, 0) * 1e30 * (c + 1)); }},
      {"rank 2 of 5, zero first column", 100, 5,
       [&](int64_t r, int64_t c) { return c == 0 ? 0.0f : float(u.at(r, 1) + c * u.at(r, 2)); }},
      {"equal columns, 37 x 2", 37, 2, [&](int64_t r, int64_t) { return float(u.at(r, 1)); }},
      {"one nonzero row, 50 x 3", 50, 3, [](int64_t r, int64_t c) { return r == 7 ? float(c + 1) : 0.0f; }},
  };
  for_each_backend([&](Backend& be) {
    for (const Case& k : cases)
      for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr}) {
        const std::string name = k.name;
        CAPTURE(name);
        CAPTURE(static_cast<int>(method));
        Matrix a{k.rows, k.cols, {}};
        for (int64_t r = 0; r < k.rows; ++r)
          for (int64_t c = 0; c < k.cols; ++c) a.data.push_back(k.at(r, c));
        const Matrix q = orthogonalized(be, a, method, 0.0f, 42);
        REQUIRE(all_finite(q));
        CHECK(orthogonality_error(q, k.cols) < kOrthoTol);
        CHECK(span_error(q, a, k.cols) < 1e-4);
        // A batch of three copies: each item orthonormal.
        const int64_t n = k.rows * k.cols;
        std::vector<float> three;
        for (int i = 0; i < 3; ++i) three.insert(three.end(), a.data.begin(), a.data.end());
        DeviceBuffer buf = upload(be, three);
        be.orthogonalize(buf.data(), k.rows, k.cols, 3, n, method, 0.0f, 42);
        const std::vector<float> got = download(be, buf);
        for (int64_t i = 0; i < 3; ++i) {
          const Matrix item{k.rows, k.cols, std::vector<float>(got.begin() + i * n, got.begin() + (i + 1) * n)};
          CHECK(orthogonality_error(item, k.cols) < kOrthoTol);
        }
      }
  });
}

// A column that differs from a combination of the earlier ones by 2e-4 to 0.1 of its norm is data, not
// rounding noise (degenerate.hpp), but one float projection leaves it with a component along them of about
// 1e-7 of its norm: 1e-5 to 1e-3 of what is left. The second projection makes it orthogonal to rounding, so
// that P P^T M reproduces what P spans (a rank-1 gradient at rank 2 drifted 2e-4 without it).
TEST_CASE("orthogonalize: a nearly dependent column comes out orthogonal by a second projection") {
  const Matrix u = random_matrix(4096, 3, 900);
  for_each_backend([&](Backend& be) {
    for (const int64_t rows : {64, 4096})
      for (const double delta : {5e-4, 1e-3, 1e-2, 0.3}) {
        CAPTURE(rows);
        CAPTURE(delta);
        Matrix a{rows, 3, {}};
        for (int64_t r = 0; r < rows; ++r) {
          a.data.push_back(float(u.at(r, 0)));
          a.data.push_back(float(u.at(r, 0) + delta * u.at(r, 1)));
          a.data.push_back(float(u.at(r, 0) - 2 * u.at(r, 1) + delta * u.at(r, 2)));
        }
        const Matrix q = orthogonalized(be, a, OrthoMethod::GramSchmidt, 0.0f, 7);
        REQUIRE(all_finite(q));
        CHECK(orthogonality_error(q, 3) < kOrthoTol);
        CHECK(span_error(q, a, 3) < 1e-4);
      }
  });
}

TEST_CASE("orthogonalize: fewer rows than columns") {
  for_each_backend([](Backend& be) {
    const Matrix a = random_matrix(3, 5, 400);
    for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr}) {
      CAPTURE(static_cast<int>(method));
      const Matrix q = orthogonalized(be, a, method, 0.0f);
      CHECK(orthogonality_error(q, 3) < kOrthoTol);
      CHECK(span_error(q, a, 3) < 1e-4);
      for (int64_t r = 0; r < 3; ++r)
        for (int64_t c = 3; c < 5; ++c) CHECK(q.at(r, c) == 0.0);
    }
  });
}

TEST_CASE("orthogonalize: epsilon divides by (norm + epsilon) before projecting") {
  for_each_backend([](Backend& be) {
    const Matrix a = random_matrix(20, 3, 500);
    const float epsilon = 0.5f;
    const Matrix q = orthogonalized(be, a, OrthoMethod::GramSchmidt, epsilon);
    const Matrix ref = reference_gram_schmidt(a, epsilon);
    for (size_t i = 0; i < q.data.size(); ++i) REQUIRE(std::fabs(q.data[i] - ref.data[i]) < 1e-5);
    // The first column is a pure rescale, so its norm is ||a|| / (||a|| + epsilon) < 1.
    const double n0 = column_norm(a, 0);
    CHECK(column_norm(q, 0) == doctest::Approx(n0 / (n0 + epsilon)).epsilon(1e-5));
  });
}

TEST_CASE("orthogonalize: strided batches leave the gaps untouched") {
  for_each_backend([](Backend& be) {
    const int64_t rows = 40, cols = 3, batch = 4, gap = 5, stride = rows * cols + gap;
    for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr}) {
      CAPTURE(static_cast<int>(method));
      std::vector<float> host(static_cast<size_t>(stride * batch), kSentinel);
      std::vector<Matrix> inputs;
      for (int64_t item = 0; item < batch; ++item) {
        inputs.push_back(random_matrix(rows, cols, 600 + static_cast<uint32_t>(item)));
        std::copy(inputs.back().data.begin(), inputs.back().data.end(), host.begin() + item * stride);
      }
      DeviceBuffer buf = upload(be, host);
      be.orthogonalize(buf.data(), rows, cols, batch, stride, method, 0.0f, 0);
      const std::vector<float> got = download(be, buf);
      for (int64_t item = 0; item < batch; ++item) {
        CAPTURE(item);
        const Matrix q{rows, cols,
                       std::vector<float>(got.begin() + item * stride, got.begin() + item * stride + rows * cols)};
        CHECK(orthogonality_error(q, cols) < kOrthoTol);
        CHECK(span_error(q, inputs[static_cast<size_t>(item)], cols) < 1e-4);
        for (int64_t g = rows * cols; g < stride; ++g) REQUIRE(got[static_cast<size_t>(item * stride + g)] == kSentinel);
      }
    }
  });
}

TEST_CASE("orthogonalize: rejects bad arguments") {
  for_each_backend([](Backend& be) {
    DeviceBuffer buf = be.allocate(200);
    CHECK_THROWS_AS(be.orthogonalize(buf.data(), 2, kMaxOrthoCols + 1, 1, 0, OrthoMethod::Qr, 0.0f, 0),
                    InvalidArgumentError);
    CHECK_THROWS_AS(be.orthogonalize(buf.data(), 4, 2, 1, 0, OrthoMethod::GramSchmidt, -1.0f, 0), InvalidArgumentError);
    CHECK_THROWS_AS(be.orthogonalize(buf.data(), 4, 2, 1, 0, OrthoMethod::GramSchmidt,
                                     std::numeric_limits<float>::quiet_NaN(), 0),
                    InvalidArgumentError);
    CHECK_THROWS_AS(be.orthogonalize(buf.data(), 4, 2, 2, 7, OrthoMethod::Qr, 0.0f, 0), InvalidArgumentError);
    CHECK_THROWS_AS(be.orthogonalize(buf.data(), -4, 2, 1, 0, OrthoMethod::Qr, 0.0f, 0), InvalidArgumentError);
  });
}

// ---- backend-specific ----

#ifndef PSGD_TEST_COMPUTE_CUDA

// The orthogonalization runs on the allreduced P and the warm Q, the same bits
// on every rank: its replacement of degenerate columns must be too, whatever
// kernel variant and thread count a rank runs (docs/compute.md).
TEST_CASE("cpu: degenerate columns are replaced with the same bits by every kernel variant and thread count") {
  const Matrix u = random_matrix(200, 2, 900);
  std::vector<Matrix> inputs = {Matrix{64, 1, std::vector<float>(64, 0.0f)}, Matrix{64, 2, std::vector<float>(128, 0.0f)},
                                Matrix{48, 4, std::vector<float>(192, 0.0f)}, Matrix{200, 4, {}}, Matrix{200, 2, {}}};
  for (int64_t r = 0; r < 200; ++r)
    for (int64_t c = 0; c < 4; ++c) inputs[3].data.push_back(static_cast<float>(u.at(r, 0) * (c + 1)));  // rank 1
  for (int64_t r = 0; r < 200; ++r)
    for (int64_t c = 0; c < 2; ++c) inputs[4].data.push_back(static_cast<float>(u.at(r, 1)));  // equal columns
  const int original = cpu_blas_threads();
  for (const Matrix& a : inputs)
    for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr}) {
      CAPTURE(a.rows);
      CAPTURE(a.cols);
      CAPTURE(static_cast<int>(method));
      std::optional<std::vector<float>> first;
      for (const std::string& variant : cpu_kernel_variants())
        for (int threads : {1, 2}) {
          CAPTURE(variant);
          CAPTURE(threads);
          set_cpu_blas_threads(threads);
          auto be = make_cpu_backend(variant);
          const Matrix q = orthogonalized(*be, a, method, 0.0f, 7);
          CHECK(orthogonality_error(q, a.cols) < kOrthoTol);
          if (!first) first = q.data;
          CHECK(std::memcmp(first->data(), q.data.data(), q.data.size() * sizeof(float)) == 0);
        }
      // Another seed: other vectors for the degenerate columns (here every column but a rank-1 input's first).
      auto be = make_cpu_backend();
      const Matrix other = orthogonalized(*be, a, method, 0.0f, 8);
      CHECK(orthogonality_error(other, a.cols) < kOrthoTol);
      CHECK(other.data != *first);
    }
  // The seed changes nothing where no column is degenerate.
  auto be = make_cpu_backend();
  const Matrix a = random_matrix(100, 4, 901);
  for (OrthoMethod method : {OrthoMethod::GramSchmidt, OrthoMethod::Qr})
    CHECK(orthogonalized(*be, a, method, 0.0f, 1).data == orthogonalized(*be, a, method, 0.0f, 2).data);
  set_cpu_blas_threads(original);
}

TEST_CASE("cpu: BLAS thread count probe, set, and PSGD_BLAS_THREADS") {
  const int original = cpu_blas_threads();
  REQUIRE(original >= 1);
  set_cpu_blas_threads(1);
  CHECK(cpu_blas_threads() == 1);
  CHECK_THROWS_AS(set_cpu_blas_threads(0), InvalidArgumentError);

  REQUIRE(setenv("PSGD_BLAS_THREADS", "2", 1) == 0);
  auto backend = make_cpu_backend();
  // OpenBLAS caps the count at what it was built for; 2 is within every build.
  CHECK(cpu_blas_threads() == 2);
  CHECK(backend->name().find("2 threads") != std::string::npos);
  CHECK(backend->name().find("OpenBLAS") != std::string::npos);
  REQUIRE(setenv("PSGD_BLAS_THREADS", "zero", 1) == 0);
  CHECK_THROWS_AS(make_cpu_backend(), InvalidArgumentError);
  REQUIRE(unsetenv("PSGD_BLAS_THREADS") == 0);
  set_cpu_blas_threads(original);
  CHECK(cpu_blas_threads() == original);
}

TEST_CASE("cpu: kind and host access") {
  auto backend = make_cpu_backend();
  CHECK(backend->kind() == DeviceKind::Cpu);
  CHECK(backend->host_accessible());
  CHECK(make_backend(DeviceKind::Cpu)->kind() == DeviceKind::Cpu);
}

TEST_CASE("cuda factory: unavailable on a host without a GPU is an UnsupportedError") {
  if (cuda_available()) {
    CHECK(make_cuda_backend(0)->kind() == DeviceKind::Cuda);
    CHECK_THROWS_AS(make_cuda_backend(1 << 20), InvalidArgumentError);
  } else {
    CHECK_THROWS_AS(make_cuda_backend(0), UnsupportedError);
    CHECK_THROWS_AS(make_backend(DeviceKind::Cuda, 0), UnsupportedError);
  }
}

#else

TEST_CASE("cuda: kind, device memory, bad device index") {
  auto backend = make_cuda_backend(0);
  CHECK(backend->kind() == DeviceKind::Cuda);
  CHECK_FALSE(backend->host_accessible());
  CHECK(backend->name().find("cuda") != std::string::npos);
  CHECK_THROWS_AS(make_cuda_backend(-1), InvalidArgumentError);
  CHECK_THROWS_AS(make_cuda_backend(1 << 20), InvalidArgumentError);
}

#endif

}  // namespace
}  // namespace powersgd::compute

#ifndef PSGD_TEST_COMPUTE_CUDA
int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
#endif
