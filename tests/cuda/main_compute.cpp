// Entry point of test_compute_cuda: the cases of tests/unit/test_compute.cpp on
// the CUDA backend. Exits 77 (Meson: skipped) when no CUDA device is usable.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <cstdio>
#include <string>

#include "compute/backend.hpp"

int main(int argc, char** argv) {
  if (const std::string reason = powersgd::compute::cuda_unavailable_reason(); !reason.empty()) {
    std::printf("test_compute_cuda: skipping: %s\n", reason.c_str());
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}
