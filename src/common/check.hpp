// Private checking macros: the one family through which every system call and
// every invariant is checked (docs/errors.md). Not installed.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>

#include "powersgd/error.hpp"

namespace powersgd::detail {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] void throw_internal(const char* expr, const char* file, int line, const std::string& what);
[[noreturn]] void throw_system(const char* call, const char* file, int line, int err);
[[noreturn]] void throw_system(const char* call, const char* file, int line, int err, const std::string& context);

}  // namespace powersgd::detail

// Throws ErrorType with the streamed arguments as message:
//   PSGD_THROW(InvalidArgumentError, "rank must be >= 1, got ", rank);
#define PSGD_THROW(ErrorType, ...) throw ::powersgd::ErrorType(::powersgd::detail::concat(__VA_ARGS__))

// Argument check with a message naming the value and what was expected.
#define PSGD_REQUIRE(cond, ErrorType, ...) \
  do {                                     \
    if (!(cond)) PSGD_THROW(ErrorType, __VA_ARGS__); \
  } while (0)

// Internal invariant; failing it is a bug in powersgd. Active in every build type.
#define PSGD_ASSERT(cond, ...)                                                                       \
  do {                                                                                               \
    if (!(cond))                                                                                     \
      ::powersgd::detail::throw_internal(#cond, __FILE__, __LINE__, ::powersgd::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)

// POSIX call returning -1 on failure with errno set. Evaluates to the call's result.
#define PSGD_CHECK_SYS(call)                                                     \
  ([&]() {                                                                       \
    auto psgd_rc_ = (call);                                                      \
    if (psgd_rc_ == -1) ::powersgd::detail::throw_system(#call, __FILE__, __LINE__, errno); \
    return psgd_rc_;                                                             \
  }())

// The same, with the streamed arguments as context (what was being done, on
// which file or peer) in front of the call's text:
//   PSGD_CHECK_SYS_MSG(::open(p, O_RDONLY), "cannot open checkpoint ", p);
#define PSGD_CHECK_SYS_MSG(call, ...)                                                                 \
  ([&]() {                                                                                            \
    auto psgd_rc_ = (call);                                                                           \
    if (psgd_rc_ == -1) {                                                                             \
      const int psgd_errno_ = errno; /* before concat() may change it */                             \
      ::powersgd::detail::throw_system(#call, __FILE__, __LINE__, psgd_errno_,                        \
                                       ::powersgd::detail::concat(__VA_ARGS__));                      \
    }                                                                                                 \
    return psgd_rc_;                                                                                  \
  }())
