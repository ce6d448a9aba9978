// The module's one exported symbol: the table through which libpowersgd.so
// uses this backend (compute/cuda_module.hpp). Everything else in the module is
// hidden (module.map).
#include <cstdio>
#include <string>

#include "compute/cuda/backend.hpp"
#include "compute/cuda_module.hpp"
#include "powersgd_build_config.h"

namespace {

using powersgd::compute::Backend;
using powersgd::compute::CudaModuleTable;

int device_count(char* reason, size_t reason_size) {
  std::string why;
  int count = 0;
  try {
    count = powersgd::compute::cuda::device_count(&why);
  } catch (const std::exception& e) {  // only bad_alloc can get here
    why = e.what();
  }
  if (count == 0 && reason_size > 0) std::snprintf(reason, reason_size, "%s", why.c_str());
  return count;
}

std::unique_ptr<Backend> create(int device_index) { return powersgd::compute::cuda::make_backend(device_index); }

constexpr CudaModuleTable kTable{powersgd::compute::kComputeSeamAbi, PSGD_VERSION, &device_count, &create};

}  // namespace

// The name is kCudaModuleEntryPoint (cuda_module.hpp).
extern "C" __attribute__((visibility("default"))) const CudaModuleTable* psgd_cuda_module_v1() { return &kTable; }
