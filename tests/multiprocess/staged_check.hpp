// Shared by the multiprocess tests that have host-staged variants (Meson's *-staged-* cases).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "support/doctest_main.hpp"

namespace powersgd::testing {

// With PSGD_HOST_STAGE=1 (Meson's staged variants, pretend hosts from PSGD_TEST_HOSTS): requires that the
// communicator is staged over those hosts, so a staged variant cannot pass unstaged. Whether it is staged.
inline bool require_staged_if_asked(const Communicator& comm) {
  const char* stage = std::getenv("PSGD_HOST_STAGE");
  if (stage == nullptr || std::string(stage) != "1") return false;
  const auto names = testing::pretend_hosts();
  std::vector<std::string> hosts;
  for (const auto& name : names)
    if (std::find(hosts.begin(), hosts.end(), name) == hosts.end()) hosts.push_back(name);
  const auto* gloo = dynamic_cast<const powersgd::transport::GlooCommunicator*>(&comm);
  REQUIRE(gloo != nullptr);
  REQUIRE(gloo->staged_hosts() == static_cast<int>(hosts.size()));
  return true;
}

}  // namespace powersgd::testing
