// File store: one file per key under directory/prefix/, for jobs whose ranks
// share a filesystem. Writers publish with rename(), which is atomic, so a
// reader sees either no file or the whole value.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <filesystem>
#include <optional>
#include <random>
#include <thread>

#include "common/check.hpp"
#include "common/fd.hpp"
#include "store.hpp"

namespace powersgd::transport {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void sys_error(const char* call, const std::string& path) {
  PSGD_THROW_ERRNO(IoError, errno, "file store: ", call, " of ", path, " failed");
}

uint64_t fnv1a(const std::string& s, uint64_t basis) {
  uint64_t h = basis;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// File name of a key: bytes outside [A-Za-z0-9_-] are escaped as %XX, so names
// of keys never contain '.', which keeps them apart from temp and lock files.
// Names that would pass NAME_MAX are cut and completed by a 128-bit hash of
// the key ('~' never appears in an escaped name).
std::string file_name(const std::string& key) {
  static const char hex[] = "0123456789abcdef";
  std::string name;
  for (unsigned char c : key) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-') {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += hex[c >> 4];
      name += hex[c & 15];
    }
  }
  if (name.empty()) return "%";
  if (name.size() <= 200) return name;
  char digest[34];
  std::snprintf(digest, sizeof digest, "~%016llx%016llx",
                static_cast<unsigned long long>(fnv1a(key, 0xcbf29ce484222325ull)),
                static_cast<unsigned long long>(fnv1a(key, 0x84222325cbf29ce4ull)));
  return name.substr(0, 100) + digest;
}

// Reads the whole file; nullopt when it does not exist.
std::optional<std::vector<char>> read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    sys_error("open", path);
  }
  std::vector<char> data;
  char buffer[65536];
  for (;;) {
    ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      errno = err;
      sys_error("read", path);
    }
    if (n == 0) break;
    data.insert(data.end(), buffer, buffer + n);
  }
  ::close(fd);
  return data;
}

bool exists(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT) return false;
  sys_error("stat", path);
}

