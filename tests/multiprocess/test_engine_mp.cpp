// Multi-process properties of the PowerSGD engine. Every rank runs this binary
// with one test case selected, under powersgd-run:
//   powersgd-run -n 4 --timeout 300 -- test_engine_mp -tc='exact*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <unistd.h>

#include "engine/checkpoint.hpp"
#include "engine_reference.hpp"
#include "error_of.hpp"

using namespace powersgd;
using powersgd::test::error_of;
using powersgd::test::Reference;
using powersgd::test::config_for;
using powersgd::test::gradients;
using powersgd::test::relative_difference;

namespace {

std::unique_ptr<Communicator> connect(const char* run_id) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  return Communicator::create(o);
}

// Every rank's gradients of one bucket at one step (deterministic, identical in every process).
std::vector<std::vector<float>> all_gradients(size_t n, int world, int64_t step, uint64_t salt = 0) {
  std::vector<std::vector<float>> g;
  for (int w = 0; w < world; ++w) g.push_back(gradients(n, w, step, salt));
  return g;
}

// Rank w's matrices are U (S C_w)^T: U shared by the ranks (new every step), S
// shared and fixed, C_w = I + (w - (world - 1) / 2) K with K a random {-1, 0, 1}
// pattern, so the mean over ranks is exactly U S^T: rank r and well conditioned
// (near-singular means would make "exact" depend on rounding luck). Tensors that
// are not compressed get random values.
std::vector<float> low_rank(const engine::BucketPlan& plan, int64_t r, int rank, int world, int64_t step,
                            uint64_t salt) {
  std::vector<float> g = gradients(static_cast<size_t>(plan.numel), rank, step, salt);
  for (const auto& t : plan.tensors) {
    if (!t.compressed) continue;
    const int64_t rows = t.shape[0], cols = t.numel / rows;
    std::vector<float> u = gradients(static_cast<size_t>(rows * r), 1000, step, salt + 7);
    std::vector<float> s = gradients(static_cast<size_t>(cols * r), 2000, 0, salt + 13);
    std::vector<float> pat = gradients(static_cast<size_t>(r * r), 3000, step, salt + 11);
    std::vector<float> c(static_cast<size_t>(r * r));
    for (int64_t i = 0; i < r * r; ++i) {
      const float pattern = pat[static_cast<size_t>(i)] > 0.5f ? 1.0f : pat[static_cast<size_t>(i)] < -0.5f ? -1.0f : 0.0f;
      c[static_cast<size_t>(i)] = (i % (r + 1) == 0 ? 1.0f : 0.0f) + (static_cast<float>(rank) - static_cast<float>(world - 1) / 2) * pattern;
    }
    std::vector<float> v(static_cast<size_t>(cols * r), 0.0f);
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t k = 0; k < r; ++k)
        for (int64_t l = 0; l < r; ++l) v[static_cast<size_t>(j * r + k)] += s[static_cast<size_t>(j * r + l)] * c[static_cast<size_t>(l * r + k)];
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        float sum = 0;
        for (int64_t k = 0; k < r; ++k) sum += u[static_cast<size_t>(i * r + k)] * v[static_cast<size_t>(j * r + k)];
        g[static_cast<size_t>(t.offset + i * cols + j)] = sum;
      }
  }
  return g;
}

std::vector<double> mean_of(const std::vector<std::vector<float>>& all) {
  std::vector<double> mean(all[0].size(), 0.0);
  for (const auto& g : all)
    for (size_t i = 0; i < g.size(); ++i) mean[i] += g[i];
  for (auto& m : mean) m /= static_cast<double>(all.size());
  return mean;
}

const std::vector<Shape> kShapes = {{32, 24}, {32}, {16, 8, 3, 3}, {}, {5, 6}, {40, 10}};

// Resident set size of this process in KiB (/proc/self/status VmRSS).
long resident_kib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  REQUIRE(f != nullptr);
  char line[256];
  long kib = -1;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, "VmRSS:", 6) == 0) kib = std::strtol(line + 6, nullptr, 10);
  std::fclose(f);
  REQUIRE(kib > 0);
  return kib;
}

}  // namespace

