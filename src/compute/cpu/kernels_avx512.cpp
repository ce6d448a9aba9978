// The fused row kernels for AVX-512 (16 floats per vector), compiled with
// -mavx512f -mavx512dq -mavx512vl -mavx512bw -mfma (meson.build); run only
// where the CPU and the OS support them (kernels_avx512()).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "compute/cpu/kernels.hpp"

namespace powersgd::compute::cpu {
namespace {

constexpr size_t kW = 16;
using vf = float __attribute__((vector_size(64)));
using vd = double __attribute__((vector_size(64)));
inline vf madd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vd madd(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
// One vcvtps2pd of each 256-bit half (GCC 12 splits __builtin_convertvector of
// a shuffled half into 128-bit pieces and inserts, which slowed every pass);
// halves taken by shuffles (GCC 12 warns about the undefined parts inside
// _mm512_castps512_ps256, _mm512_extractf32x8_ps and _mm512_cvtps_pd; the
// zero-masked conversion is the same instruction).
inline vd to_double_lo(vf x) { return _mm512_maskz_cvtps_pd(0xff, __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)); }
inline vd to_double_hi(vf x) { return _mm512_maskz_cvtps_pd(0xff, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15)); }
inline void stream(float* p, vf v) { _mm512_stream_ps(p, v); }
void fence() { _mm_sfence(); }

#include "compute/cpu/kernels_impl.hpp"

constexpr Kernels kTable{"avx512", kW, form_project_entry, project_cols_entry, reconstruct_entry, fence};

}  // namespace

const Kernels* kernels_avx512() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("fma");
  return ok ? &kTable : nullptr;
}

}  // namespace powersgd::compute::cpu
