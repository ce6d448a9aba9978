#include "engine/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>

#include "common/check.hpp"
#include "common/fd.hpp"
#include "engine/config_fields.hpp"

namespace powersgd::engine {
namespace {

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

// The type a config field has in the file: bools as one byte, int and enums as 32 bits.
template <typename T>
using WireType = std::conditional_t<std::is_same_v<T, bool>, uint8_t,
                                    std::conditional_t<std::is_same_v<T, int> || std::is_enum_v<T>, int32_t, T>>;

void put_config(Writer& w, const Config& config) {
  for_each_config_field(config, [&](const FieldSpec& spec, const auto& value) {
    if (spec.scope == FieldScope::Shared) w.put(static_cast<WireType<std::decay_t<decltype(value)>>>(value));
  });
}

// Each field of `config` as its wire bits, in the list's order.
std::vector<uint64_t> wire_bits(const Config& config) {
  std::vector<uint64_t> bits;
  for_each_config_field(config, [&](const FieldSpec&, const auto& value) {
    using Wire = WireType<std::decay_t<decltype(value)>>;
    bits.push_back(std::bit_cast<wire::Bits<Wire>>(static_cast<Wire>(value)));
  });
  return bits;
}

// A field that `version` predates was at its default when the file was written.
// Only the fields that the file's or the loader's configuration uses must agree
// (field_in_use): rank_high without adaptive, say, changes nothing resumed.
void expect_config(Reader& r, const Config& config, uint32_t version) {
  std::vector<uint64_t> file = wire_bits(Config{});  // defaults, replaced by what the file holds
  const std::vector<uint64_t> mine = wire_bits(config);
  Config theirs = config;  // the file's Shared fields; the loader's others
  size_t index = 0;
  for_each_config_field(theirs, [&](const FieldSpec& spec, auto& field) {
    const size_t i = index++;
    if (spec.scope != FieldScope::Shared) return;
    using Field = std::decay_t<decltype(field)>;
    using Wire = WireType<Field>;
    if (spec.since_version <= version) file[i] = std::bit_cast<wire::Bits<Wire>>(r.get<Wire>(spec.name));
    const auto value = std::bit_cast<Wire>(static_cast<wire::Bits<Wire>>(file[i]));
    if constexpr (std::is_same_v<Field, bool>)
      field = value != 0;
    else
      field = static_cast<Field>(value);
  });
  index = 0;
  for_each_config_field(config, [&](const FieldSpec& spec, const auto& value) {
    const size_t i = index++;
    if (spec.scope != FieldScope::Shared || file[i] == mine[i]) return;
    if (!field_in_use(spec, config) && !field_in_use(spec, theirs)) return;
    using Wire = WireType<std::decay_t<decltype(value)>>;
    PSGD_THROW(MismatchError, "checkpoint ", r.path(), " was written with config.", spec.name, " = ",
               +std::bit_cast<Wire>(static_cast<wire::Bits<Wire>>(file[i])), ", this reducer has ",
               +static_cast<Wire>(value));
  });
}

// `expected` floats. A file may also hold `shorter` (if not 0) floats: they are
// padded with zeros to `expected` (a whole bucket's error memory saved before
// its padding's error was kept).
std::vector<float> get_counted_floats(Reader& r, size_t expected, const char* field, size_t bucket,
                                      size_t shorter = 0) {
  const auto count = r.get<uint64_t>(field);
  PSGD_REQUIRE(count == expected || (shorter != 0 && count == shorter), MismatchError, "checkpoint ", r.path(),
               ": bucket ", bucket, " has ", count, " ", field, " values, this reducer expects ", expected);
  std::vector<float> values = r.get_floats(static_cast<size_t>(count), field);
  values.resize(expected, 0.0f);
  return values;
}

void put_counted_floats(Writer& w, const std::vector<float>& values) {
  w.put(static_cast<uint64_t>(values.size()));
  w.put_floats(values);
}

RankReason get_reason(Reader& r, const char* field, size_t bucket) {
  const auto value = r.get<uint8_t>(field);
  PSGD_REQUIRE(value <= static_cast<uint8_t>(RankReason::NormChangeLow), IoError, "checkpoint ", r.path(),
               " is malformed: bucket ", bucket, " has ", field, " ", +value, ", expected 0 to ",
               static_cast<int>(RankReason::NormChangeLow));
  return static_cast<RankReason>(value);
}

// The bucket's rank-policy state: version 4 holds it; an older file had no
// policy, so no note pending, no boost left, and with adaptive the level in
// force is the rule's (its reason from the window it came from).
void read_policy(Reader& r, const Config& config, CheckpointBucket& out, uint32_t version, size_t levels,
                 size_t bucket) {
  if (version >= 4) {
    out.note_pending = r.get<uint8_t>("note pending") != 0;
    out.boost_left = r.get<uint64_t>("boost left");
    out.rule_level = r.get<uint32_t>("rule level");
    PSGD_REQUIRE(out.rule_level < levels, IoError, "checkpoint ", r.path(), " is malformed: bucket ", bucket,
                 " has rule level ", out.rule_level, ", this configuration has ", levels, " rank level(s)");
    out.rule_reason = get_reason(r, "rule reason", bucket);
    out.reason = get_reason(r, "reason", bucket);
    return;
  }
  if (!config.adaptive) {
    out.rule_level = static_cast<uint32_t>(levels - 1);
    out.reason = RankReason::Fixed;
    return;
  }
  out.rule_level = out.level;
  out.rule_reason = std::isnan(out.previous_window) ? RankReason::FirstWindow
                    : out.level == 1                ? RankReason::NormChangeHigh
                                                    : RankReason::NormChangeLow;
  out.reason = out.rule_reason;
}

struct Framing {
  const char* magic;
  uint32_t oldest, newest;  // the format versions this build reads
  const char* name;         // in messages
  const char* loader;       // the call that loads this kind
};

// A job file's version v payload is the per-rank payload of version v + 1 (job
// checkpoints came with version 2), so the payload parser reads it as that.
Framing framing_of(CheckpointKind kind) {
  if (kind == CheckpointKind::Job)
    return {kJobCheckpointMagic, kJobCheckpointOldestVersion, kJobCheckpointVersion, "a job checkpoint (save_job)",
            "load_job"};
  return {kCheckpointMagic, kCheckpointOldestVersion, kCheckpointVersion, "a per-rank checkpoint (save)", "load"};
}

// Returns the payload of a checked file of `kind` and sets the version of its payload layout.
std::span<const char> unframe(std::span<const char> file, const std::string& path, CheckpointKind kind,
                              uint32_t& payload_version) {
  const Framing mine = framing_of(kind);
  const Framing other = framing_of(kind == CheckpointKind::Job ? CheckpointKind::PerRank : CheckpointKind::Job);
  if (file.size() >= kCheckpointHeaderBytes)
    PSGD_REQUIRE(std::memcmp(file.data(), other.magic, sizeof(kCheckpointMagic)) != 0, MismatchError, "checkpoint ",
                 path, " is ", other.name, ", not ", mine.name, ": load it with ", other.loader);
  uint32_t version = 0;
  const std::span<const char> payload = checked_payload(file, path, mine.magic, mine.oldest, mine.newest, version);
  payload_version = kind == CheckpointKind::Job ? version + 1 : version;
  return payload;
}

}  // namespace

uint32_t crc32(const void* data, size_t size) {
  uint32_t c = 0xFFFFFFFFU;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) c = kCrcTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFU;
}

