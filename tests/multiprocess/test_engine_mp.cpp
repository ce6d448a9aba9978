// Multi-process properties of the PowerSGD engine. Every rank runs this binary
// with one test case selected, under powersgd-run:
//   powersgd-run -n 4 --timeout 300 -- test_engine_mp -tc='exact*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <unistd.h>

#include "comm/communicator.hpp"
#include "staged_check.hpp"
#include "engine/checkpoint.hpp"
#include "engine/fault_injection.hpp"
#include "engine_reference.hpp"
#include "error_of.hpp"

using namespace powersgd;
using powersgd::test::error_of;
using powersgd::test::Outcome;
using powersgd::test::outcome_of;
using powersgd::test::Reference;
using powersgd::test::config_for;
using powersgd::test::gradients;
using powersgd::test::relative_difference;
using powersgd::testing::require_staged_if_asked;

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

// Buckets of `data` whose outputs are not their exact `means` (to 1e-4 relative); each named in a MESSAGE.
int inexact_buckets(const std::vector<std::vector<float>>& data, const std::vector<std::vector<double>>& means,
                    const std::string& what) {
  int wrong = 0;
  for (size_t b = 0; b < data.size(); ++b)
    for (size_t i = 0; i < data[b].size(); ++i)
      if (std::abs(data[b][i] - means[b][i]) > 1e-4 * (1 + std::abs(means[b][i]))) {
        ++wrong;
        MESSAGE(what, " bucket ", b, " element ", i, ": got ", data[b][i], ", mean ", means[b][i]);
        break;
      }
  return wrong;
}

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
  require_staged_if_asked(*comm);
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

TEST_CASE("rounds: a reduction costs its collectives' rounds, exactly (Communicator::communication_rounds)") {
  // One after the other per reduction: the order guard's announce, then the
  // plain collective (a step before start_iter) or P and then Q (compressed).
  // All are small: the direct algorithm, one round each by default, and the
  // announce carries P (the lead exchange; OrderGuard::carry), so a compressed
  // reduction costs 2; with PSGD_CARRY_FIRST=0 on rank 0 only, that rank's
  // announce carries nothing, so no rank's P is summed in it: 3 again. With
  // PSGD_DIRECT_MAX_BYTES=0 and PSGD_SCATTER_GATHER=0 Gloo's bcube and no lead
  // exchange, on 2 or 3 ranks one exchange each way (2 rounds) each of 3.
  // With a bf16 wire P's float32 part and its 16-bit factors are two collectives: the announce carries both
  // (of one bucket, or gathered for reduce_all), so 2, and 4 where a rank carries nothing.
  enum Variant { Carried, OneRankCarriesNothing, Bcube };
  for (const WireDType wire : {WireDType::Float32, WireDType::BFloat16}) {
    const bool half = wire != WireDType::Float32;
    std::vector<std::vector<float>> carried_outputs;
    for (const Variant variant : {Carried, OneRankCarriesNothing, Bcube}) {
      if (half && variant == Bcube) continue;
      const bool direct = variant != Bcube;
      if (!direct) setenv("PSGD_DIRECT_MAX_BYTES", "0", 1);
      if (!direct) setenv("PSGD_SCATTER_GATHER", "0", 1);
      const char* rank = std::getenv("RANK");
      if (variant == OneRankCarriesNothing && rank != nullptr && std::string(rank) == "0")
        setenv("PSGD_CARRY_FIRST", "0", 1);
      const std::string name = variant == Carried ? "engine-rounds" : variant == Bcube ? "engine-rounds-bcube"
                                                                                       : "engine-rounds-one-carries-nothing";
      auto comm = connect((half ? name + "-bf16" : name).c_str());
      unsetenv("PSGD_DIRECT_MAX_BYTES");
      unsetenv("PSGD_SCATTER_GATHER");
      // Staged (Meson's rounds-staged variant): the leaders' collectives count, among at most 3 hosts.
      const bool staged = require_staged_if_asked(*comm);
      const auto* gloo = dynamic_cast<const transport::GlooCommunicator*>(comm.get());
      REQUIRE((staged ? gloo->staged_hosts() : comm->size()) <= 3);
      const uint64_t per_collective = direct ? 1 : 2;
      // Collectives of a compressed reduction, one bucket or reduce_all.
      const uint64_t compressed = variant == Carried ? 2 : 3 + (half ? 1 : 0);
      Config c;
      c.rank = 2;
      c.start_iter = 1;
      c.wire_dtype = wire;
      Reducer reducer(*comm, c);
      unsetenv("PSGD_CARRY_FIRST");  // read when the Reducer was made
      reducer.add_bucket(kShapes);
      reducer.add_bucket({{64, 64}});
      for (int step = 0; step < 4; ++step)
        for (int b = 0; b < 2; ++b) {
          auto g = gradients(reducer.bucket_size(b), comm->rank(), step);
          const uint64_t before = comm->communication_rounds();
          reducer.reduce(b, g.data());
          INFO("step ", step, " bucket ", b, " variant ", static_cast<int>(variant), " ", to_string(wire));
          CHECK(comm->communication_rounds() - before == (step == 0 ? 2 : compressed) * per_collective);
        }
      // reduce_all: one announce, one P and one Q collective for both buckets.
      std::vector<std::vector<float>> g{gradients(reducer.bucket_size(0), comm->rank(), 4),
                                        gradients(reducer.bucket_size(1), comm->rank(), 4)};
      const std::vector<float*> data{g[0].data(), g[1].data()};
      const uint64_t before = comm->communication_rounds();
      reducer.reduce_all(std::span<float* const>(data));
      CHECK(comm->communication_rounds() - before == compressed * per_collective);
      // Every rank's outputs are the same bits (the carried sums are direct's, on every rank), and carrying or
      // not changes no bit: the same as the variant that carries nothing.
      for (size_t b = 0; b < g.size(); ++b) {
        const auto& out = g[b];
        std::vector<float> all(out.size() * static_cast<size_t>(comm->size()));
        comm->allgather(out.data(), all.data(), out.size() * sizeof(float));
        for (int r = 1; r < comm->size(); ++r)
          CHECK(std::memcmp(all.data(), all.data() + static_cast<size_t>(r) * out.size(), out.size() * sizeof(float)) == 0);
        if (variant == Carried) carried_outputs.push_back(out);
        if (variant == OneRankCarriesNothing)
          CHECK(std::memcmp(out.data(), carried_outputs.at(b).data(), out.size() * sizeof(float)) == 0);
      }
    }
  }
}

