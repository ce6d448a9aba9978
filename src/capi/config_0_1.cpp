// The exported symbol psgd_config_default, frozen at powersgd 0.1's layout for binaries built against the
// 0.1 header, which declared `psgd_config psgd_config_default(void)` in the library. Since 0.2 the header's
// psgd_config_default is an inline wrapper of psgd_config_init stamping the caller's sizeof; this symbol
// stays for old binaries and returns exactly the 72 bytes they reserved (x86-64 and AArch64 return a struct
// this large through a pointer to the caller's object: a larger struct would overwrite its neighbours).
// This file must not include powersgd.h: its inline psgd_config_default would clash with this definition.
#include <cstddef>
#include <cstdint>

#include "capi/config_defaults.hpp"
#include "powersgd/export.h"

namespace powersgd::capi {

// psgd_config as the 0.1 header declared it (tests/abi/powersgd_0_1.h). Never changes.
struct ConfigV01 {
  size_t struct_size;
  int rank;
  int64_t start_iter;
  double min_compression_rate;
  int error_feedback;
  int warm_start;
  double orthogonalization_epsilon;
  uint64_t seed;
  int batch_same_shape;
  int whole_bucket;
  int device;
  int device_index;
};
static_assert(sizeof(ConfigV01) == 72 && offsetof(ConfigV01, device_index) == 68, "the 0.1 layout is frozen");

}  // namespace powersgd::capi

extern "C" PSGD_API powersgd::capi::ConfigV01 psgd_config_default(void) {
  powersgd::capi::ConfigV01 config;
  powersgd::capi::write_config_defaults(&config, sizeof(config));  // struct_size = 72: every later field defaults
  return config;
}