std::vector<char> frame_checkpoint(const char* magic, uint32_t version, std::span<const char> payload) {
  Writer file;
  file.put_raw(magic, sizeof(kCheckpointMagic));
  file.put(version);
  file.put(crc32(payload.data(), payload.size()));
  file.put(static_cast<uint64_t>(payload.size()));
  PSGD_ASSERT(file.bytes().size() == kCheckpointHeaderBytes);
  file.put_raw(payload.data(), payload.size());
  return file.take();
}

namespace {

// The file kinds of this library that share the frame, for a message naming the one found.
struct FileKind {
  const char* magic;
  const char* name;
  const char* loader;
};
constexpr FileKind kFileKinds[] = {
    {kCheckpointMagic, "a per-rank checkpoint (Reducer::save)", "Reducer::load or load_shared"},
    {kJobCheckpointMagic, "a job checkpoint (Reducer::save_job)", "Reducer::load_job"},
    {kOuterCheckpointMagic, "an outer-optimizer checkpoint (OuterOptimizer::save)", "OuterOptimizer::load"},
};

// Printable bytes as they are, others as \xNN.
std::string quoted_bytes(const char* bytes, size_t size) {
  std::string text = "\"";
  for (size_t i = 0; i < size; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      text += static_cast<char>(c);
    } else {
      static const char digits[] = "0123456789abcdef";
      text += {'\\', 'x', digits[c >> 4], digits[c & 15]};
    }
  }
  return text + "\"";
}

}  // namespace

