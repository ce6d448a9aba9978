// The PowerSGD engine in one process (world size 1, a real communicator): every
// option against the double-precision reference, validation, the step counter,
// the non-finite guard, async and fused reduction, statistics, checkpoints, and
// the C API. Properties across ranks: tests/multiprocess/test_engine_mp.cpp.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <thread>

#include "engine_reference.hpp"
#include "error_of.hpp"
#include "powersgd/powersgd.h"

using namespace powersgd;
using powersgd::test::error_of;
using powersgd::test::Reference;
using powersgd::test::config_for;
using powersgd::test::gradients;
using powersgd::test::relative_difference;

namespace {

std::unique_ptr<Communicator> solo() { return Communicator::create(CommOptions::single_process()); }

// A per-test temporary file name.
std::string temp_path(const char* tag) {
  return "/tmp/psgd-test-engine-" + std::to_string(::getpid()) + "-" + tag;
}

const std::vector<Shape> kShapes = {{16, 20}, {}, {4, 3, 2, 2}, {16, 20}, {5}, {3, 40}, {2, 50}, {16, 20}};

}  // namespace

TEST_CASE("config: every invalid field is named with its value") {
  auto comm = solo();
  struct Bad {
    std::function<void(Config&)> set;
    const char* expect;
  };
  const Bad cases[] = {
      {[](Config& c) { c.rank = 0; }, "config.rank = 0"},
      {[](Config& c) { c.rank = 65; }, "config.rank = 65"},
      {[](Config& c) { c.start_iter = -1; }, "config.start_iter = -1"},
      {[](Config& c) { c.min_compression_rate = -1; }, "config.min_compression_rate = -1"},
      {[](Config& c) { c.min_compression_rate = std::nan(""); }, "config.min_compression_rate"},
      {[](Config& c) { c.orthogonalization_epsilon = -0.5; }, "config.orthogonalization_epsilon = -0.5"},
      {[](Config& c) { c.orthogonalization_epsilon = INFINITY; }, "config.orthogonalization_epsilon = inf"},
      {[](Config& c) { c.device_index = -2; }, "config.device_index = -2"},
      {[](Config& c) { c.device = static_cast<Device>(7); }, "config.device = 7"},
      {[](Config& c) { c.rank_low = 0; }, "config.rank_low = 0: expected 1 to 64"},
      {[](Config& c) { c.rank_high = 65; }, "config.rank_high = 65: expected 1 to 64"},
      {[](Config& c) { c.rank_low = 3, c.rank_high = 2; }, "config.rank_low = 3 > config.rank_high = 2"},
      {[](Config& c) { c.adaptive_interval = 0; }, "config.adaptive_interval = 0: expected >= 1"},
      {[](Config& c) { c.adaptive_threshold = -0.25; }, "config.adaptive_threshold = -0.25"},
      {[](Config& c) { c.adaptive_threshold = std::nan(""); }, "config.adaptive_threshold = nan"},
  };
  for (const auto& bad : cases) {
    Config c;
    bad.set(c);
    CHECK_THROWS_AS(Reducer(*comm, c), InvalidArgumentError);
    CHECK(error_of([&] { Reducer r(*comm, c); }).find(bad.expect) != std::string::npos);
  }
}

TEST_CASE("plan: compression test, matrix views and packing as the reference") {
  Config c;
  c.rank = 2;
  auto plan = engine::make_plan(kShapes, c);
  // 16x20 at r=2: (36)*2*2 = 144 < 320 -> compressed; 3x40 at r=2: 86*2*2 > 120 -> not.
  CHECK(plan.tensors[0].compressed);
  CHECK_FALSE(plan.tensors[1].compressed);  // 0-D
  CHECK_FALSE(plan.tensors[4].compressed);  // 1-D
  CHECK_FALSE(plan.tensors[5].compressed);
  CHECK(plan.numel == 320 + 1 + 48 + 320 + 5 + 120 + 100 + 320);
  CHECK(plan.p_numel == 3 * 16 * 2);
  CHECK(plan.q_numel == 3 * 20 * 2);
  CHECK(plan.packed_numel == plan.numel - plan.compressed_numel);
  CHECK(engine::should_compress(16, 20, 2, 2.0));
  CHECK_FALSE(engine::should_compress(3, 40, 2, 2.0));
  CHECK(engine::should_compress(3, 40, 100, 0.1));  // r = min(n, m, rank) = 3
  c.batch_same_shape = true;
  plan = engine::make_plan(kShapes, c);
  CHECK(plan.groups[0].count == 3);
  CHECK(plan.tensors[3].work_offset == plan.tensors[0].work_offset + 320);
  c.whole_bucket = true;
  plan = engine::make_plan(kShapes, c);
  CHECK(plan.side * plan.side >= plan.numel);
  CHECK((plan.side - 1) * (plan.side - 1) < plan.numel);
}