// Long run with several buckets in flight: no error, the resident set flat
// after warm-up, and the error-feedback invariant over the whole run:
//   sum over ranks and steps of the inputs
//     = W * (sum over steps of the outputs) + sum over ranks of the final error memory.
// PSGD_SOAK_STEPS sets the length (CI: 1500; bench/soak.sh: 20000).
TEST_CASE("soak: several buckets in flight for many steps, memory flat, invariant holds") {
  const char* env_steps = std::getenv("PSGD_SOAK_STEPS");
  const int steps = env_steps != nullptr ? std::atoi(env_steps) : 1500;
  REQUIRE(steps >= 100);
  auto comm = connect("engine-soak");
  const int world = comm->size();
  Config c;
  c.rank = 2;
  c.start_iter = 20;
  Reducer reducer(*comm, c);
  const std::vector<std::vector<Shape>> buckets = {{{64, 48}, {48}}, {{32, 32, 3, 3}}, {{9}}, {{100, 20}, {20}}};
  std::vector<std::vector<double>> sum_in, sum_out;
  for (const auto& shapes : buckets) {
    int b = reducer.add_bucket(shapes);
    sum_in.emplace_back(reducer.bucket_size(b), 0.0);
    sum_out.emplace_back(reducer.bucket_size(b), 0.0);
  }
  std::vector<std::vector<float>> data(buckets.size());
  uint64_t state = 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(comm->rank() + 1);
  auto uniform = [&state] {  // xorshift64*: cheap, deterministic per rank
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return static_cast<float>((state * 0x2545F4914F6CDD1DULL) >> 40) / static_cast<float>(1 << 24) - 0.5f;
  };
  const int warmup = std::max(100, steps / 10);
  long rss_after_warmup = 0;
  for (int step = 0; step < steps; ++step) {
    std::vector<ReduceHandle> handles;
    for (size_t b = 0; b < buckets.size(); ++b) {
      data[b].resize(sum_in[b].size());
      for (size_t i = 0; i < data[b].size(); ++i) {
        // A slowly turning low-rank signal plus noise, as gradients are.
        data[b][i] = std::sin(0.001f * static_cast<float>(step) + 0.01f * static_cast<float>(i % 97)) + uniform();
        sum_in[b][i] += data[b][i];
      }
      handles.push_back(reducer.reduce_async(static_cast<int>(b), data[b].data()));
    }
    for (size_t b = 0; b < buckets.size(); ++b) {
      handles[b].wait();
      for (size_t i = 0; i < data[b].size(); ++i) sum_out[b][i] += data[b][i];
    }
    if (step + 1 == warmup) rss_after_warmup = resident_kib();
  }
  const long rss_end = resident_kib();
  CHECK(reducer.iteration() == steps);
  double worst = 0, scale = 1;
  for (size_t b = 0; b < buckets.size(); ++b) {
    std::vector<float> error(sum_in[b].size());
    reducer.error_feedback(static_cast<int>(b), error.data());
    std::vector<double> error_sum(error.begin(), error.end());
    comm->allreduce(sum_in[b].data(), sum_in[b].size(), DataType::Float64);
    comm->allreduce(error_sum.data(), error_sum.size(), DataType::Float64);
    for (size_t i = 0; i < error.size(); ++i) {
      worst = std::max(worst, std::abs(sum_in[b][i] - world * sum_out[b][i] - error_sum[i]));
      scale = std::max(scale, std::abs(sum_in[b][i]));
    }
  }
  INFO("invariant residual ", worst, " at scale ", scale, "; RSS ", rss_after_warmup, " KiB after warm-up, ", rss_end,
       " KiB at the end");
  MESSAGE("soak: ", steps, " steps, invariant residual/scale ", worst / scale, ", RSS ", rss_after_warmup, " -> ",
          rss_end, " KiB");
  // float32 outputs summed over the run: relative rounding of ~steps * 2^-24.
  CHECK(worst / scale < 1e-4);
  CHECK(static_cast<double>(rss_end) <= 1.01 * static_cast<double>(rss_after_warmup));
}

