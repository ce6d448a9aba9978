// The PowerSGD engine in one process (world size 1, a real communicator): every
// option against the double-precision reference, validation, the step counter,
// the non-finite guard, async and fused reduction, statistics, checkpoints, and
// the C API. Properties across ranks: tests/multiprocess/test_engine_mp.cpp.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <string>
#include <thread>

#include "engine/checkpoint.hpp"
#include "engine/fault_injection.hpp"
#include "engine/order_guard.hpp"
#include "engine/rank_reports.hpp"
#include "c_comm_of_one.hpp"
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

using test::c_comm_of_one;

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
      // Used as a float: 1e39 became Inf (every compressed step refused), 1e-46 zero (the other branch).
      {[](Config& c) { c.orthogonalization_epsilon = 1e39; },
       "config.orthogonalization_epsilon = 1e+39: expected 0 or a float from 1.1754944e-38 to 3.4028235e38"},
      {[](Config& c) { c.orthogonalization_epsilon = 1e-46; },
       "config.orthogonalization_epsilon = 1e-46: expected 0 or a float from 1.1754944e-38 to 3.4028235e38"},
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
  CHECK_FALSE(plan.tensors[1].compressed);  // 0-D as 1 x 1: 2 * 1 * 2 > 1
  CHECK_FALSE(plan.tensors[4].compressed);  // 1-D as 5 x 1: 6 * 1 * 2 > 5
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

TEST_CASE("plan: every tensor by the reference's rule, as PyTorch 1.13 decides it") {
  // Recorded from Debian's python3-torch 1.13 (/usr/bin/python3): per shape,
  // m = torch.zeros(shape).view(shape[0], -1); n, m = m.shape; r = min(n, m, rank);
  // c = powerSGD_hook._should_compress(n, m, r, rate): c[0] and c[2] if c[0] else c[1]
  // (the elements it sends). 1-D tensors are n x 1 and compressed when the rule holds.
  const std::vector<Shape> shapes = {{512}, {1}, {2}, {3}, {16, 20}, {3, 40}, {5, 0}, {4, 3, 2, 2}, {7, 1}, {1, 7}, {2, 50}};
  struct Row {
    int rank;
    double rate;
    std::vector<int> compressed;
    std::vector<int64_t> sent;
  };
  const std::vector<Row> torch = {
      {1, 0.5, {1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1}, {513, 1, 3, 4, 36, 43, 0, 16, 8, 8, 52}},
      {1, 2.0, {0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0}, {512, 1, 2, 3, 36, 43, 0, 16, 7, 7, 100}},
      {1, 0.0, {1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1}, {513, 2, 3, 4, 36, 43, 0, 16, 8, 8, 52}},
      {2, 0.5, {1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1}, {513, 1, 3, 4, 72, 86, 0, 32, 8, 8, 104}},
      {2, 2.0, {0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0}, {512, 1, 2, 3, 72, 120, 0, 48, 7, 7, 100}},
      {2, 0.0, {1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1}, {513, 2, 3, 4, 72, 86, 0, 32, 8, 8, 104}},
  };
  for (const Row& row : torch) {
    Config c;
    c.rank = row.rank;
    c.min_compression_rate = row.rate;
    CAPTURE(row.rank);
    CAPTURE(row.rate);
    const auto plan = engine::make_plan(shapes, c);
    int64_t sent = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      CAPTURE(i);
      CHECK(plan.tensors[i].compressed == (row.compressed[i] != 0));
      CHECK(powersgd::test::reference_compresses(shapes[i], c) == (row.compressed[i] != 0));
      sent += row.sent[i];
    }
    CHECK(plan.p_numel + plan.q_numel + plan.packed_numel == sent);
  }
  // 0-D, where the reference's shape[0] raises: 1 x 1, as {1}.
  Config c;
  c.min_compression_rate = 0.0;
  CHECK(engine::make_plan(std::vector<Shape>{{}}, c).tensors[0].compressed);
  c.min_compression_rate = 0.5;
  CHECK_FALSE(engine::make_plan(std::vector<Shape>{{}}, c).tensors[0].compressed);
}

TEST_CASE("step: a 1-D bucket {512} at rank 1, rate 0.5 is compressed as 512 x 1: 513 elements per step") {
  auto comm = solo();
  Config c;
  c.rank = 1;
  c.min_compression_rate = 0.5;
  c.start_iter = 0;
  const std::vector<Shape> shapes = {{512}};
  Reducer r(*comm, c);
  r.add_bucket(shapes);
  Reference ref(shapes, c, 1);
  for (int step = 0; step < 3; ++step) {
    std::vector<float> g = gradients(512, 0, step);
    const std::vector<double> expected = ref.step({g});
    r.reduce(0, g.data());
    CHECK(relative_difference(g, expected) < 2e-5);
    std::vector<float> error(512);
    r.error_feedback(0, error.data());
    CHECK(relative_difference(error, ref.error(0)) < 2e-5);
  }
  CHECK(r.stats().numel_before == 3 * 512);
  CHECK(r.stats().numel_after == 3 * 513);
}

