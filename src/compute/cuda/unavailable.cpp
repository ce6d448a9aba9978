// The CUDA factory of a build without CUDA: the backend reports itself
// unavailable, so callers and tests take the same path as on a GPU-less host.
#include "common/check.hpp"
#include "compute/backend.hpp"

namespace powersgd::compute {

bool cuda_available() { return false; }

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  PSGD_THROW(UnsupportedError, "CUDA backend (device ", device_index,
             ") unavailable: built without CUDA; reconfigure with -Dcuda=enabled");
}

}  // namespace powersgd::compute