TEST_CASE("reference: W ranks against the double-precision reference, every option") {
  auto comm = connect("engine-reference");
  const int world = comm->size();
  for (int flags = 0; flags < 16; ++flags)
    for (int rank : {1, 3}) {
      Config c = config_for(rank, flags);
      CAPTURE(flags);
      CAPTURE(rank);
      Reducer reducer(*comm, c);
      reducer.add_bucket(kShapes);
      Reference ref(kShapes, c, world);
      const size_t n = reducer.bucket_size(0);
      for (int step = 0; step < 3; ++step) {
        auto all = all_gradients(n, world, step);
        auto expected = ref.step(all);
        std::vector<float> g = all[static_cast<size_t>(comm->rank())];
        reducer.reduce(0, g.data());
        CHECK(relative_difference(g, expected) < 3e-5);
        std::vector<float> error(n);
        reducer.error_feedback(0, error.data());
        CHECK(relative_difference(error, ref.error(comm->rank())) < 3e-5);
      }
    }
}

TEST_CASE("exact: a mean of rank <= r, uncompressed tensors and plain steps give the exact mean") {
  auto comm = connect("engine-exact");
  const int world = comm->size();
  for (int r : {1, 2, 4}) {
    Config c;
    c.rank = r;
    c.start_iter = 2;
    CAPTURE(r);
    Reducer reducer(*comm, c);
    reducer.add_bucket(kShapes);
    const auto& plan = engine::make_plan(kShapes, c);
    for (int step = 0; step < 6; ++step) {
      std::vector<std::vector<float>> all;
      for (int w = 0; w < world; ++w) all.push_back(low_rank(plan, r, w, world, step, static_cast<uint64_t>(r)));
      const auto mean = mean_of(all);
      std::vector<float> g = all[static_cast<size_t>(comm->rank())];
      reducer.reduce(0, g.data());
      CAPTURE(step);
      double worst = 0, worst_unc = 0, scale = 1;
      for (double m : mean) scale = std::max(scale, std::abs(m));
      for (const auto& t : plan.tensors)
        for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
          const double d = std::abs(g[static_cast<size_t>(i)] - mean[static_cast<size_t>(i)]) / scale;
          (t.compressed && step >= c.start_iter ? worst : worst_unc) = std::max(t.compressed && step >= c.start_iter ? worst : worst_unc, d);
        }
      CHECK(worst < 1e-4);      // compressed: the rank-r mean is reproduced (up to float rounding)
      CHECK(worst_unc < 1e-6);  // uncompressed tensors and plain steps: the exact mean
    }
  }
}

TEST_CASE("invariant: outputs plus mean error equal the mean gradients over 200 steps") {
  auto comm = connect("engine-invariant");
  const int world = comm->size();
  Config c;
  c.rank = 2;
  c.start_iter = 10;
  Reducer reducer(*comm, c);
  const std::vector<Shape> shapes = {{48, 40}, {40}, {20, 30}};
  reducer.add_bucket(shapes);
  const size_t n = reducer.bucket_size(0);
  std::vector<double> sum_out(n, 0.0), sum_mean(n, 0.0);
  for (int step = 0; step < 200; ++step) {
    auto all = all_gradients(n, world, step, 5);
    const auto mean = mean_of(all);
    std::vector<float> g = all[static_cast<size_t>(comm->rank())];
    reducer.reduce(0, g.data());
    for (size_t i = 0; i < n; ++i) {
      sum_out[i] += g[i];
      sum_mean[i] += mean[i];
    }
  }
  std::vector<float> error(n);
  reducer.error_feedback(0, error.data());
  comm->allreduce(error.data(), n, DataType::Float32);
  double worst = 0, scale = 1;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::abs(sum_out[i] + error[i] / world - sum_mean[i]));
    scale = std::max(scale, std::abs(sum_mean[i]));
  }
  CHECK(worst / scale < 1e-4);
  CHECK(reducer.iteration() == 200);
}

TEST_CASE("stats: counts and bytes follow the formula") {
  auto comm = connect("engine-stats");
  Config c;
  c.rank = 2;
  c.start_iter = 3;
  Reducer reducer(*comm, c);
  reducer.add_bucket(kShapes);
  reducer.add_bucket({{64, 64}});
  const auto p0 = engine::make_plan(kShapes, c);
  const auto p1 = engine::make_plan(std::vector<Shape>{{64, 64}}, c);
  for (int step = 0; step < 10; ++step)
    for (int b = 0; b < 2; ++b) {
      auto g = gradients(reducer.bucket_size(b), comm->rank(), step);
      reducer.reduce(b, g.data());
    }
  const Stats s = reducer.stats();
  const auto n = static_cast<uint64_t>(p0.numel + p1.numel);
  const auto after = static_cast<uint64_t>(p0.p_numel + p0.q_numel + p0.packed_numel + p1.p_numel + p1.q_numel);
  CHECK(s.numel_before == 7 * n);
  CHECK(s.numel_after == 7 * after);
  CHECK(s.bytes_sent == 4 * (3 * (n + 2) + 7 * (after + 2)));
  CHECK(s.relative_error.size() == 2);
  CHECK(s.relative_error[1] > 0.5);  // a random 64 x 64 matrix is far from rank 2
  CHECK(s.relative_error[1] < 1.0);
}

