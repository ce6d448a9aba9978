// Minimal leveled logging to stderr, one line per call, prefixed with the rank
// when known. Level from PSGD_LOG_LEVEL. Thread-safe.
#pragma once

#include "check.hpp"

namespace powersgd::log {

enum class Level { Error = 0, Warn = 1, Info = 2, Debug = 3 };

bool enabled(Level level);
void write(Level level, const std::string& message);
void set_rank(int rank);  // prefix for later lines; -1 for none

}  // namespace powersgd::log

#define PSGD_LOG(level, ...)                                                     \
  do {                                                                           \
    if (::powersgd::log::enabled(::powersgd::log::Level::level))                 \
      ::powersgd::log::write(::powersgd::log::Level::level, ::powersgd::detail::concat(__VA_ARGS__)); \
  } while (0)
