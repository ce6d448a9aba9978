#include "engine/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "common/check.hpp"
#include "common/fd.hpp"

namespace powersgd::engine {
namespace {

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t crc;
  uint64_t payload_bytes;
};
static_assert(sizeof(Header) == 24);

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320U ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr auto kCrcTable = make_crc_table();

void write_fully(int fd, const void* data, size_t size, const std::string& path) {
  if (int err = write_all(fd, data, size); err != 0) PSGD_THROW_ERRNO(IoError, err, "writing checkpoint ", path);
}

// Reads up to `size` bytes; returns how many (fewer only at end of file).
size_t read_some(int fd, void* data, size_t size, const std::string& path) {
  char* p = static_cast<char*>(data);
  size_t total = 0;
  while (total < size) {
    ssize_t n = ::read(fd, p + total, size - total);
    if (n < 0 && errno == EINTR) continue;
    PSGD_REQUIRE(n >= 0, IoError, "reading checkpoint ", path, ": ", std::strerror(errno));
    if (n == 0) break;
    total += static_cast<size_t>(n);
  }
  return total;
}

}  // namespace

uint32_t crc32(const void* data, size_t size) {
  uint32_t c = 0xFFFFFFFFU;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) c = kCrcTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFU;
}

void Writer::put_bytes(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  bytes_.insert(bytes_.end(), p, p + size);
}

void Reader::get_bytes(void* out, size_t size, const char* field) {
  PSGD_REQUIRE(size <= bytes_.size() - pos_, IoError, "checkpoint ", path_, " is malformed: it ends inside ", field);
  if (size > 0) std::memcpy(out, bytes_.data() + pos_, size);
  pos_ += size;
}

void write_checkpoint(const std::string& path, const std::vector<char>& payload) {
  Header header{};
  std::memcpy(header.magic, kCheckpointMagic, sizeof(header.magic));
  header.version = kCheckpointVersion;
  header.crc = crc32(payload.data(), payload.size());
  header.payload_bytes = payload.size();
  const std::string tmp = path + ".tmp";
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  PSGD_REQUIRE(fd.get() >= 0, IoError, "cannot create checkpoint file ", tmp, ": ", std::strerror(errno));
  write_fully(fd.get(), &header, sizeof(header), tmp);
  write_fully(fd.get(), payload.data(), payload.size(), tmp);
  PSGD_REQUIRE(::fsync(fd.get()) == 0, IoError, "fsync of checkpoint ", tmp, ": ", std::strerror(errno));
  PSGD_REQUIRE(::close(fd.release()) == 0, IoError, "closing checkpoint ", tmp, ": ", std::strerror(errno));
  PSGD_REQUIRE(::rename(tmp.c_str(), path.c_str()) == 0, IoError, "renaming checkpoint ", tmp, " to ", path, ": ",
               std::strerror(errno));
}

std::vector<char> read_checkpoint(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  PSGD_REQUIRE(fd.get() >= 0, IoError, "cannot open checkpoint ", path, ": ", std::strerror(errno));
  Header header{};
  const size_t got = read_some(fd.get(), &header, sizeof(header), path);
  PSGD_REQUIRE(got == sizeof(header), IoError, "checkpoint ", path, " is truncated: ", got,
               " bytes, shorter than its ", sizeof(header), "-byte header");
  PSGD_REQUIRE(std::memcmp(header.magic, kCheckpointMagic, sizeof(header.magic)) == 0, IoError, "file ", path,
               " is not a powersgd checkpoint (bad magic)");
  PSGD_REQUIRE(header.version == kCheckpointVersion, IoError, "checkpoint ", path, " has format version ",
               header.version, ": this build reads version ", kCheckpointVersion);
  struct stat st {};
  PSGD_CHECK_SYS(::fstat(fd.get(), &st));
  const uint64_t actual = static_cast<uint64_t>(st.st_size) - sizeof(header);
  PSGD_REQUIRE(actual == header.payload_bytes, IoError, "checkpoint ", path, " is ",
               actual < header.payload_bytes ? "truncated" : "longer than recorded", ": payload of ", actual,
               " bytes, header says ", header.payload_bytes);
  std::vector<char> payload(header.payload_bytes);
  const size_t read = read_some(fd.get(), payload.data(), payload.size(), path);
  PSGD_REQUIRE(read == payload.size(), IoError, "checkpoint ", path, " is truncated: read ", read, " of ",
               payload.size(), " payload bytes");
  const uint32_t crc = crc32(payload.data(), payload.size());
  PSGD_REQUIRE(crc == header.crc, IoError, "checkpoint ", path, " is corrupted: CRC-32 of the payload is ", crc,
               ", header says ", header.crc);
  return payload;
}

}  // namespace powersgd::engine
