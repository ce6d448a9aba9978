// Checkpoint codec and file I/O. A checkpoint file is a 24-byte header (magic,
// format version, CRC-32 and length of the payload), then the payload. Every
// field, header and payload, is written little-endian whatever the host's byte
// order; docs/engine.md lists the fields. The codec is a pure function of its
// inputs (no communicator, no backend), so it is tested on bytes; the Reducer
// gathers and applies the state.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "powersgd/reducer.hpp"

namespace powersgd::engine {

inline constexpr char kCheckpointMagic[8] = {'P', 'S', 'G', 'D', 'C', 'K', 'P', 'T'};
// Version 2 appended the adaptive and alternating config fields and, per
// bucket, its rank and step state; version 3, per bucket, its rank level (which
// its rank alone does not tell when rank_low == rank_high); version 4, the rank
// policy's config fields (warmup_steps, lr_boost_steps) and, per bucket, its
// policy state. load() also reads versions 1 (those fields at their defaults: a
// reducer without adaptive or alternating), 2 (the level found from the rank)
// and 3 (no note pending, no boost left, with adaptive the rule's choice in force).
inline constexpr uint32_t kCheckpointVersion = 4;
inline constexpr uint32_t kCheckpointOldestVersion = 1;
inline constexpr size_t kCheckpointHeaderBytes = 24;
// The largest step count a checkpoint may hold (2^62: the counter never overflows after a load).
inline constexpr int64_t kMaxCheckpointIteration = int64_t{1} << 62;
// IoError naming `what` and the first value that is NaN or Inf: a checkpoint's values that no saver writes.
void require_values_finite(const std::vector<float>& values, const char* what, const std::string& path,
                           size_t bucket);
// A job checkpoint (Reducer::save_job) has the same header and payload layout
// under its own magic and version, so that load() refuses a job file and
// load_job() a per-rank file, naming the other kind.
inline constexpr char kJobCheckpointMagic[8] = {'P', 'S', 'G', 'D', 'J', 'O', 'B', 'C'};
// Job version v's payload is the per-rank payload of version v + 1; load_job()
// reads job versions 1 to 3.
inline constexpr uint32_t kJobCheckpointVersion = 3;
inline constexpr uint32_t kJobCheckpointOldestVersion = 1;

// The outer optimizer's state (OuterOptimizer::save, docs/local-steps.md): its
// config, outer step count, every bucket's start point and outer momentum.
inline constexpr char kOuterCheckpointMagic[8] = {'P', 'S', 'G', 'D', 'O', 'U', 'T', 'R'};
inline constexpr uint32_t kOuterCheckpointVersion = 1;

// PerRank: one rank's own state (Reducer::save). Job: the world's state with the
// mean of the ranks' error memories (Reducer::save_job), loadable on any world size.
enum class CheckpointKind { PerRank, Job };

uint32_t crc32(const void* data, size_t size);

namespace wire {
template <size_t N> struct Unsigned;
template <> struct Unsigned<1> { using type = uint8_t; };
template <> struct Unsigned<2> { using type = uint16_t; };
template <> struct Unsigned<4> { using type = uint32_t; };
template <> struct Unsigned<8> { using type = uint64_t; };
template <typename T>
using Bits = typename Unsigned<sizeof(T)>::type;
}  // namespace wire

// Appends arithmetic values little-endian.
class Writer {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    const auto bits = std::bit_cast<wire::Bits<T>>(value);
    for (size_t i = 0; i < sizeof(T); ++i) bytes_.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
  }
  void put_floats(std::span<const float> values);
  void put_raw(const void* data, size_t size);  // bytes as they are (the magic)
  const std::vector<char>& bytes() const { return bytes_; }
  std::vector<char> take() { return std::move(bytes_); }

 private:
  std::vector<char> bytes_;
};

// Reads little-endian values; running past the end throws IoError naming
// `path` and the field.
class Reader {
 public:
  Reader(std::span<const char> bytes, std::string path) : bytes_(bytes), path_(std::move(path)) {}
  template <typename T>
  T get(const char* field) {
    static_assert(std::is_arithmetic_v<T>);
    const char* p = take(sizeof(T), field);
    wire::Bits<T> bits = 0;
    for (size_t i = 0; i < sizeof(T); ++i)
      bits = static_cast<wire::Bits<T>>(bits | (static_cast<wire::Bits<T>>(static_cast<unsigned char>(p[i])) << (8 * i)));
    return std::bit_cast<T>(bits);
  }
  std::vector<float> get_floats(size_t count, const char* field);
  void get_raw(void* out, size_t size, const char* field);
  bool at_end() const { return pos_ == bytes_.size(); }
  const std::string& path() const { return path_; }