std::span<const char> checked_payload(std::span<const char> file, const std::string& path, const char* magic,
                                      uint32_t oldest, uint32_t newest, uint32_t& version) {
  PSGD_REQUIRE(file.size() >= kCheckpointHeaderBytes, IoError, "checkpoint ", path, " is truncated: ", file.size(),
               " bytes, shorter than its ", kCheckpointHeaderBytes, "-byte header");
  Reader header(file.first(kCheckpointHeaderBytes), path);
  char found[sizeof(kCheckpointMagic)];
  header.get_raw(found, sizeof(found), "magic");
  if (std::memcmp(found, magic, sizeof(found)) != 0) {
    const auto is = [&](const char* m) { return [m](const FileKind& k) { return std::memcmp(k.magic, m, 8) == 0; }; };
    const FileKind* other = std::find_if(std::begin(kFileKinds), std::end(kFileKinds), is(found));
    const FileKind* expected = std::find_if(std::begin(kFileKinds), std::end(kFileKinds), is(magic));
    PSGD_REQUIRE(other == std::end(kFileKinds) || expected == std::end(kFileKinds), MismatchError, "checkpoint ",
                 path, " is ", other->name, ", not ", expected->name, ": load it with ", other->loader);
    PSGD_THROW(IoError, "file ", path, " is not a powersgd checkpoint (bad magic ", quoted_bytes(found, sizeof(found)),
               ", expected ", quoted_bytes(magic, sizeof(found)), ")");
  }
  version = header.get<uint32_t>("version");
  PSGD_REQUIRE(version >= oldest && version <= newest, IoError, "checkpoint ", path, " has format version ", version,
               ": this build reads ",
               oldest == newest ? detail::concat("version ", newest) : detail::concat("versions ", oldest, " to ", newest));
  const auto crc = header.get<uint32_t>("crc");
  const auto recorded = header.get<uint64_t>("payload length");
  const std::span<const char> payload = file.subspan(kCheckpointHeaderBytes);
  PSGD_REQUIRE(payload.size() == recorded, IoError, "checkpoint ", path, " is ",
               payload.size() < recorded ? "truncated" : "longer than recorded", ": payload of ", payload.size(),
               " bytes, header says ", recorded);
  const uint32_t actual = crc32(payload.data(), payload.size());
  PSGD_REQUIRE(actual == crc, IoError, "checkpoint ", path, " is corrupted: CRC-32 of the payload is ", actual,
               ", header says ", crc);
  return payload;
}

void Writer::put_floats(std::span<const float> values) {
  if constexpr (std::endian::native == std::endian::little) {
    put_raw(values.data(), values.size_bytes());
  } else {
    for (float v : values) put(v);
  }
}

void Writer::put_raw(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  bytes_.insert(bytes_.end(), p, p + size);
}

const char* Reader::take(size_t size, const char* field) {
  PSGD_REQUIRE(size <= bytes_.size() - pos_, IoError, "checkpoint ", path_, " is malformed: it ends inside ", field);
  const char* p = bytes_.data() + pos_;
  pos_ += size;
  return p;
}

void Reader::get_raw(void* out, size_t size, const char* field) {
  const char* p = take(size, field);
  if (size > 0) std::memcpy(out, p, size);
}

std::vector<float> Reader::get_floats(size_t count, const char* field) {
  PSGD_REQUIRE(count <= (bytes_.size() - pos_) / sizeof(float), IoError, "checkpoint ", path_,
               " is malformed: it ends inside ", field);
  std::vector<float> values(count);
  if constexpr (std::endian::native == std::endian::little) {
    get_raw(values.data(), count * sizeof(float), field);
  } else {
    for (float& v : values) v = get<float>(field);
  }
  return values;
}