TEST_CASE("checkpoint: a resumed run equals an uninterrupted one bit for bit") {
  auto comm = connect("engine-checkpoint");
  Config c;
  c.rank = 2;
  c.start_iter = 3;
  const std::vector<Shape> second = {{64, 64}, {64}};
  Reducer a(*comm, c);
  a.add_bucket(kShapes);
  a.add_bucket(second);
  auto step = [&](Reducer& r, int t) {
    std::vector<std::vector<float>> out;
    for (int b = 0; b < r.num_buckets(); ++b) out.push_back(gradients(r.bucket_size(b), comm->rank(), t, 3));
    std::vector<float*> ptrs{out[0].data(), out[1].data()};
    if (t % 2)
      r.reduce_all(ptrs);
    else
      for (int b = 0; b < r.num_buckets(); ++b) r.reduce(b, out[static_cast<size_t>(b)].data());
    return out;
  };
  for (int t = 0; t < 6; ++t) step(a, t);
  const std::string path = "/tmp/psgd-test-engine-mp-" + std::to_string(::getpid()) + ".ckpt";
  a.save(path);
  std::vector<std::vector<std::vector<float>>> expected;
  for (int t = 6; t < 12; ++t) expected.push_back(step(a, t));
  Reducer b(*comm, c);
  b.add_bucket(kShapes);
  b.add_bucket(second);
  b.load(path);
  CHECK(b.iteration() == 6);
  for (int t = 6; t < 12; ++t) CHECK(step(b, t) == expected[static_cast<size_t>(t - 6)]);
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: another rank's file is refused, naming both; ranks saving to one path never fail") {
  auto comm = connect("engine-checkpoint-ranks");
  const int world = comm->size(), me = comm->rank();
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  Reducer r(*comm, c);
  r.add_bucket(kShapes);
  for (int t = 0; t < 3; ++t) {
    auto g = gradients(r.bucket_size(0), me, t, 9);
    r.reduce(0, g.data());
  }
  const char* port = std::getenv("MASTER_PORT");
  REQUIRE(port != nullptr);
  const std::string base = std::string("/tmp/psgd-test-ckpt-") + port;
  const std::string mine = base + ".rank" + std::to_string(me);
  r.save(mine);
  std::vector<float> error_before(r.bucket_size(0)), error_after(r.bucket_size(0));
  r.error_feedback(0, error_before.data());
  comm->barrier();
  // Before: load ignored the file's rank, so every rank could resume with one rank's error memory.
  const int next = (me + 1) % world;
  const std::string refused = error_of([&] { r.load(base + ".rank" + std::to_string(next)); });
  INFO(refused);
  CHECK(refused.find("was saved by rank " + std::to_string(next) + " of " + std::to_string(world)) != std::string::npos);
  CHECK(refused.find("this is rank " + std::to_string(me) + " of " + std::to_string(world)) != std::string::npos);
  r.error_feedback(0, error_after.data());
  CHECK(error_after == error_before);  // refused: state unchanged
  CHECK(r.iteration() == 3);
  r.load(mine);
  // Every rank saves to one path at once, many times (the README's old example): no save fails.
  const std::string shared = base + ".shared";
  int failed = 0;
  for (int i = 0; i < 40; ++i) failed += error_of([&] { r.save(shared); }).empty() ? 0 : 1;
  CHECK(failed == 0);
  comm->barrier();
  if (me == 0) {
    for (const auto& entry : std::filesystem::directory_iterator("/tmp"))
      CHECK(entry.path().string().rfind(shared + ".tmp", 0) != 0);  // no temporary file left
    std::remove(shared.c_str());
  }
  comm->barrier();
  std::remove(mine.c_str());
}

