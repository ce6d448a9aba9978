// The fused row kernels for the build's baseline instruction set (SSE2 on
// x86-64: 4 floats per vector, no FMA; GCC vector extensions elsewhere), built
// with the layer's flags: the table every CPU runs, and the narrowest one the
// tests compare the others with.
#include <cstddef>
#include <cstdint>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "compute/cpu/kernels.hpp"

namespace powersgd::compute::cpu {
namespace {

constexpr size_t kW = 4;
using vf = float __attribute__((vector_size(16)));
using vd = double __attribute__((vector_size(16)));
inline vf madd(vf a, vf b, vf c) { return a * b + c; }  // -ffp-contract=off: a multiply, then an add
inline vd madd(vd a, vd b, vd c) { return a * b + c; }
inline vd to_double_lo(vf x) { return __builtin_convertvector(__builtin_shufflevector(x, x, 0, 1), vd); }
inline vd to_double_hi(vf x) { return __builtin_convertvector(__builtin_shufflevector(x, x, 2, 3), vd); }
#if defined(__SSE2__)
inline void stream(float* p, vf v) { _mm_stream_ps(p, v); }
void fence() { _mm_sfence(); }
constexpr const char* kName = "sse2";
#else
inline void stream(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
void fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
constexpr const char* kName = "portable";
#endif

#include "compute/cpu/kernels_impl.hpp"

constexpr Kernels kTable{kName, kW, form_project_entry, project_cols_entry, reconstruct_entry, fence};

}  // namespace

const Kernels& kernels_baseline() { return kTable; }

}  // namespace powersgd::compute::cpu
