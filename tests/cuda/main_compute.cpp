// Entry point of test_compute_cuda: the cases of tests/unit/test_compute.cpp on
// the CUDA backend. Exits 77 (Meson: skipped) when no CUDA device is usable.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <cstdio>

#include "compute/backend.hpp"

int main(int argc, char** argv) {
  if (!powersgd::compute::cuda_available()) {
    std::puts("test_compute_cuda: no usable CUDA device on this host; skipping");
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}