 private:
  const char* take(size_t size, const char* field);

  std::span<const char> bytes_;
  std::string path_;
  size_t pos_ = 0;
};

// The framing every powersgd checkpoint file shares (the Reducer's and the
// OuterOptimizer's): `magic` (8 bytes), then `version`, the CRC-32 and the
// length of `payload`, then the payload.
std::vector<char> frame_checkpoint(const char* magic, uint32_t version, std::span<const char> payload);
// The payload of `file` after checking its header: IoError naming `path` for a
// file shorter than the header, another magic, a version outside
// oldest..newest, a length or CRC-32 mismatch. Sets `version` to the file's.
std::span<const char> checked_payload(std::span<const char> file, const std::string& path, const char* magic,
                                      uint32_t oldest, uint32_t newest, uint32_t& version);

// One bucket's state in a checkpoint.
struct CheckpointBucket {
  uint64_t numel = 0;  // elements of the bucket (a layout check)
  bool q_initialized = false;
  uint64_t draws = 0;
  // Error-feedback memory in the bucket's order, then for a whole bucket the
  // padding's error (side * side in all); empty without error feedback.
  std::vector<float> error;
  std::vector<float> p, q;   // warm-start state (sized by the plan at `rank`)
  // Version 2: the rank of the bucket's next compressed step, its successful
  // compressed steps, and the adaptive window (sum so far, previous window's; NaN: none).
  int32_t rank = 1;
  // Version 3: the index of the bucket's rank level (0: the only rank, or
  // rank_low; 1: rank_high). Older files: the level of `rank` (the last one
  // when rank_low == rank_high).
  uint32_t level = 0;
  uint64_t compressed_steps = 0;
  double window_sum = 0.0;
  double previous_window = std::nan("");
  // Version 4: the rank policy (policy.hpp): a note not yet applied, the boosted
  // compressed steps left, the adaptive rule's level and reason, the reason in force.
  bool note_pending = false;
  uint64_t boost_left = 0;
  uint32_t rule_level = 0;
  RankReason rule_reason = RankReason::FirstWindow;
  RankReason reason = RankReason::Fixed;
};

// A rank's whole reducer state.
struct CheckpointContents {
  Config config;  // the Shared fields are saved (config_fields.hpp)
  uint64_t layout_fingerprint = 0;
  // Per-rank: Reducer::load refuses a file of another rank or world size. Job:
  // the world size whose mean the file holds, and rank -1 (no rank's own state).
  int32_t world_size = 0;
  int32_t rank = 0;
  int64_t iteration = 0;
  uint64_t numel_before = 0, numel_after = 0, bytes_sent = 0;
  std::vector<CheckpointBucket> buckets;
};

// What the loading reducer expects of each bucket: its size, error float count,
// and per rank level the level's rank and P and Q float counts.
struct CheckpointLevel {
  int32_t rank = 1;
  size_t p = 0, q = 0;
};
struct CheckpointBucketShape {
  uint64_t numel = 0;
  size_t error = 0;
  std::vector<CheckpointLevel> levels;  // a version 1 file has the first level's
  // Whole bucket with error feedback: the bucket's size. Files written before
  // the padding's error was kept hold only these floats; they load with a zero
  // padding error, which is what that build carried. 0: no such files.
  size_t error_without_padding = 0;
};

// Header + payload, ready for write_checkpoint_file.
std::vector<char> encode_checkpoint(const CheckpointContents& contents, CheckpointKind kind = CheckpointKind::PerRank);

// Verifies the header (length, magic, version, size, CRC-32) and parses the
// payload against what the loading reducer has: IoError for a damaged or foreign
// file, MismatchError for another configuration or layout; `path` names the file
// in every message; a file of the other kind is a MismatchError naming both
// kinds. The result's PerRank config fields are `config`'s.
CheckpointContents decode_checkpoint(std::span<const char> file, const std::string& path, const Config& config,
                                     uint64_t layout_fingerprint, std::span<const CheckpointBucketShape> buckets,
                                     CheckpointKind kind = CheckpointKind::PerRank);

// Writes `bytes` to `path` through a temporary file, fsync and rename(), so a
// crash never leaves a half-written checkpoint under `path`. Throws IoError.
void write_checkpoint_file(const std::string& path, const std::vector<char>& bytes);
// The whole file. Throws IoError ("cannot open checkpoint ...").
std::vector<char> read_checkpoint_file(const std::string& path);

}  // namespace powersgd::engine
