// Error types of the C++ API. Policy: docs/errors.md.
//
// Every failure the library reports is a powersgd::Error (or a subclass) carrying
// a code that maps 1:1 onto the C API's psgd_status, and a message that names the
// offending value and what was expected.
#pragma once

// Every C++ header of the API includes this one: below C++20 it says so
// before std::span and friends fail (from C or older C++: powersgd.h).
#if !defined(__cplusplus) || __cplusplus <= 201703L
#error "powersgd's C++ headers need C++20 (g++ -std=c++20; CMake: powersgd::powersgd sets it); from C or an older C++ use powersgd/powersgd.h"
#endif

#include <stdexcept>
#include <string>

#include "powersgd/export.h"

namespace powersgd {

// Values equal the C API's psgd_status codes.
enum class ErrorCode : int {
  InvalidArgument = 1,  // a caller-supplied value is out of its documented range
  Io = 2,               // system call, file, socket or peer failure
  Timeout = 3,          // an operation exceeded its configured timeout
  Mismatch = 4,         // ranks (or a checkpoint) disagree on configuration or layout
  NonFinite = 5,        // NaN or Inf found in input data
  Unsupported = 6,      // feature not built in or not available on this host
  Internal = 7,         // broken invariant: a bug in powersgd
};

PSGD_API const char* to_string(ErrorCode code) noexcept;

class PSGD_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

class PSGD_API InvalidArgumentError : public Error {
 public:
  explicit InvalidArgumentError(const std::string& m) : Error(ErrorCode::InvalidArgument, m) {}
};

class PSGD_API IoError : public Error {
 public:
  explicit IoError(const std::string& m) : Error(ErrorCode::Io, m) {}
};

class PSGD_API TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& m) : Error(ErrorCode::Timeout, m) {}
};

class PSGD_API MismatchError : public Error {
 public:
  explicit MismatchError(const std::string& m) : Error(ErrorCode::Mismatch, m) {}
};

class PSGD_API NonFiniteError : public Error {
 public:
  explicit NonFiniteError(const std::string& m) : Error(ErrorCode::NonFinite, m) {}
};

class PSGD_API UnsupportedError : public Error {
 public:
  explicit UnsupportedError(const std::string& m) : Error(ErrorCode::Unsupported, m) {}
};

class PSGD_API InternalError : public Error {
 public:
  explicit InternalError(const std::string& m) : Error(ErrorCode::Internal, m) {}
};

// A collective failed because of one peer (it closed the connection, reset it,
// or stopped answering). `code()` is Io, or Timeout for a stalled peer.
class PSGD_API PeerError : public Error {
 public:
  PeerError(ErrorCode code, std::string operation, int peer, const std::string& message)
      : Error(code, message), operation_(std::move(operation)), peer_(peer) {}
  const std::string& operation() const noexcept { return operation_; }
  int peer() const noexcept { return peer_; }  // -1 when the peer is unknown

 private:
  std::string operation_;
  int peer_;
};

}  // namespace powersgd
