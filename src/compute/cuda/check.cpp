#include "compute/cuda/check.hpp"

#include "common/check.hpp"

namespace powersgd::compute::cuda {

void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  // Cleared, so that the next launch's cudaGetLastError() does not report this error as its own (an out of
  // memory for QR's scratch failed the next step too). A sticky error stays whatever is done here.
  cudaGetLastError();
  PSGD_THROW(IoError, "CUDA call ", call, " failed at ", file, ":", line, ": ", cudaGetErrorName(status), " (",
             cudaGetErrorString(status), ")");
}

void check(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  PSGD_THROW(IoError, "cuBLAS call ", call, " failed at ", file, ":", line, ": ", cublasGetStatusName(status), " (",
             cublasGetStatusString(status), ")");
}

void check(cusolverStatus_t status, const char* call, const char* file, int line) {
  if (status == CUSOLVER_STATUS_SUCCESS) return;
  // cuSOLVER has no status-to-string function; the enum value is in cusolver_common.h.
  PSGD_THROW(IoError, "cuSOLVER call ", call, " failed at ", file, ":", line, ": cusolverStatus_t ",
             static_cast<int>(status));
}

}  // namespace powersgd::compute::cuda
