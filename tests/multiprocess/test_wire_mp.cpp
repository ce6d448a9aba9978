// Factors in 16 bits on the wire (Config::wire_dtype) across real processes,
// under powersgd-run:
//   powersgd-run -n 3 --timeout 120 -- test_wire_mp -tc='wire:*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/fault_injection.hpp"
#include "engine/half.hpp"
#include "engine/plan.hpp"
#include "engine_reference.hpp"
#include "error_of.hpp"

using namespace powersgd;
using powersgd::test::error_of;
using powersgd::test::gradients;

namespace {

std::unique_ptr<Communicator> connect(const std::string& run_id) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  return Communicator::create(o);
}

// Whether every rank holds the same bits in `data`.
bool same_on_every_rank(Communicator& comm, const std::vector<float>& data) {
  const uint32_t mine = engine::crc32(data.data(), data.size() * sizeof(float));
  std::vector<uint32_t> all(static_cast<size_t>(comm.size()));
  comm.allgather(&mine, all.data(), sizeof(mine));
  return std::all_of(all.begin(), all.end(), [&](uint32_t c) { return c == all[0]; });
}

double relative(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    n += double(b[i]) * double(b[i]);
  }
  return std::sqrt(d / n);
}

// Two compressed matrices (one batched pair), a bias and a 1-D tensor that travel uncompressed.
const std::vector<Shape> kShapes{{48, 40}, {40}, {16, 3, 3, 3}, {16, 3, 3, 3}, {7}};

struct Variant {
  const char* name;
  bool alternating, whole_bucket, batch_same_shape, two_buckets;
};
const Variant kVariants[] = {{"default", false, false, false, false},
                             {"alternating", true, false, false, false},
                             {"whole bucket", false, true, false, false},
                             {"batched", false, false, true, false},
                             {"reduce_all of two buckets", false, false, false, true}};

// A variant's configuration: rank 2, one plain step (float32 on the wire), then compressed.
Config variant_config(const Variant& v, WireDType wire) {
  Config config;
  config.rank = 2;
  config.start_iter = 1;
  config.alternating = v.alternating;
  config.whole_bucket = v.whole_bucket;
  config.batch_same_shape = v.batch_same_shape;
  config.wire_dtype = wire;
  return config;
}

}  // namespace

TEST_CASE("wire: 16-bit factors give bitwise-identical outputs on every rank, near float32's, error memory exact") {
  auto comm = connect("wire-identical");
  const int me = comm->rank();
  for (WireDType type : {WireDType::BFloat16, WireDType::Float16})
    for (const Variant& v : kVariants) {
      INFO(to_string(type), ", ", v.name);
      const Config config = variant_config(v, type), f32 = variant_config(v, WireDType::Float32);
      Reducer wire(*comm, config), ref(*comm, f32);
      const int buckets = v.two_buckets ? 2 : 1;
      for (int b = 0; b < buckets; ++b) {
        wire.add_bucket(kShapes);
        ref.add_bucket(kShapes);
      }
      const size_t n = wire.bucket_size(0);
      for (int64_t step = 0; step < 6; ++step) {
        std::vector<std::vector<float>> out_w(buckets), out_f(buckets), error_before(buckets);
        for (int b = 0; b < buckets; ++b) {
          out_w[b] = gradients(n, me, step, static_cast<uint64_t>(b));
          out_f[b] = out_w[b];
          error_before[b].resize(n);
          wire.error_feedback(b, error_before[b]);
        }
        if (v.two_buckets) {
          std::vector<std::span<float>> wd{out_w[0], out_w[1]}, fd{out_f[0], out_f[1]};
          wire.reduce_all(wd);
          ref.reduce_all(fd);
        } else {
          wire.reduce(0, out_w[0]);
          ref.reduce(0, out_f[0]);
        }
        for (int b = 0; b < buckets; ++b) {
          CAPTURE(step);
          CAPTURE(b);
          CHECK(same_on_every_rank(*comm, out_w[b]));
          // Compressed steps: the error memory is M minus what this rank wrote: local gradient + old error = output + new error.
          std::vector<float> error(n);
          wire.error_feedback(b, error);
          const auto g = gradients(n, me, step, static_cast<uint64_t>(b));
          double worst = 0;
          for (size_t i = 0; i < n; ++i)
            worst = std::max(worst, std::abs((double(g[i]) + error_before[b][i]) - (double(out_w[b][i]) + error[i])) /
                                        (1.0 + std::abs(double(g[i]) + error_before[b][i])));
          if (step >= 1) CHECK(worst < 1e-6);
          // Step 1 starts from the same state on both reducers (the plain step leaves no error): the outputs
          // differ by the factors' rounding only. A unit roundoff of 2^-8 (bf16) or 2^-11 (fp16), a few
          // roundings deep, amplified by the orthogonalization: a loose multiple.
          if (step == 1) {
            const double rel = relative(out_w[b], out_f[b]);
            MESSAGE(std::string(to_string(type)), " ", std::string(v.name), ": output relative to float32 output ", rel);
            CHECK(rel < (type == WireDType::BFloat16 ? 0.05 : 0.01));
            CHECK(rel > 0);  // the factors really were rounded
          }
          if (step == 0) CHECK(out_w[b] == out_f[b]);  // plain steps stay float32
        }
        // Bytes: the factors cost 2 bytes each instead of 4; everything else the same.
        if (step >= 1) {
          const engine::BucketPlan plan = engine::make_plan(kShapes, config);
          const int64_t factors = v.alternating ? (wire.iteration() % 2 == 1 ? plan.q_numel : plan.p_numel)
                                                : plan.p_numel + plan.q_numel;
          CHECK(ref.stats().last_step_bytes - wire.stats().last_step_bytes ==
                static_cast<uint64_t>(2 * factors * buckets));
        }
      }
    }
}

