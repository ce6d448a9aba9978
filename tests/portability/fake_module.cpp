// A module with the CUDA module's entry point and the numbers of another build
// (seam ABI 1000, or version 0.0.0-other): the library must refuse it before
// calling anything else in it (cuda_split.sh, scenario mismatch). No CUDA.
#include <string>

#include "compute/cuda_module.hpp"
#include "powersgd_build_config.h"

namespace {

using powersgd::compute::Backend;
using powersgd::compute::CudaModuleTable;

int refuse_count(char* reason, size_t reason_size) {
  if (reason_size > 0) reason[0] = '\0';
  return 0;
}

std::unique_ptr<Backend> refuse_create(int) { return nullptr; }

#ifdef FAKE_OTHER_ABI
constexpr CudaModuleTable kTable{1000, PSGD_VERSION, &refuse_count, &refuse_create};
#else
constexpr CudaModuleTable kTable{powersgd::compute::kComputeSeamAbi, "0.0.0-other", &refuse_count, &refuse_create};
#endif

}  // namespace

extern "C" __attribute__((visibility("default"))) const CudaModuleTable* psgd_cuda_module_v1() { return &kTable; }