std::vector<char> encode_checkpoint(const CheckpointContents& c, CheckpointKind kind) {
  Writer w;
  put_config(w, c.config);
  w.put(c.layout_fingerprint);
  w.put(static_cast<uint32_t>(c.buckets.size()));
  for (const auto& b : c.buckets) w.put(b.numel);
  w.put(c.world_size);
  w.put(c.rank);
  w.put(c.iteration);
  w.put(c.numel_before);
  w.put(c.numel_after);
  w.put(c.bytes_sent);
  for (const auto& b : c.buckets) {
    w.put(static_cast<uint8_t>(b.q_initialized));
    w.put(b.draws);
    w.put(b.rank);
    w.put(b.level);
    w.put(b.compressed_steps);
    w.put(b.window_sum);
    w.put(b.previous_window);
    w.put(static_cast<uint8_t>(b.note_pending));
    w.put(b.boost_left);
    w.put(b.rule_level);
    w.put(static_cast<uint8_t>(b.rule_reason));
    w.put(static_cast<uint8_t>(b.reason));
    put_counted_floats(w, b.error);
    put_counted_floats(w, b.p);
    put_counted_floats(w, b.q);
  }
  const std::vector<char> payload = w.take();
  const Framing framing = framing_of(kind);
  return frame_checkpoint(framing.magic, framing.newest, payload);
}

// What a reducer never saves, though the CRC holds (a file written by hand, or by a defective build): refused
// as malformed instead of loaded into a reducer that then fails every step (non-finite values: "NaN in the
// gradients") or asserts (a boost at a level whose buffers were not laid out).
void require_values_finite(const std::vector<float>& values, const char* what, const std::string& path,
                           size_t bucket) {
  const auto bad = std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
  PSGD_REQUIRE(bad == values.end(), IoError, "checkpoint ", path, " is malformed: bucket ", bucket, "'s ", what,
               " holds ", *bad, " at ", bad - values.begin(), ", expected finite values");
}

namespace {
void require_consistent(const CheckpointBucket& out, const Config& config, size_t levels, const std::string& path,
                        size_t bucket) {
  require_values_finite(out.error, "error memory", path, bucket);
  require_values_finite(out.p, "P", path, bucket);
  require_values_finite(out.q, "Q", path, bucket);
  PSGD_REQUIRE(out.boost_left <= static_cast<uint64_t>(config.lr_boost_steps) &&
                   (out.boost_left == 0 || out.level == levels - 1),
               IoError, "checkpoint ", path, " is malformed: bucket ", bucket, " has ", out.boost_left,
               " boosted steps left at rank level ", out.level, ", expected at most lr_boost_steps (",
               config.lr_boost_steps, "), and none but at the highest level (", levels - 1, ")");
  const bool previous_valid =
      std::isnan(out.previous_window) || (std::isfinite(out.previous_window) && out.previous_window >= 0);
  PSGD_REQUIRE(std::isfinite(out.window_sum) && out.window_sum >= 0 && previous_valid,
               IoError, "checkpoint ", path, " is malformed: bucket ", bucket, " has the adaptive windows' sums ",
               out.window_sum, " and ", out.previous_window, ", expected finite and >= 0 (the previous one NaN before "
               "the first window)");
}

}  // namespace

