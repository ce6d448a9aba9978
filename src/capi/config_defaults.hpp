// The library's psgd_config defaults, written at a caller's struct size: shared by psgd_config_init
// (capi.cpp) and the exported 0.1 psgd_config_default (config_0_1.cpp), which cannot include powersgd.h.
#pragma once

#include <cstddef>

namespace powersgd::capi {

// Writes the defaults into the first struct_size bytes at config (zeros past the fields this library knows)
// and stamps struct_size. Precondition: struct_size was checked (72 to 4096, powersgd.h); never throws.
void write_config_defaults(void* config, size_t struct_size) noexcept;

}  // namespace powersgd::capi
