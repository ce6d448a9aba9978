// The C API's boundary out of host memory (docs/errors.md, "C API: one boundary"): where even the error's
// message cannot be allocated, the call still returns a status and psgd_last_error() a fixed message; no
// exception leaves the C function (through a C or ctypes caller: std::terminate). This binary replaces the
// global operator new to refuse every allocation while `refuse_allocations` is set on the calling thread.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "powersgd/powersgd.h"

// AddressSanitizer: GCC says so by a macro, clang by a feature.
#if defined(__SANITIZE_ADDRESS__)
#define PSGD_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PSGD_TEST_ASAN 1
#endif
#endif

namespace {
thread_local bool refuse_allocations = false;
}  // namespace

// Not under AddressSanitizer, whose own operators new and delete (the array, aligned and nothrow forms this file
// does not replace) would meet these in one allocation's life: the binary exits 77 there (skipped).
#if !defined(PSGD_TEST_ASAN)
// GCC pairs the replaced operators with malloc/free itself and warns of a mismatch that is none here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t size) {
  if (refuse_allocations) throw std::bad_alloc();
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
#endif

TEST_CASE("C API out of host memory: the error's message cannot be allocated; a status and a fixed message") {
  refuse_allocations = true;
  const psgd_status refused = psgd_config_validate(nullptr);  // its InvalidArgumentError cannot be built either
  refuse_allocations = false;
  CHECK(refused == PSGD_ERR_INTERNAL);
  CHECK(std::string(psgd_last_error()) == "psgd_config_validate: out of host memory");
  // With memory again, the message is the error's own.
  CHECK(psgd_config_validate(nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("psgd_config_validate: argument 'config' is null") == 0);
}

int main(int argc, char** argv) {
#if defined(PSGD_TEST_ASAN)
  std::printf("test_capi_oom: skipped under AddressSanitizer (it replaces operator new)\n");
  return 77;
#endif
  return powersgd::testing::run_selected_tests(argc, argv);
}
