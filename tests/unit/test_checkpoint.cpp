// The checkpoint codec on bytes, without a communicator or a backend: round
// trip, the little-endian encoding, and every way a file can be damaged,
// foreign or of another configuration. The Reducer's save/load around it:
// test_engine.cpp ("checkpoint: ...").
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
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
  for (const auto& b : c.buckets) shapes.push_back({b.numel, b.error.size(), {{b.rank, b.p.size(), b.q.size()}}});
  return shapes;
}

CheckpointContents decode(const std::vector<char>& file, const CheckpointContents& like) {
  return decode_checkpoint(file, "ckpt", like.config, like.layout_fingerprint, shapes_of(like));
}

// A file framed around `payload` with a correct header.
std::vector<char> framed(const std::vector<char>& payload) {
  Writer w;
  w.put_raw(kCheckpointMagic, sizeof(kCheckpointMagic));
  w.put(kCheckpointVersion);
  w.put(crc32(payload.data(), payload.size()));
  w.put(static_cast<uint64_t>(payload.size()));
  w.put_raw(payload.data(), payload.size());
  return w.take();
}

std::vector<char> payload_of(const std::vector<char>& file) {
  return {file.begin() + static_cast<std::ptrdiff_t>(kCheckpointHeaderBytes), file.end()};
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

  // The header: magic, then version 2, CRC and payload length, little-endian.
  const std::vector<char> file = encode_checkpoint(test_contents());
  CHECK(std::memcmp(file.data(), kCheckpointMagic, 8) == 0);
  CHECK(file[8] == 2);
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
  CHECK(contains(error_of([&] { decode(magic, like); }), "file ckpt is not a powersgd checkpoint (bad magic)"));

  std::vector<char> version = file;
  version[8] = 3;
  CHECK_THROWS_AS(decode(version, like), IoError);
  CHECK(contains(error_of([&] { decode(version, like); }), "has format version 3: this build reads versions 1 to 2"));
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

TEST_CASE("checkpoint file: written atomically, read back whole; a missing file is named") {
  const std::string path = "/tmp/psgd-test-checkpoint-" + std::to_string(::getpid());
  const std::vector<char> file = encode_checkpoint(test_contents());
  write_checkpoint_file(path, file);
  CHECK(read_checkpoint_file(path) == file);
  for (const auto& entry : std::filesystem::directory_iterator("/tmp"))  // the temporary file was renamed away
    CHECK(entry.path().string().rfind(path + ".tmp", 0) != 0);
  ::unlink(path.c_str());
  CHECK_THROWS_AS(read_checkpoint_file(path), IoError);
  CHECK(contains(error_of([&] { read_checkpoint_file(path); }), "cannot open checkpoint " + path));
  CHECK(contains(error_of([&] { write_checkpoint_file("/nonexistent-dir/x", file); }),
                 "cannot create a temporary file for checkpoint /nonexistent-dir/x"));
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
