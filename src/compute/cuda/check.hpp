// The one checking macro for CUDA runtime, cuBLAS and cuSOLVER calls: a failed
// call throws a powersgd error naming the call, its status and file:line.
// Usable from host code compiled by g++ and by nvcc. Private to compute/cuda.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

namespace powersgd::compute::cuda {

// Throw when `status` is not success. Out-of-memory throws IoError naming the
// call; every other failure throws IoError as well (the device, driver or
// library failed), with the library's status name.
void check(cudaError_t status, const char* call, const char* file, int line);
void check(cublasStatus_t status, const char* call, const char* file, int line);
void check(cusolverStatus_t status, const char* call, const char* file, int line);

}  // namespace powersgd::compute::cuda

#define PSGD_CUDA_CHECK(call) ::powersgd::compute::cuda::check((call), #call, __FILE__, __LINE__)
