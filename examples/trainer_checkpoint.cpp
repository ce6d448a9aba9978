#include "trainer_checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace fashion_mnist {
namespace {

constexpr char kMagic[8] = {'P', 'S', 'G', 'D', 'T', 'R', 'N', '1'};

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

// Temporary file, fsync, rename, fsync of the directory: `path` holds the old
// contents or the new ones whole, whenever the process dies. A failure (a full
// disk) removes the temporary file and closes what it opened.
void write_file_durably(const std::string& path, const std::vector<char>& bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) fail_io("cannot create", tmp);
  const auto give_up = [&](const char* what, const std::string& name, bool close_fd) {
    const int err = errno;
    if (close_fd) ::close(fd);
    ::unlink(tmp.c_str());
    errno = err;
    fail_io(what, name);
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) give_up("cannot write", tmp, true);
    done += size_t(n);
  }
  if (::fsync(fd) != 0) give_up("cannot sync", tmp, true);
  if (::close(fd) != 0) give_up("cannot close", tmp, false);
  if (::rename(tmp.c_str(), path.c_str()) != 0) give_up("cannot rename to", path, false);
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) fail_io("cannot open directory", dir);
  const int synced = ::fsync(dir_fd);
  ::close(dir_fd);
  if (synced != 0) fail_io("cannot sync directory", dir);
}

std::vector<char> read_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) fail_io("cannot open", path);
  std::vector<char> bytes;
  char chunk[1 << 16];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) bytes.insert(bytes.end(), chunk, chunk + n);
  const bool failed = std::ferror(f) != 0;  // a read error is not the end of the file ("is truncated")
  const int err = errno;
  std::fclose(f);
  errno = err;
  if (failed) fail_io("cannot read", path);
  return bytes;
}

template <typename T>
void put(std::vector<char>& out, const T& value) {
  const char* p = reinterpret_cast<const char*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

class Cursor {
 public:
  Cursor(const std::vector<char>& bytes, const std::string& path) : bytes_(bytes), path_(path) {}
  template <typename T>
  T get() {
    T value;
    std::memcpy(&value, take(sizeof(T)), sizeof(T));
    return value;
  }
  void get_floats(std::vector<float>& out, size_t expected) {
    const auto n = get<uint64_t>();
    if (n != expected)
      throw std::runtime_error(path_ + ": a tensor of " + std::to_string(n) + " floats, this model's has " +
                               std::to_string(expected));
    out.resize(n);
    if (n > 0) std::memcpy(out.data(), take(n * sizeof(float)), n * sizeof(float));
  }
  bool at_end() const { return pos_ == bytes_.size(); }

 private:
  const char* take(size_t n) {
    if (n > bytes_.size() - pos_) throw std::runtime_error(path_ + " is truncated");
    const char* p = bytes_.data() + pos_;
    pos_ += n;
    return p;
  }
  const std::vector<char>& bytes_;
  const std::string& path_;
  size_t pos_ = 0;
};

std::string set_dir(const std::string& dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%010lld", static_cast<long long>(step));
  return dir + "/" + name;
}
std::string trainer_file(const std::string& set, int rank) { return set + "/trainer.rank" + std::to_string(rank); }
std::string reducer_file(const std::string& set, int rank) {
  return set + "/reducer.rank" + std::to_string(rank) + ".ckpt";
}
std::string outer_file(const std::string& set, int rank) { return set + "/outer.rank" + std::to_string(rank) + ".ckpt"; }

// The step of a set directory's name, or -1 for another name.
int64_t step_of(const std::filesystem::path& entry) {
  const std::string name = entry.filename().string();
  if (name.size() != 15 || name.rfind("step-", 0) != 0) return -1;
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) return -1;
  return std::stoll(name.substr(5));
}

}  // namespace

uint64_t fnv1a(const void* data, size_t size, uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ p[i]) * 0x100000001B3ULL;
  return hash;
}

