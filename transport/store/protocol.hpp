// Wire protocol of the TCP store (docs/store-protocol.md), shared by the server
// and the client. Private to transport/store.
//
// Frame: u32 length (bytes that follow, little-endian) + u8 type + fields.
// Fields: str = u32 length + bytes; u64 / i64 little-endian; u8.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "store.hpp"

namespace powersgd::transport::protocol {

inline constexpr uint32_t kVersion = 1;

// Largest frame body (after the length field): a SET of the largest key and value.
inline constexpr size_t kMaxFrameBytes = kMaxValueBytes + kMaxKeyBytes + 64;
// Largest frame accepted before authentication (a HELLO with a token of up to kMaxKeyBytes).
inline constexpr size_t kMaxHelloBytes = kMaxKeyBytes + 64;
// Most keys in one WAIT, CHECK or GET_MANY.
inline constexpr size_t kMaxKeysPerRequest = 4096;

// What a server offers beyond version 1's requests: the u32 of its HELLO's Ok (a bit each). A server that
// sends none (an empty Ok, every build before GET_MANY) offers nothing; a client ignores bits it does not
// know, and version 1 clients ignore the field, so neither side needs a new protocol version.
inline constexpr uint32_t kFeatureGetMany = 1u << 0;
inline constexpr uint32_t kServerFeatures = kFeatureGetMany;

enum class Request : uint8_t {
  Hello = 1,   // u32 version, str token                -> Ok(u32 features; may be absent) | Refused | Busy | Error
  Set = 2,     // str key, str value                    -> Ok
  Get = 3,     // str key, u64 timeout_ms               -> Ok(str value) | Timeout
  Wait = 4,    // u32 n, n x str key, u64 timeout_ms    -> Ok | Timeout
  Add = 5,     // str key, i64 delta                    -> Ok(i64 new value)
  Check = 6,   // u32 n, n x str key                    -> Ok(u8 all present)
  Remove = 7,  // str key                               -> Ok(u8 existed)
  // Waits for all keys, then returns their values in the order asked; Error (connection usable) when they
  // would not fit one frame. Only where the server offers kFeatureGetMany.
  GetMany = 8,  // u32 n, n x str key, u64 timeout_ms   -> Ok(u32 n, n x str value) | Timeout | Error
};

enum class Reply : uint8_t {
  Ok = 0x80,
  Error = 0x81,    // str message; the request failed, the connection stays usable
  Timeout = 0x82,  // str message (naming the keys missing); a Get/Wait/GetMany expired on the server; after
                   // GetMany also u32 m, m x u32: the indices of the keys missing, ascending
  Refused = 0x83,  // str message; authentication failed, the server closes
  Busy = 0x84,     // str message; no room for this connection now (caps), the server closes; retry
};

// Appends fields to a frame under construction (length patched by finish()).
class Writer {
 public:
  explicit Writer(uint8_t type) : bytes_(4, 0) { bytes_.push_back(static_cast<char>(type)); }
  Writer& u8(uint8_t v) {
    bytes_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(uint32_t v) { return le(v, 4); }
  Writer& u64(uint64_t v) { return le(v, 8); }
  Writer& i64(int64_t v) { return le(static_cast<uint64_t>(v), 8); }
  Writer& str(const char* data, size_t size) {
    u32(static_cast<uint32_t>(size));
    bytes_.insert(bytes_.end(), data, data + size);
    return *this;
  }
  Writer& str(const std::string& s) { return str(s.data(), s.size()); }
  Writer& str(const std::vector<char>& s) { return str(s.data(), s.size()); }
  // Patches the length and hands the frame over; the writer is empty after.
  // `more`: bytes the caller sends after these as part of the same frame.
  std::vector<char> finish(size_t more = 0) {
    uint32_t body = static_cast<uint32_t>(bytes_.size() - 4 + more);
    for (int i = 0; i < 4; ++i) bytes_[i] = static_cast<char>((body >> (8 * i)) & 0xff);
    return std::move(bytes_);
  }

 private:
  Writer& le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  std::vector<char> bytes_;
};

// Reads fields of a received frame body (type byte excluded); every read checks
// bounds, so a malformed frame yields nullopt / false, never an overrun.
class Reader {
 public:
  Reader(const char* data, size_t size) : p_(data), end_(data + size) {}
  std::optional<uint8_t> u8() {
    if (end_ - p_ < 1) return std::nullopt;
    return static_cast<uint8_t>(*p_++);
  }
  std::optional<uint32_t> u32() {
    auto v = le(4);
    if (!v) return std::nullopt;
    return static_cast<uint32_t>(*v);
  }
  std::optional<uint64_t> u64() { return le(8); }
  std::optional<int64_t> i64() {
    auto v = le(8);
    if (!v) return std::nullopt;
    return static_cast<int64_t>(*v);
  }
  // A string of at most max_bytes.
  std::optional<std::string> str(size_t max_bytes) {
    auto n = u32();
    if (!n || *n > max_bytes || static_cast<size_t>(end_ - p_) < *n) return std::nullopt;
    std::string s(p_, *n);
    p_ += *n;
    return s;
  }
  bool done() const { return p_ == end_; }

 private:
  std::optional<uint64_t> le(int n) {
    if (end_ - p_ < n) return std::nullopt;
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p_[i])) << (8 * i);
    p_ += n;
    return v;
  }
  const char* p_;
  const char* end_;
};

inline uint32_t decode_u32(const unsigned char* b) {
  return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 | static_cast<uint32_t>(b[2]) << 16 |
         static_cast<uint32_t>(b[3]) << 24;
}

}  // namespace powersgd::transport::protocol
