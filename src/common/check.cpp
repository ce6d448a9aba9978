#include "check.hpp"

namespace powersgd::detail {

void throw_internal(const char* expr, const char* file, int line, const std::string& what) {
  throw InternalError(concat("internal error: ", expr, " failed at ", file, ":", line,
                             what.empty() ? "" : ": ", what, " (please report this bug)"));
}

void throw_system(const char* call, const char* file, int line, int err) {
  throw IoError(concat(call, " failed at ", file, ":", line, ": ", errno_text(err)));
}

std::string errno_text(int err) {
  char buffer[256];
  // GNU strerror_r: returns the text, in `buffer` or a static string.
  return strerror_r(err, buffer, sizeof(buffer));
}

void throw_system(const char* call, const char* file, int line, int err, const std::string& context) {
  throw IoError(concat(context, ": ", call, " failed at ", file, ":", line, ": ", errno_text(err)));
}

}  // namespace powersgd::detail
