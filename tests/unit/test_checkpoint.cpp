// The checkpoint codec on bytes, without a communicator or a backend: round
// trip, the little-endian encoding, and every way a file can be damaged,
// foreign or of another configuration. The Reducer's save/load around it:
// test_engine.cpp ("checkpoint: ...").
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/fingerprint.hpp"
#include "error_of.hpp"

using namespace powersgd;
using powersgd::test::error_of;
using namespace powersgd::engine;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

Config test_config() {
  Config c;
  c.rank = 3;
  c.start_iter = 7;
  c.seed = 42;
  c.whole_bucket = true;
  return c;
}

std::vector<float> ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * (static_cast<float>(i) - 1.5f);
  return v;
}

CheckpointContents test_contents() {
  CheckpointContents c;
  c.config = test_config();
  c.layout_fingerprint = 0x0123456789ABCDEFULL;
  c.world_size = 4;
  c.rank = 2;
  c.iteration = 11;
  c.numel_before = 1000;
  c.numel_after = 100;
  c.bytes_sent = 4096;
  c.buckets.push_back({12, true, 3, ramp(12, 0.5f), ramp(6, 2.0f), ramp(9, -1.0f)});
  c.buckets.push_back({5, false, 0, ramp(5, 0.25f), {}, {}});
  return c;
}

std::vector<CheckpointBucketShape> shapes_of(const CheckpointContents& c) {
  std::vector<CheckpointBucketShape> shapes;
  // Levels up to the bucket's, each at its rank (as with rank_low == rank_high).
  for (const auto& b : c.buckets)
    shapes.push_back({b.numel, b.error.size(), std::vector<CheckpointLevel>(b.level + 1, {b.rank, b.p.size(), b.q.size()})});
  return shapes;
}

CheckpointContents decode(const std::vector<char>& file, const CheckpointContents& like) {
  return decode_checkpoint(file, "ckpt", like.config, like.layout_fingerprint, shapes_of(like));
}

// A file framed around `payload` with a correct header.
std::vector<char> framed(const std::vector<char>& payload, uint32_t version = kCheckpointVersion) {
  Writer w;
  w.put_raw(kCheckpointMagic, sizeof(kCheckpointMagic));
  w.put(version);
  w.put(crc32(payload.data(), payload.size()));
  w.put(static_cast<uint64_t>(payload.size()));
  w.put_raw(payload.data(), payload.size());
  return w.take();
}

std::vector<char> payload_of(const std::vector<char>& file) {
  return {file.begin() + static_cast<std::ptrdiff_t>(kCheckpointHeaderBytes), file.end()};
}

// The payload of `c` in format version 1 (before adaptive and alternating), 2
// (before the rank level) or 3 (before the rank policy), written field by field
// as docs/engine.md lists them.
std::vector<char> payload_before_level(const CheckpointContents& c, uint32_t version) {
  const Config& k = c.config;
  Writer w;
  w.put(int32_t{k.rank});
  w.put(k.start_iter);
  w.put(k.min_compression_rate);
  w.put(uint8_t{k.error_feedback});
  w.put(uint8_t{k.warm_start});
  w.put(k.orthogonalization_epsilon);
  w.put(k.seed);
  w.put(uint8_t{k.batch_same_shape});
  w.put(uint8_t{k.whole_bucket});
  if (version >= 2) {
    w.put(uint8_t{k.adaptive});
    w.put(int32_t{k.rank_low});
    w.put(int32_t{k.rank_high});
    w.put(k.adaptive_interval);
    w.put(k.adaptive_threshold);
    w.put(uint8_t{k.alternating});
  }
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
    if (version >= 2) {
      w.put(b.rank);
      if (version >= 3) w.put(b.level);
      w.put(b.compressed_steps);
      w.put(b.window_sum);
      w.put(b.previous_window);
    }
    for (const auto* values : {&b.error, &b.p, &b.q}) {
      w.put(static_cast<uint64_t>(values->size()));
      w.put_floats(*values);
    }
  }
  return w.take();
}

}  // namespace

TEST_CASE("checkpoint codec: encode then decode gives back every field") {
  const CheckpointContents in = test_contents();
  const std::vector<char> file = encode_checkpoint(in);
  const CheckpointContents out = decode(file, in);
  CHECK(out.layout_fingerprint == in.layout_fingerprint);
  CHECK(out.world_size == 4);
  CHECK(out.rank == 2);
  CHECK(out.iteration == 11);
  CHECK(out.numel_before == 1000);
  CHECK(out.numel_after == 100);
  CHECK(out.bytes_sent == 4096);
  CHECK(config_fingerprint(out.config) == config_fingerprint(in.config));
  REQUIRE(out.buckets.size() == 2);
  for (size_t b = 0; b < 2; ++b) {
    CHECK(out.buckets[b].numel == in.buckets[b].numel);
    CHECK(out.buckets[b].q_initialized == in.buckets[b].q_initialized);
    CHECK(out.buckets[b].draws == in.buckets[b].draws);
    CHECK(out.buckets[b].error == in.buckets[b].error);
    CHECK(out.buckets[b].p == in.buckets[b].p);
    CHECK(out.buckets[b].q == in.buckets[b].q);
  }
  // Deterministic: the same contents give the same bytes.
  CHECK(encode_checkpoint(in) == file);
}