CheckpointContents decode_checkpoint(std::span<const char> file, const std::string& path, const Config& config,
                                     uint64_t layout_fingerprint, std::span<const CheckpointBucketShape> buckets,
                                     CheckpointKind kind) {
  uint32_t version = 0;
  Reader r(unframe(file, path, kind, version), path);
  CheckpointContents c;
  expect_config(r, config, version);
  c.config = config;
  c.layout_fingerprint = r.get<uint64_t>("layout fingerprint");
  const auto count = r.get<uint32_t>("bucket count");
  PSGD_REQUIRE(count == buckets.size(), MismatchError, "checkpoint ", path, " has ", count,
               " buckets, this reducer declares ", buckets.size());
  c.buckets.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    c.buckets[b].numel = r.get<uint64_t>("bucket size");
    PSGD_REQUIRE(c.buckets[b].numel == buckets[b].numel, MismatchError, "checkpoint ", path, ": bucket ", b, " has ",
                 c.buckets[b].numel, " elements, this reducer's has ", buckets[b].numel);
  }
  PSGD_REQUIRE(c.layout_fingerprint == layout_fingerprint, MismatchError, "checkpoint ", path,
               " was written for another bucket layout (tensor shapes differ; fingerprint ", c.layout_fingerprint,
               " vs ", layout_fingerprint, ")");
  c.world_size = r.get<int32_t>("world size");
  c.rank = r.get<int32_t>("rank");
  c.iteration = r.get<int64_t>("iteration");
  // Bounded far beyond any run, so that the step counter never overflows (signed: undefined behaviour).
  PSGD_REQUIRE(c.iteration >= 0 && c.iteration <= kMaxCheckpointIteration, IoError, "checkpoint ", path,
               " is malformed: iteration ", c.iteration, ", expected 0 to ", kMaxCheckpointIteration);
  c.numel_before = r.get<uint64_t>("numel_before");
  c.numel_after = r.get<uint64_t>("numel_after");
  c.bytes_sent = r.get<uint64_t>("bytes_sent");
  for (size_t b = 0; b < buckets.size(); ++b) {
    CheckpointBucket& out = c.buckets[b];
    out.q_initialized = r.get<uint8_t>("q_initialized") != 0;
    out.draws = r.get<uint64_t>("draws");
    const std::vector<CheckpointLevel>& levels = buckets[b].levels;
    PSGD_ASSERT(!levels.empty(), "bucket ", b, " has no rank level");
    const CheckpointLevel* level = &levels.front();
    if (version >= 2) {
      out.rank = r.get<int32_t>("rank");
      const auto found = std::find_if(levels.rbegin(), levels.rend(),
                                      [&](const CheckpointLevel& l) { return l.rank == out.rank; });
      PSGD_REQUIRE(found != levels.rend(), MismatchError, "checkpoint ", path, ": bucket ", b, " was at rank ",
                   out.rank, ", a rank this reducer's configuration does not use");
      out.level = static_cast<uint32_t>(levels.rend() - found - 1);
      if (version >= 3) {
        out.level = r.get<uint32_t>("level");
        PSGD_REQUIRE(out.level < levels.size() && levels[out.level].rank == out.rank, IoError, "checkpoint ", path,
                     " is malformed: bucket ", b, " was at rank ", out.rank, " and rank level ", out.level,
                     ", which is not that rank's level in its configuration");
      }
      level = &levels[out.level];
      out.compressed_steps = r.get<uint64_t>("compressed steps");
      out.window_sum = r.get<double>("window sum");
      out.previous_window = r.get<double>("previous window");
    } else {
      out.rank = level->rank;
    }
    read_policy(r, config, out, version, levels.size(), b);
    out.error = get_counted_floats(r, buckets[b].error, "error", b, buckets[b].error_without_padding);
    out.p = get_counted_floats(r, level->p, "P", b);
    out.q = get_counted_floats(r, level->q, "Q", b);
    require_consistent(out, config, levels.size(), path, b);
  }
  PSGD_REQUIRE(r.at_end(), IoError, "checkpoint ", path, " is malformed: bytes after the last bucket");
  return c;
}