TEST_CASE("wire: ranks with different wire types fail add_bucket on every rank, naming wire_dtype") {
  auto comm = connect("wire-mismatch");
  Config config;
  if (comm->rank() == 1) config.wire_dtype = WireDType::BFloat16;
  Reducer reducer(*comm, config);
  const std::string error = error_of([&] { reducer.add_bucket({{32, 32}}); });
  INFO(error);
  CHECK(error.find("wire_dtype") != std::string::npos);
}

// A step that fails on one rank (its prepare, its work between P and Q, NaN in its gradients) or on every rank
// (an fp16 factor past 65504) while the announce carries the bucket's float32 part (packed tensors and flag)
// and its 16-bit factor (OrderGuard::carried_counts): every rank fails that step, naming the cause, with its
// error memory, warm start and data unchanged, and goes on as a run that skipped the step. A clean step costs
// 2 rounds (the announce with the float32 part and the factor, then Q; 1 for alternating), so the carry ran.
TEST_CASE("wire: a step that fails while the announce carries the float32 part and the factor fails every rank") {
  enum Failure { Prepare, Between, NaN, Overflow };
  constexpr int64_t kFailStep = 3;
  auto comm = connect("wire-carried-failure");
  const int me = comm->rank();
  for (const WireDType type : {WireDType::BFloat16, WireDType::Float16})
    for (const bool alternating : {false, true})
      for (const Failure failure : {Prepare, Between, NaN, Overflow}) {
        if (failure == Overflow && type != WireDType::Float16) continue;  // bf16 has float32's range
        if (failure == Between && alternating) continue;                  // one collective: nothing between
        INFO(std::string(to_string(type)), alternating ? " alternating" : "", " failure ", static_cast<int>(failure));
        Config c;
        c.rank = 2;
        c.start_iter = 0;  // compressed from the first step: the carried branch every step
        c.alternating = alternating;
        c.wire_dtype = type;
        if (me == 1 && (failure == Prepare || failure == Between))
          engine::arm_fault({failure == Prepare ? engine::FaultPoint::Prepare : engine::FaultPoint::Between, kFailStep});
        Reducer r(*comm, c), clean(*comm, c);  // r takes the armed fault
        r.add_bucket(kShapes);
        clean.add_bucket(kShapes);
        const size_t n = r.bucket_size(0);
        for (int64_t step = 0; step < 7; ++step) {
          CAPTURE(step);
          auto g = gradients(n, me, step, 21);
          if (step == kFailStep) {
            if (failure == NaN && me == comm->size() - 1) g[5] = std::nanf("");
            // Finite in float32; P of the 48 x 40 matrix (offset 0) lies far past fp16's 65504.
            if (failure == Overflow)
              for (size_t i = 0; i < 48 * 40; ++i) g[i] *= 1e6f;
            std::vector<float> before(n), after(n);
            r.error_feedback(0, before);
            const auto data = g;
            const std::string error = error_of([&] { r.reduce(0, g.data()); });
            INFO(error);
            if (failure == Prepare || failure == Between) {
              CHECK(error.find("injected fault") != std::string::npos);
              if (me != 1)
                CHECK(error.find("step 3, bucket 0 failed on rank 1: injected") != std::string::npos);
            }
            if (failure == NaN) CHECK(error.find("NaN or Inf in the gradients of 1 rank(s)") != std::string::npos);
            if (failure == Overflow) CHECK(error.find("wire_dtype fp16 carries at most +-65504") != std::string::npos);
            r.error_feedback(0, after);
            CHECK(after == before);
            CHECK(std::memcmp(g.data(), data.data(), n * sizeof(float)) == 0);  // NaN included
            continue;
          }
          auto h = g;
          const uint64_t rounds = comm->communication_rounds();
          r.reduce(0, g.data());
          // The announce carries the float32 part and the factors, then Q (alternating: no Q collective).
          CHECK(comm->communication_rounds() - rounds == (alternating ? 1u : 2u));
          clean.reduce(0, h.data());
          CHECK(g == h);
          CHECK(same_on_every_rank(*comm, g));
        }
        CHECK(r.iteration() == 7);
      }
}