TEST_CASE("checkpoint codec: every field is little-endian whatever the host's order") {
  Writer w;
  w.put(uint32_t{0x01020304});
  w.put(int16_t{-2});
  w.put(1.0f);
  w.put(-2.0);
  const std::vector<float> floats = {1.0f, -0.5f};
  w.put_floats(floats);
  const std::vector<unsigned char> expected = {
      0x04, 0x03, 0x02, 0x01,                          // uint32 0x01020304
      0xFE, 0xFF,                                      // int16 -2
      0x00, 0x00, 0x80, 0x3F,                          // float 1.0 (0x3F800000)
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xC0,  // double -2.0 (0xC000000000000000)
      0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xBF,  // floats 1.0, -0.5
  };
  REQUIRE(w.bytes().size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) CHECK(static_cast<unsigned char>(w.bytes()[i]) == expected[i]);

  Reader r(w.bytes(), "bytes");
  CHECK(r.get<uint32_t>("a") == 0x01020304U);
  CHECK(r.get<int16_t>("b") == -2);
  CHECK(r.get<float>("c") == 1.0f);
  CHECK(r.get<double>("d") == -2.0);
  CHECK(r.get_floats(2, "e") == floats);
  CHECK(r.at_end());

  // The header: magic, then version 4, CRC and payload length, little-endian.
  const std::vector<char> file = encode_checkpoint(test_contents());
  CHECK(std::memcmp(file.data(), kCheckpointMagic, 8) == 0);
  CHECK(file[8] == 4);
  CHECK(file[9] == 0);
  CHECK(file[10] == 0);
  CHECK(file[11] == 0);
  const uint64_t length = file.size() - kCheckpointHeaderBytes;
  for (size_t i = 0; i < 8; ++i) CHECK(static_cast<unsigned char>(file[16 + i]) == ((length >> (8 * i)) & 0xFF));
}

TEST_CASE("checkpoint codec: truncated, corrupted and foreign input is refused with IoError") {
  const CheckpointContents like = test_contents();
  const std::vector<char> file = encode_checkpoint(like);

  const std::vector<char> short_header(file.begin(), file.begin() + 10);
  CHECK_THROWS_AS(decode(short_header, like), IoError);
  CHECK(contains(error_of([&] { decode(short_header, like); }), "ckpt is truncated: 10 bytes, shorter than its 24"));
  CHECK(contains(error_of([&] { decode({}, like); }), "truncated: 0 bytes"));

  const std::vector<char> half(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(file.size() / 2));
  CHECK(contains(error_of([&] { decode(half, like); }), "is truncated: payload of"));
  std::vector<char> longer = file;
  longer.push_back(0);
  CHECK(contains(error_of([&] { decode(longer, like); }), "longer than recorded"));

  std::vector<char> flipped = file;
  flipped[file.size() - 3] ^= 0x40;
  CHECK_THROWS_AS(decode(flipped, like), IoError);
  CHECK(contains(error_of([&] { decode(flipped, like); }), "ckpt is corrupted: CRC-32"));

  std::vector<char> magic = file;
  magic[0] = 'X';
  CHECK(error_of([&] { decode(magic, like); }) ==
        "file ckpt is not a powersgd checkpoint (bad magic \"XSGDCKPT\", expected \"PSGDCKPT\")");
  magic[1] = '\0';
  magic[2] = '"';
  CHECK(contains(error_of([&] { decode(magic, like); }), "(bad magic \"X\\x00\\x22DCKPT\", expected"));
  std::vector<char> outer = file;  // another kind of this library's files is named, with its loader
  std::copy(std::begin(kOuterCheckpointMagic), std::end(kOuterCheckpointMagic), outer.begin());
  CHECK_THROWS_AS(decode(outer, like), MismatchError);
  CHECK(error_of([&] { decode(outer, like); }) ==
        "checkpoint ckpt is an outer-optimizer checkpoint (OuterOptimizer::save), not a per-rank checkpoint "
        "(Reducer::save): load it with OuterOptimizer::load");

  std::vector<char> version = file;
  version[8] = 5;
  CHECK_THROWS_AS(decode(version, like), IoError);
  CHECK(contains(error_of([&] { decode(version, like); }), "has format version 5: this build reads versions 1 to 4"));
  version[8] = 0;
  version[11] = 1;  // big-endian 1 read as little-endian
  CHECK(contains(error_of([&] { decode(version, like); }), "has format version 16777216"));

  // A well-framed payload that ends inside a field, or has bytes after the last bucket.
  std::vector<char> payload = payload_of(file);
  const std::vector<char> cut(payload.begin(), payload.end() - 5);
  CHECK(contains(error_of([&] { decode(framed(cut), like); }), "is malformed: it ends inside Q"));
  std::vector<char> extra = payload;
  extra.push_back(7);
  CHECK(contains(error_of([&] { decode(framed(extra), like); }), "is malformed: bytes after the last bucket"));
}