void write_checkpoint_file(const std::string& path, const std::vector<char>& bytes) {
  // A temporary name of this process alone (random, created with O_EXCL: never an
  // existing file or link), so that concurrent savers to one path never write into
  // each other's file; the last rename wins whole. fsync of the file and then of its
  // directory makes the rename survive a crash.
  // Its name: the file's own, cut to 200 bytes so that ".tmp." and 16 digits stay within NAME_MAX (255: a valid
  // name of 250 bytes failed with ENAMETOOLONG).
  const size_t name_at = path.find_last_of('/') + 1;  // 0 without a slash
  const std::string stem = path.substr(0, name_at + std::min<size_t>(path.size() - name_at, 200)) + ".tmp.";
  // A file it replaces keeps its permissions (the error memory is close to the gradients: a 0600 stays 0600),
  // given at creation, so that the new file is never more open than the old one; a new file gets 0666 less
  // the umask, as any (not mkstemp's 0600, nor a fixed 0644 that ignored a umask 077).
  struct stat replaced {};
  const bool replacing = ::stat(path.c_str(), &replaced) == 0 && S_ISREG(replaced.st_mode);
  const mode_t mode = replacing ? (replaced.st_mode & 0777) : 0666;
  std::string tmp;
  Fd fd;
  std::random_device random;
  for (int attempt = 0; !fd; ++attempt) {
    char digits[17];
    std::snprintf(digits, sizeof digits, "%08x%08x", static_cast<unsigned>(random()), static_cast<unsigned>(random()));
    tmp = stem + digits;
    const int opened = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (opened < 0 && (errno != EEXIST || attempt == 99))
      PSGD_THROW_ERRNO(IoError, errno, "cannot create a temporary file for checkpoint ", path);
    if (opened >= 0) fd = Fd(opened);
  }
  try {
    // The replaced file's bits exactly (the umask took some at creation). Best effort: a file system that
    // refuses chmod keeps the new file's, never more open than the old.
    if (replacing) (void)::fchmod(fd.get(), replaced.st_mode & 07777);
    write_fully(fd.get(), bytes.data(), bytes.size(), tmp);
    PSGD_CHECK_SYS_CTX(::fsync(fd.get()), "fsync of checkpoint ", tmp);
    PSGD_CHECK_SYS_CTX(::close(fd.release()), "closing checkpoint ", tmp);
    PSGD_CHECK_SYS_CTX(::rename(tmp.c_str(), path.c_str()), "renaming checkpoint ", tmp, " to ", path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  Fd dir_fd(PSGD_CHECK_SYS_CTX(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC), "opening the directory of checkpoint ", path));
  PSGD_CHECK_SYS_CTX(::fsync(dir_fd.get()), "fsync of the directory of checkpoint ", path);
}

namespace {
// Reads bytes [total, want) of `fd` into `bytes` (sized `want`); returns how many there were in all (fewer where
// the file shrank while being read: the frame check reports it truncated).
size_t read_up_to(int fd, std::vector<char>& bytes, size_t total, const std::string& path) {
  while (total < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + total, bytes.size() - total);
    if (n < 0 && errno == EINTR) continue;
    PSGD_CHECK_SYS_CTX(n, "reading checkpoint ", path);
    if (n == 0) break;
    total += static_cast<size_t>(n);
  }
  return total;
}
}  // namespace

std::vector<char> read_checkpoint_file(const std::string& path) {
  // O_NONBLOCK: a FIFO at the path must be refused below, not block the open until a writer comes (a job's
  // load_job waited forever on rank 0). A regular file's reads ignore it.
  Fd fd(PSGD_CHECK_SYS_CTX(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK), "cannot open checkpoint ", path));
  struct stat st {};
  PSGD_CHECK_SYS_CTX(::fstat(fd.get(), &st), "reading checkpoint ", path);
  PSGD_REQUIRE(S_ISREG(st.st_mode), IoError, "cannot read checkpoint ", path, ": ",
               S_ISDIR(st.st_mode) ? "a directory" : "not a regular file", ", expected a checkpoint file");
  // The header first: no more is read (nor allocated) than it says the payload is, and one byte more to tell
  // a longer file, so a file that is not a checkpoint (a sparse terabyte of zeros) costs its header, and
  // checked_payload names what is wrong with it.
  const size_t size = static_cast<size_t>(st.st_size);
  std::vector<char> bytes(std::min(size, kCheckpointHeaderBytes));
  size_t total = read_up_to(fd.get(), bytes, 0, path);
  // Only a powersgd checkpoint's header (any kind: checked_payload names the one expected) is read on from, and
  // only where the file holds what it says: a model.pt (a zip) given by mistake, whose bytes 16-23 read as a
  // length beyond the file, was read whole.
  if (total < kCheckpointHeaderBytes) {  // checked_payload: shorter than its header
    bytes.resize(total);
    return bytes;
  }
  char magic[sizeof(kCheckpointMagic)];
  Reader header(bytes, path);
  header.get_raw(magic, sizeof(magic), "magic");
  header.get<uint32_t>("version");
  header.get<uint32_t>("crc");
  const auto recorded = header.get<uint64_t>("payload length");
  const bool ours = std::any_of(std::begin(kFileKinds), std::end(kFileKinds),
                                [&](const FileKind& k) { return std::memcmp(magic, k.magic, sizeof(magic)) == 0; });
  if (ours) {
    const uint64_t held = size - kCheckpointHeaderBytes;
    PSGD_REQUIRE(recorded <= held, IoError, "checkpoint ", path, " is truncated: its header says ", recorded,
                 " bytes of payload, the file holds ", held);
    bytes.resize(kCheckpointHeaderBytes + static_cast<size_t>(std::min<uint64_t>(recorded + 1, held)));
    total = read_up_to(fd.get(), bytes, total, path);
  }
  bytes.resize(total);
  return bytes;
}

}  // namespace powersgd::engine