TEST_CASE("whole bucket: the padding's error is carried across steps, as batched_powerSGD_hook") {
  auto comm = solo();
  // 13 elements: a 4 x 4 square with 3 padding elements.
  const std::vector<Shape> shapes = {{7}, {3, 2}};
  for (int rank : {1, 2}) {
    Config c = config_for(rank, 1 | 2 | 8);  // error feedback, warm start, whole bucket
    CAPTURE(rank);
    Reducer r(*comm, c);
    r.add_bucket(shapes);
    Reference ref(shapes, c, 1);
    REQUIRE(ref.plan().side == 4);
    double padding_error = 0;
    for (int step = 0; step < 8; ++step) {
      CAPTURE(step);
      std::vector<float> g = gradients(13, 0, step);
      const std::vector<double> expected = ref.step({g});
      r.reduce(0, g.data());
      CHECK(relative_difference(g, expected) < 2e-5);
      std::vector<float> error(13);
      r.error_feedback(0, error.data());  // the bucket's elements; the padding's error stays internal
      CHECK(relative_difference(error, ref.error(0)) < 2e-5);
      for (double e : ref.padding_error(0)) padding_error = std::max(padding_error, std::abs(e));
    }
    CHECK(padding_error > 0.01);  // there was padding error to carry: dropping it changes the outputs
  }
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

TEST_CASE("PSGD_FUSE_REDUCTIONS and PSGD_CARRY_FIRST are 0 or 1: another value refuses the Reducer, naming it") {
  auto comm = solo();
  for (const char* name : {"PSGD_FUSE_REDUCTIONS", "PSGD_CARRY_FIRST"}) {
    INFO(name);
    for (const char* value : {"0", "1"}) {
      setenv(name, value, 1);
      CHECK_NOTHROW(Reducer(*comm, Config{}));
    }
    // "false" and "off" used to read as on: anything but "0" was.
    for (const char* value : {"false", "off", "2", " 0"}) {
      setenv(name, value, 1);
      CHECK(error_of([&] { Reducer r(*comm, Config{}); }) ==
            std::string("environment variable ") + name + "='" + value +
                "' is invalid: expected 1 (on, the default) or 0 (off)");
    }
    unsetenv(name);
    CHECK_NOTHROW(Reducer(*comm, Config{}));
  }
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

// Run under ThreadSanitizer by the tsan suite (engine-threads, tests/unit/meson.build): the user thread's
// reads of a bucket's size in bucket_size, reduce_async, reduce_all and error_feedback, with a reduction in
// flight whose bucket switches rank level on the worker (a learning-rate note: the high level for one step,
// then back). Each read follows a switch the user thread has not synchronized with (no wait in between).
TEST_CASE("threads: the user thread reads bucket sizes while the worker switches the bucket's level") {
  auto comm = solo();
  Config c;
  c.start_iter = 0;
  c.rank = 1;
  c.rank_high = 2;
  c.lr_boost_steps = 1;
  Reducer r(*comm, c);
  r.add_bucket(std::vector<Shape>{{32, 24}});
  const size_t n = r.bucket_size(0);
  std::vector<std::vector<float>> grads;
  std::vector<float> error(n);
  std::vector<ReduceHandle> handles;
  const auto noted_step_in_flight = [&] {
    r.note_lr_change();
    grads.push_back(gradients(n, 0, static_cast<int64_t>(grads.size())));
    handles.push_back(r.reduce_async(0, std::span<float>(grads.back())));
    // Long enough for the worker to run the step (and its two switches) first; the race is there either way.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  };
  noted_step_in_flight();
  CHECK(r.bucket_size(0) == n);
  noted_step_in_flight();
  r.error_feedback(0, std::span<float>(error));
  noted_step_in_flight();
  grads.push_back(gradients(n, 0, static_cast<int64_t>(grads.size())));
  handles.push_back(r.reduce_async(0, std::span<float>(grads.back())));
  noted_step_in_flight();
  grads.push_back(gradients(n, 0, static_cast<int64_t>(grads.size())));
  std::vector<std::span<float>> all = {std::span<float>(grads.back())};
  r.reduce_all(all);
  for (auto& h : handles) h.wait();
  CHECK(r.iteration() == 6);
  CHECK(r.bucket_rank(0) == 1);
  std::set<int64_t> noted;  // the steps a note switched the bucket to the high level in
  for (const RankDecision& d : r.decisions())
    if (d.reason == RankReason::LrNote) noted.insert(d.step);
  CHECK(noted == std::set<int64_t>{0, 1, 2, 4});
}

TEST_CASE("threads: two channels, a Reducer on a communicator and one on its channel, reduce at once") {
  // What docs/scaling.md ("Channels") tells a caller to do: a channel of the first (create_channel); each
  // Reducer driven from its own thread, both in flight at once.
  auto first = solo();
  auto second = first->create_channel(1);
  Config c;
  c.start_iter = 1;
  c.rank = 2;
  const std::vector<std::vector<Shape>> shapes = {kShapes, {{24, 12}, {7}, {12, 30}}};
  constexpr int kSteps = 6;
  // Each channel's outputs and error memory after kSteps steps of its own gradients (salted by the channel).
  const auto run_channel = [&](Communicator& comm, size_t channel, std::vector<float>& out, std::vector<float>& error) {
    Reducer r(comm, c);
    r.add_bucket(shapes[channel]);
    const size_t n = r.bucket_size(0);
    for (int64_t step = 0; step < kSteps; ++step) {
      out = gradients(n, 0, step, channel);
      if (step % 2 == 0) {
        r.reduce(0, out.data());
      } else {
        r.reduce_async(0, out.data()).wait();
      }
    }
    error.resize(n);
    r.error_feedback(0, std::span<float>(error));
  };
  std::vector<float> out[2], error[2];
  std::thread other([&] { run_channel(*second, 1, out[1], error[1]); });
  run_channel(*first, 0, out[0], error[0]);
  other.join();
  // The same Reducers one after the other on a communicator of their own: the same bits.
  auto alone = solo();
  for (size_t channel = 0; channel < 2; ++channel) {
    CAPTURE(channel);
    std::vector<float> expected_out, expected_error;
    run_channel(*alone, channel, expected_out, expected_error);
    CHECK(std::memcmp(out[channel].data(), expected_out.data(), expected_out.size() * sizeof(float)) == 0);
    CHECK(out[channel].size() == expected_out.size());
    CHECK(std::memcmp(error[channel].data(), expected_error.data(), expected_error.size() * sizeof(float)) == 0);
  }
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

TEST_CASE("checkpoint: fields the configuration does not use do not refuse a file; used ones do") {
  auto comm = solo();
  Config c;
  c.start_iter = 1;
  c.rank = 2;
  c.lr_boost_steps = 0;  // no rank policy: rank_high is unused too (a boostable fixed rank uses it)
  Reducer a(*comm, c);
  a.add_bucket(kShapes);
  for (int t = 0; t < 3; ++t) {
    std::vector<float> g = gradients(a.bucket_size(0), 0, t);
    a.reduce(0, g.data());
  }
  const std::string path = temp_path("unused-fields");
  a.save(path);
  Config unused = c;  // the adaptive fields, without adaptive
  unused.rank_low = 2;
  unused.rank_high = 8;
  unused.adaptive_interval = 7;
  Reducer b(*comm, unused);
  b.add_bucket(kShapes);
  b.load(path);
  CHECK(b.iteration() == 3);
  std::vector<float> x = gradients(a.bucket_size(0), 0, 3), y = x;
  a.reduce(0, x.data());
  b.reduce(0, y.data());
  CHECK(x == y);
  Config used = c;
  used.rank = 3;
  Reducer refused(*comm, used);
  refused.add_bucket(kShapes);
  CHECK_THROWS_AS(refused.load(path), MismatchError);
  CHECK(error_of([&] { refused.load(path); }).find("config.rank = 2, this reducer has 3") != std::string::npos);
  std::remove(path.c_str());
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

  psgd_comm* comm = c_comm_of_one();
  CHECK(psgd_comm_rank(comm) == 0);
  CHECK(psgd_comm_size(comm) == 1);
  float x[3] = {1, 2, 3};
  CHECK(psgd_comm_allreduce_sum_f32(comm, x, 3) == PSGD_OK);
  CHECK(x[2] == 3.0f);
  CHECK(psgd_comm_barrier(comm) == PSGD_OK);
  // A world of one exchanges nothing: no rounds. A null comm or out is refused, naming it, out untouched.
  uint64_t rounds = 7;
  CHECK(psgd_comm_communication_rounds(comm, &rounds) == PSGD_OK);
  CHECK(rounds == 0);
  rounds = 7;
  CHECK(psgd_comm_communication_rounds(nullptr, &rounds) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("psgd_comm_communication_rounds: argument 'comm' is null") !=
        std::string::npos);
  CHECK(rounds == 7);
  CHECK(psgd_comm_communication_rounds(comm, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("argument 'out' is null") != std::string::npos);
  // A channel: index 1 to 255, out set to null on a refusal; it sums as its first does and outlives it.
  psgd_comm* channel = comm;
  CHECK(psgd_comm_init_channel(nullptr, 1, &channel) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("psgd_comm_init_channel: argument 'first' is null") != std::string::npos);
  CHECK(channel == nullptr);
  CHECK(psgd_comm_init_channel(comm, 1, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  for (const int bad : {0, -1, 256}) {
    CAPTURE(bad);
    channel = comm;
    CHECK(psgd_comm_init_channel(comm, bad, &channel) == PSGD_ERR_INVALID_ARGUMENT);
    CHECK(std::string(psgd_last_error()).find("channel index " + std::to_string(bad) + ": expected 1 to 255") !=
          std::string::npos);
    CHECK(channel == nullptr);
  }
  for (const int index : {1, 255}) {
    CAPTURE(index);
    REQUIRE_MESSAGE(psgd_comm_init_channel(comm, index, &channel) == PSGD_OK, psgd_last_error());
    CHECK(psgd_comm_size(channel) == 1);
    x[0] = 4;
    CHECK(psgd_comm_allreduce_sum_f32(channel, x, 3) == PSGD_OK);
    CHECK(x[0] == 4.0f);
    psgd_comm_destroy(channel);
  }
  {
    psgd_comm* second = c_comm_of_one();  // hosts its store: its channel keeps working once it is gone
    REQUIRE(psgd_comm_init_channel(second, 2, &channel) == PSGD_OK);
    psgd_comm_destroy(second);
    CHECK(psgd_comm_barrier(channel) == PSGD_OK);
    psgd_comm_destroy(channel);
  }

  psgd_reducer* r = nullptr;
  // psgd_config_validate refuses what psgd_reducer_create refuses, with the same status and message (one
  // validation: Config::validate behind both), and accepts the defaults.
  const auto refused = [&](const psgd_config& bad, psgd_status status, const std::string& words) {
    CHECK(psgd_reducer_create(comm, &bad, &r) == status);
    const std::string created = psgd_last_error();
    CHECK(created.find(words) != std::string::npos);
    CHECK(r == nullptr);
    CHECK(psgd_config_validate(&bad) == status);
    const std::string validated = psgd_last_error();
    CHECK(validated == "psgd_config_validate" + created.substr(created.find(':')));
  };
  CHECK(psgd_config_validate(&d) == PSGD_OK);
  struct Bad {
    void (*set)(psgd_config&);
    psgd_status status;
    const char* words;
  };
  const Bad bads[] = {
      {[](psgd_config& c) { c.warm_start = 2; }, PSGD_ERR_INVALID_ARGUMENT, "config.warm_start = 2: expected 0 or 1"},
      {[](psgd_config& c) { c.alternating = 3; }, PSGD_ERR_INVALID_ARGUMENT, "config.alternating = 3"},
      {[](psgd_config& c) { c.rank_low = 5; }, PSGD_ERR_INVALID_ARGUMENT, "config.rank_low = 5 > config.rank_high = 4"},
      {[](psgd_config& c) { c.rank = 65; }, PSGD_ERR_INVALID_ARGUMENT, "config.rank = 65: expected 1 to 64"},
      {[](psgd_config& c) { c.divergence_check_interval = -1; }, PSGD_ERR_INVALID_ARGUMENT,
       "config.divergence_check_interval = -1: expected >= 0"},
      {[](psgd_config& c) { c.alternating = 1, c.warm_start = 0; }, PSGD_ERR_INVALID_ARGUMENT,
       "alternating needs warm_start = 1"},
      {[](psgd_config& c) { c.wire_dtype = 3; }, PSGD_ERR_INVALID_ARGUMENT,
       "config.wire_dtype = 3: expected f32 (0), bf16 (1) or fp16 (2)"},
      {[](psgd_config& c) { c.wire_dtype = PSGD_WIRE_BF16, c.device = 1; }, PSGD_ERR_UNSUPPORTED,
       "16-bit factors on the wire are CPU-only"},
      {[](psgd_config& c) { c.struct_size = 8; }, PSGD_ERR_INVALID_ARGUMENT,
       "config.struct_size = 8: expected at least 72"},
  };
  for (const Bad& b : bads) {
    CAPTURE(b.words);
    psgd_config bad = d;
    b.set(bad);
    refused(bad, b.status, b.words);
  }
  CHECK(psgd_reducer_create(comm, nullptr, &r) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("'config'") != std::string::npos);
  CHECK(psgd_config_validate(nullptr) == PSGD_ERR_INVALID_ARGUMENT);
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
  CHECK(psgd_reducer_reduce(r, 3, g.data()) == PSGD_ERR_INVALID_ARGUMENT);  // a bad index does not count
  CHECK(psgd_reducer_reduce(r, 0, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_iteration(r) == 1);  // a null data counts as the bucket's failed reduction, as on other ranks
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  CHECK(psgd_reducer_iteration(r) == 3);
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
}

TEST_CASE("communicator destroyed before its reducer: every later call fails with an error, no crash") {
  for (bool reduced_before : {false, true}) {
    CAPTURE(reduced_before);
    auto comm = solo();
    Config c;
    c.start_iter = 0;
    c.rank = 2;
    Reducer r(*comm, c);
    r.add_bucket(kShapes);
    std::vector<float> g = gradients(r.bucket_size(0), 0, 0);
    if (reduced_before) r.reduce(0, g.data());
    comm.reset();
    const std::string expected = "the communicator of this reducer was destroyed";
    CHECK_THROWS_AS(r.reduce(0, g.data()), InvalidArgumentError);
    CHECK(error_of([&] { r.reduce(0, g.data()); }).find(expected) != std::string::npos);
    CHECK(error_of([&] { r.reduce_async(0, g.data()).wait(); }).find(expected) != std::string::npos);
    float* all[] = {g.data()};
    CHECK(error_of([&] { r.reduce_all(all); }).find(expected) != std::string::npos);
    CHECK(error_of([&] { r.add_bucket(kShapes); }).find(expected) != std::string::npos);
    CHECK(error_of([&] { r.stats(); }).find(expected) != std::string::npos);
    const std::string path = temp_path("comm-gone");
    CHECK(error_of([&] { r.save(path); }).find(expected) != std::string::npos);
    CHECK(error_of([&] { r.save_job(path); }).find(expected) != std::string::npos);
    CHECK(error_of([&] { r.load(path); }).find(expected) != std::string::npos);
    std::remove(path.c_str());
  }  // the reducer's destructor does not touch the communicator
}

TEST_CASE("communicator destroyed while reduce_async is in flight: the queued reductions finish first") {
  Config c;
  c.start_iter = 2;
  c.rank = 2;
  constexpr int kSteps = 12;
  // Reference: the same steps with the communicator alive throughout.
  std::vector<std::vector<float>> expected;
  {
    auto comm = solo();
    Reducer r(*comm, c);
    r.add_bucket(kShapes);
    for (int t = 0; t < kSteps; ++t) {
      expected.push_back(gradients(r.bucket_size(0), 0, t));
      r.reduce(0, expected.back().data());
    }
  }
  auto comm = solo();
  Reducer r(*comm, c);
  r.add_bucket(kShapes);
  std::vector<std::vector<float>> data;
  for (int t = 0; t < kSteps; ++t) data.push_back(gradients(r.bucket_size(0), 0, t));
  std::vector<ReduceHandle> handles;
  for (auto& d : data) handles.push_back(r.reduce_async(0, d.data()));
  comm.reset();  // waits for the queued reductions, then detaches the reducer
  for (auto& h : handles) {
    CHECK(h.done());
    CHECK_NOTHROW(h.wait());
  }
  CHECK(data == expected);
  CHECK(error_of([&] { r.reduce(0, data[0].data()); }).find("the communicator of this reducer was destroyed") !=
        std::string::npos);
}

TEST_CASE("C API: psgd_comm_destroy before psgd_reducer_destroy: the reducer's calls fail, no crash") {
  psgd_comm* comm = c_comm_of_one();
  psgd_config config = psgd_config_default();
  config.start_iter = 0;
  psgd_reducer* r = nullptr;
  REQUIRE(psgd_reducer_create(comm, &config, &r) == PSGD_OK);
  const int ndims[] = {2};
  const int64_t dims[] = {8, 6};
  int index = -1;
  REQUIRE(psgd_reducer_add_bucket(r, 1, ndims, dims, &index) == PSGD_OK);
  std::vector<float> g = gradients(48, 0, 0);
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  psgd_comm_destroy(comm);
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("the communicator of this reducer was destroyed") != std::string::npos);
  psgd_reducer_destroy(r);
}

TEST_CASE("C API: job checkpoint save_job/load_job, and each kind refused by the other's load") {
  psgd_comm* comm = c_comm_of_one();
  psgd_config d = psgd_config_default();
  d.start_iter = 1;
  psgd_reducer* r = nullptr;
  REQUIRE(psgd_reducer_create(comm, &d, &r) == PSGD_OK);
  const int ndims[] = {2, 1};
  const int64_t dims[] = {8, 6, 5};
  int index = -1;
  REQUIRE(psgd_reducer_add_bucket(r, 2, ndims, dims, &index) == PSGD_OK);
  for (int t = 0; t < 3; ++t) {
    std::vector<float> g = gradients(53, 0, t);
    REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  }
  std::vector<float> saved_error(53), error(53);
  REQUIRE(psgd_reducer_error_feedback(r, 0, saved_error.data()) == PSGD_OK);
  const std::string job = temp_path("capi-job"), per_rank = temp_path("capi-rank");
  CHECK(psgd_reducer_save_job(nullptr, job.c_str()) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_save_job(r, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("'path'") != std::string::npos);
  CHECK(psgd_reducer_load_job(r, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  REQUIRE(psgd_reducer_save_job(r, job.c_str()) == PSGD_OK);
  REQUIRE(psgd_reducer_save(r, per_rank.c_str()) == PSGD_OK);
  CHECK(psgd_reducer_save_job(r, "/nonexistent-dir/job.ckpt") == PSGD_ERR_IO);
  CHECK(std::string(psgd_last_error()).find("/nonexistent-dir/job.ckpt") != std::string::npos);

  std::vector<float> g = gradients(53, 0, 3);
  REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  CHECK(psgd_reducer_iteration(r) == 4);
  CHECK(psgd_reducer_load_job(r, (job + ".none").c_str()) == PSGD_ERR_IO);
  CHECK(psgd_reducer_load_job(r, per_rank.c_str()) == PSGD_ERR_MISMATCH);
  CHECK(std::string(psgd_last_error()).find("is a per-rank checkpoint (save), not a job checkpoint (save_job): load it with load") != std::string::npos);
  CHECK(psgd_reducer_load(r, job.c_str()) == PSGD_ERR_MISMATCH);
  CHECK(std::string(psgd_last_error()).find("is a job checkpoint (save_job), not a per-rank checkpoint (save): load it with load_job") != std::string::npos);
  CHECK(psgd_reducer_iteration(r) == 4);  // refused: unchanged
  REQUIRE(psgd_reducer_load_job(r, job.c_str()) == PSGD_OK);
  CHECK(psgd_reducer_iteration(r) == 3);
  REQUIRE(psgd_reducer_error_feedback(r, 0, error.data()) == PSGD_OK);
  CHECK(error == saved_error);  // a world of one: the mean is its own memory
  // load_shared: the step count and warm start of any rank's per-rank file, the error memory zero.
  REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  CHECK(psgd_reducer_load_shared(r, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_load_shared(r, job.c_str()) == PSGD_ERR_MISMATCH);
  CHECK(psgd_reducer_iteration(r) == 4);  // refused: unchanged
  REQUIRE(psgd_reducer_load_shared(r, per_rank.c_str()) == PSGD_OK);
  CHECK(psgd_reducer_iteration(r) == 3);
  REQUIRE(psgd_reducer_error_feedback(r, 0, error.data()) == PSGD_OK);
  CHECK(error == std::vector<float>(53, 0.0f));
  CHECK(saved_error != error);
  REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  std::remove(job.c_str());
  std::remove(per_rank.c_str());
  psgd_reducer_destroy(r);
  psgd_comm_destroy(comm);
}

TEST_CASE("C API: version, struct_size of config and stats, bucket_size") {
  CHECK(std::string(psgd_version()) == std::to_string(PSGD_VERSION_MAJOR) + "." + std::to_string(PSGD_VERSION_MINOR) +
                                           "." + std::to_string(PSGD_VERSION_PATCH));
  CHECK(PSGD_VERSION_NUMBER == 10000 * PSGD_VERSION_MAJOR + 100 * PSGD_VERSION_MINOR + PSGD_VERSION_PATCH);
  const psgd_config d = psgd_config_default();
  CHECK(d.struct_size == sizeof(psgd_config));

  psgd_comm* comm = c_comm_of_one();
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
  CHECK(psgd_reducer_create(comm, &newer.config, &r) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("holds fields this library does not know") != std::string::npos);
  CHECK(std::string(psgd_last_error()).find("byte " + std::to_string(sizeof(psgd_config)) + " is 1") !=
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
}

// ---- issue 10: the async C API and the store port beside torch.distributed ----

TEST_CASE("C API async: equals the blocking reduce bit for bit; errors come out of wait, on the waiting thread") {
  psgd_comm* comm = c_comm_of_one();
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
  CHECK(psgd_reducer_reduce_async(nullptr, 0, g.data(), &h) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(h == nullptr);
  // A null data, or a null out, counts as the bucket's (failed) reduction, as on other ranks
  // (docs/errors.md): on a reducer of its own, so `async` and `sync` stay in step.
  for (const bool null_out : {false, true}) {
    psgd_reducer* other = nullptr;
    REQUIRE(psgd_reducer_create(comm, &c, &other) == PSGD_OK);
    int index = -1;
    REQUIRE(psgd_reducer_add_bucket(other, 2, ndims, dims, &index) == PSGD_OK);
    CHECK(psgd_reducer_reduce_async(other, 0, null_out ? g.data() : nullptr, null_out ? nullptr : &h) ==
          PSGD_ERR_INVALID_ARGUMENT);
    CHECK(std::string(psgd_last_error()).find(null_out ? "'out'" : "data is null") != std::string::npos);
    CHECK(h == nullptr);
    CHECK(psgd_reducer_iteration(other) == 1);
    psgd_reducer_destroy(other);
  }
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
    // Timing (issue 20): each in order submitted <= started <= finished; the worker runs bucket 1 first.
    double t1[3] = {0, 0, 0}, t0[3] = {0, 0, 0};
    REQUIRE(psgd_reduce_handle_times(h1, &t1[0], &t1[1], &t1[2]) == PSGD_OK);
    REQUIRE(psgd_reduce_handle_times(h0, &t0[0], &t0[1], &t0[2]) == PSGD_OK);
    CHECK((0 < t1[0] && t1[0] <= t1[1] && t1[1] <= t1[2]));
    CHECK((t0[0] <= t0[1] && t0[1] <= t0[2] && t1[2] <= t0[1] && t1[0] <= t0[0]));
    CHECK(psgd_reduce_handle_times(h0, nullptr, &t0[1], &t0[2]) == PSGD_ERR_INVALID_ARGUMENT);
    CHECK(psgd_reduce_handle_times(nullptr, &t0[0], &t0[1], &t0[2]) == PSGD_ERR_INVALID_ARGUMENT);
    psgd_reduce_handle_free(h0);
    psgd_reduce_handle_free(h1);
    REQUIRE(psgd_reducer_reduce(sync, 1, s1.data()) == PSGD_OK);
    REQUIRE(psgd_reducer_reduce(sync, 0, s0.data()) == PSGD_OK);
    CHECK(a0 == s0);
    CHECK(a1 == s1);
  }
  CHECK(psgd_reducer_iteration(async) == 6);
  {
    double seconds[6] = {-1, -1, -1, -1, -1, -1};
    size_t known = 0;
    REQUIRE(psgd_reducer_worker_seconds(async, seconds, 6, &known) == PSGD_OK);
    CHECK(known == 5);
    for (size_t i = 0; i < 5; ++i) CHECK(seconds[i] >= 0.0);
    CHECK(seconds[0] > 0.0);    // compress: 4 compressed steps ran
    CHECK(seconds[5] == -1.0);  // past the known kinds: untouched
    CHECK(psgd_reducer_worker_seconds(async, nullptr, 0, &known) == PSGD_OK);
    CHECK(psgd_reducer_worker_seconds(async, nullptr, 1, &known) == PSGD_ERR_INVALID_ARGUMENT);
    CHECK(psgd_reducer_worker_seconds(async, seconds, 5, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
    CHECK(psgd_reducer_worker_seconds(nullptr, seconds, 5, &known) == PSGD_ERR_INVALID_ARGUMENT);
  }

  char word[6] = "hello";
  CHECK(psgd_comm_broadcast(comm, word, sizeof word, 0) == PSGD_OK);
  CHECK(std::string(word) == "hello");
  CHECK(psgd_comm_broadcast(comm, word, sizeof word, 1) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("broadcast: root 1 is out of range: expected 0 to 0") != std::string::npos);
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

// Issue 32, "the token on every path": under powersgd-run a PyTorch job rendezvouses through torch's own
// store; its keys carry the prefix derived from PSGD_TOKEN, so they cannot be predicted without the token.
// Before: powersgd/default/... whatever PSGD_TOKEN.
TEST_CASE("C API: a communicator on the caller's store carries PSGD_TOKEN's key prefix") {
  struct Keys {
    std::map<std::string, std::string> data;
  } keys;
  psgd_store_callbacks cb{};
  cb.struct_size = sizeof cb;
  cb.user = &keys;
  cb.set = [](void* u, const char* key, const void* data, size_t size, char*, size_t) {
    static_cast<Keys*>(u)->data[key] = std::string(static_cast<const char*>(data), size);
    return 0;
  };
  cb.get = [](void* u, const char* key, int64_t, psgd_store_value* value, char*, size_t) {
    auto& d = static_cast<Keys*>(u)->data;
    if (!d.count(key)) return static_cast<int>(PSGD_ERR_TIMEOUT);
    return static_cast<int>(psgd_store_value_set(value, d[key].data(), d[key].size()));
  };
  cb.add = [](void* u, const char* key, int64_t delta, int64_t* result, char*, size_t) {
    auto& v = static_cast<Keys*>(u)->data[key];
    *result = (v.empty() ? 0 : std::stoll(v)) + delta;
    v = std::to_string(*result);
    return 0;
  };
  cb.wait = [](void* u, const char* const* k, size_t count, int64_t, char*, size_t) {
    for (size_t i = 0; i < count; ++i)
      if (!static_cast<Keys*>(u)->data.count(k[i])) return static_cast<int>(PSGD_ERR_TIMEOUT);
    return 0;
  };
  cb.remove = [](void* u, const char* key, int* existed, char*, size_t) {
    *existed = static_cast<int>(static_cast<Keys*>(u)->data.erase(key));
    return 0;
  };
  ::setenv("PSGD_TOKEN", "s3cret", 1);
  psgd_comm* comm = nullptr;
  psgd_status status = psgd_comm_init_on_store(0, 1, nullptr, &cb, "127.0.0.1", &comm);
  ::unsetenv("PSGD_TOKEN");
  REQUIRE_MESSAGE(status == PSGD_OK, psgd_last_error());
  // A channel needs the store after this call, which the communicator does not keep.
  psgd_comm* channel = reinterpret_cast<psgd_comm*>(&keys);
  CHECK(psgd_comm_init_channel(comm, 1, &channel) == PSGD_ERR_UNSUPPORTED);
  CHECK(channel == nullptr);
  CHECK(std::string(psgd_last_error()).find("psgd_comm_init_channel: create_channel(1): this communicator "
                                            "rendezvoused on the caller's store, which it does not keep") !=
        std::string::npos);
  psgd_comm_destroy(comm);
  REQUIRE_FALSE(keys.data.empty());
  for (const auto& [key, value] : keys.data) {
    CAPTURE(key);
    CHECK(key.rfind("powersgd/job-", 0) == 0);
    CHECK(key.find("s3cret") == std::string::npos);
  }
}

TEST_CASE("rank reports: a failing rank's error reaches the others with its code, rank and reason") {
  using engine::RankReport;
  std::vector<RankReport> reports(4, engine::report_values({7}));
  CHECK_NOTHROW(engine::throw_if_any_failed(reports, nullptr, "step 2"));
  const std::string long_reason(1000, 'x');
  reports[2] = engine::report_failure(std::make_exception_ptr(InvalidArgumentError("bad shape " + long_reason)));
  reports[3] = engine::report_failure(std::make_exception_ptr(std::runtime_error("not a powersgd error")));
  CHECK(reports[2].reason_text().size() == RankReport::kReasonBytes - 1);  // truncated, NUL-terminated
  CHECK(reports[3].code == static_cast<int32_t>(ErrorCode::Internal));
  // The others: the first failing rank's class and code, its rank and reason, the consequence.
  CHECK_THROWS_WITH_AS(engine::throw_if_any_failed(reports, nullptr, "step 2", "nothing written"),
                       doctest::Contains("step 2 failed on rank 2 (and 1 other rank(s)): bad shape xxx"),
                       InvalidArgumentError);
  CHECK(error_of([&] { engine::throw_if_any_failed(reports, nullptr, "step 2", "nothing written"); })
            .ends_with("x; nothing written"));
  // The failing rank: its own error.
  CHECK_THROWS_AS(engine::throw_if_any_failed(reports, std::make_exception_ptr(IoError("mine")), "step 2"), IoError);
  for (int code = 1; code <= 8; ++code) {  // every code keeps its class; an unknown one is Internal
    try {
      engine::throw_error(static_cast<ErrorCode>(code), "m");
    } catch (const Error& e) {
      CHECK(static_cast<int>(e.code()) == (code <= 7 ? code : 7));
    }
  }
}

TEST_CASE("fault injection: a failed prepare or compute between the collectives changes no state") {
  auto comm = solo();
  for (auto point : {engine::FaultPoint::Prepare, engine::FaultPoint::Between}) {
    Config c;
    c.rank = 2;
    c.start_iter = 1;
    engine::arm_fault({point, 2});
    Reducer r(*comm, c);
    CHECK_FALSE(engine::take_armed_fault().has_value());  // the Reducer took it
    r.add_bucket({{16, 12}, {12}});
    const size_t n = r.bucket_size(0);
    for (int step = 0; step < 4; ++step) {
      auto g = gradients(n, 0, step);
      if (step != 2) {
        r.reduce(0, g.data());
        continue;
      }
      std::vector<float> before(n), after(n);
      r.error_feedback(0, before.data());
      const auto data = g;
      CHECK_THROWS_WITH_AS(r.reduce(0, g.data()), doctest::Contains("injected fault"), IoError);
      r.error_feedback(0, after.data());
      CHECK(after == before);
      CHECK(g == data);
    }
    CHECK(r.iteration() == 4);
  }
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }

// ==== Adaptive rank and alternating power iterations (issue 11) ====

namespace {

// A real communicator that counts the collectives issued through it (the
// reducer's "one collective per step" is a property of what reaches the wire).
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const CommOptions& options() const override { return inner_->options(); }
  Work allreduce_async(void* data, size_t count, DataType type) override {
    ++allreduces;
    return inner_->allreduce_async(data, count, type);
  }
  Work broadcast_async(void* data, size_t bytes, int root) override { return inner_->broadcast_async(data, bytes, root); }
  Work allgather_async(const void* in, void* out, size_t bytes) override {
    return inner_->allgather_async(in, out, bytes);
  }
  Work barrier_async() override { return inner_->barrier_async(); }
  void check_same(uint64_t fingerprint, const std::string& what) override { inner_->check_same(fingerprint, what); }

  std::atomic<int> allreduces{0};

 private:
  std::unique_ptr<Communicator> inner_;
};

// Every compressed tensor of `plan` (and, with whole_bucket, the side x side
// matrix) is `scale` times a fixed matrix of rank `r`; other tensors random.
std::vector<float> rank_r_bucket(const engine::BucketPlan& plan, int64_t r, float scale, uint64_t salt) {
  std::vector<float> g = gradients(static_cast<size_t>(plan.numel), 0, 0, salt);
  const auto fill = [&](int64_t offset, int64_t rows, int64_t cols, int64_t limit) {
    const std::vector<float> u = gradients(static_cast<size_t>(rows * r), 1, 0, salt + 1);
    const std::vector<float> v = gradients(static_cast<size_t>(cols * r), 2, 0, salt + 2);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols && i * cols + j < limit; ++j) {
        float sum = 0;
        for (int64_t k = 0; k < r; ++k) sum += u[static_cast<size_t>(i * r + k)] * v[static_cast<size_t>(j * r + k)];
        g[static_cast<size_t>(offset + i * cols + j)] = scale * sum;
      }
  };
  if (plan.whole) {
    fill(0, plan.side, plan.side, plan.numel);  // the bucket is the first numel elements of the square matrix
    return g;
  }
  for (const auto& t : plan.tensors)
    if (t.compressed) fill(t.offset, t.shape[0], t.numel / t.shape[0], t.numel);
  return g;
}

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

double max_abs(const std::vector<float>& a) {
  double worst = 0;
  for (float v : a) worst = std::max(worst, std::abs(double(v)));
  return worst;
}

// Shapes whose compression depends on the rank: {10, 12} is compressed at rank 1
// ((10 + 12) * 1 * 2 < 120) and travels uncompressed at rank 4 (176 >= 120).
const std::vector<Shape> kAdaptiveShapes = {{24, 30}, {30}, {10, 12}, {24, 30}, {8, 4, 3}};

// Adaptive between rank 1 and rank_high, threshold 0.5.
Config adaptive_config(int64_t start_iter, int rank_high, int64_t interval, bool alternating) {
  Config c;
  c.start_iter = start_iter;
  c.adaptive = true;
  c.rank_low = 1;
  c.rank_high = rank_high;
  c.adaptive_interval = interval;
  c.adaptive_threshold = 0.5;
  c.alternating = alternating;
  return c;
}

}  // namespace

TEST_CASE("alternating: one collective per step; a rank-r gradient is reproduced (error feedback: in every pair of steps)") {
  for (int variant = 0; variant < 6; ++variant) {  // per matrix, same-shape batching, whole bucket; with and without EF
    CountingCommunicator comm(solo());
    Config c;
    c.rank = 2;
    c.start_iter = 0;
    c.alternating = true;
    c.batch_same_shape = variant % 3 == 1;
    c.whole_bucket = variant % 3 == 2;
    c.error_feedback = variant < 3;
    CAPTURE(variant);
    const std::vector<Shape> shapes = c.whole_bucket ? std::vector<Shape>{{40 * 40}} : kAdaptiveShapes;
    Reducer reducer(comm, c);
    reducer.add_bucket(shapes);
    const engine::BucketPlan plan = engine::make_plan(shapes, c);
    const std::vector<float> g = rank_r_bucket(plan, 2, 1.0f, 5);
    const double tolerance = 1e-4 * (1 + max_abs(g));
    std::vector<double> sum_in(g.size(), 0.0), sum_out(g.size(), 0.0);
    const int before = comm.allreduces;
    for (int step = 0; step < 8; ++step) {
      CAPTURE(step);
      std::vector<float> out = g;
      reducer.reduce(0, out.data());
      CHECK(comm.allreduces == before + step + 1);  // one collective per step
      // The step sends the packed tensors, the flag and P (even steps) or Q (odd steps).
      const int64_t factor = step % 2 == 0 ? plan.p_numel : plan.q_numel;
      CHECK(reducer.stats().last_step_bytes == uint64_t(plan.packed_numel + 1 + factor) * sizeof(float));
      std::vector<float> error(g.size());
      reducer.error_feedback(0, error.data());
      if (!c.error_feedback) {
        // Step 0 projects on a random Q; from step 1 on the warm factor spans g's columns or rows.
        if (step >= 1) CHECK(max_abs_difference(out, g) < tolerance);
        continue;
      }
      // With error feedback the P half's Q comes from the previous Q half's M = g + error, whose rows
      // need not lie in g's row space: a P half outputs g projected on it. The Q half's P spans g's
      // columns, so it outputs M exactly and leaves no error: after every Q half the outputs so far
      // equal the gradients so far.
      if (step % 2 == 1) CHECK(max_abs(error) < tolerance);
      double worst = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        sum_in[i] += g[i];
        sum_out[i] += out[i];
        worst = std::max(worst, std::abs(sum_in[i] - sum_out[i] - error[i]));
      }
      CHECK(worst < tolerance * (step + 1));  // error feedback loses nothing (world 1)
    }
    const Stats s = reducer.stats();
    CHECK(s.numel_after == uint64_t(8 * plan.packed_numel + 4 * plan.p_numel + 4 * plan.q_numel));
  }
  // The default sends two collectives per compressed step.
  CountingCommunicator comm(solo());
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  Reducer reducer(comm, c);
  reducer.add_bucket(kAdaptiveShapes);
  std::vector<float> g = gradients(reducer.bucket_size(0), 0, 0);
  const int before = comm.allreduces;
  reducer.reduce(0, g.data());
  CHECK(comm.allreduces == before + 2);

  // Alternating builds on the previous step's factor: without warm start it is refused.
  c.alternating = true;
  c.warm_start = false;
  CHECK(error_of([&] { Reducer r(comm, c); }).find("config.alternating = 1 with config.warm_start = 0") !=
        std::string::npos);
}

TEST_CASE("alternating and adaptive: reduce_all packs each bucket's range into one collective, equal bucket by bucket") {
  for (int variant = 0; variant < 3; ++variant) {  // alternating, adaptive, both
    CAPTURE(variant);
    CountingCommunicator comm(solo());
    Config c = adaptive_config(1, 3, 2, variant != 1);
    c.adaptive = variant != 0;
    c.rank = 2;
    Reducer fused(comm, c), single(comm, c);
    const std::vector<std::vector<Shape>> buckets = {kAdaptiveShapes, {{16, 20}, {7}}, {{3}}};
    for (const auto& b : buckets) {
      fused.add_bucket(b);
      single.add_bucket(b);
    }
    std::vector<int> ranks_seen;
    for (int step = 0; step < 12; ++step) {
      std::vector<std::vector<float>> a, b;
      std::vector<float*> pointers;
      for (int k = 0; k < 3; ++k) {
        a.push_back(gradients(fused.bucket_size(k), k, step));
        for (float& v : a.back()) v *= step % 4 < 2 ? 1.0f : 8.0f;  // changes that make adaptive switch
        b.push_back(a.back());
      }
      for (auto& v : a) pointers.push_back(v.data());
      const int before = comm.allreduces;
      fused.reduce_all(pointers);
      const int compressed_collectives = c.alternating ? 1 : 2;
      CHECK(comm.allreduces == before + (step >= c.start_iter ? compressed_collectives : 3));  // plain: one per bucket
      for (int k = 0; k < 3; ++k) single.reduce(k, b[static_cast<size_t>(k)].data());
      for (int k = 0; k < 3; ++k) CHECK(a[static_cast<size_t>(k)] == b[static_cast<size_t>(k)]);
      CHECK(fused.stats().current_rank == single.stats().current_rank);
      ranks_seen.push_back(fused.bucket_rank(0));
    }
    CHECK(fused.stats().bytes_sent == single.stats().bytes_sent);
    if (c.adaptive) CHECK(std::count(ranks_seen.begin(), ranks_seen.end(), 1) > 0);
  }
}

TEST_CASE("alternating: a non-finite step changes nothing; the next step runs the same half") {
  auto comm = solo();
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  c.alternating = true;
  Reducer a(*comm, c), b(*comm, c);
  a.add_bucket(kAdaptiveShapes);
  b.add_bucket(kAdaptiveShapes);
  const size_t n = a.bucket_size(0);
  for (int step = 0; step < 5; ++step) {
    CAPTURE(step);
    if (step == 1 || step == 2) {  // a fails a P half and a Q half; b skips those steps
      std::vector<float> bad = gradients(n, 0, step);
      bad[7] = INFINITY;
      const std::vector<float> kept = bad;
      CHECK_THROWS_AS(a.reduce(0, bad.data()), NonFiniteError);
      CHECK(std::memcmp(bad.data(), kept.data(), n * sizeof(float)) == 0);
      continue;
    }
    std::vector<float> x = gradients(n, 0, step), y = x;
    a.reduce(0, x.data());
    b.reduce(0, y.data());
    CHECK(x == y);
  }
}

TEST_CASE("adaptive: rank_high on a large change of the output norm, rank_low when steady; exact throughout") {
  for (int variant = 0; variant < 4; ++variant) {  // default, alternating, same-shape batching, whole bucket
    auto comm = solo();
    Config c = adaptive_config(0, 4, 4, variant == 1);
    c.batch_same_shape = variant == 2;
    c.whole_bucket = variant == 3;
    CAPTURE(variant);
    const std::vector<Shape> shapes = c.whole_bucket ? std::vector<Shape>{{30 * 30}} : kAdaptiveShapes;
    Reducer reducer(*comm, c);
    reducer.add_bucket(shapes);
    CHECK(reducer.bucket_rank(0) == 4);  // the first window is at rank_high
    // Rank-1 gradients are reproduced at either rank, so the output's norm changes only with the scale:
    // steady in windows 1 and 2, x10 in window 3, steady in 4.
    const engine::BucketPlan plan_low = engine::make_plan(shapes, c, 1);
    const std::vector<float> base = rank_r_bucket(plan_low, 1, 1.0f, 9);
    const int expected_rank[] = {4, 4, 4, 4, 4, 4, 4, 4, 1, 1, 1, 1, 4, 4, 4, 4, 1};
    for (int step = 0; step < 16; ++step) {
      CAPTURE(step);
      const float scale = step < 8 ? 1.0f : 10.0f;
      std::vector<float> g = base;
      for (float& v : g) v *= scale;
      std::vector<float> out = g;
      CHECK(reducer.bucket_rank(0) == expected_rank[step]);
      reducer.reduce(0, out.data());
      // Alternating with error feedback reproduces g over each pair of steps (the alternating test case).
      if (step >= 2 && !c.alternating) CHECK(max_abs_difference(out, g) < 1e-4 * (1 + max_abs(g)));
      std::vector<float> error(g.size());
      reducer.error_feedback(0, error.data());
      if (step >= 2 && c.alternating && step % 2 == 1) CHECK(max_abs(error) < 1e-4 * (1 + max_abs(g)));
      const Stats s = reducer.stats();
      REQUIRE(s.current_rank.size() == 1);
      CHECK(s.current_rank[0] == expected_rank[step + 1]);
    }
  }
}

TEST_CASE("adaptive: switching keeps the error memory; a checkpoint taken mid-run resumes bit-identically") {
  for (bool alternating : {false, true}) {
    CAPTURE(alternating);
    auto comm = solo();
    Config c = adaptive_config(1, 3, 3, alternating);
    Reducer a(*comm, c);
    a.add_bucket(kAdaptiveShapes);
    a.add_bucket({{12, 24}, {6}});
    // Random gradients (the error memory is never 0) whose scale jumps x20 every 9 steps.
    auto grads = [&](int b, int step) {
      std::vector<float> g = gradients(a.bucket_size(b), b, step);
      for (float& v : g) v *= (step / 9) % 2 == 0 ? 1.0f : 20.0f;
      return g;
    };
    std::vector<std::vector<double>> sum_in(2), sum_out(2);
    for (int b = 0; b < 2; ++b) {
      sum_in[static_cast<size_t>(b)].assign(a.bucket_size(b), 0.0);
      sum_out[static_cast<size_t>(b)].assign(a.bucket_size(b), 0.0);
    }
    std::vector<int> ranks_seen;
    const std::string path = temp_path(alternating ? "adaptive-alt" : "adaptive");
    for (int step = 0; step < 30; ++step) {
      for (int b = 0; b < 2; ++b) {
        std::vector<float> g = grads(b, step), out = g;
        a.reduce(b, out.data());
        std::vector<float> error(g.size());
        a.error_feedback(b, error.data());
        double worst = 0, scale = 1;
        auto& in = sum_in[static_cast<size_t>(b)];
        auto& so = sum_out[static_cast<size_t>(b)];
        for (size_t i = 0; i < g.size(); ++i) {
          in[i] += g[i];
          so[i] += out[i];
          worst = std::max(worst, std::abs(in[i] - so[i] - error[i]));
          scale = std::max(scale, std::abs(in[i]));
        }
        CHECK(worst < 1e-5 * scale * (step + 1));  // nothing lost across switches
      }
      ranks_seen.push_back(a.bucket_rank(0));
      if (step == 13) a.save(path);
    }
    // Both levels were used, and the switch back up happened.
    CHECK(std::find(ranks_seen.begin(), ranks_seen.end(), 1) != ranks_seen.end());
    const auto first_low = std::find(ranks_seen.begin(), ranks_seen.end(), 1);
    CHECK(std::find(first_low, ranks_seen.end(), 3) != ranks_seen.end());

    // Resume from step 14 and replay: every output, error and rank equal the uninterrupted run's.
    Reducer resumed(*comm, c), replay(*comm, c);
    for (Reducer* r : {&resumed, &replay}) {
      r->add_bucket(kAdaptiveShapes);
      r->add_bucket({{12, 24}, {6}});
    }
    for (int step = 0; step < 14; ++step)
      for (int b = 0; b < 2; ++b) {
        std::vector<float> g = grads(b, step);
        replay.reduce(b, g.data());
      }
    resumed.load(path);
    CHECK(resumed.iteration() == 14);
    CHECK(resumed.stats().current_rank == replay.stats().current_rank);
    for (int step = 14; step < 30; ++step)
      for (int b = 0; b < 2; ++b) {
        std::vector<float> x = grads(b, step), y = x;
        resumed.reduce(b, x.data());
        replay.reduce(b, y.data());
        CHECK(x == y);
        CHECK(resumed.bucket_rank(b) == replay.bucket_rank(b));
      }
    std::vector<float> e1(resumed.bucket_size(0)), e2(e1.size());
    resumed.error_feedback(0, e1.data());
    replay.error_feedback(0, e2.data());
    CHECK(e1 == e2);
    CHECK(resumed.bucket_rank(0) == a.bucket_rank(0));

    // A reducer of another adaptive configuration refuses the file, naming the field.
    Config other = c;
    other.rank_high = 4;
    Reducer foreign(*comm, other);
    foreign.add_bucket(kAdaptiveShapes);
    foreign.add_bucket({{12, 24}, {6}});
    CHECK(error_of([&] { foreign.load(path); }).find("config.rank_high = 3, this reducer has 4") != std::string::npos);
    std::remove(path.c_str());
  }
}

TEST_CASE("adaptive with rank_low == rank_high: a checkpoint saved at level 0 resumes at level 0") {
  // The level is not visible through the rank here; the state is: after the same steps, the resumed
  // reducer's checkpoint is byte for byte the uninterrupted one's (level, generator draws, windows).
  auto comm = solo();
  Config c = adaptive_config(1, 1, 3, false);  // rank_low = rank_high = 1; windows of 3 compressed steps
  auto grads = [](size_t n, int step) {
    // Steady for 24 steps (the first windows select level 1, steady ones level 0), then a jump.
    std::vector<float> g = gradients(n, 0, step % 2);
    for (float& v : g) v *= step < 24 ? 1.0f : 30.0f;
    return g;
  };
  Reducer a(*comm, c);
  a.add_bucket(kAdaptiveShapes);
  const std::string path = temp_path("adaptive-equal"), a_end = path + ".a", b_end = path + ".b";
  for (int step = 0; step < 30; ++step) {
    std::vector<float> g = grads(a.bucket_size(0), step);
    a.reduce(0, g.data());
    // 19 compressed steps: at level 0, after steady windows (the old format, which found the level from the
    // rank, resumed at level 1 and its state differed from here on: measured).
    if (step == 19) a.save(path);
  }
  a.save(a_end);
  Reducer b(*comm, c);
  b.add_bucket(kAdaptiveShapes);
  b.load(path);
  for (int step = 20; step < 30; ++step) {
    std::vector<float> g = grads(b.bucket_size(0), step);
    b.reduce(0, g.data());
  }
  b.save(b_end);
  CHECK(engine::read_checkpoint_file(a_end) == engine::read_checkpoint_file(b_end));
  for (const auto& p : {path, a_end, b_end}) std::remove(p.c_str());
}

// The initial-Q generator computes log, sin and cos itself in a fixed order
// (glibc's libm picks FMA or non-FMA code per host, engine/random.cpp): its
// floats must still be the Box-Muller draws glibc's functions give on this host.
// ==== A zero gradient (issue 29) ====

// A 64 x 48 matrix whose gradient is 0 in its first 5 compressed steps, then a
// fixed rank-1 matrix g: with the factors kept at 0 by the orthogonalization,
// every later output was 0 (and the error memory grew by g every step). Now the
// zero steps output exactly 0 and leave no error (only the factor basis is
// repaired), and from the first nonzero step on one power iteration
// reproduces g (rank 1 <= r; at ranks 2 and 4 P is rank-deficient, whose
// dependent columns Gram-Schmidt left as rounding noise that is not
// orthogonal to the first). Alternating reproduces it over each pair of steps.
TEST_CASE("zero gradient: a matrix whose gradient is 0 in its first compressed steps learns afterwards, every variant") {
  struct Variant {
    const char* name;
    std::function<void(Config&)> edit;
  };
  const std::vector<Variant> variants = {
      {"default (rank 1)", [](Config&) {}},
      {"rank 2 (Gram-Schmidt, rank-deficient P)", [](Config& c) { c.rank = 2; }},
      {"rank 4 (QR, rank-deficient P)", [](Config& c) { c.rank = 4; }},
      {"same-shape batching", [](Config& c) { c.batch_same_shape = true; }},
      {"whole bucket", [](Config& c) { c.whole_bucket = true; }},
      {"alternating", [](Config& c) { c.alternating = true; }},
      {"adaptive 1..4, interval 2",
       [](Config& c) {
         c.adaptive = true;
         c.adaptive_interval = 2;
       }},
      {"warm-up: 3 steps at rank 4", [](Config& c) { c.warmup_steps = 3; }},
      {"boost: rank 4 for 2 steps after a note at step 2", [](Config& c) { c.lr_boost_steps = 2; }},
      {"bf16 wire", [](Config& c) { c.wire_dtype = WireDType::BFloat16; }},
      {"bf16 wire, alternating",
       [](Config& c) {
         c.wire_dtype = WireDType::BFloat16;
         c.alternating = true;
       }},
  };
  constexpr int kZeroSteps = 5, kSteps = 10;
  for (const Variant& v : variants)
    for (bool ef : {true, false}) {
      Config c;
      c.rank = 1;
      c.rank_low = 1;
      c.rank_high = 4;
      c.start_iter = 0;
      c.error_feedback = ef;
      v.edit(c);
      const std::string variant = v.name;
      CAPTURE(variant);
      CAPTURE(ef);
      auto comm = solo();
      Reducer reducer(*comm, c);
      const std::vector<Shape> shapes =
          c.whole_bucket ? std::vector<Shape>{{64, 64}} : std::vector<Shape>{{64, 48}, {64, 48}, {7}};
      reducer.add_bucket(shapes);
      const std::vector<float> g = rank_r_bucket(engine::make_plan(shapes, c), 1, 10.0f, 29);
      const bool bf16 = c.wire_dtype == WireDType::BFloat16;
      const double tolerance = (bf16 ? 5e-2 : 1e-4) * max_abs(g);
      std::vector<double> sum_in(g.size(), 0.0), sum_out(g.size(), 0.0);
      for (int step = 0; step < kSteps; ++step) {
        CAPTURE(step);
        if (step == 2 && c.lr_boost_steps == 2) reducer.note_lr_change();
        const bool zero = step < kZeroSteps;
        std::vector<float> out = zero ? std::vector<float>(g.size(), 0.0f) : g;
        reducer.reduce(0, out.data());
        std::vector<float> error(g.size());
        reducer.error_feedback(0, error.data());
        if (zero) {
          CHECK(max_abs(out) == 0.0);
          CHECK(max_abs(error) == 0.0);
          continue;
        }
        CHECK(max_abs(out) > 0.0);
        double worst = 0;
        for (size_t i = 0; i < g.size(); ++i) {
          sum_in[i] += g[i];
          sum_out[i] += out[i];
          worst = std::max(worst, std::abs(sum_in[i] - sum_out[i] - (ef ? error[i] : 0.0)));
        }
        if (!c.alternating) {
          CHECK(max_abs_difference(out, g) < tolerance);
        } else if (!ef) {
          if (step > kZeroSteps) CHECK(max_abs_difference(out, g) < tolerance);
        } else if (step % 2 == 0) {
          // After each P half (steps 6, 8) the outputs since step 5 equal the gradients.
          CHECK(max_abs(error) < tolerance);
          CHECK(worst < tolerance * (step - kZeroSteps + 1));
        }
      }
    }
}

TEST_CASE("random: the fixed-order generator draws the same floats as Box-Muller through libm") {
  constexpr size_t kCount = 1 << 20;
  for (uint64_t seed : {uint64_t{0}, uint64_t{42}}) {
    std::vector<float> drawn(kCount);
    engine::standard_normal(seed, 3, 7, drawn);
    // The same stream through glibc (the generator's mixing, copied).
    auto splitmix64 = [](uint64_t& state) {
      uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      return z ^ (z >> 31);
    };
    auto uniform = [&](uint64_t& state) { return (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53; };
    uint64_t state = seed;
    state = splitmix64(state) ^ 3;
    state = splitmix64(state) ^ 7;
    state = splitmix64(state);
    size_t differing = 0;
    double sum = 0, sum2 = 0;
    for (size_t i = 0; i < kCount; i += 2) {
      const double radius = std::sqrt(-2.0 * std::log(uniform(state)));
      const double angle = 2.0 * M_PI * uniform(state);
      differing += drawn[i] != static_cast<float>(radius * std::cos(angle));
      differing += drawn[i + 1] != static_cast<float>(radius * std::sin(angle));
      sum += static_cast<double>(drawn[i]) + drawn[i + 1];
      sum2 += static_cast<double>(drawn[i]) * drawn[i] + static_cast<double>(drawn[i + 1]) * drawn[i + 1];
    }
    CHECK(differing == 0);
    CHECK(std::abs(sum / kCount) < 0.01);
    CHECK(std::abs(sum2 / kCount - 1.0) < 0.01);
  }
}

// ==== Order guard and divergence detector (issue 18) ====

namespace {

// A real communicator that reports a larger world than it has: the reducer's
// constructor reads only size() (it issues no collective).
class WideCommunicator final : public Communicator {
 public:
  WideCommunicator(std::unique_ptr<Communicator> inner, int size) : inner_(std::move(inner)), size_(size) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return size_; }
  const CommOptions& options() const override { return inner_->options(); }
  Work allreduce_async(void* data, size_t count, DataType type) override {
    return inner_->allreduce_async(data, count, type);
  }
  Work broadcast_async(void* data, size_t bytes, int root) override { return inner_->broadcast_async(data, bytes, root); }
  Work allgather_async(const void* in, void* out, size_t bytes) override {
    return inner_->allgather_async(in, out, bytes);
  }
  Work barrier_async() override { return inner_->barrier_async(); }
  void check_same(uint64_t fingerprint, const std::string& what) override { inner_->check_same(fingerprint, what); }

 private:
  std::unique_ptr<Communicator> inner_;
  int size_;
};

}  // namespace

// Before: a world of 4096 or more ranks was accepted, and its failure flags
// (4096 per failed rank, summed in float) could not tell a failure from NaNs.
TEST_CASE("guard: a world of 4096 or more ranks is refused, naming its size") {
  WideCommunicator wide(solo(), 4096);
  CHECK_THROWS_WITH_AS(Reducer(wide, Config{}), doctest::Contains("a world of 4096 ranks: the reducer supports at most 4095"),
                       InvalidArgumentError);
  WideCommunicator widest(solo(), 4095);
  CHECK_NOTHROW(Reducer(widest, Config{}));
}

TEST_CASE("guard: the announce's agreement test is exact up to 4095 ranks") {
  const auto sums_of = [](const std::vector<uint64_t>& values) {
    std::vector<double> sums(2 * engine::kChunks, 0.0);
    for (uint64_t v : values) {
      double one[2 * engine::kChunks];
      engine::encode_agreement(v, one);
      for (size_t i = 0; i < sums.size(); ++i) sums[i] += one[i];
    }
    return sums;
  };
  const uint64_t big = 0xFFFFFFFFFFFFFFFFULL, other = 0xFFFFFFFFFFFFFFFEULL;
  std::vector<uint64_t> same(4095, big);
  CHECK(engine::all_agree(sums_of(same).data(), 4095));
  same[17] = other;  // one rank differs by one bit
  CHECK_FALSE(engine::all_agree(sums_of(same).data(), 4095));
  // Equal sums of chunks from different values (1 + 3 == 2 + 2): the squares tell them apart.
  CHECK_FALSE(engine::all_agree(sums_of({1, 3}).data(), 2));
  CHECK(engine::all_agree(sums_of({2, 2}).data(), 2));
}

TEST_CASE("guard: the divergence hash sees every bit, in every position and length") {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{1000}}) {
    CAPTURE(n);
    std::vector<float> x = gradients(n, 0, 0, 3);
    const uint64_t h = engine::hash_floats(x.data(), x.size());
    CHECK(engine::hash_floats(x.data(), x.size()) == h);
    CHECK(engine::hash_floats(x.data(), x.size(), 1) != h);
    for (size_t i = 0; i < n; i += std::max<size_t>(1, n / 7)) {
      std::vector<float> y = x;
      y[i] = std::bit_cast<float>(std::bit_cast<uint32_t>(y[i]) ^ 1u);
      CHECK(engine::hash_floats(y.data(), y.size()) != h);
    }
  }
  CHECK(engine::hash_floats(nullptr, 0) != engine::hash_floats(std::vector<float>(1, 0.0f).data(), 1));
}

TEST_CASE("guard: divergence_check_interval is validated and reaches the C API") {
  Config c;
  CHECK(c.divergence_check_interval == 100);
  c.divergence_check_interval = -1;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("config.divergence_check_interval = -1: expected >= 0"),
                       InvalidArgumentError);
  CHECK(psgd_config_default().divergence_check_interval == 100);
}

// Before: reduce(int, float*) read past a short buffer (SIGSEGV); there was no size to check.
TEST_CASE("guard: the size-checked entry points refuse a wrong count, naming both") {
  auto comm = solo();
  Reducer r(*comm, Config{});
  r.add_bucket({{8, 6}, {5}});
  std::vector<float> g(53, 1.0f), out(53);
  CHECK_THROWS_WITH_AS(r.reduce(0, std::span<float>(g).first(52)),
                       doctest::Contains("reduce of bucket 0: the buffer has 52 elements, the bucket has 53"),
                       InvalidArgumentError);
  CHECK_THROWS_WITH_AS(r.reduce_async(0, std::span<float>(g).first(10)),
                       doctest::Contains("the buffer has 10 elements, the bucket has 53"), InvalidArgumentError);
  CHECK_THROWS_WITH_AS(r.error_feedback(0, std::span<float>(out).first(3)),
                       doctest::Contains("error_feedback of bucket 0: the buffer has 3 elements, the bucket has 53"),
                       InvalidArgumentError);
  std::vector<std::span<float>> spans{std::span<float>(g).first(50)};
  CHECK_THROWS_WITH_AS(r.reduce_all(spans), doctest::Contains("reduce_all: data[0] has 50 elements, bucket 0 has 53"),
                       InvalidArgumentError);
  // The refused calls counted as steps (as on other ranks); the right size works.
  const int64_t before = r.iteration();
  r.reduce(0, std::span<float>(g));
  CHECK(r.iteration() == before + 1);
  r.error_feedback(0, std::span<float>(out));

  psgd_comm* c = c_comm_of_one();
  psgd_reducer* cr = nullptr;
  const psgd_config d = psgd_config_default();
  REQUIRE(psgd_reducer_create(c, &d, &cr) == PSGD_OK);
  const int ndims[] = {2, 1};
  const int64_t dims[] = {8, 6, 5};
  int index = -1;
  REQUIRE(psgd_reducer_add_bucket(cr, 2, ndims, dims, &index) == PSGD_OK);
  CHECK(psgd_reducer_reduce_n(cr, 0, g.data(), 52) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("the buffer has 52 elements, the bucket has 53") != std::string::npos);
  psgd_reduce_handle* h = nullptr;
  CHECK(psgd_reducer_reduce_async_n(cr, 0, g.data(), 54, &h) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(h == nullptr);
  CHECK(psgd_reducer_error_feedback_n(cr, 0, out.data(), 1) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_reduce_n(cr, 0, nullptr, 53) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("data is null") != std::string::npos);
  CHECK(psgd_reducer_reduce_n(cr, 0, g.data(), 53) == PSGD_OK);
  CHECK(psgd_reducer_reduce_async_n(cr, 0, g.data(), 53, &h) == PSGD_OK);
  CHECK(psgd_reduce_handle_wait(h) == PSGD_OK);
  psgd_reduce_handle_free(h);
  CHECK(psgd_reducer_error_feedback_n(cr, 0, out.data(), 53) == PSGD_OK);
  psgd_reducer_destroy(cr);
  psgd_comm_destroy(c);
}
