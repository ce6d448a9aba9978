// The CUDA backend's factory, inside the module (module.cpp publishes it to
// libpowersgd.so through compute/cuda_module.hpp). Private to compute/cuda.
#pragma once

#include <memory>
#include <string>

#include "compute/backend.hpp"

namespace powersgd::compute::cuda {

// Number of usable CUDA devices; 0 with `reason` saying what is missing (the
// NVIDIA driver or a device) and how to get it. Never throws.
int device_count(std::string* reason);

// A backend on device `device_index`: UnsupportedError without a device,
// InvalidArgumentError for an index out of range.
std::unique_ptr<Backend> make_backend(int device_index);

}  // namespace powersgd::compute::cuda