TEST_CASE("non-finite: NaN on one rank fails the step everywhere and leaves all state intact") {
  auto comm = connect("engine-nonfinite");
  const int last = comm->size() - 1;
  // The failed step counts as a step, so the clean run (which skips it) stays
  // in the same phase only when start_iter is not crossed: all compressed, all plain.
  for (int64_t start : {0, 100}) {
    Config c;
    c.rank = 2;
    c.start_iter = start;
    Reducer r(*comm, c), clean(*comm, c);
    r.add_bucket(kShapes);
    clean.add_bucket(kShapes);
    const size_t n = r.bucket_size(0);
    for (int step = 0; step < 8; ++step) {
      auto g = gradients(n, comm->rank(), step, 9);
      if (step == 2) {
        if (comm->rank() == last) g[7] = std::nanf("");
        std::vector<float> before(n), after(n);
        r.error_feedback(0, before.data());
        const auto data = g;
        CHECK(error_of([&] { r.reduce(0, g.data()); }).find("NaN or Inf in the gradients of 1 rank(s)") !=
              std::string::npos);
        r.error_feedback(0, after.data());
        CHECK(std::memcmp(before.data(), after.data(), n * sizeof(float)) == 0);
        CHECK(std::memcmp(data.data(), g.data(), n * sizeof(float)) == 0);
        continue;
      }
      auto h = g;
      r.reduce(0, g.data());
      clean.reduce(0, h.data());
      CHECK(g == h);
    }
  }
}

TEST_CASE("mismatch: a rank with another layout or configuration is named") {
  auto comm = connect("engine-mismatch");
  const int last = comm->size() - 1;
  {
    Reducer r(*comm, Config{});
    r.add_bucket(kShapes);
    std::vector<Shape> shapes = kShapes;
    if (comm->rank() == last) shapes[0] = {24, 32};
    const std::string message = error_of([&] { r.add_bucket(shapes); });
    CHECK(message.find("rank " + std::to_string(last)) != std::string::npos);
    CHECK(message.find("layout of buckets 0..1") != std::string::npos);
  }
  {
    Config c;
    if (comm->rank() == last) c.seed = 3;
    Reducer r(*comm, c);
    CHECK(error_of([&] { r.add_bucket(kShapes); }).find("rank " + std::to_string(last)) != std::string::npos);
  }
}

TEST_CASE("in flight: many buckets async, 500 steps, results exact") {
  auto comm = connect("engine-inflight");
  const int world = comm->size();
  Config c;
  c.rank = 2;
  c.start_iter = 5;
  Reducer reducer(*comm, c);
  const std::vector<std::vector<Shape>> buckets = {
      {{24, 16}, {16}}, {{8, 8, 3, 3}}, {{7}}, {{32, 20}}, {{10, 30}, {30}, {12, 12}}, {{40, 8}}, {{3}}, {{16, 16}}};
  std::vector<engine::BucketPlan> plans;
  for (const auto& shapes : buckets) {
    reducer.add_bucket(shapes);
    plans.push_back(engine::make_plan(shapes, c));
  }
  int wrong = 0;
  for (int step = 0; step < 500; ++step) {
    std::vector<std::vector<float>> data;
    std::vector<std::vector<double>> means;
    for (size_t b = 0; b < plans.size(); ++b) {
      // Rank-2 means: exactly reproduced, so every output can be checked.
      std::vector<std::vector<float>> all;
      for (int w = 0; w < world; ++w) all.push_back(low_rank(plans[b], 2, w, world, step, b));
      means.push_back(mean_of(all));
      data.push_back(all[static_cast<size_t>(comm->rank())]);
    }
    if (step % 7 == 3) {
      std::vector<float*> ptrs;
      for (auto& d : data) ptrs.push_back(d.data());
      reducer.reduce_all(ptrs);
    } else {
      std::vector<ReduceHandle> handles;
      // Submission order changes with the step (the same on every rank).
      for (size_t k = 0; k < plans.size(); ++k) {
        const size_t b = (k * 3 + static_cast<size_t>(step)) % plans.size();
        handles.push_back(reducer.reduce_async(static_cast<int>(b), data[b].data()));
      }
      for (auto& h : handles) h.wait();
    }
    for (size_t b = 0; b < plans.size(); ++b)
      for (size_t i = 0; i < data[b].size(); ++i)
        if (std::abs(data[b][i] - means[b][i]) > 1e-4 * (1 + std::abs(means[b][i]))) {
          ++wrong;
          MESSAGE("step ", step, " bucket ", b, " element ", i, ": got ", data[b][i], ", mean ", means[b][i]);
          break;
        }
  }
  CHECK(wrong == 0);
  CHECK(reducer.iteration() == 500);
}

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) {
    std::fprintf(stderr, "test_engine_mp: WORLD_SIZE is not set; run under powersgd-run (skipped)\n");
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}

