// Test helper: a C API communicator of one rank, made through
// psgd_comm_init_from_env as a C caller would make it; the environment it
// needs is set for the call only. Shared by the engine, policy and wire tests.
#pragma once

#include <doctest/doctest.h>
#include <stdlib.h>

#include "powersgd/powersgd.h"

namespace powersgd::test {

inline psgd_comm* c_comm_of_one() {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  psgd_comm* comm = nullptr;
  const psgd_status status = psgd_comm_init_from_env(&comm);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  REQUIRE(status == PSGD_OK);
  return comm;
}

}  // namespace powersgd::test
