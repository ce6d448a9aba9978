// The two LAPACK routines the CPU backend uses, declared by hand: Debian builds
// OpenBLAS with LAPACK but without LAPACKE (NO_LAPACKE=1), so only the Fortran
// symbols exist. Fortran passes every argument by pointer and stores matrices
// column-major; OpenBLAS on Debian uses 32-bit integers (libopenblas64 is the
// 64-bit-integer variant, not linked here).
#pragma once

extern "C" {

// QR factorization A = Q R of an m x n column-major matrix: R in the upper
// triangle, Householder reflectors below it and in tau (min(m, n) of them).
void sgeqrf_(const int* m, const int* n, float* a, const int* lda, float* tau, float* work, const int* lwork,
             int* info);

// Forms the m x n matrix Q (m >= n >= k) from the first k reflectors left by sgeqrf_.
void sorgqr_(const int* m, const int* n, const int* k, float* a, const int* lda, const float* tau, float* work,
             const int* lwork, int* info);

}  // extern "C"
