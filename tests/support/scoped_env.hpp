// Test helper: an environment variable set for a scope (tests/multiprocess, tests/unit).
#pragma once

#include <stdlib.h>

#include <optional>
#include <string>

namespace powersgd::test {

// Sets an environment variable for a scope and restores what it was (unset where it was), whatever leaves it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace powersgd::test
