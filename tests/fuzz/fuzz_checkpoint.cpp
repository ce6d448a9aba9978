// libFuzzer target: the checkpoint reader (src/engine/checkpoint.*, through
// Reducer::load, the path a user's file takes). One reducer on a single-process
// communicator with two buckets (a compressed matrix and a vector) is built
// once; each input is written to a file on tmpfs and loaded. The first byte
// picks the framing:
//   even: the rest is the whole file (header, length, CRC, payload);
//   odd:  the rest is a payload, framed by write_checkpoint with a valid header
//         and checksum, so mutations reach the payload parser past the CRC.
// load() may only succeed or throw powersgd::Error; anything else (a crash, an
// uncaught exception, ASan/UBSan) is a finding.
// PSGD_FUZZ_WRITE_SEED=DIR writes the seed corpus files (a checkpoint saved by
// this reducer, in both framings) to DIR and exits.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "powersgd/comm.hpp"
#include "powersgd/error.hpp"
#include "powersgd/reducer.hpp"

namespace {

struct Target {
  std::unique_ptr<powersgd::Communicator> comm;
  std::unique_ptr<powersgd::Reducer> reducer;
  std::string path;
};

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, char mode, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.put(mode);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The header before the payload: magic, u32 version, u32 crc, u64 length (checkpoint.hpp).
constexpr size_t kHeaderBytes = powersgd::engine::kCheckpointHeaderBytes;

// A valid header (magic, version, CRC-32, length; little-endian) in front of
// `payload`, so that mutations reach the payload parser.
std::vector<char> framed(const std::vector<char>& payload) {
  namespace engine = powersgd::engine;
  std::vector<char> out(engine::kCheckpointMagic, engine::kCheckpointMagic + sizeof engine::kCheckpointMagic);
  auto put = [&out](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(engine::kCheckpointVersion, 4);
  put(engine::crc32(payload.data(), payload.size()), 4);
  put(payload.size(), 8);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

Target& target() {
  static Target* t = [] {
    auto* made = new Target;
    made->comm = powersgd::Communicator::create(powersgd::CommOptions::single_process());
    powersgd::Config config;
    config.rank = 2;
    config.start_iter = 0;  // compress from the first step, so the state has P, Q and error
    made->reducer = std::make_unique<powersgd::Reducer>(*made->comm, config);
    made->reducer->add_bucket({{8, 6}, {5}});
    // Two steps so the saved state is not all zeros.
    std::vector<float> gradient(made->reducer->bucket_size(0));
    for (size_t i = 0; i < gradient.size(); ++i) gradient[i] = static_cast<float>(i % 7) - 3.0f;
    made->reducer->reduce(0, gradient.data());
    made->reducer->reduce(0, gradient.data());
    const char* dir = std::getenv("TMPDIR");
    made->path = std::string(::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : dir != nullptr ? dir : "/tmp") +
                 "/psgd-fuzz-checkpoint-" + std::to_string(::getpid());
    if (const char* seed_dir = std::getenv("PSGD_FUZZ_WRITE_SEED")) {
      made->reducer->save(made->path);
      std::vector<char> file = read_file(made->path);
      write_file(std::string(seed_dir) + "/valid-file", 0, file);
      write_file(std::string(seed_dir) + "/valid-payload", 1, {file.begin() + kHeaderBytes, file.end()});
      std::remove(made->path.c_str());
      std::exit(0);
    }
    return made;
  }();
  return *t;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  target();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Target& t = target();
  const bool frame_it = (data[0] & 1) != 0;
  std::vector<char> bytes(reinterpret_cast<const char*>(data) + 1, reinterpret_cast<const char*>(data) + size);
  if (frame_it) {
    powersgd::engine::write_checkpoint_file(t.path, framed(bytes));
  } else {
    std::ofstream out(t.path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  try {
    t.reducer->load(t.path);
  } catch (const powersgd::Error&) {
    // refused with a clear error: the expected outcome for most inputs
  }
  std::remove(t.path.c_str());
  return 0;
}
