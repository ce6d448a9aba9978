// Checkpoint file framing: a versioned header with the payload's length and
// CRC-32, then the payload (little-endian fields; docs/engine.md lists them).
// The Reducer composes the payload with Writer and parses it with Reader.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace powersgd::engine {

inline constexpr char kCheckpointMagic[8] = {'P', 'S', 'G', 'D', 'C', 'K', 'P', 'T'};
inline constexpr uint32_t kCheckpointVersion = 1;

uint32_t crc32(const void* data, size_t size);

class Writer {
 public:
  template <typename T>
  void put(const T& value) { put_bytes(&value, sizeof(T)); }
  void put_bytes(const void* data, size_t size);
  const std::vector<char>& bytes() const { return bytes_; }

 private:
  std::vector<char> bytes_;
};

// Reads a payload; running past its end throws IoError naming `path` and the field.
class Reader {
 public:
  Reader(const std::vector<char>& bytes, std::string path) : bytes_(bytes), path_(std::move(path)) {}
  template <typename T>
  T get(const char* field) {
    T value;
    get_bytes(&value, sizeof(T), field);
    return value;
  }
  void get_bytes(void* out, size_t size, const char* field);
  bool at_end() const { return pos_ == bytes_.size(); }

 private:
  const std::vector<char>& bytes_;
  std::string path_;
  size_t pos_ = 0;
};

// Writes header + payload to `path` through a temporary file and rename(), so a
// crash never leaves a half-written checkpoint under `path`. Throws IoError.
void write_checkpoint(const std::string& path, const std::vector<char>& payload);

// Reads and verifies the header, length and checksum; returns the payload.
// Throws IoError naming the path and what is wrong (missing, truncated,
// not a checkpoint, unknown version, checksum mismatch).
std::vector<char> read_checkpoint(const std::string& path);

}  // namespace powersgd::engine
