// Test helper: the message of the powersgd::Error that fn throws, or "" when it
// throws none. Shared by the engine and checkpoint tests.
#pragma once

#include <functional>
#include <string>

#include "powersgd/error.hpp"

namespace powersgd::test {

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace powersgd::test