TEST_CASE("checkpoint codec: a job checkpoint has its own magic; each loader refuses the other kind") {
  CheckpointContents in = test_contents();
  in.rank = -1;
  const std::vector<char> job = encode_checkpoint(in, CheckpointKind::Job);
  CHECK(std::memcmp(job.data(), kJobCheckpointMagic, 8) == 0);
  CHECK(std::memcmp(job.data(), kCheckpointMagic, 8) != 0);
  const CheckpointContents out =
      decode_checkpoint(job, "job", in.config, in.layout_fingerprint, shapes_of(in), CheckpointKind::Job);
  CHECK(out.rank == -1);
  CHECK(out.world_size == 4);
  CHECK(out.iteration == 11);
  REQUIRE(out.buckets.size() == 2);
  CHECK(out.buckets[0].error == in.buckets[0].error);
  CHECK(out.buckets[0].q == in.buckets[0].q);
  // Same payload, other frame.
  CHECK(payload_of(job) == payload_of(encode_checkpoint(in)));

  CHECK_THROWS_AS(decode(job, in), MismatchError);
  CHECK(contains(error_of([&] { decode(job, in); }),
                 "checkpoint ckpt is a job checkpoint (save_job), not a per-rank checkpoint (save): load it with "
                 "load_job"));
  const std::vector<char> per_rank = encode_checkpoint(in);
  auto as_job = [&](const std::vector<char>& file) {
    return decode_checkpoint(file, "ckpt", in.config, in.layout_fingerprint, shapes_of(in), CheckpointKind::Job);
  };
  CHECK_THROWS_AS(as_job(per_rank), MismatchError);
  CHECK(contains(error_of([&] { as_job(per_rank); }),
                 "is a per-rank checkpoint (save), not a job checkpoint (save_job): load it with load"));
  std::vector<char> damaged = job;
  damaged[job.size() - 2] ^= 0x01;
  CHECK_THROWS_AS(as_job(damaged), IoError);
  damaged = job;
  damaged[4] = 'X';
  CHECK(contains(error_of([&] { as_job(damaged); }), "is not a powersgd checkpoint (bad magic \"PSGDXOBC\""));
}

TEST_CASE("checkpoint codec: another configuration or layout is refused with MismatchError") {
  const CheckpointContents saved = test_contents();
  const std::vector<char> file = encode_checkpoint(saved);

  CheckpointContents other = saved;
  other.config.seed = 9;
  CHECK_THROWS_AS(decode(file, other), MismatchError);
  CHECK(contains(error_of([&] { decode(file, other); }), "was written with config.seed = 42, this reducer has 9"));
  other = saved;
  other.config.error_feedback = false;
  CHECK(contains(error_of([&] { decode(file, other); }), "config.error_feedback = 1, this reducer has 0"));
  // Per-rank fields are not saved: another device decodes (and keeps the loader's).
  other = saved;
  other.config.device_index = 3;
  CHECK(decode(file, other).config.device_index == 3);

  other = saved;
  other.layout_fingerprint = 1;
  CHECK_THROWS_AS(decode(file, other), MismatchError);
  CHECK(contains(error_of([&] { decode(file, other); }), "another bucket layout"));
  other = saved;
  other.buckets.pop_back();
  CHECK(contains(error_of([&] { decode(file, other); }), "has 2 buckets, this reducer declares 1"));
  other = saved;
  other.buckets[1].numel = 6;
  CHECK(contains(error_of([&] { decode(file, other); }), "bucket 1 has 5 elements, this reducer's has 6"));
  other = saved;
  other.buckets[0].p.resize(7);
  CHECK_THROWS_AS(decode(file, other), MismatchError);
  CHECK(contains(error_of([&] { decode(file, other); }), "bucket 0 has 6 P values, this reducer expects 7"));
}