TEST_CASE("add_bucket: empty buckets and bad shapes are refused clearly") {
  auto comm = solo();
  Reducer r(*comm, Config{});
  CHECK(error_of([&] { r.add_bucket(std::vector<Shape>{}); }).find("no tensors") != std::string::npos);
  CHECK(error_of([&] { r.add_bucket({{0}, {3, 0}}); }).find("0 elements") != std::string::npos);
  CHECK(error_of([&] { r.add_bucket({{4, -3}}); }).find("dimension 1 = -3") != std::string::npos);
  CHECK(error_of([&] { r.add_bucket({{1LL << 20, 1LL << 20}}); }).find("too large") != std::string::npos);
  CHECK(r.num_buckets() == 0);
  std::vector<float> data(7);
  CHECK(error_of([&] { r.reduce(0, data.data()); }).find("bucket index 0") != std::string::npos);
  CHECK(r.add_bucket({{7}}) == 0);
  CHECK(error_of([&] { r.reduce(0, nullptr); }).find("data is null") != std::string::npos);
  r.reduce(0, data.data());
  CHECK(error_of([&] { r.add_bucket({{3}}); }).find("after the first reduce") != std::string::npos);
}

TEST_CASE("step: every option against the double-precision reference") {
  auto comm = solo();
  int combos = 0;
  for (int rank : {1, 2, 3, 5})
    for (int flags = 0; flags < 32; ++flags) {
      Config c = config_for(rank, flags);
      c.min_compression_rate = (flags & 16) ? 0.0 : 2.0;  // 0: r > min(n, m) is exercised
      c.orthogonalization_epsilon = rank == 2 ? 1e-3 : 0.0;
      c.seed = static_cast<uint64_t>(flags);
      CAPTURE(rank);
      CAPTURE(flags);
      Reducer reducer(*comm, c);
      const int b = reducer.add_bucket(kShapes);
      Reference ref(kShapes, c, 1);
      const size_t n = reducer.bucket_size(b);
      for (int step = 0; step < 4; ++step) {
        std::vector<float> g = gradients(n, 0, step);
        std::vector<double> expected = ref.step({g});
        reducer.reduce(b, g.data());
        CHECK(relative_difference(g, expected) < 2e-5);
        std::vector<float> error(n);
        reducer.error_feedback(b, error.data());
        CHECK(relative_difference(error, ref.error(0)) < 2e-5);
      }
      CHECK(reducer.iteration() == 4);
      ++combos;
    }
  CHECK(combos == 128);
}

TEST_CASE("step: a bucket reduced twice in one step is refused; the counter counts steps") {
  auto comm = solo();
  Reducer r(*comm, Config{});
  r.add_bucket({{4, 4}});
  r.add_bucket({{3}});
  std::vector<float> a(16, 1.0f), b(3, 1.0f);
  r.reduce(0, a.data());
  CHECK(r.iteration() == 0);
  CHECK(error_of([&] { r.reduce(0, a.data()); }).find("bucket 0 was already reduced in step 0") != std::string::npos);
  r.reduce(1, b.data());
  CHECK(r.iteration() == 1);
  r.reduce(1, b.data());  // any order within a step
  r.reduce(0, a.data());
  CHECK(r.iteration() == 2);
  std::vector<float*> both{a.data(), b.data()};
  r.reduce_all(both);
  CHECK(r.iteration() == 3);
  r.reduce(0, a.data());
  CHECK(error_of([&] { r.reduce_all(both); }).find("must start a step") != std::string::npos);
}