// The announce carries a 16-bit wire's float32 parts and factors (2 rounds where the float32 wire pays 2): in
// every variant, alternating's halves included, the outputs and error memory are the bits of a Reducer whose
// announces carry nothing (PSGD_CARRY_FIRST=0 on every rank), which pays the collectives it replaces.
TEST_CASE("wire: every variant's carried factors have the bits of the collectives they replace") {
  auto comm = connect("wire-carried-bits");
  const int me = comm->rank();
  if (comm->size() < 2) return;
  for (WireDType type : {WireDType::BFloat16, WireDType::Float16})
    for (const Variant& v : kVariants) {
      INFO(to_string(type), ", ", v.name);
      const Config config = variant_config(v, type);
      Reducer carried(*comm, config);
      setenv("PSGD_CARRY_FIRST", "0", 1);
      Reducer plain(*comm, config);
      unsetenv("PSGD_CARRY_FIRST");  // read when a Reducer is made
      const int buckets = v.two_buckets ? 2 : 1;
      for (int b = 0; b < buckets; ++b) {
        carried.add_bucket(kShapes);
        plain.add_bucket(kShapes);
      }
      const size_t n = carried.bucket_size(0);
      uint64_t carried_rounds = 0, plain_rounds = 0;
      for (int64_t step = 0; step < 6; ++step) {
        CAPTURE(step);
        std::vector<std::vector<float>> g(static_cast<size_t>(buckets)), h(static_cast<size_t>(buckets));
        for (size_t b = 0; b < g.size(); ++b) h[b] = g[b] = gradients(n, me, step, b);
        const auto reduce = [&](Reducer& reducer, std::vector<std::vector<float>>& data) {
          const uint64_t before = comm->communication_rounds();
          if (v.two_buckets) {
            std::vector<std::span<float>> spans{data[0], data[1]};
            reducer.reduce_all(spans);
          } else {
            reducer.reduce(0, data[0]);
          }
          return comm->communication_rounds() - before;
        };
        const uint64_t a = reduce(carried, g), b = reduce(plain, h);
        if (step >= 1) {  // compressed: 2 rounds carried (1 alternating), more where nothing is carried
          CHECK(a == (v.alternating ? 1u : 2u));
          CHECK(b > a);
        }
        carried_rounds += a;
        plain_rounds += b;
        for (size_t k = 0; k < g.size(); ++k) {
          CHECK(std::memcmp(g[k].data(), h[k].data(), n * sizeof(float)) == 0);
          CHECK(same_on_every_rank(*comm, g[k]));
        }
      }
      for (int b = 0; b < buckets; ++b) {
        std::vector<float> e(n), f(n);
        carried.error_feedback(b, e);
        plain.error_feedback(b, f);
        CHECK(std::memcmp(e.data(), f.data(), n * sizeof(float)) == 0);
      }
      CHECK(carried.stats().bytes_sent == plain.stats().bytes_sent);
      MESSAGE(std::string(to_string(type)), " ", std::string(v.name), ": ", carried_rounds, " rounds carried, ",
              plain_rounds, " not");
    }
}

