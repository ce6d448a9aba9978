// Test helpers: the message of the powersgd::Error that fn throws, or "" when it
// throws none; and its code and message with the time it took. Shared by the
// engine, checkpoint and multiprocess tests.
#pragma once

#include <chrono>
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

// The error code and message fn throws (code 0 and "" when it throws none), and how long it took.
struct Outcome {
  int code = 0;
  std::string message;
  double seconds = 0;
};
inline Outcome outcome_of(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  Outcome o;
  try {
    fn();
  } catch (const Error& e) {
    o.code = static_cast<int>(e.code());
    o.message = e.what();
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

}  // namespace powersgd::test