TEST_CASE("non-finite: NaN or Inf fails the call and leaves data and state untouched") {
  auto comm = solo();
  for (bool whole : {false, true})
    for (float bad : {std::nanf(""), INFINITY}) {
      Config c;
      c.start_iter = 1;
      c.whole_bucket = whole;
      Reducer r(*comm, c);
      r.add_bucket(kShapes);
      Reducer clean(*comm, c);
      clean.add_bucket(kShapes);
      const size_t n = r.bucket_size(0);
      for (int step = 0; step < 6; ++step) {
        if (step == 1 || step == 3) {  // one plain step, one compressed step
          std::vector<float> g = gradients(n, 0, 100 + step);
          g[n / 2] = bad;
          std::vector<float> before_error(n), after_error(n);
          r.error_feedback(0, before_error.data());
          const std::vector<float> before = g;
          CHECK_THROWS_AS(r.reduce(0, g.data()), NonFiniteError);
          r.error_feedback(0, after_error.data());
          CHECK(std::memcmp(before_error.data(), after_error.data(), n * sizeof(float)) == 0);
          CHECK(std::memcmp(before.data(), g.data(), n * sizeof(float)) == 0);
          continue;  // the failed step counted; the clean run skips it
        }
        std::vector<float> g = gradients(n, 0, step), h = g;
        r.reduce(0, g.data());
        clean.reduce(0, h.data());
        CHECK(std::memcmp(g.data(), h.data(), n * sizeof(float)) == 0);
      }
      CHECK(r.iteration() == 6);
    }
}

TEST_CASE("async and fused: many buckets in flight equal one at a time, bit for bit") {
  auto comm = solo();
  Config c;
  c.start_iter = 2;
  c.rank = 2;
  const std::vector<std::vector<Shape>> buckets = {kShapes, {{64, 32}}, {{7}}, {{32, 32}, {32}}, {{8, 8, 3, 3}}};
  Reducer sync(*comm, c), async(*comm, c), fused(*comm, c);
  for (const auto& shapes : buckets) {
    sync.add_bucket(shapes);
    async.add_bucket(shapes);
    fused.add_bucket(shapes);
  }
  for (int step = 0; step < 8; ++step) {
    std::vector<std::vector<float>> a, s, f;
    for (int b = 0; b < sync.num_buckets(); ++b) {
      a.push_back(gradients(sync.bucket_size(b), b, step));
      s.push_back(a.back());
      f.push_back(a.back());
    }
    std::vector<ReduceHandle> handles;
    for (int b = sync.num_buckets() - 1; b >= 0; --b) handles.push_back(async.reduce_async(b, a[static_cast<size_t>(b)].data()));
    for (int b = sync.num_buckets() - 1; b >= 0; --b) sync.reduce(b, s[static_cast<size_t>(b)].data());
    std::vector<float*> ptrs;
    for (auto& v : f) ptrs.push_back(v.data());
    fused.reduce_all(ptrs);
    for (auto& h : handles) h.wait();
    for (size_t b = 0; b < a.size(); ++b) {
      CHECK(a[b] == s[b]);
      CHECK(f[b] == s[b]);
    }
  }
  CHECK(async.iteration() == 8);
  CHECK(fused.iteration() == 8);
}

TEST_CASE("stats: element counts as the reference, bytes sent, relative error") {
  auto comm = solo();
  Config c;
  c.start_iter = 1;
  c.rank = 2;
  Reducer r(*comm, c);
  r.add_bucket(kShapes);
  const auto plan = engine::make_plan(kShapes, c);
  const size_t n = r.bucket_size(0);
  std::vector<float> g = gradients(n, 0, 0);
  r.reduce(0, g.data());  // plain
  Stats s = r.stats();
  CHECK(s.numel_before == 0);
  CHECK(s.bytes_sent == (n + 1) * 4);
  CHECK(std::isnan(s.relative_error[0]));
  for (int step = 1; step <= 3; ++step) {
    g = gradients(n, 0, step);
    r.reduce(0, g.data());
  }
  s = r.stats();
  CHECK(s.numel_before == 3 * n);
  const auto after = static_cast<uint64_t>(plan.p_numel + plan.q_numel + plan.packed_numel);
  CHECK(s.numel_after == 3 * after);
  CHECK(s.compression_rate() == doctest::Approx(double(n) / double(after)));
  CHECK(s.bytes_sent == (n + 1) * 4 + 3 * 4 * (after + 1));
  CHECK(s.relative_error[0] > 0.05);  // random matrices are far from rank 2
  CHECK(s.relative_error[0] < 1.0);
  CHECK(s.total_relative_error == doctest::Approx(s.relative_error[0]));
  CHECK(s.compress_seconds > 0);
  CHECK(s.communicate_seconds > 0);
  CHECK(s.decompress_seconds > 0);
  // A rank-1 gradient is reproduced: relative error ~ 0.
  Reducer exact(*comm, Config{.rank = 1, .start_iter = 0, .error_feedback = false});
  exact.add_bucket({{30, 40}});
  std::vector<float> m(1200);
  for (int i = 0; i < 30; ++i)
    for (int j = 0; j < 40; ++j) m[static_cast<size_t>(i * 40 + j)] = float(i + 1) * float(j % 7 - 3);
  exact.reduce(0, m.data());
  CHECK(exact.stats().relative_error[0] < 1e-5);
}