// Where the factors do not fit beside the announce and the float32 parts (the lead exchange's capacity), the
// announce carries the float32 parts alone and the factors follow in their own collective: 3 rounds per
// compressed step, the bits and bytes of a Reducer whose announce carries nothing (4 rounds: the announce, the
// float32 parts, the factors, Q).
TEST_CASE("wire: factors beyond the lead exchange's capacity follow in their own collective, the same bits") {
  constexpr size_t kBound = 65536;
  setenv("PSGD_DIRECT_MAX_BYTES", std::to_string(kBound).c_str(), 1);
  auto comm = connect("wire-factors-beyond");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  const auto n = static_cast<size_t>(comm->size());
  if (n < 2) return;
  // P at rank 2 of 300 bytes less than a direct message to each peer (bound / (n - 1)), so its own collective
  // is direct (one round), and more than the lead exchange's capacity (bound / (n - 1) rounded down to 64, less
  // 8) leaves beside the announce (576 bytes) and the float32 parts.
  const auto rows = static_cast<int64_t>((kBound / (n - 1) - 300) / sizeof(uint16_t) / 2);
  const std::vector<Shape> shapes{{rows, 8}, {10}};
  Config c;
  c.rank = 2;
  c.start_iter = 1;
  c.wire_dtype = WireDType::BFloat16;
  Reducer carried(*comm, c);
  setenv("PSGD_CARRY_FIRST", "0", 1);
  Reducer plain(*comm, c);
  unsetenv("PSGD_CARRY_FIRST");  // read when a Reducer is made
  carried.add_bucket(shapes);
  plain.add_bucket(shapes);
  for (int step = 0; step < 4; ++step) {
    INFO("step ", step);
    auto g = gradients(carried.bucket_size(0), comm->rank(), step);
    auto h = g;
    uint64_t before = comm->communication_rounds();
    carried.reduce(0, g.data());
    const uint64_t carried_rounds = comm->communication_rounds() - before;
    before = comm->communication_rounds();
    plain.reduce(0, h.data());
    const uint64_t plain_rounds = comm->communication_rounds() - before;
    if (step > 0) {  // step 0 is a plain allreduce of the whole bucket
      CHECK(carried_rounds == 3);
      CHECK(plain_rounds == 4);
    }
    CHECK(std::memcmp(g.data(), h.data(), g.size() * sizeof(float)) == 0);
    CHECK(same_on_every_rank(*comm, g));
  }
  CHECK(carried.stats().bytes_sent == plain.stats().bytes_sent);
}

// Not a check: how far the transport's 16-bit sum (rounded at every hop) lies
// from one rounding of the float32 sum of the same rounded inputs (what partial
// sums in float32 would give), against the exact float32 sum. Figures for
// docs/engine.md; run with -tc='measure*'.
TEST_CASE("measure: per-hop rounding against one rounding" * doctest::skip()) {
  auto comm = connect("wire-measure");
  const int me = comm->rank();
  const size_t n = 1 << 16;
  for (WireDType type : {WireDType::BFloat16, WireDType::Float16}) {
    const auto mine = gradients(n, me, 0, 7);
    std::vector<float> exact = mine;
    comm->allreduce(exact.data(), n, DataType::Float32);
    std::vector<uint16_t> wire(n);
    engine::encode(type, mine.data(), wire.data(), n);
    std::vector<float> rounded(n);
    engine::decode(type, wire.data(), rounded.data(), n);
    comm->allreduce(wire.data(), n, type == WireDType::BFloat16 ? DataType::BFloat16 : DataType::Float16);
    std::vector<float> hops(n);
    engine::decode(type, wire.data(), hops.data(), n);
    comm->allreduce(rounded.data(), n, DataType::Float32);  // partial sums in float32
    std::vector<uint16_t> once(n);
    engine::encode(type, rounded.data(), once.data(), n);
    engine::decode(type, once.data(), rounded.data(), n);
    if (me == 0)
      std::printf("%d ranks, %s: relative error vs float32 sum: per-hop %.3e, one rounding %.3e\n", comm->size(),
                  to_string(type), relative(hops, exact), relative(rounded, exact));
  }
}

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) {
    std::fprintf(stderr, "test_wire_mp: run under powersgd-run (no WORLD_SIZE); skipped\n");
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}
