// The fused row kernels for AVX2 with FMA (8 floats per vector), compiled with
// -mavx2 -mfma (meson.build); run only where the CPU supports them (kernels_avx2()).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "compute/cpu/kernels.hpp"

namespace powersgd::compute::cpu {
namespace {

constexpr size_t kW = 8;
using vf = float __attribute__((vector_size(32)));
using vd = double __attribute__((vector_size(32)));
inline vf madd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vd madd(vd a, vd b, vd c) { return _mm256_fmadd_pd(a, b, c); }
// One vcvtps2pd of each 128-bit half (see kernels_avx512.cpp).
inline vd to_double_lo(vf x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
inline vd to_double_hi(vf x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }
inline void stream(float* p, vf v) { _mm256_stream_ps(p, v); }
void fence() { _mm_sfence(); }

#include "compute/cpu/kernels_impl.hpp"

constexpr Kernels kTable{"avx2", kW, form_project_entry, project_cols_entry, reconstruct_entry, fence};

}  // namespace

const Kernels* kernels_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &kTable : nullptr;
}

}  // namespace powersgd::compute::cpu
