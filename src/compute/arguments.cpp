// Argument validation shared by every backend (arguments.hpp). Built into the
// library and into the CUDA module, which carries its own copy.
#include "compute/arguments.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include "common/check.hpp"

namespace powersgd::compute {

namespace detail {

namespace {

const char* transpose_name(Transpose t) { return t == Transpose::No ? "no-transpose" : "transpose"; }

// Leading-dimension rule of a stored row-major matrix with `cols` columns.
void check_ld(const char* name, int64_t ld, int64_t cols, Transpose t) {
  PSGD_REQUIRE(ld >= std::max<int64_t>(1, cols), InvalidArgumentError, "gemm: ", name, "=", ld, " (",
               transpose_name(t), ") must be >= max(1, ", cols, "), the column count of the stored matrix");
}

}  // namespace

bool fits_int32(int64_t value) { return value >= INT_MIN && value <= INT_MAX; }

void check_gemm_arguments(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                          int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b,
                          const float* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  PSGD_REQUIRE(m >= 0 && n >= 0 && k >= 0, InvalidArgumentError, "gemm: sizes must be >= 0, got m=", m, " n=", n,
               " k=", k);
  PSGD_REQUIRE(batch >= 0, InvalidArgumentError, "gemm: batch must be >= 0, got ", batch);
  check_ld("lda", lda, trans_a == Transpose::No ? k : m, trans_a);
  check_ld("ldb", ldb, trans_b == Transpose::No ? n : k, trans_b);
  check_ld("ldc", ldc, n, Transpose::No);
  if (m == 0 || n == 0 || batch == 0) return;
  PSGD_REQUIRE(c != nullptr, InvalidArgumentError, "gemm: c is null for a ", m, " x ", n, " result");
  PSGD_REQUIRE(k == 0 || (a != nullptr && b != nullptr), InvalidArgumentError, "gemm: a or b is null with k=", k);
  if (batch > 1) {
    PSGD_REQUIRE(stride_a >= 0 && stride_b >= 0, InvalidArgumentError, "gemm: stride_a=", stride_a,
                 " and stride_b=", stride_b, " must be >= 0");
    const int64_t c_extent = (m - 1) * ldc + n;
    PSGD_REQUIRE(stride_c >= c_extent, InvalidArgumentError, "gemm: stride_c=", stride_c, " must be >= ", c_extent,
                 " so that the ", batch, " C matrices (", m, " x ", n, ", ldc=", ldc, ") do not overlap");
  }
}

void check_orthogonalize_arguments(const float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride,
                                   float epsilon) {
  PSGD_REQUIRE(rows >= 0, InvalidArgumentError, "orthogonalize: rows must be >= 0, got ", rows);
  PSGD_REQUIRE(cols >= 0 && cols <= kMaxOrthoCols, InvalidArgumentError, "orthogonalize: cols must be in [0, ",
               kMaxOrthoCols, "], got ", cols);
  PSGD_REQUIRE(batch >= 0, InvalidArgumentError, "orthogonalize: batch must be >= 0, got ", batch);
  PSGD_REQUIRE(std::isfinite(epsilon) && epsilon >= 0.0f, InvalidArgumentError,
               "orthogonalize: epsilon must be finite and >= 0, got ", epsilon);
  if (rows == 0 || cols == 0 || batch == 0) return;
  PSGD_REQUIRE(m != nullptr, InvalidArgumentError, "orthogonalize: matrix pointer is null for ", rows, " x ", cols);
  PSGD_REQUIRE(batch == 1 || stride >= rows * cols, InvalidArgumentError, "orthogonalize: stride=", stride,
               " must be >= rows * cols = ", rows * cols, " for batch=", batch);
}

void check_fused_arguments(const char* what, int64_t rows, int64_t cols, int64_t rank,
                           std::initializer_list<FusedOperand> operands) {
  PSGD_REQUIRE(rows >= 0 && cols >= 0, InvalidArgumentError, what, ": sizes must be >= 0, got rows=", rows,
               " cols=", cols);
  PSGD_REQUIRE(rank >= 0 && rank <= kMaxOrthoCols, InvalidArgumentError, what, ": rank must be in [0, ",
               kMaxOrthoCols, "], got ", rank);
  for (const auto& op : operands)
    PSGD_REQUIRE(op.count == 0 || op.data != nullptr, InvalidArgumentError, what, ": ", op.name, " is null (",
                 op.count, " elements; rows=", rows, " cols=", cols, " rank=", rank, ")");
}

}  // namespace detail

}  // namespace powersgd::compute
