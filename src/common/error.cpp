#include "powersgd/error.hpp"

namespace powersgd {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::InvalidArgument: return "invalid argument";
    case ErrorCode::Io: return "I/O error";
    case ErrorCode::Timeout: return "timeout";
    case ErrorCode::Mismatch: return "mismatch";
    case ErrorCode::NonFinite: return "non-finite value";
    case ErrorCode::Unsupported: return "unsupported";
    case ErrorCode::Internal: return "internal error";
  }
  return "unknown error";
}

}  // namespace powersgd