class FileStore final : public Store {
 public:
  FileStore(const std::string& directory, const std::string& prefix, std::chrono::milliseconds timeout)
      : dir_(std::filesystem::path(directory) / prefix) {
    set_timeout(timeout);
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) PSGD_THROW(IoError, "file store: cannot create directory ", dir_.string(), ": ", ec.message());
  }

  void set(const std::string& key, const std::vector<char>& value) override {
    check_key(key);
    PSGD_REQUIRE(value.size() <= kMaxValueBytes, InvalidArgumentError, "store value for key '", key, "' is ",
                 value.size(), " bytes, the limit is ", kMaxValueBytes);
    publish(path(key), value);
  }

  using Store::get;
  std::vector<char> get(const std::string& key, std::chrono::milliseconds limit) override {
    check_key(key);
    std::string p = path(key);
    auto deadline = Clock::now() + limit;
    for (auto delay = std::chrono::milliseconds(1);; delay = std::min(delay * 2, std::chrono::milliseconds(20))) {
      if (auto value = read_file(p)) return *value;
      if (Clock::now() >= deadline)
        PSGD_THROW(TimeoutError, "store get of key '", key, "' timed out after ", limit.count(), " ms (file store ",
                   dir_.string(), ")");
      std::this_thread::sleep_for(std::min(delay, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      deadline - Clock::now() + std::chrono::milliseconds(1))));
    }
  }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& limit) override {
    auto deadline = Clock::now() + limit;
    for (auto delay = std::chrono::milliseconds(1);; delay = std::min(delay * 2, std::chrono::milliseconds(20))) {
      if (check(keys)) return;
      if (Clock::now() >= deadline) {
        std::string missing;
        for (const auto& k : keys)
          if (!exists(path(k))) missing += (missing.empty() ? "'" : ", '") + k + "'";
        PSGD_THROW(TimeoutError, "store wait for key(s) ", missing, " timed out after ", limit.count(),
                   " ms (file store ", dir_.string(), ")");
      }
      std::this_thread::sleep_for(delay);
    }
  }

  int64_t add(const std::string& key, int64_t delta) override {
    check_key(key);
    std::string p = path(key);
    std::string lock_path = p + ".lock";
    int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) sys_error("open", lock_path);
    // The lock dies with its process, so a crashed writer never wedges the counter; a stalled one (stopped, in
    // a debugger) holds it at most the store's timeout. (On NFS the request itself is a call to the server's
    // lock daemon: one that does not answer is not bounded here.)
    const auto deadline = Clock::now() + timeout();
    for (auto delay = std::chrono::milliseconds(1); ::flock(fd, LOCK_EX | LOCK_NB) != 0;
         delay = std::min(delay * 2, std::chrono::milliseconds(20))) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err != EWOULDBLOCK || Clock::now() >= deadline) {
        ::close(fd);
        if (err == EWOULDBLOCK)
          PSGD_THROW(TimeoutError, "store add on key '", key, "' timed out after ", timeout().count(),
                     " ms waiting for the lock ", lock_path, " (file store ", dir_.string(), ")");
        errno = err;
        sys_error("flock", lock_path);
      }
      std::this_thread::sleep_for(delay);
    }
    struct Unlock {
      int fd;
      ~Unlock() { ::close(fd); }
    } unlock{fd};
    int64_t current = 0;
    if (auto value = read_file(p)) {
      auto [end, ec] = std::from_chars(value->data(), value->data() + value->size(), current);
      PSGD_REQUIRE(ec == std::errc() && end == value->data() + value->size(), InvalidArgumentError,
                   "store add on key '", key, "', whose value is not a decimal 64-bit integer");
    }
    int64_t result = 0;
    PSGD_REQUIRE(!__builtin_add_overflow(current, delta, &result), InvalidArgumentError, "store add of ", delta,
                 " to key '", key, "' (value ", current, ") overflows a 64-bit integer");
    std::string text = std::to_string(result);
    publish(p, std::vector<char>(text.begin(), text.end()));
    return result;
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) {
      check_key(k);
      if (!exists(path(k))) return false;
    }
    return true;
  }

  bool remove(const std::string& key) override {
    check_key(key);
    std::string p = path(key);
    if (::unlink(p.c_str()) == 0) return true;
    if (errno == ENOENT) return false;
    sys_error("unlink", p);
  }

 private:
  static void check_key(const std::string& key) {
    PSGD_REQUIRE(key.size() <= kMaxKeyBytes, InvalidArgumentError, "store key of ", key.size(),
                 " bytes is over the limit of ", kMaxKeyBytes, " bytes");
  }

  std::string path(const std::string& key) const { return (dir_ / file_name(key)).string(); }

  // Writes a uniquely named temp file next to the target, then renames it over.
  void publish(const std::string& target, const std::vector<char>& value) {
    static std::atomic<uint64_t> counter{0};
    // Processes of other hosts share the directory and may have the same pid (containers, or by chance): a
    // random number of this process's too.
    static const uint64_t process_nonce = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
    std::string tmp = (dir_ / detail::concat(".tmp.", std::hex, process_nonce, std::dec, ".", ::getpid(), ".",
                                             counter.fetch_add(1), ".", reinterpret_cast<uintptr_t>(this)))
                          .string();
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) sys_error("open", tmp);
    if (int err = write_all(fd, value.data(), value.size()); err != 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      errno = err;
      sys_error("write", tmp);
    }
    if (::close(fd) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      errno = err;
      sys_error("close", tmp);
    }
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      errno = err;
      sys_error("rename", target);
    }
  }

  std::filesystem::path dir_;
};

}  // namespace

std::unique_ptr<Store> make_file_store(const std::string& directory, const std::string& prefix,
                                       std::chrono::milliseconds timeout) {
  PSGD_REQUIRE(!prefix.empty(), InvalidArgumentError, "file store prefix must not be empty (use a per-run id)");
  PSGD_REQUIRE(prefix.find("..") == std::string::npos, InvalidArgumentError, "file store prefix '", prefix,
               "' must not contain '..'");
  return std::make_unique<FileStore>(directory, prefix, timeout);
}

}  // namespace powersgd::transport