TEST_CASE("checkpoint codec: a whole bucket's error memory from before its padding was kept loads zero-padded") {
  // A whole bucket of 12 elements is a 4 x 4 square: its error memory is 16
  // floats; files written before the padding's error was kept hold 12.
  const CheckpointContents saved = test_contents();  // bucket 0: 12 error floats
  const std::vector<char> file = encode_checkpoint(saved);
  std::vector<CheckpointBucketShape> shapes = shapes_of(saved);
  shapes[0].error = 16;
  shapes[0].error_without_padding = 12;
  const CheckpointContents out = decode_checkpoint(file, "ckpt", saved.config, saved.layout_fingerprint, shapes);
  std::vector<float> padded = saved.buckets[0].error;
  padded.resize(16, 0.0f);
  CHECK(out.buckets[0].error == padded);
  CHECK(out.buckets[1].error == saved.buckets[1].error);
  // Without that allowance 12 is refused, naming both counts; so is any other count.
  shapes[0].error_without_padding = 0;
  CHECK_THROWS_AS(decode_checkpoint(file, "ckpt", saved.config, saved.layout_fingerprint, shapes), MismatchError);
  CHECK(contains(error_of([&] { decode_checkpoint(file, "ckpt", saved.config, saved.layout_fingerprint, shapes); }),
                 "bucket 0 has 12 error values, this reducer expects 16"));
  shapes[0].error = 25;
  shapes[0].error_without_padding = 13;
  CHECK(contains(error_of([&] { decode_checkpoint(file, "ckpt", saved.config, saved.layout_fingerprint, shapes); }),
                 "bucket 0 has 12 error values, this reducer expects 25"));
}

TEST_CASE("checkpoint file: written atomically, read back whole; a missing file is named") {
  const std::string path = "/tmp/psgd-test-checkpoint-" + std::to_string(::getpid());
  const std::vector<char> file = encode_checkpoint(test_contents());
  write_checkpoint_file(path, file);
  CHECK(read_checkpoint_file(path) == file);
  for (const auto& entry : std::filesystem::directory_iterator("/tmp"))  // the temporary file was renamed away
    CHECK(entry.path().string().rfind(path + ".tmp", 0) != 0);
  ::unlink(path.c_str());
  // The mode of a new file is 0666 less the umask (before: always 0644, a umask 077 ignored); a file it replaces
  // keeps its own.
  const auto mode_of = [](const std::string& p) {
    struct stat st {};
    REQUIRE(::stat(p.c_str(), &st) == 0);
    return st.st_mode & 07777;
  };
  const mode_t old_umask = ::umask(077);
  write_checkpoint_file(path, file);
  ::umask(022);
  CHECK(mode_of(path) == 0600);
  write_checkpoint_file(path, file);
  CHECK(mode_of(path) == 0600);  // kept
  ::unlink(path.c_str());
  write_checkpoint_file(path, file);
  CHECK(mode_of(path) == 0644);
  REQUIRE(::chmod(path.c_str(), 0640) == 0);
  write_checkpoint_file(path, file);
  CHECK(mode_of(path) == 0640);
  ::umask(old_umask);
  ::unlink(path.c_str());
  CHECK_THROWS_AS(read_checkpoint_file(path), IoError);
  CHECK(contains(error_of([&] { read_checkpoint_file(path); }), "cannot open checkpoint " + path));
  CHECK(contains(error_of([&] { write_checkpoint_file("/nonexistent-dir/x", file); }),
                 "cannot create a temporary file for checkpoint /nonexistent-dir/x"));
  // A name of 250 bytes (NAME_MAX is 255): its temporary file's name is cut, not too long (ENAMETOOLONG before).
  const std::string long_name = "/tmp/" + std::string(250 - std::to_string(::getpid()).size(), 'c') +
                                std::to_string(::getpid());
  write_checkpoint_file(long_name, file);
  CHECK(read_checkpoint_file(long_name) == file);
  ::unlink(long_name.c_str());
  // Before: "reading checkpoint /tmp: n failed at ../src/engine/checkpoint.cpp:373: Is a directory".
  CHECK_THROWS_AS(read_checkpoint_file("/tmp"), IoError);
  CHECK(error_of([&] { read_checkpoint_file("/tmp"); }) ==
        "cannot read checkpoint /tmp: a directory, expected a checkpoint file");
}

