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

// errno as text (thread-safe, unlike strerror).
std::string errno_text(int err);

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

// The system-call family (docs/errors.md). Every system call goes through one of these:
//
// PSGD_CHECK_SYS(call): a POSIX call returning -1 on failure with errno set.
// Evaluates to the call's result; throws IoError naming the call, file:line and
// the errno text.
#define PSGD_CHECK_SYS(call)                                                     \
  ([&]() {                                                                       \
    auto psgd_rc_ = (call);                                                      \
    if (psgd_rc_ == -1) ::powersgd::detail::throw_system(#call, __FILE__, __LINE__, errno); \
    return psgd_rc_;                                                             \
  }())

// PSGD_CHECK_SYS_RETRY(call): as PSGD_CHECK_SYS, and reissues the call while it
// fails with EINTR (read, write, waitpid, poll, getrandom...).
#define PSGD_CHECK_SYS_RETRY(call)                                               \
  ([&]() {                                                                       \
    for (;;) {                                                                   \
      auto psgd_rc_ = (call);                                                    \
      if (psgd_rc_ != -1) return psgd_rc_;                                       \
      if (errno != EINTR) ::powersgd::detail::throw_system(#call, __FILE__, __LINE__, errno); \
    }                                                                            \
  }())

// PSGD_CHECK_SYS_MSG(call, ErrorType, ...): a call whose failure the user acts
// on (a path they gave, a file they must fix). Throws ErrorType with the
// streamed message, ": " and the errno text: "cannot create log file x: Permission denied".
#define PSGD_CHECK_SYS_MSG(call, ErrorType, ...)                                 \
  ([&]() {                                                                       \
    auto psgd_rc_ = (call);                                                      \
    if (psgd_rc_ == -1) {                                                        \
      int psgd_err_ = errno;                                                     \
      PSGD_THROW(ErrorType, __VA_ARGS__, ": ", ::powersgd::detail::errno_text(psgd_err_)); \
    }                                                                            \
    return psgd_rc_;                                                             \
  }())

// PSGD_THROW_ERRNO(ErrorType, err, ...): a failure whose errno was saved (a call
// returning a null pointer, an error reported by a child process, a stream).
#define PSGD_THROW_ERRNO(ErrorType, err, ...)                                    \
  do {                                                                           \
    int psgd_err_ = (err);                                                       \
    PSGD_THROW(ErrorType, __VA_ARGS__, ": ", ::powersgd::detail::errno_text(psgd_err_)); \
  } while (0)

// PSGD_CHECK_SYS_CTX(call, ...): PSGD_CHECK_SYS with the streamed arguments as context (what was being done, on
// which file or peer) in front of the call's text:
//   PSGD_CHECK_SYS_CTX(::open(p, O_RDONLY), "cannot open checkpoint ", p);
#define PSGD_CHECK_SYS_CTX(call, ...)                                                                 \
  ([&]() {                                                                                            \
    auto psgd_rc_ = (call);                                                                           \
    if (psgd_rc_ == -1) {                                                                             \
      const int psgd_errno_ = errno; /* before concat() may change it */                             \
      ::powersgd::detail::throw_system(#call, __FILE__, __LINE__, psgd_errno_,                        \
                                       ::powersgd::detail::concat(__VA_ARGS__));                      \
    }                                                                                                 \
    return psgd_rc_;                                                                                  \
  }())