// Replicas: every rank's outputs are the same bits, step after step, plain and compressed, one by one and
// fused (reduce_all). Meson runs it on a plain communicator and on host-staged ones (PSGD_HOST_STAGE=1 with
// pretend hosts from PSGD_TEST_HOSTS): then the communicator must be staged, and each reduction's collectives
// cost one round each (direct among the leaders; the staged lead exchange carries the announce and P).
TEST_CASE("replicas: a rank-2 Reducer's outputs are the same bits on every rank") {
  auto comm = connect("engine-replicas");
  const bool staged = require_staged_if_asked(*comm);
  const size_t world = static_cast<size_t>(comm->size());
  Config c;
  c.rank = 2;
  c.start_iter = 2;
  Reducer reducer(*comm, c);
  reducer.add_bucket(kShapes);
  reducer.add_bucket({{64, 48}, {48}});
  int differing = 0;
  for (int step = 0; step < 12; ++step) {
    std::vector<std::vector<float>> g{gradients(reducer.bucket_size(0), comm->rank(), step, 21),
                                      gradients(reducer.bucket_size(1), comm->rank(), step, 22)};
    const uint64_t before = comm->communication_rounds();
    if (step % 3 == 2) {
      const std::vector<float*> data{g[0].data(), g[1].data()};
      reducer.reduce_all(std::span<float* const>(data));
    } else {
      for (int b = 0; b < 2; ++b) reducer.reduce(b, g[static_cast<size_t>(b)].data());
    }
    if (staged) {  // announce, then one plain collective; or the announce carrying P, then Q; per reduction or group
      const uint64_t collectives = 2 * (step % 3 == 2 ? 1 : 2);
      CHECK(comm->communication_rounds() - before == collectives);
    }
    for (size_t b = 0; b < g.size(); ++b) {
      uint64_t mine = 1469598103934665603ull;
      for (float x : g[b]) {
        uint32_t bits = 0;
        std::memcpy(&bits, &x, sizeof bits);
        mine = (mine ^ bits) * 1099511628211ull;
      }
      std::vector<uint64_t> all(world);
      comm->allgather(&mine, all.data(), sizeof mine);
      for (uint64_t other : all) differing += other != mine;
    }
  }
  CHECK(differing == 0);
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
  const char* port = std::getenv("PSGD_STORE_PORT");
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

// ---- Job checkpoint (Reducer::save_job / load_job): saved on 4 ranks, resumed on 2.
// job_checkpoint.sh runs the two phases one after the other under powersgd-run
// (-n 4, then -n 2) with PSGD_JOB_DIR set; doctest::skip keeps them out of a run
// without it. Rank j of the 2-rank job gets the mean of the 4-rank job's ranks
// 2j and 2j+1, so the mean gradient is the same and, the update depending on the
// error memories only through their mean, so are the outputs.
namespace {

constexpr int kJobSteps = 5;        // steps before save_job
constexpr int kJobAfter = 3;        // steps compared after it
constexpr uint64_t kJobSalt = 21;

Config job_config() {
  Config c;
  c.rank = 2;
  c.start_iter = 2;
  return c;
}

void declare_job_buckets(Reducer& r) {
  r.add_bucket(kShapes);
  r.add_bucket({{64, 64}, {64}});
}

std::string job_dir() {
  const char* dir = std::getenv("PSGD_JOB_DIR");
  REQUIRE_MESSAGE(dir != nullptr, "run through job_checkpoint.sh (PSGD_JOB_DIR)");
  return dir;
}

// All buckets' floats one after the other.
std::vector<float> concatenated(const std::vector<std::vector<float>>& parts) {
  std::vector<float> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

void write_floats(const std::string& path, const std::vector<float>& values) {
  FILE* f = std::fopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(std::fwrite(values.data(), sizeof(float), values.size(), f) == values.size());
  REQUIRE(std::fclose(f) == 0);
}

std::vector<float> read_floats(const std::string& path, size_t count) {
  std::vector<float> values(count);
  FILE* f = std::fopen(path.c_str(), "rb");
  REQUIRE_MESSAGE(f != nullptr, path);
  REQUIRE(std::fread(values.data(), sizeof(float), count, f) == count);
  std::fclose(f);
  return values;
}

// One step of the job; `gradient(bucket, size)` gives this rank's gradients. Returns the outputs.
std::vector<std::vector<float>> job_step(Reducer& r, const std::function<std::vector<float>(int, size_t)>& gradient) {
  std::vector<std::vector<float>> data;
  std::vector<float*> ptrs;
  for (int b = 0; b < r.num_buckets(); ++b) data.push_back(gradient(b, r.bucket_size(b)));
  for (auto& d : data) ptrs.push_back(d.data());
  r.reduce_all(ptrs);
  return data;
}

std::vector<float> all_error_feedback(const Reducer& r) {
  std::vector<std::vector<float>> parts;
  for (int b = 0; b < r.num_buckets(); ++b) {
    parts.emplace_back(r.bucket_size(b));
    r.error_feedback(b, parts.back().data());
  }
  return concatenated(parts);
}

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

}  // namespace

TEST_CASE("job checkpoint: phase 1, 4 ranks run, save_job, and record the next steps" * doctest::skip()) {
  const std::string dir = job_dir();
  auto comm = connect("engine-job-save");
  REQUIRE(comm->size() == 4);
  const int me = comm->rank();
  Reducer r(*comm, job_config());
  declare_job_buckets(r);
  auto mine = [&](int64_t t) {
    return [&, t](int b, size_t n) { return gradients(n, me, t, kJobSalt + static_cast<uint64_t>(b)); };
  };
  for (int t = 0; t < kJobSteps; ++t) job_step(r, mine(t));
  r.save_job(dir + "/job.ckpt");
  // The mean error memory every rank of the resumed job must hold.
  std::vector<float> error = all_error_feedback(r);
  std::vector<double> sum(error.begin(), error.end());
  comm->allreduce(sum.data(), sum.size(), DataType::Float64);
  std::vector<float> mean(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) mean[i] = static_cast<float>(sum[i] / 4.0);
  std::vector<float> outputs;
  for (int t = kJobSteps; t < kJobSteps + kJobAfter; ++t) {
    const std::vector<float> out = concatenated(job_step(r, mine(t)));
    outputs.insert(outputs.end(), out.begin(), out.end());
  }
  if (me == 0) {
    write_floats(dir + "/mean_error.bin", mean);
    write_floats(dir + "/outputs.bin", outputs);
  }
  comm->barrier();
}

TEST_CASE("job checkpoint: phase 2, 2 ranks load_job and reduce the same mean: outputs equal to 1e-5" *
          doctest::skip()) {
  const std::string dir = job_dir();
  auto comm = connect("engine-job-resume");
  REQUIRE(comm->size() == 2);
  const int me = comm->rank();
  Reducer r(*comm, job_config());
  declare_job_buckets(r);
  size_t total = 0;
  for (int b = 0; b < r.num_buckets(); ++b) total += r.bucket_size(b);
  r.load_job(dir + "/job.ckpt");
  CHECK(r.iteration() == kJobSteps);
  // Every rank holds the 4 ranks' mean error memory (the test's mean and the reducer's may round apart).
  CHECK(max_relative_difference(all_error_feedback(r), read_floats(dir + "/mean_error.bin", total)) < 1e-6);
  const std::vector<float> expected = read_floats(dir + "/outputs.bin", total * kJobAfter);
  for (int t = kJobSteps; t < kJobSteps + kJobAfter; ++t) {
    const std::vector<float> out = concatenated(job_step(r, [&](int b, size_t n) {
      const uint64_t salt = kJobSalt + static_cast<uint64_t>(b);
      std::vector<float> g = gradients(n, 2 * me, t, salt);
      const std::vector<float> h = gradients(n, 2 * me + 1, t, salt);
      for (size_t i = 0; i < n; ++i) g[i] = (g[i] + h[i]) / 2;
      return g;
    }));
    const auto first = static_cast<std::ptrdiff_t>(total) * (t - kJobSteps);
    const std::vector<float> uninterrupted(expected.begin() + first,
                                           expected.begin() + first + static_cast<std::ptrdiff_t>(total));
    INFO("step ", t);
    CHECK(max_relative_difference(out, uninterrupted) < 1e-5);
  }
}

TEST_CASE("job checkpoint: a missing, corrupted, foreign or mismatching file fails every rank, state unchanged") {
  auto comm = connect("engine-job-refusals");
  const int me = comm->rank();
  const char* port = std::getenv("PSGD_STORE_PORT");
  REQUIRE(port != nullptr);
  const std::string base = std::string("/tmp/psgd-test-job-") + port;
  Reducer r(*comm, job_config());
  declare_job_buckets(r);
  auto mine = [&](int64_t t) {
    return [&, t](int b, size_t n) { return gradients(n, me, t, kJobSalt + static_cast<uint64_t>(b)); };
  };
  for (int t = 0; t < 3; ++t) job_step(r, mine(t));
  r.save_job(base + ".job");
  r.save(base + ".rank" + std::to_string(me));
  // Rank 0 alone writes; the file exists for every rank once save_job returned.
  CHECK(std::filesystem::exists(base + ".job"));
  // A write failure on rank 0 is an error on every rank, not a hang.
  const std::string unwritable = error_of([&] { r.save_job("/nonexistent-psgd-dir/job.ckpt"); });
  CHECK(unwritable.find("save_job: writing job checkpoint /nonexistent-psgd-dir/job.ckpt failed on rank 0") !=
        std::string::npos);
  job_step(r, mine(3));
  const std::vector<float> error_before = all_error_feedback(r);
  auto unchanged = [&] {
    CHECK(r.iteration() == 4);
    CHECK(all_error_feedback(r) == error_before);
  };

  const std::string missing = error_of([&] { r.load_job(base + ".none"); });
  INFO(missing);
  CHECK_THROWS_AS(r.load_job(base + ".none"), IoError);
  CHECK(missing.find("load_job: reading job checkpoint " + base + ".none failed on rank 0") != std::string::npos);
  CHECK(missing.find("cannot open checkpoint") != std::string::npos);
  unchanged();

  if (me == 0) {  // a damaged copy, visible to rank 0 only: the others get its bytes by broadcast
    std::filesystem::copy_file(base + ".job", base + ".damaged", std::filesystem::copy_options::overwrite_existing);
    FILE* f = std::fopen((base + ".damaged").c_str(), "r+b");
    REQUIRE(f != nullptr);
    std::fseek(f, -7, SEEK_END);
    std::fputc('!', f);
    std::fclose(f);
  }
  comm->barrier();
  const std::string damaged = error_of([&] { r.load_job(base + ".damaged"); });
  INFO(damaged);
  CHECK_THROWS_AS(r.load_job(base + ".damaged"), IoError);
  CHECK(damaged.find("is corrupted: CRC-32") != std::string::npos);
  unchanged();

  // Rank 0's per-rank file: refused on every rank as the wrong kind.
  CHECK_THROWS_AS(r.load_job(base + ".rank0"), MismatchError);
  CHECK(error_of([&] { r.load_job(base + ".rank0"); }).find("not a job checkpoint (save_job): load it with load") !=
        std::string::npos);
  CHECK_THROWS_AS(r.load(base + ".job"), MismatchError);
  unchanged();

  // Another configuration: MismatchError everywhere, naming the field.
  Config other = job_config();
  other.rank = 1;
  Reducer o(*comm, other);
  declare_job_buckets(o);
  const std::string mismatch = error_of([&] { o.load_job(base + ".job"); });
  INFO(mismatch);
  CHECK_THROWS_AS(o.load_job(base + ".job"), MismatchError);
  CHECK(mismatch.find("was written with config.rank = 2, this reducer has 1") != std::string::npos);
  CHECK(o.iteration() == 0);

  // And a good load after the refusals: every rank at step 3 with the same (mean) error memory.
  r.load_job(base + ".job");
  CHECK(r.iteration() == 3);
  std::vector<float> error = all_error_feedback(r), rank0 = error;
  comm->broadcast(rank0.data(), rank0.size() * sizeof(float), 0);
  CHECK(error == rank0);

  // Ranks at different steps (rank 0 alone goes back to its step-3 per-rank file): save_job refuses on every
  // rank, naming the first differing rank, and writes nothing.
  job_step(r, mine(3));
  if (me == 0) r.load(base + ".rank0");
  const std::string diverged = error_of([&] { r.save_job(base + ".diverged"); });
  INFO(diverged);
  CHECK(diverged.find("save_job: the step count (this rank: " + std::to_string(me == 0 ? 3 : 4) +
                      ") and warm-start state differs between ranks: rank 1") != std::string::npos);
  comm->barrier();
  CHECK_FALSE(std::filesystem::exists(base + ".diverged"));
  comm->barrier();
  if (me == 0)
    for (const char* suffix : {".job", ".damaged"}) std::remove((base + suffix).c_str());
  std::remove((base + ".rank" + std::to_string(me)).c_str());
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

TEST_CASE("non-finite: finite inputs that overflow in the sum fail plain and compressed steps alike") {
  auto comm = connect("engine-overflow");
  // kShapes' 1-D tensor {32} (offset 768) travels uncompressed: every rank's 3e38
  // there sums to Inf. Both paths refuse on the allreduced sums, on every rank.
  for (int64_t start : {0, 100}) {
    CAPTURE(start);
    Config c;
    c.rank = 2;
    c.start_iter = start;
    Reducer r(*comm, c), clean(*comm, c);
    r.add_bucket(kShapes);
    clean.add_bucket(kShapes);
    const size_t n = r.bucket_size(0);
    REQUIRE_FALSE(engine::make_plan(kShapes, c).tensors[1].compressed);
    for (int step = 0; step < 6; ++step) {
      auto g = gradients(n, comm->rank(), step, 5);
      if (step == 2) {
        g[768 + 5] = 3e38f;
        std::vector<float> before(n), after(n);
        r.error_feedback(0, before.data());
        const auto data = g;
        std::string message;
        try {
          r.reduce(0, g.data());
        } catch (const NonFiniteError& e) {
          message = e.what();
        }
        CHECK(message.find("overflowed to Inf/NaN") != std::string::npos);
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
    // What differs, in words (issue 18), not only fingerprints.
    CHECK(message.find("bucket 1 tensor 0: [24,32] on rank " + std::to_string(last) + ", [32,24] on rank 0") != std::string::npos);
  }
  {
    Config c;
    if (comm->rank() == last) c.seed = 3;
    Reducer r(*comm, c);
    const std::string message = error_of([&] { r.add_bucket(kShapes); });
    CHECK(message.find("rank " + std::to_string(last)) != std::string::npos);
    CHECK(message.find("config.seed 3 on rank " + std::to_string(last) + ", 0 on rank 0") != std::string::npos);
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
    wrong += inexact_buckets(data, means, "step " + std::to_string(step));
  }
  CHECK(wrong == 0);
  CHECK(reducer.iteration() == 500);
}

// Several reducers on one communicator (two models in one process, e.g. a GAN's generator and
// discriminator), their calls interleaved on one thread: reduce_async of one while the other's reductions
// are in flight, a blocking reduce_all of one, and a third reducer's add_bucket (collective) while the
// others' reductions are in flight. Each reducer issues its collectives from its own worker thread; the
// communicator runs them in the calls' order on every rank (comm_turns.hpp), so every output is the exact
// mean. Without that order they reached the communicator in an order that depended on timing: the order
// guard's MismatchError, one reducer's collective paired with another's (wrong sums), or Gloo's abort.
TEST_CASE("two reducers: calls interleaved on one communicator are reduced in call order, exact") {
  auto comm = connect("engine-two-reducers");
  const int world = comm->size();
  Config c;
  c.rank = 2;
  c.start_iter = 2;
  struct Model {
    std::vector<std::vector<Shape>> buckets;
    std::unique_ptr<Reducer> reducer;
    std::vector<engine::BucketPlan> plans;
    std::vector<std::vector<float>> data;
    std::vector<std::vector<double>> means;
  };
  std::vector<Model> models(3);
  models[0].buckets = {{{32, 24}, {24}}, {{40, 8}}, {{16, 16}}};
  models[1].buckets = {{{24, 16}}, {{8, 8, 3, 3}, {7}}, {{30, 10}}, {{5}}};
  models[2].buckets = {{{20, 20}}, {{12, 6}, {6}}};
  const auto declare = [&](Model& m) {
    m.reducer = std::make_unique<Reducer>(*comm, c);
    for (const auto& shapes : m.buckets) {
      m.reducer->add_bucket(shapes);
      m.plans.push_back(engine::make_plan(shapes, c));
    }
  };
  declare(models[0]);
  declare(models[1]);
  const int steps = 40, late_step = 10;
  int wrong = 0;
  for (int step = 0; step < steps; ++step) {
    const size_t active = step < late_step ? 2 : 3;
    for (size_t mi = 0; mi < active; ++mi) {
      Model& m = models[mi];
      m.data.clear();
      m.means.clear();
      for (size_t b = 0; b < m.plans.size(); ++b) {
        std::vector<std::vector<float>> all;
        for (int w = 0; w < world; ++w) all.push_back(low_rank(m.plans[b], 2, w, world, step, mi * 100 + b));
        m.means.push_back(mean_of(all));
        m.data.push_back(all[static_cast<size_t>(comm->rank())]);
      }
    }
    std::vector<ReduceHandle> handles;
    // Bucket by bucket, alternating between the models (the same on every rank).
    for (size_t k = 0; k < 4; ++k)
      for (size_t mi = 0; mi < active; ++mi) {
        Model& m = models[mi];
        if (mi == 1 && step % 5 == 4) continue;  // model 1 reduces this step with reduce_all, below
        if (k < m.plans.size())
          handles.push_back(m.reducer->reduce_async(static_cast<int>(k), std::span<float>(m.data[k])));
      }
    if (step % 5 == 4) {
      std::vector<std::span<float>> all;
      for (auto& d : models[1].data) all.emplace_back(d);
      models[1].reducer->reduce_all(all);
    }
    if (step == late_step - 1) {
      declare(models[2]);  // collective, while models 0 and 1 have reductions in flight
      CHECK(models[2].reducer->num_buckets() == 2);
    }
    for (auto& h : handles) h.wait();
    for (size_t mi = 0; mi < active; ++mi)
      wrong += inexact_buckets(models[mi].data, models[mi].means,
                               "step " + std::to_string(step) + " model " + std::to_string(mi));
  }
  CHECK(wrong == 0);
  CHECK(models[0].reducer->iteration() == steps);
  CHECK(models[1].reducer->iteration() == steps);
  CHECK(models[2].reducer->iteration() == steps - late_step);
}

namespace {

// A failure on one rank must reach every rank at once, not after PSGD_TIMEOUT_MS
// (300 s by default): 1 s is the guarantee; the bound leaves room for a loaded machine.
constexpr double kFailTogetherSeconds = 5.0;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

// Before: rank 0 sent a plain allreduce of the whole bucket and rank 1 a
// compressed one, and Gloo aborted the process (SIGABRT, pair.cc enforce).
TEST_CASE("resume: ranks loading checkpoints of different steps get MismatchError; a consistent load recovers") {
  auto comm = connect("engine-resume");
  const int me = comm->rank();
  Config c;
  c.rank = 2;
  c.start_iter = 2;
  const char* port = std::getenv("PSGD_STORE_PORT");
  REQUIRE(port != nullptr);
  auto file = [&](int step) {
    return std::string("/tmp/psgd-test-resume-") + port + ".step" + std::to_string(step) + ".rank" + std::to_string(me);
  };
  Reducer a(*comm, c);
  a.add_bucket(kShapes);
  const size_t n = a.bucket_size(0);
  std::vector<std::vector<float>> expected;  // the uninterrupted run's outputs of steps 3, 4, 5
  for (int t = 0; t < 6; ++t) {
    if (t == 1 || t == 3) a.save(file(t));
    auto g = gradients(n, me, t, 21);
    a.reduce(0, g.data());
    if (t >= 3) expected.push_back(g);
  }

  Reducer b(*comm, c);
  b.add_bucket(kShapes);
  b.load(file(me == 0 ? 1 : 3));
  std::vector<float> error_before(n), error_after(n);
  b.error_feedback(0, error_before.data());
  auto g = gradients(n, me, 3, 21);
  const auto data = g;
  // The check stays pending until a load, so a second reduce fails the same way
  // (a failed reduction counts as a step, as for NaN: steps 4 and 2 then).
  for (const char* differs : {"rank 1 differs from rank 0 in step 3 (compressed) against 1 (uncompressed)",
                              "rank 1 differs from rank 0 in step 4 (compressed) against 2 (compressed)"}) {
    const Outcome o = outcome_of([&] { b.reduce(0, g.data()); });
    INFO(o.message);
    MESSAGE("rank ", me, ": failed after ", o.seconds, " s: ", o.message);
    CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
    CHECK(contains(o.message, differs));
    CHECK(o.seconds < kFailTogetherSeconds);
    CHECK(g == data);
    b.error_feedback(0, error_after.data());
    CHECK(error_after == error_before);
  }
  // A consistent load on every rank: the reducer works again, exactly as the uninterrupted run.
  b.load(file(3));
  CHECK(b.iteration() == 3);
  for (int t = 3; t < 6; ++t) {
    auto h = gradients(n, me, t, 21);
    b.reduce(0, h.data());
    CHECK(h == expected[static_cast<size_t>(t - 3)]);
  }

  // Only rank 0 loads: the others' first reduce (step 0) differs from its (step 3).
  Reducer d(*comm, c);
  d.add_bucket(kShapes);
  if (me == 0) d.load(file(3));
  const Outcome o = outcome_of([&] { d.reduce(0, g.data()); });
  INFO(o.message);
  CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
  CHECK(contains(o.message, "rank 1 differs from rank 0 in step 0 (uncompressed) against 3 (compressed)"));
  CHECK(contains(o.message, "warm-start state"));
  comm->barrier();
  std::remove(file(1).c_str());
  std::remove(file(3).c_str());
}

// Before: the refusing rank threw at once and the others waited in the layout
// check for PSGD_TIMEOUT_MS, after which their communicator was broken.
TEST_CASE("fail together: add_bucket refused on one rank fails every rank at once, naming it") {
  auto comm = connect("engine-fail-add-bucket");
  const int me = comm->rank(), last = comm->size() - 1;
  Config c;
  c.start_iter = 0;
  Reducer r(*comm, c);
  r.add_bucket(kShapes);
  for (const std::vector<Shape>& bad : {std::vector<Shape>{}, std::vector<Shape>{{4, -2}}}) {
    const Outcome o = outcome_of([&] { r.add_bucket(me == last ? bad : kShapes); });
    INFO(o.message);
    MESSAGE("rank ", me, ": failed after ", o.seconds, " s: ", o.message);
    CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
    CHECK(o.seconds < kFailTogetherSeconds);
    if (me != last) CHECK(contains(o.message, "add_bucket of bucket 1 failed on rank " + std::to_string(last) + ": "));
    CHECK(contains(o.message, bad.empty() ? "bucket has no tensors" : "-2"));
  }
  // Nothing was declared anywhere: a consistent add_bucket and a step work.
  CHECK(r.num_buckets() == 1);
  CHECK(r.add_bucket({{8, 8}}) == 1);
  std::vector<std::vector<float>> data;
  for (int b = 0; b < 2; ++b) data.push_back(gradients(r.bucket_size(b), me, 0, 4));
  std::vector<float*> ptrs{data[0].data(), data[1].data()};
  r.reduce_all(ptrs);
  CHECK(r.iteration() == 1);
}

namespace {

// Rank 1's local work fails (a real exception, from the test-only fault hook)
// at step 3, at `point`: every rank fails that step at once, naming rank 1 and
// the reason; no state changes anywhere; the run then continues exactly as a
// run that skipped the step. Two buckets reduced asynchronously, so the second
// one's prepare runs ahead (the lookahead) and fails there.
void fail_together_at(engine::FaultPoint point, int64_t start_iter, const char* run_id) {
  auto comm = connect(run_id);
  const int me = comm->rank();
  constexpr int64_t kFailStep = 3;
  Config c;
  c.rank = 2;
  c.start_iter = start_iter;
  if (me == 1) engine::arm_fault({point, kFailStep});
  Reducer r(*comm, c), clean(*comm, c);  // r takes the armed fault
  const std::vector<std::vector<Shape>> buckets = {kShapes, {{64, 64}, {64}}};
  for (const auto& shapes : buckets) {
    r.add_bucket(shapes);
    clean.add_bucket(shapes);
  }
  for (int step = 0; step < 7; ++step) {
    std::vector<std::vector<float>> g;
    for (int b = 0; b < 2; ++b) g.push_back(gradients(r.bucket_size(b), me, step, 17));
    CAPTURE(step);
    if (step == kFailStep) {
      std::vector<std::vector<float>> before;
      for (int b = 0; b < 2; ++b) {
        before.emplace_back(r.bucket_size(b));
        r.error_feedback(b, before.back().data());
      }
      const auto data = g;
      const auto submitted = std::chrono::steady_clock::now();
      std::vector<ReduceHandle> handles;
      for (int b = 0; b < 2; ++b) handles.push_back(r.reduce_async(b, g[static_cast<size_t>(b)].data()));
      for (int b = 0; b < 2; ++b) {
        const Outcome o = outcome_of([&] { handles[static_cast<size_t>(b)].wait(); });
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - submitted).count();
        INFO(o.message);
        MESSAGE("rank ", me, " bucket ", b, ": failed ", seconds, " s after submission: ", o.message);
        CHECK(o.code == static_cast<int>(ErrorCode::Io));
        CHECK(seconds < kFailTogetherSeconds);
        CHECK(contains(o.message, "injected fault"));
        if (me != 1) CHECK(contains(o.message, "step 3, bucket " + std::to_string(b) + " failed on rank 1: injected"));
        if (me != 1) CHECK(contains(o.message, "; nothing written, error-feedback and warm-start state unchanged"));
        std::vector<float> after(r.bucket_size(b));
        r.error_feedback(b, after.data());
        CHECK(after == before[static_cast<size_t>(b)]);
      }
      CHECK(g == data);
      continue;
    }
    auto h = g;
    std::vector<ReduceHandle> handles;
    for (int b = 0; b < 2; ++b) handles.push_back(r.reduce_async(b, g[static_cast<size_t>(b)].data()));
    for (auto& handle : handles) handle.wait();
    for (int b = 0; b < 2; ++b) clean.reduce(b, h[static_cast<size_t>(b)].data());
    CHECK(g == h);
  }
  CHECK(r.iteration() == 7);
}

}  // namespace

// Before: the failing rank threw alone and the others waited in the step's
// first (or second) collective for PSGD_TIMEOUT_MS.
TEST_CASE("fail together: a failure in one rank's prepare, compressed step") {
  fail_together_at(engine::FaultPoint::Prepare, 0, "engine-fail-prepare-compressed");
}
TEST_CASE("fail together: a failure in one rank's prepare, plain step") {
  fail_together_at(engine::FaultPoint::Prepare, 100, "engine-fail-prepare-plain");
}
TEST_CASE("fail together: a failure on one rank between the P and Q collectives") {
  fail_together_at(engine::FaultPoint::Between, 0, "engine-fail-between");
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

// ==== Order guard and divergence detector (issue 18) ====
// Before: ranks that reduced different buckets passed Gloo collectives of
// different sizes (Gloo aborted the process: SIGABRT, pair.cc enforce
// `op.preamble.length <= op.nbytes`) or, with equal sizes, averaged the buckets
// into each other silently; a load on rank 0 only ended in a collective timeout.

namespace {

// Whether every rank holds the same bits in `data`.
bool same_on_every_rank(Communicator& comm, const std::vector<float>& data) {
  const uint32_t mine = engine::crc32(data.data(), data.size() * sizeof(float));
  std::vector<uint32_t> all(static_cast<size_t>(comm.size()));
  comm.allgather(&mine, all.data(), sizeof(mine));
  return std::all_of(all.begin(), all.end(), [&](uint32_t c) { return c == all[0]; });
}

// The mean over ranks of gradients(n, rank, step, salt), in float as the plain path computes it (sum, then / W).
std::vector<float> plain_mean(size_t n, int world, int64_t step, uint64_t salt) {
  std::vector<float> sum(n, 0.0f);
  for (int w = 0; w < world; ++w) {
    const auto g = gradients(n, w, step, salt);
    for (size_t i = 0; i < n; ++i) sum[i] += g[i];
  }
  for (auto& v : sum) v /= static_cast<float>(world);
  return sum;
}

bool near(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::abs(a[i] - b[i]) > 1e-5f * (1 + std::abs(b[i]))) return false;
  return true;
}

// A file both ranks see: a side channel for the threads test (never collective traffic).
std::string side_file(const char* name) {
  const char* port = std::getenv("PSGD_STORE_PORT");
  REQUIRE(port != nullptr);
  return std::string("/tmp/psgd-test-") + name + "-" + port;
}

}  // namespace

TEST_CASE("order: buckets swapped by one rank in step 0 or later, sizes equal or not, plain or compressed") {
  auto comm = connect("engine-order-swap");
  const int me = comm->rank(), last = comm->size() - 1, world = comm->size();
  for (bool equal : {false, true})
    for (int64_t start_iter : {int64_t{0}, int64_t{1000}})
      for (int swap_step : {0, 2}) {
        CAPTURE(equal);
        CAPTURE(start_iter);
        CAPTURE(swap_step);
        Config c;
        c.rank = 2;
        c.start_iter = start_iter;
        Reducer r(*comm, c);
        r.add_bucket({{16, 8}});
        r.add_bucket(equal ? std::vector<Shape>{{8, 16}} : std::vector<Shape>{{8, 4}});
        const size_t n0 = r.bucket_size(0), n1 = r.bucket_size(1);
        for (int step = 0; step < 4; ++step) {
          std::vector<std::vector<float>> g{gradients(n0, me, step, 5), gradients(n1, me, step, 6)};
          if (step == swap_step) {
            const auto data = g;
            const std::vector<int> order = me == last ? std::vector<int>{1, 0} : std::vector<int>{0, 1};
            for (int k = 0; k < 2; ++k) {
              const int b = order[static_cast<size_t>(k)];
              const Outcome o = outcome_of([&] { r.reduce(b, g[static_cast<size_t>(b)].data()); });
              INFO(o.message);
              CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
              CHECK(o.seconds < kFailTogetherSeconds);
              const std::string expected =
                  "step " + std::to_string(step) + ": rank " + std::to_string(last) + " reduces bucket " +
                  std::to_string(1 - k) + " (" + std::to_string(k == 0 ? n1 : n0) + " floats) where rank 0 reduces bucket " +
                  std::to_string(k) + " (" + std::to_string(k == 0 ? n0 : n1) + " floats)";
              CHECK(contains(o.message, expected));
            }
            CHECK(g == data);  // nothing written
            continue;
          }
          for (int b = 0; b < 2; ++b) r.reduce(b, g[static_cast<size_t>(b)].data());
          for (int b = 0; b < 2; ++b) {
            CHECK(same_on_every_rank(*comm, g[static_cast<size_t>(b)]));
            if (step < start_iter)  // plain: the exact mean of this bucket, not of the other one
              CHECK(near(g[static_cast<size_t>(b)], plain_mean(b == 0 ? n0 : n1, world, step, b == 0 ? 5 : 6)));
          }
        }
        CHECK(r.iteration() == 4);
        CHECK(r.stats().guard_seconds > 0);
      }
}

TEST_CASE("order: a call refused on one rank fails that reduction everywhere; its next bucket goes on") {
  auto comm = connect("engine-order-local-error");
  const int me = comm->rank(), last = comm->size() - 1, world = comm->size();
  for (int64_t start_iter : {int64_t{0}, int64_t{1000}}) {
    CAPTURE(start_iter);
    Config c;
    c.rank = 2;
    c.start_iter = start_iter;
    // Refused for bucket 0 on the last rank: a null pointer, a short span. The bucket counts as reduced there,
    // as on the others, so its next bucket (1) pairs with theirs and succeeds.
    for (int kind = 0; kind < 2; ++kind) {
      CAPTURE(kind);
      Reducer r(*comm, c);
      r.add_bucket(kShapes);
      r.add_bucket({{12, 10}});
      std::vector<std::vector<float>> g{gradients(r.bucket_size(0), me, 0, 1), gradients(r.bucket_size(1), me, 0, 2)};
      const auto data = g;
      const Outcome o = outcome_of([&] {
        if (me != last)
          r.reduce(0, std::span<float>(g[0]));
        else if (kind == 0)
          r.reduce(0, static_cast<float*>(nullptr));
        else
          r.reduce(0, std::span<float>(g[0]).first(g[0].size() - 1));
      });
      INFO(o.message);
      CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
      CHECK(o.seconds < kFailTogetherSeconds);
      const std::string reason = kind == 0 ? "reduce of bucket 0: data is null"
                                           : "reduce of bucket 0: the buffer has " + std::to_string(g[0].size() - 1) +
                                                 " elements, the bucket has " + std::to_string(g[0].size());
      CHECK(contains(o.message, reason));
      if (me != last) CHECK(contains(o.message, "step 0, bucket 0 (" + std::to_string(g[0].size()) +
                                                    " floats) failed on rank " + std::to_string(last) + ": "));
      CHECK(g == data);
      r.reduce(1, std::span<float>(g[1]));
      CHECK(same_on_every_rank(*comm, g[1]));
      if (start_iter > 0) CHECK(near(g[1], plain_mean(g[1].size(), world, 0, 2)));
      CHECK(r.iteration() == 1);
    }
    // A bad index, or a bucket reduced twice, on the last rank, then its next bucket: every rank fails, naming it.
    for (int kind = 0; kind < 2; ++kind) {
      CAPTURE(kind);
      Reducer r(*comm, c);
      r.add_bucket(kShapes);
      r.add_bucket({{12, 10}});
      std::vector<std::vector<float>> g{gradients(r.bucket_size(0), me, 0, 1), gradients(r.bucket_size(1), me, 0, 2)};
      if (kind == 1) r.reduce(0, g[0].data());
      const Outcome first = outcome_of([&] {
        if (me != last)
          r.reduce(kind == 0 ? 0 : 1, g[kind == 0 ? 0 : 1].data());
        else
          r.reduce(kind == 0 ? 7 : 0, g[0].data());
      });
      INFO(first.message);
      CHECK(first.code == static_cast<int>(ErrorCode::InvalidArgument));
      CHECK(first.seconds < kFailTogetherSeconds);
      CHECK(contains(first.message, kind == 0 ? "bucket index 7: expected 0 to 1" : "bucket 0 was already reduced in step 0"));
      if (me != last) CHECK(contains(first.message, "failed on rank " + std::to_string(last)));
      // Every rank carries on with its next bucket: the last rank's refused call did not count, the others'
      // failed reduction did.
      const int next_bucket = me == last || kind == 0 ? 1 : 0;
      const Outcome next = outcome_of([&] { r.reduce(next_bucket, g[static_cast<size_t>(next_bucket)].data()); });
      INFO(next.message);
      if (kind == 0) {
        // A bad index: every rank's next is bucket 1 of step 0, so it pairs and succeeds.
        CHECK(next.code == 0);
        CHECK(same_on_every_rank(*comm, g[1]));
        if (start_iter > 0) CHECK(near(g[1], plain_mean(g[1].size(), world, 0, 2)));
      } else {
        // A bucket twice: the last rank reduces bucket 1 of step 0, the others bucket 0 of step 1.
        CHECK(next.code == static_cast<int>(ErrorCode::Mismatch));
        CHECK(contains(next.message, "ranks are at different steps: rank " + std::to_string(last)));
      }
      CHECK(next.seconds < kFailTogetherSeconds);
    }
  }
}

TEST_CASE("order: a bucket skipped by one rank is named on every rank; the run recovers") {
  auto comm = connect("engine-order-skip");
  const int me = comm->rank(), last = comm->size() - 1, world = comm->size();
  Config c;
  c.start_iter = 1000;
  Reducer r(*comm, c);
  r.add_bucket({{64}});
  r.add_bucket({{16}});
  std::vector<std::vector<float>> g{gradients(64, me, 0, 1), gradients(16, me, 0, 2)};
  for (int b = 0; b < 2; ++b) r.reduce(b, g[static_cast<size_t>(b)].data());
  // Step 1: the last rank skips bucket 0 and reduces bucket 1.
  const Outcome o = outcome_of([&] { r.reduce(me == last ? 1 : 0, g[me == last ? 1 : 0].data()); });
  INFO(o.message);
  CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
  CHECK(contains(o.message, "step 1: rank " + std::to_string(last) +
                                " reduces bucket 1 (16 floats) where rank 0 reduces bucket 0 (64 floats)"));
  CHECK(o.seconds < kFailTogetherSeconds);
  // It then reduces the skipped bucket; the others their second: that fails too, and step 1 is over everywhere.
  CHECK_THROWS_AS(r.reduce(me == last ? 0 : 1, g[me == last ? 0 : 1].data()), MismatchError);
  CHECK(r.iteration() == 2);
  for (int b = 0; b < 2; ++b) {
    auto h = gradients(g[static_cast<size_t>(b)].size(), me, 2, 3);
    r.reduce(b, h.data());
    CHECK(near(h, plain_mean(h.size(), world, 2, 3)));
  }
}

TEST_CASE("order: a second thread's call while reduce() runs is refused, nothing submitted") {
  auto comm = connect("engine-order-threads");
  const int me = comm->rank(), last = comm->size() - 1, world = comm->size();
  const std::string file = side_file("threads");
  if (me == 0) std::remove(file.c_str());
  comm->barrier();
  Config c;
  c.start_iter = 1000;
  Reducer r(*comm, c);
  r.add_bucket({{32}});
  r.add_bucket({{32}});  // equal sizes: mixing them would go unnoticed by Gloo
  std::vector<std::vector<float>> g{gradients(32, me, 0, 1), gradients(32, me, 0, 2)};
  if (me == last) {
    // Thread A is inside reduce(0), waiting for the others (they wait for the side file);
    // this thread's reduce(1) meanwhile is refused.
    std::atomic<bool> started{false};
    std::thread a([&] {
      started = true;
      r.reduce(0, g[0].data());
    });
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const Outcome o = outcome_of([&] { r.reduce(1, g[1].data()); });
    INFO(o.message);
    CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
    CHECK(contains(o.message, "reduce while another thread is inside a call of this Reducer"));
    { std::FILE* f = std::fopen(file.c_str(), "w"); REQUIRE(f != nullptr); std::fclose(f); }
    a.join();
    r.reduce(1, g[1].data());  // bucket 1 was not submitted: reduced now, in order
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(file) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(std::filesystem::exists(file));
    for (int b = 0; b < 2; ++b) r.reduce(b, g[static_cast<size_t>(b)].data());
  }
  for (int b = 0; b < 2; ++b) CHECK(near(g[static_cast<size_t>(b)], plain_mean(32, world, 0, static_cast<uint64_t>(b + 1))));
  comm->barrier();
  if (me == 0) std::remove(file.c_str());
}

TEST_CASE("order: a load on rank 0 only fails the next reduce on every rank with MismatchError") {
  auto comm = connect("engine-order-load-one");
  const int me = comm->rank();
  Config c;
  c.rank = 2;
  c.start_iter = 2;
  const std::string file = side_file("load-one") + ".rank" + std::to_string(me);
  Reducer r(*comm, c);
  r.add_bucket(kShapes);
  const size_t n = r.bucket_size(0);
  for (int t = 0; t < 4; ++t) {
    if (t == 1) r.save(file);
    auto g = gradients(n, me, t, 9);
    r.reduce(0, g.data());
  }
  if (me == 0) r.load(file);  // step 1 on rank 0; the others are at step 4
  auto g = gradients(n, me, 4, 9);
  const auto data = g;
  const Outcome o = outcome_of([&] { r.reduce(0, g.data()); });
  INFO(o.message);
  CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
  CHECK(contains(o.message, "ranks resumed from inconsistent state: rank 1 differs from rank 0 in step 4 "
                            "(compressed) against 1 (uncompressed)"));
  CHECK(o.seconds < kFailTogetherSeconds);
  CHECK(g == data);
  // Every rank loads: consistent again.
  r.load(file);
  g = gradients(n, me, 1, 9);
  r.reduce(0, g.data());
  CHECK(same_on_every_rank(*comm, g));
  comm->barrier();
  std::remove(file.c_str());
}

// A replica that drifts (one output bit flipped on rank 1 by the test-only
// fault point, as a different CPU kernel would) is named on every rank.
TEST_CASE("divergence: one rank's drifted output is named on every rank, with the step and the bucket") {
  auto comm = connect("engine-divergence");
  const int me = comm->rank();
  for (int64_t start_iter : {int64_t{0}, int64_t{1000}})
    for (int64_t interval : {int64_t{1}, int64_t{2}, int64_t{0}}) {
      CAPTURE(start_iter);
      CAPTURE(interval);
      Config c;
      c.rank = 2;
      c.start_iter = start_iter;
      c.divergence_check_interval = interval;
      constexpr int64_t kDrift = 3;  // (3 + 1) % interval == 0 for intervals 1 and 2
      if (me == 1) engine::arm_fault({engine::FaultPoint::Output, kDrift});
      Reducer r(*comm, c);
      r.add_bucket(kShapes);
      r.add_bucket({{12, 10}});
      for (int step = 0; step < 6; ++step) {
        CAPTURE(step);
        for (int b = 0; b < 2; ++b) {
          auto g = gradients(r.bucket_size(b), me, step, static_cast<uint64_t>(b));
          const Outcome o = outcome_of([&] { r.reduce(b, g.data()); });
          INFO(o.message);
          if (step == kDrift + 1 && interval != 0) {
            CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
            CHECK(contains(o.message, "replicas diverged in step 3, bucket " + std::to_string(b) + " (" +
                                          std::to_string(r.bucket_size(b)) + " floats): "));
            CHECK(contains(o.message, comm->size() >= 3 ? "rank 1 computed another output" : "rank 0 / rank 1"));
          } else {
            CHECK(o.code == 0);
          }
        }
      }
      const Stats s = r.stats();
      CHECK((s.check_seconds > 0) == (interval != 0));
    }
}

namespace {

// The decision log as floats (step, bucket, rank, reason per entry), to compare across ranks.
std::vector<float> log_floats(const std::vector<RankDecision>& log) {
  std::vector<float> out;
  for (const auto& d : log)
    for (const float v : {float(d.step), float(d.bucket), float(d.rank), float(d.reason)}) out.push_back(v);
  return out;
}

// Steps [from, to) of two buckets reduced one by one with the adaptive rule, warm-up and a learning-rate
// note before step 9; the rank-policy test's run. Returns every output, in order.
std::vector<float> policy_steps(Reducer& r, int me, int from, int to) {
  std::vector<float> outputs;
  for (int t = from; t < to; ++t) {
    if (t == 9) r.note_lr_change();
    for (int b = 0; b < 2; ++b) {
      // The gradients' scale jumps at step 14: the norm rule's high rank after the boost.
      auto g = gradients(r.bucket_size(b), me, t, 31 + static_cast<uint64_t>(b));
      for (float& v : g) v *= t < 14 ? 1.0f : 20.0f;
      r.reduce(b, g.data());
      outputs.insert(outputs.end(), g.begin(), g.end());
    }
  }
  return outputs;
}

Config policy_config() {
  Config c;
  c.start_iter = 1;
  c.adaptive = true;
  c.rank_low = 1;
  c.rank_high = 3;
  c.adaptive_interval = 2;
  c.warmup_steps = 3;
  c.lr_boost_steps = 2;
  return c;
}

// Rank 1, boosted to 3 for 2 steps by a learning-rate note; compressed from the start.
Config boost_config() {
  Config c;
  c.rank = 1;
  c.rank_high = 3;
  c.start_iter = 0;
  c.lr_boost_steps = 2;
  return c;
}

}  // namespace

TEST_CASE("policy: the rank decisions are identical on every rank, also after a checkpoint resume") {
  auto comm = connect("engine-policy-agree");
  const int me = comm->rank();
  const std::string file = side_file("policy-agree") + ".rank" + std::to_string(me);
  Reducer a(*comm, policy_config());
  a.add_bucket(kShapes);
  a.add_bucket({{24, 20}, {7}});
  policy_steps(a, me, 0, 11);
  a.save(file);  // mid-boost (the note before step 9 boosts steps 9 and 10... its count is in the file)
  const std::vector<RankDecision> first = a.decisions();
  const std::vector<float> rest = policy_steps(a, me, 11, 20);
  const std::vector<RankDecision> later = a.decisions();
  // Warm-up, the note, the rule's windows: every kind of decision happened, on every rank alike.
  std::vector<RankDecision> all = first;
  all.insert(all.end(), later.begin(), later.end());
  for (RankReason reason : {RankReason::Warmup, RankReason::LrNote, RankReason::NormChangeLow,
                            RankReason::NormChangeHigh}) {
    CAPTURE(rank_reason_name(reason));
    CHECK(std::any_of(all.begin(), all.end(), [&](const RankDecision& d) { return d.reason == reason; }));
  }
  CHECK(same_on_every_rank(*comm, log_floats(all)));

  Reducer b(*comm, policy_config());
  b.add_bucket(kShapes);
  b.add_bucket({{24, 20}, {7}});
  b.load(file);
  CHECK(policy_steps(b, me, 11, 20) == rest);  // bit for bit
  const std::vector<RankDecision> resumed = b.decisions();
  CHECK(log_floats(resumed) == log_floats(later));
  CHECK(same_on_every_rank(*comm, log_floats(resumed)));
  comm->barrier();
  std::remove(file.c_str());
}

// The note's application (a level switch: whole buckets copied) fails on rank 1 only, after the ranks agreed on the
// note. Before: rank 1 threw alone and its peers went into the reduction's first collective without it (a
// MismatchError with rank 1 a reduction behind for good, or a timeout), its first bucket left switched.
TEST_CASE("policy: a note whose application fails on one rank fails every rank at once, state and note kept") {
  auto comm = connect("engine-policy-note-fails");
  const int me = comm->rank();
  const Config c = boost_config();
  if (me == 1) engine::arm_fault({engine::FaultPoint::Note, 3});
  Reducer r(*comm, c);
  r.add_bucket(kShapes);
  r.add_bucket({{24, 20}, {7}});
  std::vector<size_t> n{r.bucket_size(0), r.bucket_size(1)};
  for (int t = 0; t < 3; ++t)
    for (int b = 0; b < 2; ++b) {
      auto g = gradients(n[static_cast<size_t>(b)], me, t, 5 + b);
      r.reduce(b, g.data());
    }
  r.note_lr_change();
  std::vector<std::vector<float>> error_before, error_after;
  for (int b = 0; b < 2; ++b) {
    error_before.emplace_back(n[static_cast<size_t>(b)]);
    r.error_feedback(b, error_before.back().data());
  }
  CHECK(r.decisions().size() >= 1);  // the first compressed step's; taken
  {
    std::vector<std::vector<float>> g{gradients(n[0], me, 3, 5), gradients(n[1], me, 3, 6)};
    const auto data = g;
    const std::vector<float*> pointers{g[0].data(), g[1].data()};
    const Outcome o = outcome_of([&] { r.reduce_all(pointers); });
    INFO(o.message);
    CHECK(o.code == static_cast<int>(ErrorCode::Io));
    CHECK(contains(o.message, "step 3: applying a learning-rate note (note_lr_change)"));
    CHECK(contains(o.message, "rank 1"));
    CHECK(contains(o.message, "injected fault"));
    CHECK(o.seconds < kFailTogetherSeconds);
    CHECK(g == data);
    CHECK(r.iteration() == 4);  // a failed step is taken, as every refused one
    for (int b = 0; b < 2; ++b) {
      CHECK(r.bucket_rank(b) == 1);
      error_after.assign(1, std::vector<float>(n[static_cast<size_t>(b)]));
      r.error_feedback(b, error_after[0].data());
      CHECK(error_after[0] == error_before[static_cast<size_t>(b)]);
    }
    CHECK(r.decisions().empty());  // none logged for the step that failed
  }
  // The note is still pending: step 4 applies it on every rank alike.
  std::vector<std::vector<float>> g{gradients(n[0], me, 4, 5), gradients(n[1], me, 4, 6)};
  const std::vector<float*> pointers{g[0].data(), g[1].data()};
  r.reduce_all(pointers);
  for (int b = 0; b < 2; ++b) CHECK(same_on_every_rank(*comm, g[static_cast<size_t>(b)]));
  const std::vector<RankDecision> log = r.decisions();
  REQUIRE(log.size() == 2);
  for (const RankDecision& d : log) {
    CHECK(d.step == 4);
    CHECK(d.reason == RankReason::LrNote);
  }
  // The ranks are in step: the communicator's own collective pairs.
  float x = 1.0f;
  comm->allreduce(&x, 1, DataType::Float32);
  CHECK(x == static_cast<float>(comm->size()));
}

// The switch back from a boost fails on rank 1 at step 4's commit (out of memory in its copies). Before: rank 1
// threw alone for a step the others completed, its bucket half switched (the error memory of one level read
// in another's layout). Now the step succeeds on every rank, rank 1's bucket stays whole at its rank, and the
// next reduction finds the states apart on every rank; a load repairs it.
TEST_CASE("policy: a rank switch that fails on one rank at the commit leaves its bucket whole, caught next step") {
  auto comm = connect("engine-policy-switch-fails");
  const int me = comm->rank();
  const std::string file = side_file("switch-fails") + ".rank" + std::to_string(me);
  if (me == 1) engine::arm_fault({engine::FaultPoint::Switch, 4});
  Reducer r(*comm, boost_config());
  r.add_bucket(kShapes);
  const size_t n = r.bucket_size(0);
  const auto step = [&](int64_t t) {
    auto g = gradients(n, me, t, 5);
    r.reduce(0, g.data());
    return g;
  };
  for (int64_t t = 0; t < 3; ++t) step(t);
  r.save(file);
  std::vector<float> after_load;
  {
    // What step 3 computes from the saved state, without the note: compared after the load below.
    after_load = step(3);
  }
  r.load(file);
  r.note_lr_change();
  step(3);  // the note: rank 3 for steps 3 and 4
  CHECK(r.bucket_rank(0) == 3);
  const std::vector<float> out4 = step(4);  // its commit switches back to rank 1: not on rank 1
  CHECK(same_on_every_rank(*comm, out4));
  CHECK(r.bucket_rank(0) == (me == 1 ? 3 : 1));
  // Rank 1 logged no decision for the switch it did not make; the others logged theirs.
  const std::vector<RankDecision> log = r.decisions();
  const auto at_5 = std::count_if(log.begin(), log.end(), [](const RankDecision& d) { return d.step == 5; });
  CHECK(at_5 == (me == 1 ? 0 : 1));
  auto g = gradients(n, me, 5, 5);
  const auto data = g;
  const Outcome o = outcome_of([&] { r.reduce(0, g.data()); });
  INFO(o.message);
  CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
  CHECK(contains(o.message, "step 5, bucket 0"));
  CHECK(contains(o.message, "rank 1 compresses at another rank than rank 0"));
  CHECK(o.seconds < kFailTogetherSeconds);
  CHECK(g == data);
  r.load(file);  // every rank, from one state: in step again
  CHECK(step(3) == after_load);
  comm->barrier();
  std::remove(file.c_str());
}

TEST_CASE("policy: a learning-rate note on one rank only is a MismatchError on every rank, state unchanged") {
  auto comm = connect("engine-policy-one-note");
  const int me = comm->rank();
  const Config c = boost_config();
  Reducer r(*comm, c);
  r.add_bucket(kShapes);
  const size_t n = r.bucket_size(0);
  for (int t = 0; t < 3; ++t) {
    auto g = gradients(n, me, t, 5);
    r.reduce(0, g.data());
  }
  if (me == 1) r.note_lr_change();
  std::vector<float> error_before(n), error_after(n);
  r.error_feedback(0, error_before.data());
  auto g = gradients(n, me, 3, 5);
  const auto data = g;
  const Outcome o = outcome_of([&] { r.reduce(0, g.data()); });
  INFO(o.message);
  CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
  CHECK(contains(o.message, "step 3, bucket 0"));
  CHECK(contains(o.message, "rank 1 noted a learning-rate change (note_lr_change) that rank 0 did not"));
  CHECK(o.seconds < kFailTogetherSeconds);
  CHECK(g == data);
  r.error_feedback(0, error_after.data());
  CHECK(error_after == error_before);
  CHECK(r.bucket_rank(0) == 1);
  CHECK(r.decisions().size() == 1);  // the first compressed step's only
  // The others note too: the (still pending) note is agreed and boosts every rank alike.
  if (me != 1) r.note_lr_change();
  for (int t = 4; t < 7; ++t) {
    CAPTURE(t);
    g = gradients(n, me, t, 5);
    CHECK(r.bucket_rank(0) == (t == 5 ? 3 : 1));  // the note applies within step 4's reduction
    r.reduce(0, g.data());
    CHECK(same_on_every_rank(*comm, g));
  }
  const std::vector<RankDecision> log = r.decisions();
  REQUIRE(log.size() == 2);
  CHECK(log[0].step == 4);
  CHECK(log[0].reason == RankReason::LrNote);
  CHECK(log[1].step == 6);
  CHECK(log[1].reason == RankReason::Fixed);
  CHECK(same_on_every_rank(*comm, log_floats(log)));
}