std::optional<TrainerState> TrainerCheckpoints::resume(std::span<std::vector<float>* const> tensors,
                                                        std::span<const size_t> sizes) {
  int64_t newest = -1;
  if (comm_.rank() == 0)
    for (const auto& entry : std::filesystem::directory_iterator(dir_))
      if (step_of(entry.path()) >= 0 && std::filesystem::exists(entry.path() / "COMPLETE"))
        newest = std::max(newest, step_of(entry.path()));
  comm_.broadcast(&newest, sizeof newest, 0);
  if (newest < 0) return std::nullopt;
  const std::string set = set_dir(dir_, newest);
  const std::string path = trainer_file(set, comm_.rank());
  const std::vector<char> bytes = read_file(path);
  Cursor in(bytes, path);
  char magic[sizeof kMagic];
  for (char& c : magic) c = in.get<char>();
  if (std::memcmp(magic, kMagic, sizeof magic) != 0) throw std::runtime_error(path + " is not a trainer checkpoint");
  if (in.get<uint64_t>() != options_)
    throw std::runtime_error(path + " was written with other options (world size, batch, model, PowerSGD "
                                    "settings, data limits, epochs or learning rate differ)");
  const auto state = in.get<TrainerState>();
  for (size_t i = 0; i < tensors.size(); ++i) in.get_floats(*tensors[i], sizes[i]);
  if (!in.at_end()) throw std::runtime_error(path + " has bytes after its last tensor");
  if (state.step != newest) throw std::runtime_error(path + " holds step " + std::to_string(state.step));
  reducer_.load(reducer_file(set, comm_.rank()));
  if (outer_ != nullptr) outer_->load(outer_file(set, comm_.rank()));  // collective, as resume is
  return state;
}

void TrainerCheckpoints::save(const TrainerState& state, std::span<const std::vector<float>* const> tensors,
                              bool crash_before_complete) {
  const std::string set = set_dir(dir_, state.step);
  std::filesystem::create_directories(set);
  std::vector<char> out(kMagic, kMagic + sizeof kMagic);
  put(out, options_);
  put(out, state);
  for (const std::vector<float>* t : tensors) {
    put(out, uint64_t(t->size()));
    const char* p = reinterpret_cast<const char*>(t->data());
    out.insert(out.end(), p, p + t->size() * sizeof(float));
  }
  write_file_durably(trainer_file(set, comm_.rank()), out);
  reducer_.save(reducer_file(set, comm_.rank()));
  if (outer_ != nullptr) outer_->save(outer_file(set, comm_.rank()));
  if (crash_before_complete) ::raise(SIGKILL);  // a real crash, mid-save
  comm_.barrier();  // every rank's files are durable
  if (comm_.rank() == 0) write_file_durably(set + "/COMPLETE", {});
  // Keep this set and the one before; older ones (complete or interrupted) go. Each rank removes its own files
  // (a --checkpoint-dir of each node's own holds only its ranks'), rank 0 also COMPLETE, and whichever
  // rank empties a set's directory removes it: no rank removes a file another may be removing.
  std::vector<std::filesystem::path> old;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    const int64_t step = step_of(entry.path());
    if (step >= 0 && step < state.step - every_) old.push_back(entry.path());
  }
  // This rank's file names in a set, and their temporaries (a crash's).
  std::vector<std::string> own = {trainer_file("", comm_.rank()).substr(1), reducer_file("", comm_.rank()).substr(1),
                                  outer_file("", comm_.rank()).substr(1)};
  if (comm_.rank() == 0) own.push_back("COMPLETE");
  const auto mine = [&](const std::string& name) {
    return std::any_of(own.begin(), own.end(),
                       [&](const std::string& base) { return name == base || name.rfind(base + ".tmp.", 0) == 0; });
  };
  for (const auto& path : old) {
    std::error_code ignored;  // another rank may have removed the directory already
    std::vector<std::filesystem::path> files;
    for (const auto& entry : std::filesystem::directory_iterator(path, ignored))
      if (mine(entry.path().filename().string())) files.push_back(entry.path());
    for (const auto& file : files) std::filesystem::remove(file, ignored);
    std::filesystem::remove(path, ignored);  // only where empty
  }
}

}  // namespace fashion_mnist