TEST_CASE("checkpoint: resume is bit-identical; damaged or foreign files are refused") {
  auto comm = solo();
  for (bool whole : {false, true}) {
    Config c;
    c.start_iter = 2;
    c.rank = 3;
    c.warm_start = true;
    c.whole_bucket = whole;
    const std::vector<Shape> second = {{12, 24}, {6}};
    Reducer a(*comm, c);
    a.add_bucket(kShapes);
    a.add_bucket(second);
    auto step = [](Reducer& r, int t) {
      std::vector<std::vector<float>> out;
      for (int b = 0; b < r.num_buckets(); ++b) {
        out.push_back(gradients(r.bucket_size(b), b, t));
        r.reduce(b, out.back().data());
      }
      return out;
    };
    for (int t = 0; t < 5; ++t) step(a, t);
    const std::string path = temp_path(whole ? "whole" : "plain");
    a.save(path);
    std::vector<std::vector<std::vector<float>>> expected;
    for (int t = 5; t < 9; ++t) expected.push_back(step(a, t));

    Reducer b(*comm, c);
    b.add_bucket(kShapes);
    b.add_bucket(second);
    b.load(path);
    CHECK(b.iteration() == 5);
    for (int t = 5; t < 9; ++t) CHECK(step(b, t) == expected[static_cast<size_t>(t - 5)]);
    CHECK(b.stats().numel_before == a.stats().numel_before);

    // Damaged copies.
    std::ifstream in(path, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto write = [&](const std::vector<char>& content) {
      std::ofstream out(path + ".bad", std::ios::binary | std::ios::trunc);
      out.write(content.data(), static_cast<std::streamsize>(content.size()));
    };
    Reducer fresh(*comm, c);
    fresh.add_bucket(kShapes);
    fresh.add_bucket(second);
    write(std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(bytes.size() / 2)));
    CHECK(error_of([&] { fresh.load(path + ".bad"); }).find("truncated") != std::string::npos);
    write(std::vector<char>(bytes.begin(), bytes.begin() + 10));
    CHECK(error_of([&] { fresh.load(path + ".bad"); }).find("truncated") != std::string::npos);
    auto flipped = bytes;
    flipped[flipped.size() - 3] ^= 0x40;
    write(flipped);
    CHECK_THROWS_AS(fresh.load(path + ".bad"), IoError);
    CHECK(error_of([&] { fresh.load(path + ".bad"); }).find("corrupted") != std::string::npos);
    auto magic = bytes;
    magic[0] = 'X';
    write(magic);
    CHECK(error_of([&] { fresh.load(path + ".bad"); }).find("not a powersgd checkpoint") != std::string::npos);
    CHECK(error_of([&] { fresh.load(path + ".missing"); }).find("cannot open") != std::string::npos);
    CHECK(fresh.iteration() == 0);  // refused loads changed nothing

    Config other = c;
    other.seed = 9;
    Reducer wrong_config(*comm, other);
    wrong_config.add_bucket(kShapes);
    wrong_config.add_bucket(second);
    CHECK_THROWS_AS(wrong_config.load(path), MismatchError);
    CHECK(error_of([&] { wrong_config.load(path); }).find("config.seed = 0") != std::string::npos);
    Reducer wrong_layout(*comm, c);
    wrong_layout.add_bucket(kShapes);
    wrong_layout.add_bucket({{24, 12}, {6}});  // same sizes, other shapes
    CHECK(error_of([&] { wrong_layout.load(path); }).find("another bucket layout") != std::string::npos);
    Reducer fewer(*comm, c);
    fewer.add_bucket(kShapes);
    CHECK(error_of([&] { fewer.load(path); }).find("2 buckets") != std::string::npos);
    std::remove(path.c_str());
    std::remove((path + ".bad").c_str());
  }
}

