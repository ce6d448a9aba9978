// The CPU backend's fused row kernels, one table per instruction set: each
// kernels_<isa>.cpp compiles the same code (kernels_impl.hpp) for its vector
// width, and the backend picks a table at run time (cpu_kernels()).
//
// Contract of every table (what keeps replicas bitwise identical, docs/compute.md):
// - `reconstruct` computes every output element and residual with the same
//   operations in the same order (o = 0, o += p[k] * qt[k][j] for k = 0..rank-1
//   in float, no FMA, then d = o - m) whatever the table, lane or thread: its
//   outputs are the same bits on every table. Its returned sum is local order.
// - `form_project` and `project_cols` produce products on local data, summed by
//   a collective afterwards: any order, FMA allowed; results differ between
//   tables by rounding only.
// All functions are pure over their arguments, reentrant, and may run
// concurrently on disjoint outputs (the backend's row or column blocks).
// `stream` asks for non-temporal stores of the written matrix (M, out): the
// caller's matrix is larger than the caches; the caller then calls
// store_fence() before another thread or pass reads it.
#pragma once

#include <cstddef>

namespace powersgd::compute::cpu {

struct Kernels {
  const char* name;  // "avx512", "avx2", "sse2" or "portable"
  size_t width;      // floats per vector register
  // Rows [0, rows) of M (n columns, row stride n): m = a - b (b null: m = a;
  // a may equal m), p[i][k] = <m_i, qt_k> (p: rows x rank). Returns the sum of m^2 (double).
  double (*form_project)(float* m, const float* a, const float* b, size_t rows, size_t n, const float* qt,
                         size_t rank, float* p, bool stream);
  // qt[k][c] += sum_i p[i][k] * m[i][c] for columns c in [c0, c1) of all rows
  // (qt: rank rows of n floats).
  void (*project_cols)(float* qt, const float* m, size_t rows, size_t n, size_t c0, size_t c1, const float* p,
                       size_t rank);
  // Rows [0, rows): out = p qt (sum over k in order), m = out - m. Returns the sum of the new m^2.
  double (*reconstruct)(float* out, float* m, size_t rows, size_t n, const float* p, const float* qt, size_t rank,
                        bool stream);
  void (*store_fence)();
};

// Tables compiled into this build (nullptr where not built), and whether this CPU runs them.
const Kernels* kernels_avx512();
const Kernels* kernels_avx2();
const Kernels& kernels_baseline();

}  // namespace powersgd::compute::cpu
