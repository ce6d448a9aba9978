// The contract between libpowersgd.so and the CUDA backend module
// (libpowersgd-cuda.so), which the library loads with dlopen the first time a
// reducer asks for Device::Cuda (docs/compute.md, "The CUDA module").
//
// The module exports one C symbol, kCudaModuleEntryPoint, returning a
// CudaModuleTable. The symbol's name fixes the table's first two fields (seam_abi,
// version) for good, so a library can always read them and refuse a module that
// does not belong to it; everything after them is valid only when both match.
// Private to the compute layer and the module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "compute/backend.hpp"

namespace powersgd::compute {

// Bump when Backend's virtual interface, DeviceBuffer, the error types the
// module throws, or CudaModuleTable after its first two fields change: a module
// and a library with different numbers refuse each other.
inline constexpr uint32_t kComputeSeamAbi = 1;

inline constexpr const char* kCudaModuleEntryPoint = "psgd_cuda_module_v1";

struct CudaModuleTable {
  uint32_t seam_abi;    // kComputeSeamAbi the module was built with
  const char* version;  // PSGD_VERSION of the build that made the module
  // Number of usable CUDA devices; 0 with `reason` (up to reason_size bytes,
  // NUL-terminated) saying what is missing: the driver or a device. Never throws.
  int (*device_count)(char* reason, size_t reason_size);
  // A backend on device `device_index`. Throws powersgd errors (UnsupportedError
  // without a device, InvalidArgumentError for an index out of range).
  std::unique_ptr<Backend> (*create)(int device_index);
};

}  // namespace powersgd::compute

// The entry point's type, as the loader casts the dlsym result.
using psgd_cuda_module_entry = const powersgd::compute::CudaModuleTable* (*)();