// Adaptive rank across processes: every rank's gradients differ, yet every rank
// picks the same rank for every bucket at every step (the decision reads only
// allreduced sums) and outputs the same bits; with alternating too, and the
// error-feedback invariant holds across the switches.
TEST_CASE("adaptive: the same rank decisions and outputs on every rank; nothing lost across switches") {
  auto comm = connect("engine-adaptive");
  const int world = comm->size();
  for (bool alternating : {false, true}) {
    CAPTURE(alternating);
    Config c;
    c.start_iter = 2;
    c.adaptive = true;
    c.rank_low = 1;
    c.rank_high = 3;
    c.adaptive_interval = 3;
    c.alternating = alternating;
    Reducer reducer(*comm, c);
    const std::vector<std::vector<Shape>> buckets = {kShapes, {{12, 24}, {6}}};
    for (const auto& b : buckets) reducer.add_bucket(b);
    std::vector<std::vector<double>> sum_in(2), sum_out(2);
    for (int b = 0; b < 2; ++b) {
      sum_in[static_cast<size_t>(b)].assign(reducer.bucket_size(b), 0.0);
      sum_out[static_cast<size_t>(b)].assign(reducer.bucket_size(b), 0.0);
    }
    bool low_seen = false, high_after_low = false;
    for (int step = 0; step < 40; ++step) {
      const float scale = (step / 8) % 2 == 0 ? 1.0f : 30.0f;  // large changes every 8 steps
      for (int b = 0; b < 2; ++b) {
        const auto all = all_gradients(reducer.bucket_size(b), world, step, static_cast<uint64_t>(b));
        std::vector<float> g = all[static_cast<size_t>(comm->rank())];
        for (float& v : g) v *= scale;
        reducer.reduce(b, g.data());
        for (size_t i = 0; i < g.size(); ++i) {
          for (const auto& x : all) sum_in[static_cast<size_t>(b)][i] += static_cast<double>(x[i]) * scale;
          sum_out[static_cast<size_t>(b)][i] += g[i];
        }
        // Every rank's rank choice and output bits, side by side.
        const uint64_t mine[2] = {static_cast<uint64_t>(reducer.bucket_rank(b)),
                                  engine::crc32(g.data(), g.size() * sizeof(float))};
        std::vector<uint64_t> everyone(2 * static_cast<size_t>(world));
        comm->allgather(mine, everyone.data(), sizeof(mine));
        for (int w = 1; w < world; ++w) {
          CHECK(everyone[2 * static_cast<size_t>(w)] == everyone[0]);
          CHECK(everyone[2 * static_cast<size_t>(w) + 1] == everyone[1]);
        }
      }
      const int r = reducer.bucket_rank(0);
      low_seen = low_seen || r == 1;
      high_after_low = high_after_low || (low_seen && r == 3);
    }
    CHECK(low_seen);
    CHECK(high_after_low);
    // sum over ranks and steps of the inputs = W * (sum of the outputs) + sum over ranks of the error memory.
    for (int b = 0; b < 2; ++b) {
      std::vector<float> error(reducer.bucket_size(b));
      reducer.error_feedback(b, error.data());
      comm->allreduce(error.data(), error.size(), DataType::Float32);
      double worst = 0, scale = 1;
      for (size_t i = 0; i < error.size(); ++i) {
        const double expected = sum_in[static_cast<size_t>(b)][i];
        worst = std::max(worst, std::abs(world * sum_out[static_cast<size_t>(b)][i] + error[i] - expected));
        scale = std::max(scale, std::abs(expected));
      }
      CHECK(worst < 1e-4 * scale);
    }
  }
}