// A FIFO at the path blocked the open until a writer came (load_job: rank 0 forever); a file that is not a
// checkpoint was read (and allocated) whole before its header was looked at: a sparse terabyte of zeros ran out
// of memory. Now the header first, and no more than it says, plus a byte to tell a longer file.
TEST_CASE("checkpoint file: a FIFO is refused at once; only what the header says is read") {
  const std::string dir = "/tmp/psgd-test-checkpoint-read-" + std::to_string(::getpid());
  std::filesystem::create_directory(dir);
  const std::string fifo = dir + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(error_of([&] { read_checkpoint_file(fifo); }) ==
        "cannot read checkpoint " + fifo + ": not a regular file, expected a checkpoint file");
  const std::string sparse = dir + "/sparse";
  {
    std::ofstream(sparse).put('x');
  }
  std::filesystem::resize_file(sparse, uint64_t{1} << 40);  // 1 TiB of zeros, taking no disk
  CHECK(read_checkpoint_file(sparse).size() == kCheckpointHeaderBytes);  // not a checkpoint's header
  // Another file given by mistake (a model.pt, a zip) whose bytes 16-23 read as a length beyond the file: its
  // header alone is read.
  const std::string other = dir + "/model.pt";
  {
    std::ofstream out(other);
    out << "PK\x03\x04" << std::string(12, '\0') << std::string(8, '\x7f');
  }
  std::filesystem::resize_file(other, uint64_t{1} << 40);
  CHECK(read_checkpoint_file(other).size() == kCheckpointHeaderBytes);
  // A real checkpoint with bytes after it: read to one byte more than recorded, so the frame check names it. One
  // cut short: refused from its header, the file not read on (one of a terabyte whose header says more costs 24
  // bytes too).
  std::vector<char> file = encode_checkpoint(test_contents());
  const std::string longer = dir + "/longer", shorter = dir + "/shorter";
  std::vector<char> extended = file;
  extended.insert(extended.end(), 4096, 'z');
  write_checkpoint_file(longer, extended);
  write_checkpoint_file(shorter, std::vector<char>(file.begin(), file.end() - 10));
  CHECK(read_checkpoint_file(longer).size() == file.size() + 1);
  CHECK(contains(error_of([&] { read_checkpoint_file(shorter); }),
                 "is truncated: its header says " + std::to_string(file.size() - kCheckpointHeaderBytes) +
                     " bytes of payload, the file holds " + std::to_string(file.size() - kCheckpointHeaderBytes - 10)));
  const auto payload_error = [&](const std::string& path) {
    return error_of([&] {
      uint32_t version = 0;
      checked_payload(read_checkpoint_file(path), path, kCheckpointMagic, kCheckpointVersion, kCheckpointVersion,
                      version);
    });
  };
  CHECK(contains(payload_error(longer), "is longer than recorded"));
  CHECK(contains(payload_error(shorter), "is truncated"));
  CHECK(contains(payload_error(sparse), "is not a powersgd checkpoint (bad magic"));
  CHECK(contains(payload_error(other), "is not a powersgd checkpoint (bad magic"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoint file: concurrent savers to one path never fail and never leave a torn or temporary file") {
  const std::string path = "/tmp/psgd-test-checkpoint-shared-" + std::to_string(::getpid());
  std::vector<std::vector<char>> files;
  for (int w = 0; w < 4; ++w) {
    CheckpointContents contents = test_contents();
    contents.iteration = 100 + w;  // each writer's file differs
    files.push_back(encode_checkpoint(contents));
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; ++w)
    writers.emplace_back([&, w] {
      for (int i = 0; i < 75; ++i) {
        try {
          write_checkpoint_file(path, files[static_cast<size_t>(w)]);
        } catch (const std::exception& e) {
          MESSAGE(std::string(e.what()));
          ++failures;
        }
      }
    });
  for (auto& t : writers) t.join();
  CHECK(failures == 0);  // before: a fixed "path.tmp" name lost 133 of 300 saves to rename errors
  const std::vector<char> last = read_checkpoint_file(path);
  CHECK(std::find(files.begin(), files.end(), last) != files.end());  // one writer's file, whole
  for (const auto& entry : std::filesystem::directory_iterator("/tmp"))
    CHECK(entry.path().string().rfind(path + ".tmp", 0) != 0);
  ::unlink(path.c_str());
}

TEST_CASE("checkpoint codec: a version 1 file (before adaptive and alternating) loads with their defaults") {
  const CheckpointContents like = test_contents();
  const std::vector<char> v1 = framed(payload_before_level(like, 1), 1);
  const CheckpointContents out = decode(v1, like);
  CHECK(out.iteration == like.iteration);
  REQUIRE(out.buckets.size() == 2);
  for (size_t b = 0; b < 2; ++b) {
    CHECK(out.buckets[b].rank == like.buckets[b].rank);  // the loader's (only) level
    CHECK(out.buckets[b].compressed_steps == 0);
    CHECK(std::isnan(out.buckets[b].previous_window));
    CHECK(out.buckets[b].error == like.buckets[b].error);
    CHECK(out.buckets[b].q == like.buckets[b].q);
  }
  // A reducer with adaptive (or alternating) on is another configuration for a version 1 file.
  CheckpointContents adaptive = like;
  adaptive.config.adaptive = true;
  CHECK_THROWS_AS(decode(v1, adaptive), MismatchError);
  CHECK(contains(error_of([&] { decode(v1, adaptive); }), "config.adaptive = 0, this reducer has 1"));
}

TEST_CASE("checkpoint codec: each bucket's rank and window are kept; a rank the loader lacks is refused") {
  CheckpointContents in = test_contents();
  in.config.adaptive = true;
  in.config.rank_low = 1;
  in.config.rank_high = 3;
  in.buckets[0].rank = 3;
  in.buckets[0].level = 1;
  in.buckets[0].compressed_steps = 17;
  in.buckets[0].window_sum = 2.5;
  in.buckets[0].previous_window = 4.0;
  const std::vector<char> file = encode_checkpoint(in);
  const CheckpointContents out = decode(file, in);
  CHECK(out.buckets[0].rank == 3);
  CHECK(out.buckets[0].compressed_steps == 17);
  CHECK(out.buckets[0].window_sum == 2.5);
  CHECK(out.buckets[0].previous_window == 4.0);
  CHECK(std::isnan(out.buckets[1].previous_window));
  // The loader's levels give each rank's P and Q sizes; bucket 0 at rank 3 must be one of them.
  std::vector<CheckpointBucketShape> shapes = shapes_of(in);
  shapes[0].levels = {{1, 2, 3}, {2, 6, 9}};
  CHECK_THROWS_AS(decode_checkpoint(file, "ckpt", in.config, in.layout_fingerprint, shapes), MismatchError);
  CHECK(contains(error_of([&] { decode_checkpoint(file, "ckpt", in.config, in.layout_fingerprint, shapes); }),
                 "bucket 0 was at rank 3, a rank this reducer's configuration does not use"));
  shapes[0].levels = {{1, 2, 3}, {3, 6, 9}};
  CHECK(decode_checkpoint(file, "ckpt", in.config, in.layout_fingerprint, shapes).buckets[0].p == in.buckets[0].p);
}

namespace {

CheckpointContents equal_ranks_contents(uint32_t level) {
  CheckpointContents c = test_contents();
  c.config.adaptive = true;
  c.config.rank_low = c.config.rank_high = 3;
  for (auto& b : c.buckets) {
    b.rank = 3;
    b.level = level;
  }
  return c;
}

std::vector<CheckpointBucketShape> two_levels(const CheckpointContents& c) {
  std::vector<CheckpointBucketShape> shapes;
  for (const auto& b : c.buckets)
    shapes.push_back({b.numel, b.error.size(), {{b.rank, b.p.size(), b.q.size()}, {b.rank, b.p.size(), b.q.size()}}});
  return shapes;
}

}  // namespace

TEST_CASE("checkpoint codec: the rank level is kept, also when rank_low == rank_high; older versions still load") {
  for (uint32_t level : {0u, 1u}) {
    CAPTURE(level);
    const CheckpointContents in = equal_ranks_contents(level);
    const std::vector<char> file = encode_checkpoint(in);
    const CheckpointContents out = decode_checkpoint(file, "ckpt", in.config, in.layout_fingerprint, two_levels(in));
    for (const auto& b : out.buckets) {
      CHECK(b.level == level);
      CHECK(b.rank == 3);
    }
    // A job file keeps it too.
    const CheckpointContents job = decode_checkpoint(encode_checkpoint(in, CheckpointKind::Job), "job", in.config,
                                                     in.layout_fingerprint, two_levels(in), CheckpointKind::Job);
    CHECK(job.buckets[0].level == level);
  }
  // A level that is not the saved rank's level in the loader's configuration: a malformed file.
  CheckpointContents bad = equal_ranks_contents(1);
  std::vector<CheckpointBucketShape> one_level = two_levels(bad);
  one_level[0].levels.pop_back();
  CHECK_THROWS_AS(decode_checkpoint(encode_checkpoint(bad), "ckpt", bad.config, bad.layout_fingerprint, one_level),
                  IoError);
  CHECK(contains(error_of([&] {
                   decode_checkpoint(encode_checkpoint(bad), "ckpt", bad.config, bad.layout_fingerprint, one_level);
                 }),
                 "bucket 0 was at rank 3 and rank level 1"));

  // Version 2 (per-rank) and job version 1 files hold no level: a bucket resumes at its rank's level (with
  // rank_low == rank_high the higher one, as that version's reader did); every other field as saved.
  CheckpointContents v2 = equal_ranks_contents(0);
  v2.buckets[0].compressed_steps = 5;
  v2.buckets[0].previous_window = 1.5;
  const std::vector<char> payload = payload_before_level(v2, 2);
  const CheckpointContents old = decode_checkpoint(framed(payload, 2), "ckpt", v2.config, v2.layout_fingerprint,
                                                   two_levels(v2));
  CHECK(old.buckets[0].level == 1);
  CHECK(old.buckets[0].rank == 3);
  CHECK(old.buckets[0].compressed_steps == 5);
  CHECK(old.buckets[0].previous_window == 1.5);
  CHECK(old.buckets[0].p == v2.buckets[0].p);
  CHECK(old.buckets[1].error == v2.buckets[1].error);
  Writer job_v1;
  job_v1.put_raw(kJobCheckpointMagic, sizeof(kJobCheckpointMagic));
  job_v1.put(uint32_t{1});
  job_v1.put(crc32(payload.data(), payload.size()));
  job_v1.put(static_cast<uint64_t>(payload.size()));
  job_v1.put_raw(payload.data(), payload.size());
  const CheckpointContents old_job = decode_checkpoint(job_v1.take(), "job", v2.config, v2.layout_fingerprint,
                                                       two_levels(v2), CheckpointKind::Job);
  CHECK(old_job.buckets[0].compressed_steps == 5);
  CHECK(old_job.buckets[0].q == v2.buckets[0].q);
  // Version 2's layout framed as version 3 is refused, not misread.
  CHECK_THROWS_AS(decode_checkpoint(framed(payload, 3), "ckpt", v2.config, v2.layout_fingerprint, two_levels(v2)),
                  Error);
}

TEST_CASE("checkpoint codec and fingerprint: only the fields a configuration uses must agree") {
  struct Case {
    const char* what;
    std::function<void(Config&)> saved, loader;
    const char* refused;  // nullptr: loads
  };
  auto none = [](Config&) {};
  const Case cases[] = {
      // Unused: the adaptive fields without adaptive, rank with it, the per-matrix fields with whole_bucket.
      {"rank_high without adaptive and without the rank policy",
       [](Config& c) { c.lr_boost_steps = 0; }, [](Config& c) { c.lr_boost_steps = 0, c.rank_high = 8; }, nullptr},
      {"rank_low, interval, threshold without adaptive", [](Config& c) { c.rank_low = 2; },
       [](Config& c) { c.adaptive_interval = 7, c.adaptive_threshold = 0.1; }, nullptr},
      {"rank with adaptive", [](Config& c) { c.adaptive = true, c.rank = 2; },
       [](Config& c) { c.adaptive = true, c.rank = 5; }, nullptr},
      {"min_compression_rate, batch_same_shape with whole_bucket", none,
       [](Config& c) { c.min_compression_rate = 9, c.batch_same_shape = true; }, nullptr},
      // Used: refused, naming the field.
      {"rank without adaptive", none, [](Config& c) { c.rank = 5; }, "config.rank = 3, this reducer has 5"},
      {"rank_high with adaptive", [](Config& c) { c.adaptive = true; },
       [](Config& c) { c.adaptive = true, c.rank_high = 8; }, "config.rank_high = 4, this reducer has 8"},
      {"rank_high with a fixed rank the policy may boost", none, [](Config& c) { c.rank_high = 8; },
       "config.rank_high = 4, this reducer has 8"},
      {"adaptive itself", none, [](Config& c) { c.adaptive = true; }, "config.adaptive = 0, this reducer has 1"},
      {"min_compression_rate without whole_bucket", [](Config& c) { c.whole_bucket = false; },
       [](Config& c) { c.whole_bucket = false, c.min_compression_rate = 9; },
       "config.min_compression_rate = 2, this reducer has 9"},
      {"whole_bucket itself, with the per-matrix fields unused by the saver", [](Config& c) { c.min_compression_rate = 9; },
       [](Config& c) { c.whole_bucket = false, c.min_compression_rate = 9; },
       "config.whole_bucket = 1, this reducer has 0"},
      // A field unused by the loader but used by the saver still refuses.
      {"rank used by the saver only", [](Config& c) { c.rank = 5; }, [](Config& c) { c.adaptive = true; },
       "config.rank = 5, this reducer has 3"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.what);
    CheckpointContents saved = test_contents();
    k.saved(saved.config);
    CheckpointContents loader = saved;
    loader.config = test_config();
    k.loader(loader.config);
    const std::vector<char> file = encode_checkpoint(saved);
    if (k.refused == nullptr) {
      CHECK(decode(file, loader).iteration == saved.iteration);
      CHECK(config_fingerprint(saved.config) == config_fingerprint(loader.config));
    } else {
      CHECK_THROWS_AS(decode(file, loader), MismatchError);
      CHECK(contains(error_of([&] { decode(file, loader); }), k.refused));
      CHECK(config_fingerprint(saved.config) != config_fingerprint(loader.config));
    }
  }
}

TEST_CASE("checkpoint codec: the rank policy's state is kept; a version 3 file loads without it") {
  CheckpointContents in = equal_ranks_contents(1);
  in.config.warmup_steps = 7;
  in.config.lr_boost_steps = 9;
  in.buckets[0].note_pending = true;
  in.buckets[0].boost_left = 5;
  in.buckets[0].rule_level = 0;
  in.buckets[0].rule_reason = RankReason::NormChangeLow;
  in.buckets[0].reason = RankReason::LrNote;
  const CheckpointContents out =
      decode_checkpoint(encode_checkpoint(in), "ckpt", in.config, in.layout_fingerprint, two_levels(in));
  CHECK(out.buckets[0].note_pending);
  CHECK(out.buckets[0].boost_left == 5);
  CHECK(out.buckets[0].rule_level == 0);
  CHECK(out.buckets[0].rule_reason == RankReason::NormChangeLow);
  CHECK(out.buckets[0].reason == RankReason::LrNote);
  CHECK(!out.buckets[1].note_pending);
  // Another warm-up or boost length is another configuration.
  Config other = in.config;
  other.lr_boost_steps = 8;
  CHECK(contains(error_of([&] {
                   decode_checkpoint(encode_checkpoint(in), "ckpt", other, in.layout_fingerprint, two_levels(in));
                 }),
                 "config.lr_boost_steps = 9, this reducer has 8"));
  // A reason byte out of range is a malformed file (bucket 0's reason byte,
  // found by encoding with another reason).
  CheckpointContents odd = in;
  odd.buckets[0].reason = RankReason::NormChangeHigh;
  std::vector<char> payload = payload_of(encode_checkpoint(in));
  const std::vector<char> other_payload = payload_of(encode_checkpoint(odd));
  size_t at = 0;
  while (payload[at] == other_payload[at]) ++at;
  payload[at] = 9;
  CHECK(contains(error_of([&] {
                   decode_checkpoint(framed(payload), "ckpt", in.config, in.layout_fingerprint, two_levels(in));
                 }),
                 "has reason 9, expected 0 to 5"));

  // Version 3 (before the policy): no note, no boost; with adaptive the level in force is the rule's, its
  // reason from the window; the policy's config fields at their defaults (a reducer with others refuses it).
  CheckpointContents v3 = equal_ranks_contents(0);
  v3.buckets[0].previous_window = 2.5;
  const std::vector<char> old_payload = payload_before_level(v3, 3);
  const CheckpointContents old = decode_checkpoint(framed(old_payload, 3), "ckpt", v3.config, v3.layout_fingerprint,
                                                   two_levels(v3));
  CHECK(old.buckets[0].level == 0);
  CHECK(old.buckets[0].boost_left == 0);
  CHECK(!old.buckets[0].note_pending);
  CHECK(old.buckets[0].rule_level == 0);
  CHECK(old.buckets[0].rule_reason == RankReason::NormChangeLow);
  CHECK(old.buckets[0].reason == RankReason::NormChangeLow);
  CHECK(old.buckets[0].p == v3.buckets[0].p);
  Config with_warmup = v3.config;
  with_warmup.warmup_steps = 3;
  CHECK_THROWS_AS(decode_checkpoint(framed(old_payload, 3), "ckpt", with_warmup, v3.layout_fingerprint,
                                    two_levels(v3)),
                  MismatchError);
  // Job version 2's payload is version 3's.
  Writer job_v2;
  job_v2.put_raw(kJobCheckpointMagic, sizeof(kJobCheckpointMagic));
  job_v2.put(uint32_t{2});
  job_v2.put(crc32(old_payload.data(), old_payload.size()));
  job_v2.put(static_cast<uint64_t>(old_payload.size()));
  job_v2.put_raw(old_payload.data(), old_payload.size());
  const CheckpointContents old_job = decode_checkpoint(job_v2.take(), "job", v3.config, v3.layout_fingerprint,
                                                       two_levels(v3), CheckpointKind::Job);
  CHECK(old_job.buckets[0].boost_left == 0);
  CHECK(old_job.buckets[0].q == v3.buckets[0].q);
}

// Values no reducer saves, under a valid CRC (a file written by hand or by a defective build), loaded: a huge
// boost at the low level made every later step an internal error ("switches to rank level 1, whose buffers are
// not laid out"), NaN in the error memory made every step a NonFiniteError blaming the gradients, an
// iteration of INT64_MAX overflowed the step counter. Each is refused as malformed, naming the value.
TEST_CASE("checkpoint codec: values no reducer saves are refused as malformed, naming them") {
  const auto refused = [](const CheckpointContents& in) {
    return error_of([&] { decode_checkpoint(encode_checkpoint(in), "ckpt", in.config, in.layout_fingerprint,
                                            two_levels(in)); });
  };
  CheckpointContents good = equal_ranks_contents(1);
  good.config.lr_boost_steps = 9;
  good.buckets[0].boost_left = 9;
  CHECK(refused(good).empty());
  CheckpointContents in = good;
  in.buckets[0].boost_left = 10;
  CHECK(contains(refused(in), "bucket 0 has 10 boosted steps left at rank level 1, expected at most lr_boost_steps "
                              "(9), and none but at the highest level (1)"));
  in = equal_ranks_contents(0);
  in.config.lr_boost_steps = 9;
  in.buckets[0].boost_left = 3;
  CHECK(contains(refused(in), "bucket 0 has 3 boosted steps left at rank level 0"));
  in = good;
  in.buckets[1].error[2] = NAN;
  CHECK(contains(refused(in), "bucket 1's error memory holds nan at 2, expected finite values"));
  in = good;
  in.buckets[0].q[4] = -INFINITY;
  CHECK(contains(refused(in), "bucket 0's Q holds -inf at 4"));
  in = good;
  in.iteration = INT64_MAX;
  CHECK(contains(refused(in), "is malformed: iteration 9223372036854775807, expected 0 to 4611686018427387904"));
  in = good;
  in.buckets[0].window_sum = INFINITY;
  CHECK(contains(refused(in), "bucket 0 has the adaptive windows' sums inf and nan"));
  in = good;
  in.buckets[1].previous_window = -1.0;
  CHECK(contains(refused(in), "bucket 1 has the adaptive windows' sums 0 and -1"));
}