TEST_CASE("C API: defaults, null arguments, status codes and a reduction") {
  psgd_config d = psgd_config_default();
  CHECK(d.rank == 1);
  CHECK(d.start_iter == 1000);
  CHECK(d.min_compression_rate == 2.0);
  CHECK(d.error_feedback == 1);
  CHECK(d.warm_start == 1);
  CHECK(d.orthogonalization_epsilon == 0.0);
  CHECK(d.seed == 0);
  CHECK(d.batch_same_shape == 0);
  CHECK(d.whole_bucket == 0);
  CHECK(d.device == 0);
  CHECK(d.device_index == 0);
  CHECK(d.adaptive == 0);
  CHECK(d.rank_low == 1);
  CHECK(d.rank_high == 4);
  CHECK(d.adaptive_interval == 100);
  CHECK(d.adaptive_threshold == 0.5);
  CHECK(d.alternating == 0);

  CHECK(psgd_comm_init_from_env(nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("'out'") != std::string::npos);
  CHECK(psgd_comm_rank(nullptr) == -1);
  CHECK(psgd_reducer_iteration(nullptr) == -1);

  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  psgd_comm* comm = nullptr;
  REQUIRE(psgd_comm_init_from_env(&comm) == PSGD_OK);
  CHECK(psgd_comm_rank(comm) == 0);
  CHECK(psgd_comm_size(comm) == 1);
  float x[3] = {1, 2, 3};
  CHECK(psgd_comm_allreduce_sum_f32(comm, x, 3) == PSGD_OK);
  CHECK(x[2] == 3.0f);
  CHECK(psgd_comm_barrier(comm) == PSGD_OK);

  psgd_reducer* r = nullptr;
  psgd_config bad = d;
  bad.warm_start = 2;
  CHECK(psgd_reducer_create(comm, &bad, &r) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("config.warm_start = 2") != std::string::npos);
  CHECK(r == nullptr);
  bad = d;
  bad.alternating = 3;
  CHECK(psgd_reducer_create(comm, &bad, &r) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("config.alternating = 3") != std::string::npos);
  bad = d;
  bad.rank_low = 5;
  CHECK(psgd_reducer_create(comm, &bad, &r) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("config.rank_low = 5 > config.rank_high = 4") != std::string::npos);
  CHECK(psgd_reducer_create(comm, nullptr, &r) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("'config'") != std::string::npos);

  d.start_iter = 0;
  REQUIRE(psgd_reducer_create(comm, &d, &r) == PSGD_OK);
  const int ndims[] = {2, 1};
  const int64_t dims[] = {8, 6, 5};
  int index = -1;
  CHECK(psgd_reducer_add_bucket(r, 2, ndims, nullptr, &index) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("'dims'") != std::string::npos);
  CHECK(psgd_reducer_add_bucket(r, 0, ndims, dims, &index) == PSGD_ERR_INVALID_ARGUMENT);
  REQUIRE(psgd_reducer_add_bucket(r, 2, ndims, dims, &index) == PSGD_OK);
  CHECK(index == 0);
  std::vector<float> g = gradients(53, 0, 0);
  CHECK(psgd_reducer_reduce(r, 0, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_reduce(r, 3, g.data()) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  CHECK(psgd_reducer_iteration(r) == 2);
  g[4] = std::nanf("");
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_ERR_NONFINITE);
  CHECK(std::string(psgd_last_error()).find("NaN or Inf") != std::string::npos);
  std::vector<float> error(53);
  CHECK(psgd_reducer_error_feedback(r, 0, error.data()) == PSGD_OK);
  psgd_stats stats = PSGD_STATS_INIT;
  CHECK(psgd_reducer_stats(r, &stats) == PSGD_OK);
  CHECK(stats.numel_before == 2 * 53);
  CHECK(stats.compression_rate > 1.0);
  CHECK(stats.relative_error > 0.0);
  CHECK(stats.last_step_bytes > 0);
  int bucket_rank = 0;
  CHECK(psgd_reducer_bucket_rank(r, 0, &bucket_rank) == PSGD_OK);
  CHECK(bucket_rank == 1);
  CHECK(psgd_reducer_bucket_rank(r, 1, &bucket_rank) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_bucket_rank(r, 0, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  const std::string path = temp_path("capi");
  CHECK(psgd_reducer_save(r, path.c_str()) == PSGD_OK);
  CHECK(psgd_reducer_load(r, (path + ".none").c_str()) == PSGD_ERR_IO);
  CHECK(psgd_reducer_load(r, path.c_str()) == PSGD_OK);
  std::remove(path.c_str());
  psgd_reducer_destroy(r);
  psgd_comm_destroy(comm);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
}

TEST_CASE("C API: version, struct_size of config and stats, bucket_size") {
  CHECK(std::string(psgd_version()) == std::to_string(PSGD_VERSION_MAJOR) + "." + std::to_string(PSGD_VERSION_MINOR) +
                                           "." + std::to_string(PSGD_VERSION_PATCH));
  CHECK(PSGD_VERSION_NUMBER == 10000 * PSGD_VERSION_MAJOR + 100 * PSGD_VERSION_MINOR + PSGD_VERSION_PATCH);
  const psgd_config d = psgd_config_default();
  CHECK(d.struct_size == sizeof(psgd_config));

  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  psgd_comm* comm = nullptr;
  REQUIRE(psgd_comm_init_from_env(&comm) == PSGD_OK);
  psgd_reducer* r = nullptr;

  // A config that does not say its size (not from psgd_config_default) is refused, naming the value.
  psgd_config unsized = d;
  unsized.struct_size = 8;
  CHECK(psgd_reducer_create(comm, &unsized, &r) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("config.struct_size = 8: expected at least") != std::string::npos);
  CHECK(r == nullptr);

  // A caller compiled against powersgd 0.1's header: its struct ends at device_index; what lies beyond
  // (here set to invalid values) is not read, and the appended fields take their defaults.
  struct Older {
    psgd_config config;
  } older{d};
  older.config.struct_size = offsetof(psgd_config, device_index) + sizeof(int);
  older.config.rank_low = 99;
  older.config.alternating = 7;
  REQUIRE(psgd_reducer_create(comm, &older.config, &r) == PSGD_OK);
  psgd_reducer_destroy(r);
  r = nullptr;

  // A caller compiled against a newer header: a longer struct whose extra fields are at their zero
  // defaults works; a set extra field this library cannot honour is refused.
  struct Newer {
    psgd_config config;
    uint64_t appended;
  } newer{d, 0};
  newer.config.struct_size = sizeof(Newer);
  newer.config.rank = 2;
  REQUIRE(psgd_reducer_create(comm, &newer.config, &r) == PSGD_OK);
  psgd_reducer_destroy(r);
  r = nullptr;
  newer.appended = 1;
  CHECK(psgd_reducer_create(comm, &newer.config, &r) == PSGD_ERR_UNSUPPORTED);
  CHECK(std::string(psgd_last_error()).find("byte " + std::to_string(sizeof(psgd_config)) + " is set") !=
        std::string::npos);
  CHECK(r == nullptr);

  REQUIRE(psgd_reducer_create(comm, &d, &r) == PSGD_OK);
  const int ndims[] = {2, 1};
  const int64_t dims[] = {8, 6, 5};
  int index = -1;
  REQUIRE(psgd_reducer_add_bucket(r, 2, ndims, dims, &index) == PSGD_OK);
  size_t size = 0;
  CHECK(psgd_reducer_bucket_size(r, index, &size) == PSGD_OK);
  CHECK(size == 53);
  CHECK(psgd_reducer_bucket_size(r, 3, &size) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("bucket index 3") != std::string::npos);
  CHECK(psgd_reducer_bucket_size(r, 0, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("'size'") != std::string::npos);
  CHECK(psgd_reducer_bucket_size(nullptr, 0, &size) == PSGD_ERR_INVALID_ARGUMENT);

  std::vector<float> g = gradients(53, 0, 0);
  REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  psgd_stats unset{};
  CHECK(psgd_reducer_stats(r, &unset) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("stats.struct_size = 0") != std::string::npos);
  // A newer caller's longer stats: the fields this library knows are filled, the rest untouched.
  struct NewerStats {
    psgd_stats stats;
    uint64_t appended;
  } longer{PSGD_STATS_INIT, 77};
  longer.stats.struct_size = sizeof(NewerStats);
  CHECK(psgd_reducer_stats(r, &longer.stats) == PSGD_OK);
  CHECK(longer.stats.struct_size == sizeof(NewerStats));
  CHECK(longer.stats.bytes_sent == 54 * sizeof(float));  // one plain step: 53 floats and the finite flag
  CHECK(longer.appended == 77);

  psgd_reducer_destroy(r);
  psgd_comm_destroy(comm);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
}

// ---- issue 10: the async C API and the store port beside torch.distributed ----

TEST_CASE("C API async: equals the blocking reduce bit for bit; errors come out of wait, on the waiting thread") {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  psgd_comm* comm = nullptr;
  REQUIRE(psgd_comm_init_from_env(&comm) == PSGD_OK);
  psgd_config c = psgd_config_default();
  c.start_iter = 2;
  c.rank = 2;
  psgd_reducer* async = nullptr;
  psgd_reducer* sync = nullptr;
  REQUIRE(psgd_reducer_create(comm, &c, &async) == PSGD_OK);
  REQUIRE(psgd_reducer_create(comm, &c, &sync) == PSGD_OK);
  const int ndims[] = {2, 1, 2};
  const int64_t dims[] = {16, 20, 7, 12, 30};
  const size_t sizes[] = {16 * 20 + 7, 12 * 30};
  for (psgd_reducer* r : {async, sync}) {
    int index = -1;
    REQUIRE(psgd_reducer_add_bucket(r, 2, ndims, dims, &index) == PSGD_OK);
    REQUIRE(psgd_reducer_add_bucket(r, 1, ndims + 2, dims + 3, &index) == PSGD_OK);
  }

  psgd_reduce_handle* h = reinterpret_cast<psgd_reduce_handle*>(&c);  // must be reset to null on failure
  std::vector<float> g = gradients(sizes[0], 0, 0);
  CHECK(psgd_reducer_reduce_async(async, 0, g.data(), nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("'out'") != std::string::npos);
  CHECK(psgd_reducer_reduce_async(nullptr, 0, g.data(), &h) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(h == nullptr);
  CHECK(psgd_reducer_reduce_async(async, 0, nullptr, &h) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_reduce_async(async, 2, g.data(), &h) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("bucket index 2") != std::string::npos);
  CHECK(h == nullptr);
  CHECK(psgd_reduce_handle_wait(nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reduce_handle_done(nullptr) == -1);
  psgd_reduce_handle_free(nullptr);

  // Both buckets in flight at once (bucket 1 first, as DDP's last bucket comes first), waited for on
  // another thread, against the blocking call; plain steps 0-1, compressed from step 2.
  for (int step = 0; step < 6; ++step) {
    std::vector<float> a0 = gradients(sizes[0], 0, step), a1 = gradients(sizes[1], 1, step);
    std::vector<float> s0 = a0, s1 = a1;
    psgd_reduce_handle* h1 = nullptr;
    psgd_reduce_handle* h0 = nullptr;
    REQUIRE(psgd_reducer_reduce_async(async, 1, a1.data(), &h1) == PSGD_OK);
    CHECK(psgd_reducer_reduce_async(async, 1, a1.data(), &h) == PSGD_ERR_INVALID_ARGUMENT);
    CHECK(std::string(psgd_last_error()).find("already reduced") != std::string::npos);
    CHECK(h == nullptr);
    REQUIRE(psgd_reducer_reduce_async(async, 0, a0.data(), &h0) == PSGD_OK);
    psgd_status waited[2] = {PSGD_ERR_INTERNAL, PSGD_ERR_INTERNAL};
    std::thread waiter([&] {
      waited[1] = psgd_reduce_handle_wait(h1);
      waited[0] = psgd_reduce_handle_wait(h0);
    });
    waiter.join();
    CHECK(waited[0] == PSGD_OK);
    CHECK(waited[1] == PSGD_OK);
    CHECK(psgd_reduce_handle_done(h0) == 1);
    psgd_reduce_handle_free(h0);
    psgd_reduce_handle_free(h1);
    REQUIRE(psgd_reducer_reduce(sync, 1, s1.data()) == PSGD_OK);
    REQUIRE(psgd_reducer_reduce(sync, 0, s0.data()) == PSGD_OK);
    CHECK(a0 == s0);
    CHECK(a1 == s1);
  }
  CHECK(psgd_reducer_iteration(async) == 6);

  char word[6] = "hello";
  CHECK(psgd_comm_broadcast(comm, word, sizeof word, 0) == PSGD_OK);
  CHECK(std::string(word) == "hello");
  CHECK(psgd_comm_broadcast(comm, word, sizeof word, 1) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("root = 1: expected 0 to 0") != std::string::npos);
  CHECK(psgd_comm_broadcast(comm, nullptr, 3, 0) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_comm_broadcast(nullptr, word, 3, 0) == PSGD_ERR_INVALID_ARGUMENT);

  // A non-finite gradient: the start succeeds, the wait fails with the message on the waiting thread,
  // and waiting again gives the same status.
  std::vector<float> bad = gradients(sizes[1], 1, 99), good = gradients(sizes[0], 0, 99);
  bad[5] = std::nanf("");
  psgd_reduce_handle* hb = nullptr;
  psgd_reduce_handle* hg = nullptr;
  REQUIRE(psgd_reducer_reduce_async(async, 1, bad.data(), &hb) == PSGD_OK);
  REQUIRE(psgd_reducer_reduce_async(async, 0, good.data(), &hg) == PSGD_OK);
  std::string message;
  psgd_status status = PSGD_OK;
  std::thread waiter([&] {
    status = psgd_reduce_handle_wait(hb);
    message = psgd_last_error();
  });
  waiter.join();
  CHECK(status == PSGD_ERR_NONFINITE);
  CHECK(message.find("psgd_reduce_handle_wait") != std::string::npos);
  CHECK(message.find("NaN or Inf") != std::string::npos);
  CHECK(psgd_reduce_handle_wait(hb) == PSGD_ERR_NONFINITE);
  psgd_reduce_handle_free(hb);
  // A handle freed unwaited: its reduction still completes, the step counts.
  psgd_reduce_handle_free(hg);
  CHECK(psgd_reducer_iteration(async) == 7);

  psgd_reducer_destroy(async);
  psgd_reducer_destroy(sync);
  psgd_comm_destroy(comm);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
}

TEST_CASE("C API: the store port beside torch.distributed") {
  for (const char* name : {"PSGD_STORE_PORT", "MASTER_PORT", "PSGD_STORE_HOSTED"}) ::unsetenv(name);
  int port = -1;
  auto last_error = [] { return std::string(psgd_last_error()); };
  CHECK(psgd_store_port_beside_torch(nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_store_port_beside_torch(&port) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(last_error().find("MASTER_PORT is not set") != std::string::npos);
  ::setenv("MASTER_PORT", "29500", 1);
  REQUIRE(psgd_store_port_beside_torch(&port) == PSGD_OK);
  CHECK(port == 29501);
  ::setenv("PSGD_STORE_HOSTED", "1", 1);  // powersgd-run's own store is on MASTER_PORT
  REQUIRE(psgd_store_port_beside_torch(&port) == PSGD_OK);
  CHECK(port == 29500);
  ::unsetenv("PSGD_STORE_HOSTED");
  ::setenv("MASTER_PORT", "65535", 1);
  CHECK(psgd_store_port_beside_torch(&port) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(last_error().find("MASTER_PORT=65535") != std::string::npos);
  CHECK(last_error().find("PSGD_STORE_PORT") != std::string::npos);
  ::setenv("MASTER_PORT", "http", 1);
  CHECK(psgd_store_port_beside_torch(&port) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(last_error().find("MASTER_PORT='http'") != std::string::npos);
  ::setenv("PSGD_STORE_PORT", "31000", 1);  // wins over everything
  REQUIRE(psgd_store_port_beside_torch(&port) == PSGD_OK);
  CHECK(port == 31000);
  for (const char* bad : {"0", "65536", "31000x", "-1"}) {
    ::setenv("PSGD_STORE_PORT", bad, 1);
    CHECK(psgd_store_port_beside_torch(&port) == PSGD_ERR_INVALID_ARGUMENT);
    CHECK(last_error().find("PSGD_STORE_PORT") != std::string::npos);
  }
  for (const char* name : {"PSGD_STORE_PORT", "MASTER_PORT"}) ::unsetenv(name);
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
