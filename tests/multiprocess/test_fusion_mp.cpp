// Fusing queued reductions (docs/engine.md, "Fusing queued reductions"), across
// real processes: reductions queued behind the running one are announced with
// it and run as one reduction (one announce, one P and one Q collective) where
// every rank has them queued alike, with the bits of one by one; every
// guarantee of one by one holds (the order guard, non-finite gradients of one
// bucket, the divergence detector, a rank that does not fuse). Every rank runs
// this binary with one test case selected, under powersgd-run:
//   powersgd-run -n 3 --timeout 300 -- test_fusion_mp -tc='fusing: queued*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "engine/fault_injection.hpp"
#include "engine_reference.hpp"
#include "error_of.hpp"
#include "staged_check.hpp"

using namespace powersgd;
using powersgd::test::gradients;

namespace {

std::unique_ptr<Communicator> connect(const char* run_id, int timeout_ms = 0) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  if (timeout_ms > 0) o.timeout = std::chrono::milliseconds(timeout_ms);
  return Communicator::create(o);
}

// Three buckets whose slots follow each other: fusable with the default configuration.
const std::vector<std::vector<Shape>> kBuckets = {{{32, 24}, {32}, {16, 8, 3, 3}, {5, 6}}, {{64, 64}},
                                                  {{48, 32}, {7}}};

// A reducer whose worker holds each step's first reduction until the
// step's other buckets are queued (engine::FaultPoint::Hold), so that fusing
// them does not depend on timing.
// `prepares`: the held reduction's lookahead prepares the others first (engine::Fault::hold_prepares).
std::unique_ptr<Reducer> held_reducer(Communicator& comm, const Config& config, bool prepares = true) {
  engine::Fault hold{engine::FaultPoint::Hold, -1};
  hold.hold_prepares = prepares;
  engine::arm_fault(hold);
  auto reducer = std::make_unique<Reducer>(comm, config);
  for (const auto& shapes : kBuckets) reducer->add_bucket(shapes);
  return reducer;
}

std::unique_ptr<Reducer> plain_reducer(Communicator& comm, const Config& config) {
  auto reducer = std::make_unique<Reducer>(comm, config);
  for (const auto& shapes : kBuckets) reducer->add_bucket(shapes);
  return reducer;
}

std::vector<std::vector<float>> step_gradients(const Reducer& r, int rank, int64_t step) {
  std::vector<std::vector<float>> g;
  for (int b = 0; b < r.num_buckets(); ++b) g.push_back(gradients(r.bucket_size(b), rank, step, 17));
  return g;
}

// Each bucket's outcome: 0 reduced, else the error's code.
struct StepResult {
  std::vector<int> codes;
  uint64_t rounds = 0;
};

int code_of(const std::exception_ptr& e) {
  if (!e) return 0;
  try {
    std::rethrow_exception(e);
  } catch (const Error& error) {
    return static_cast<int>(error.code());
  }
}

// All buckets submitted with reduce_async in `order`, then waited for.
StepResult reduce_queued(Communicator& comm, Reducer& r, std::vector<std::vector<float>>& g,
                         const std::vector<int>& order) {
  StepResult result;
  result.codes.assign(g.size(), 0);
  const uint64_t before = comm.communication_rounds();
  std::vector<ReduceHandle> handles;
  for (int b : order) handles.push_back(r.reduce_async(b, g[static_cast<size_t>(b)].data()));
  for (size_t k = 0; k < order.size(); ++k) {
    try {
      handles[k].wait();
    } catch (...) {
      result.codes[static_cast<size_t>(order[k])] = code_of(std::current_exception());
    }
  }
  result.rounds = comm.communication_rounds() - before;
  return result;
}

// Each bucket with reduce(), one by one: no reduction is ever queued behind another.
StepResult reduce_one_by_one(Communicator& comm, Reducer& r, std::vector<std::vector<float>>& g) {
  StepResult result;
  const uint64_t before = comm.communication_rounds();
  for (size_t b = 0; b < g.size(); ++b) {
    try {
      r.reduce(static_cast<int>(b), g[b].data());
      result.codes.push_back(0);
    } catch (...) {
      result.codes.push_back(code_of(std::current_exception()));
    }
  }
  result.rounds = comm.communication_rounds() - before;
  return result;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("fusing: queued reductions run as one, with the bits of one by one") {
  auto comm = connect("fusion-bits");
  struct Variant {
    const char* name;
    Config config;
    uint64_t fused_rounds;  // per compressed step, all three fused, proposals prepared; 0: not checked
    uint64_t alone_rounds;  // per compressed step, one by one
    uint64_t unprepared_rounds = 0;  // fused, proposals not prepared when claimed; 0: not checked
  };
  std::vector<Variant> variants;
  Config c;
  c.rank = 2;
  c.start_iter = 1;
  // Fused: the announce carries the fused P of the reduction and its prepared proposals (OrderGuard::carry),
  // then Q; proposals not prepared yet: the announce at once, then P and Q; one by one: each announce carries
  // its P, then Q. The bits are the same every way.
  variants.push_back({"default", c, 2, 6, 3});
  Config bf16 = c;
  bf16.wire_dtype = WireDType::BFloat16;
  // Fused: the announce carries the buckets' float32 parts (gathered) and their 16-bit P, then Q; proposals
  // not prepared yet: the announce at once, then the float32 parts, P and Q; one by one: the announce carries
  // the bucket's float32 part and its 16-bit P, then Q.
  variants.push_back({"bf16", bf16, 2, 6, 4});
  Config rank1 = c;
  rank1.rank = 1;
  rank1.error_feedback = false;
  variants.push_back({"rank 1, no error feedback", rank1, 2, 6, 3});
  Config alternating = c;
  alternating.alternating = true;  // slots sized for P or Q: fused only where they follow each other
  variants.push_back({"alternating", alternating, 0, 3});
  for (const bool prepares : {true, false})
  for (const auto& v : variants) {
    INFO("variant ", std::string(v.name), ", proposals prepared: ", prepares);
    auto fused = held_reducer(*comm, v.config, prepares);
    auto alone = plain_reducer(*comm, v.config);
    for (int64_t step = 0; step < 6; ++step) {
      INFO("step ", step);
      auto g = step_gradients(*fused, comm->rank(), step);
      auto h = g;
      // Odd steps as DDP orders them, the last bucket first: fused in the arenas' order all the same.
      const StepResult a = reduce_queued(*comm, *fused, g, step % 2 ? std::vector<int>{2, 1, 0} : std::vector<int>{0, 1, 2});
      const StepResult b = reduce_one_by_one(*comm, *alone, h);
      CHECK(a.codes == std::vector<int>{0, 0, 0});
      CHECK(b.codes == std::vector<int>{0, 0, 0});
      for (size_t k = 0; k < g.size(); ++k) CHECK_MESSAGE(same_bits(g[k], h[k]), "bucket ", k);
      if (step == 0) {
        CHECK(a.rounds == 6);  // plain steps are not fused: announce and the bucket, each
      } else {
        CHECK(b.rounds == v.alone_rounds);
        const uint64_t expected = prepares ? v.fused_rounds : v.unprepared_rounds;
        if (expected != 0) CHECK(a.rounds == expected);
        CHECK(a.rounds <= v.alone_rounds);
      }
    }
    CHECK(fused->stats().bytes_sent == alone->stats().bytes_sent);
  }
}

namespace {

// Step 0 on a held reducer, rank 1 submitting its buckets in `rank1_order` and the others in 0, 1, 2: checks
// each bucket's outcome against `codes` (0: reduced) and the one bucket `reduced` against one by one.
std::unique_ptr<Reducer> reduce_reordered(Communicator& comm, const std::vector<int>& rank1_order,
                                          const std::vector<int>& codes, int reduced,
                                          WireDType wire = WireDType::Float32) {
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  c.wire_dtype = wire;
  auto r = held_reducer(comm, c);
  auto alone = plain_reducer(comm, c);
  auto g = step_gradients(*r, comm.rank(), 0);
  auto h = g;
  const StepResult result = reduce_queued(comm, *r, g, comm.rank() == 1 ? rank1_order : std::vector<int>{0, 1, 2});
  CHECK(result.codes == codes);
  alone->reduce(reduced, h[static_cast<size_t>(reduced)].data());
  CHECK(same_bits(g[static_cast<size_t>(reduced)], h[static_cast<size_t>(reduced)]));
  return r;
}

}  // namespace

TEST_CASE("fusing: buckets swapped by one rank are not fused; each fails with MismatchError on every rank") {
  auto comm = connect("fusion-swap");
  const int mismatch = static_cast<int>(ErrorCode::Mismatch);
  // Bucket 0 runs alone (rank 1 proposes nothing: buckets 0 and 2 do not follow each other).
  auto r = reduce_reordered(*comm, {0, 2, 1}, {0, mismatch, mismatch}, 0);
  // Nothing changed: the next step, in one order, is fused and succeeds.
  auto g = step_gradients(*r, comm->rank(), 1);
  const StepResult next = reduce_queued(*comm, *r, g, {0, 1, 2});
  CHECK(next.codes == std::vector<int>{0, 0, 0});
  CHECK(next.rounds == 2);
}

TEST_CASE("fusing: a carry summed for reductions not agreed is prepared again") {
  // Rank 1 runs bucket 1 first and proposes 0 and 2, the others run 0 and propose 1 and 2: every rank carries
  // the fused first collective of buckets 0, 1 and 2 (one size, summed by the exchange), and the announce
  // disagrees. The first two reductions fail with MismatchError on every rank; bucket 2, whose carried range
  // held the sums, is prepared again and reduced with the bits of one by one. With a bf16 wire the carried
  // float32 parts are a gathered copy, the ranges untouched (StepRunner::carries_in_place): the same outcome.
  auto comm = connect("fusion-carry-discarded");
  const int mismatch = static_cast<int>(ErrorCode::Mismatch);
  for (const WireDType wire : {WireDType::Float32, WireDType::BFloat16}) {
    INFO(std::string(to_string(wire)));
    reduce_reordered(*comm, {1, 0, 2}, {mismatch, mismatch, 0}, 2, wire);
  }
}

TEST_CASE("fusing: a refused call queued behind a reduction is left alone by the lookahead") {
  // Bucket 0's reduction is held until one more is queued: a reduce_async of a bucket that does not exist,
  // refused and queued poisoned. The lookahead, which prepares every queued reduction, skips it (its bucket
  // index is out of range: reading its state crashed the process); every rank then fails the call with
  // InvalidArgumentError, and buckets 0 and 1 have the bits of one by one.
  auto comm = connect("fusion-refused-queued");
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  engine::arm_fault({engine::FaultPoint::Hold, -1});
  Reducer r(*comm, c);
  Reducer alone(*comm, c);
  for (size_t b = 0; b < 2; ++b) {
    r.add_bucket(kBuckets[b]);
    alone.add_bucket(kBuckets[b]);
  }
  auto g = step_gradients(r, comm->rank(), 0);
  auto h = g;
  ReduceHandle first = r.reduce_async(0, g[0].data());
  CHECK(test::outcome_of([&] { r.reduce_async(std::numeric_limits<int>::max(), g[1].data()); }).code ==
        static_cast<int>(ErrorCode::InvalidArgument));
  CHECK_NOTHROW(first.wait());
  CHECK_NOTHROW(r.reduce_async(1, g[1].data()).wait());
  CHECK(reduce_one_by_one(*comm, alone, h).codes == std::vector<int>{0, 0});
  CHECK(same_bits(g[0], h[0]));
  CHECK(same_bits(g[1], h[1]));
}

TEST_CASE("fusing: non-finite gradients of one bucket on one rank fail that bucket only, as one by one") {
  auto comm = connect("fusion-nonfinite");
  Config c;
  c.rank = 2;
  c.start_iter = 1;
  auto fused = held_reducer(*comm, c);
  auto alone = plain_reducer(*comm, c);
  for (int64_t step = 0; step < 5; ++step) {
    INFO("step ", step);
    auto g = step_gradients(*fused, comm->rank(), step);
    if (step == 2 && comm->rank() == 1) g[1][5] = std::numeric_limits<float>::quiet_NaN();
    auto h = g;
    const StepResult a = reduce_queued(*comm, *fused, g, {0, 1, 2});
    const StepResult b = reduce_one_by_one(*comm, *alone, h);
    const int nonfinite = static_cast<int>(ErrorCode::NonFinite);
    CHECK(a.codes == (step == 2 ? std::vector<int>{0, nonfinite, 0} : std::vector<int>{0, 0, 0}));
    CHECK(b.codes == a.codes);
    for (size_t k = 0; k < g.size(); ++k) CHECK_MESSAGE(same_bits(g[k], h[k]), "bucket ", k);
  }
  std::vector<float> e(fused->bucket_size(1)), f(alone->bucket_size(1));
  fused->error_feedback(1, e.data());
  alone->error_feedback(1, f.data());
  CHECK(same_bits(e, f));
}

TEST_CASE("fusing: a fused reduction rerun one by one leaves the next step's queued reductions as one by one") {
  // Steps 2 and 4 are fused and fail on a NaN in one bucket, so their buckets
  // rerun one by one; the next step is queued behind in another order (bucket 2 first): the
  // reruns' lookahead must not prepare step 3's bucket 2 before step 2's rerun
  // of bucket 2 (its state is not final, and that rerun fills its slots).
  auto comm = connect("fusion-rerun-queued");
  Config c;
  c.rank = 2;
  c.start_iter = 1;
  auto fused = held_reducer(*comm, c);
  auto alone = plain_reducer(*comm, c);
  const int nonfinite = static_cast<int>(ErrorCode::NonFinite);
  for (int64_t step = 0; step < 8; step += 2) {
    INFO("steps ", step, " and ", step + 1);
    auto g = step_gradients(*fused, comm->rank(), step);
    auto g1 = step_gradients(*fused, comm->rank(), step + 1);
    // Step 2: a NaN in bucket 0 (reruns follow with buckets 1 and 2); step 4: in bucket 2.
    const int nan_bucket = step == 2 ? 0 : step == 4 ? 2 : -1;
    if (nan_bucket >= 0 && comm->rank() == 1) g[static_cast<size_t>(nan_bucket)][5] = std::numeric_limits<float>::quiet_NaN();
    auto h = g;
    auto h1 = g1;
    std::vector<ReduceHandle> handles;
    for (int b : {0, 1, 2}) handles.push_back(fused->reduce_async(b, g[static_cast<size_t>(b)].data()));
    for (int b : {2, 1, 0}) handles.push_back(fused->reduce_async(b, g1[static_cast<size_t>(b)].data()));
    std::vector<int> codes;
    for (auto& handle : handles) {
      try {
        handle.wait();
        codes.push_back(0);
      } catch (...) {
        codes.push_back(code_of(std::current_exception()));
      }
    }
    std::vector<int> expected(6, 0);
    if (nan_bucket >= 0) expected[static_cast<size_t>(nan_bucket)] = nonfinite;
    CHECK(codes == expected);
    const StepResult b = reduce_one_by_one(*comm, *alone, h);
    const StepResult b1 = reduce_one_by_one(*comm, *alone, h1);
    CHECK(b.codes == std::vector<int>{codes[0], codes[1], codes[2]});
    CHECK(b1.codes == std::vector<int>{0, 0, 0});
    for (size_t k = 0; k < g.size(); ++k) {
      CHECK_MESSAGE(same_bits(g[k], h[k]), "bucket ", k);
      CHECK_MESSAGE(same_bits(g1[k], h1[k]), "next step, bucket ", k);
    }
  }
  for (int b = 0; b < fused->num_buckets(); ++b) {
    std::vector<float> e(fused->bucket_size(b)), f(alone->bucket_size(b));
    fused->error_feedback(b, e.data());
    alone->error_feedback(b, f.data());
    CHECK_MESSAGE(same_bits(e, f), "bucket ", b);
  }
}

TEST_CASE("fusing: rank policies, wire types and calls between queued reductions keep the bits of one by one") {
  // Fused or not, every variant's outputs, error memory and bytes are those of a
  // reducer reducing one by one: adaptive rank, warm-up and learning-rate boost
  // (levels change between steps, so the slots may or may not follow each other),
  // fp16 wire, whole bucket, batched, no warm start; a note, reduce_all, and two
  // steps queued at once (fused across neither) between them.
  auto comm = connect("fusion-variants");
  std::vector<std::pair<const char*, Config>> variants;
  Config c;
  c.rank = 2;
  c.start_iter = 2;
  Config adaptive = c;
  adaptive.adaptive = true;
  adaptive.rank_low = 1;
  adaptive.rank_high = 3;
  adaptive.adaptive_interval = 2;
  adaptive.adaptive_threshold = 0.01;
  variants.emplace_back("adaptive", adaptive);
  Config policy = c;
  policy.rank = 1;
  policy.rank_high = 3;
  policy.warmup_steps = 2;
  policy.lr_boost_steps = 2;
  variants.emplace_back("warm-up and boost", policy);
  Config fp16 = c;
  fp16.wire_dtype = WireDType::Float16;
  variants.emplace_back("fp16", fp16);
  Config whole = c;
  whole.whole_bucket = true;
  variants.emplace_back("whole bucket", whole);
  Config batched = c;
  batched.batch_same_shape = true;
  batched.warm_start = false;
  variants.emplace_back("batched, no warm start", batched);
  Config alternating = adaptive;
  alternating.alternating = true;
  variants.emplace_back("alternating adaptive", alternating);
  for (const auto& [name, config] : variants) {
    INFO("variant ", name);
    auto fused = held_reducer(*comm, config);
    auto alone = plain_reducer(*comm, config);
    for (int64_t step = 0; step < 12; ++step) {
      INFO("step ", step);
      if (step == 4) {
        fused->note_lr_change();
        alone->note_lr_change();
      }
      auto g = step_gradients(*fused, comm->rank(), step);
      auto h = g;
      if (step == 6) {
        std::vector<float*> gp, hp;
        for (size_t k = 0; k < g.size(); ++k) {
          gp.push_back(g[k].data());
          hp.push_back(h[k].data());
        }
        fused->reduce_all(gp);
        alone->reduce_all(hp);
      } else if (step == 8) {
        // Steps 8 and 9 queued together: each step's buckets fused, never across steps.
        auto g1 = step_gradients(*fused, comm->rank(), step + 1);
        auto h1 = g1;
        std::vector<ReduceHandle> handles;
        for (int b : {2, 1, 0}) handles.push_back(fused->reduce_async(b, g[static_cast<size_t>(b)].data()));
        for (int b : {0, 1, 2}) handles.push_back(fused->reduce_async(b, g1[static_cast<size_t>(b)].data()));
        for (auto& handle : handles) CHECK_NOTHROW(handle.wait());
        CHECK(reduce_one_by_one(*comm, *alone, h).codes == std::vector<int>{0, 0, 0});
        CHECK(reduce_one_by_one(*comm, *alone, h1).codes == std::vector<int>{0, 0, 0});
        for (size_t k = 0; k < g1.size(); ++k) CHECK_MESSAGE(same_bits(g1[k], h1[k]), "step 9, bucket ", k);
        ++step;
      } else {
        const StepResult a = reduce_queued(*comm, *fused, g, step % 2 ? std::vector<int>{2, 1, 0} : std::vector<int>{0, 1, 2});
        const StepResult b = reduce_one_by_one(*comm, *alone, h);
        CHECK(a.codes == std::vector<int>{0, 0, 0});
        CHECK(b.codes == std::vector<int>{0, 0, 0});
      }
      for (size_t k = 0; k < g.size(); ++k) CHECK_MESSAGE(same_bits(g[k], h[k]), "bucket ", k);
    }
    for (int b = 0; b < fused->num_buckets(); ++b) {
      std::vector<float> e(fused->bucket_size(b)), f(alone->bucket_size(b));
      fused->error_feedback(b, e.data());
      alone->error_feedback(b, f.data());
      CHECK_MESSAGE(same_bits(e, f), "error memory of bucket ", b);
    }
    CHECK(fused->stats().bytes_sent == alone->stats().bytes_sent);
    CHECK(fused->stats().current_rank == alone->stats().current_rank);
  }
}

TEST_CASE("fusing: two reducers on one communicator fuse only turns that follow each other") {
  // Interleaved submissions (A's turns with B's between) are not fused; one
  // reducer's buckets submitted together are; every output is that of one by one.
  auto comm = connect("fusion-two-reducers");
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  auto a = held_reducer(*comm, c);
  auto b = held_reducer(*comm, c);
  auto a_alone = plain_reducer(*comm, c);
  auto b_alone = plain_reducer(*comm, c);
  for (int64_t step = 0; step < 4; ++step) {
    INFO("step ", step);
    auto ga = step_gradients(*a, comm->rank(), step);
    auto gb = step_gradients(*b, comm->rank(), step + 100);
    auto ha = ga;
    auto hb = gb;
    const uint64_t before = comm->communication_rounds();
    std::vector<ReduceHandle> handles;
    if (step % 2 == 0) {
      for (int k = 0; k < 3; ++k) {
        handles.push_back(a->reduce_async(k, ga[static_cast<size_t>(k)].data()));
        handles.push_back(b->reduce_async(k, gb[static_cast<size_t>(k)].data()));
      }
    } else {
      for (int k = 0; k < 3; ++k) handles.push_back(a->reduce_async(k, ga[static_cast<size_t>(k)].data()));
      for (int k = 0; k < 3; ++k) handles.push_back(b->reduce_async(k, gb[static_cast<size_t>(k)].data()));
    }
    for (auto& handle : handles) CHECK_NOTHROW(handle.wait());
    const uint64_t rounds = comm->communication_rounds() - before;
    CHECK(rounds == (step % 2 == 0 ? 12u : 4u));  // interleaved: 6 announces carrying P, and Q; else 2 fused
    CHECK(reduce_one_by_one(*comm, *a_alone, ha).codes == std::vector<int>{0, 0, 0});
    CHECK(reduce_one_by_one(*comm, *b_alone, hb).codes == std::vector<int>{0, 0, 0});
    for (size_t k = 0; k < ga.size(); ++k) {
      CHECK_MESSAGE(same_bits(ga[k], ha[k]), "A, bucket ", k);
      CHECK_MESSAGE(same_bits(gb[k], hb[k]), "B, bucket ", k);
    }
  }
}

TEST_CASE("fusing: a local failure on one rank fails each fused reduction with its own error, as one by one") {
  // Rank 1's prepare, or its work between P and Q, fails at step 3 (every
  // reduction of the step): each bucket's handle fails with the error naming
  // that bucket, on every rank, as one by one; no state changes.
  auto comm = connect("fusion-local-failure");
  for (const engine::FaultPoint point : {engine::FaultPoint::Prepare, engine::FaultPoint::Between}) {
    INFO("fault point ", static_cast<int>(point));
    Config c;
    c.rank = 2;
    c.start_iter = 0;
    engine::arm_fault(comm->rank() == 1 ? engine::Fault{point, 3, true} : engine::Fault{engine::FaultPoint::Hold, -1});
    Reducer r(*comm, c);
    for (const auto& shapes : kBuckets) r.add_bucket(shapes);
    for (int64_t step = 0; step < 5; ++step) {
      INFO("step ", step);
      auto g = step_gradients(r, comm->rank(), step);
      std::vector<std::vector<float>> before;
      for (int b = 0; b < r.num_buckets(); ++b) {
        before.emplace_back(r.bucket_size(b));
        r.error_feedback(b, before.back().data());
      }
      std::vector<ReduceHandle> handles;
      for (int b = 0; b < r.num_buckets(); ++b) handles.push_back(r.reduce_async(b, g[static_cast<size_t>(b)].data()));
      for (int b = 0; b < r.num_buckets(); ++b) {
        std::string message;
        try {
          handles[static_cast<size_t>(b)].wait();
        } catch (const Error& e) {
          message = e.what();
        }
        INFO(message);
        if (step != 3) {
          CHECK(message.empty());
          continue;
        }
        CHECK(message.find("injected fault") != std::string::npos);
        if (comm->rank() != 1)
          CHECK(message.find("step 3, bucket " + std::to_string(b) + " failed on rank 1") != std::string::npos);
        std::vector<float> after(r.bucket_size(b));
        r.error_feedback(b, after.data());
        CHECK(same_bits(after, before[static_cast<size_t>(b)]));
      }
    }
  }
}

TEST_CASE("fusing: a rank with fusing off makes every rank reduce one by one") {
  if (std::getenv("RANK") != nullptr && std::string(std::getenv("RANK")) == "0") setenv("PSGD_FUSE_REDUCTIONS", "0", 1);
  auto comm = connect("fusion-off");
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  auto fused = held_reducer(*comm, c);
  unsetenv("PSGD_FUSE_REDUCTIONS");
  auto alone = plain_reducer(*comm, c);
  for (int64_t step = 0; step < 3; ++step) {
    auto g = step_gradients(*fused, comm->rank(), step);
    auto h = g;
    const StepResult a = reduce_queued(*comm, *fused, g, {0, 1, 2});
    reduce_one_by_one(*comm, *alone, h);
    CHECK(a.codes == std::vector<int>{0, 0, 0});
    // Rank 1 proposes the queued reductions behind the first two and carries their P with the first's, rank 0
    // only the first's: the sizes differ, so every rank sends P on its own (3 rounds each); the last one's
    // announce carries P on every rank (2).
    CHECK(a.rounds == 8);
    for (size_t k = 0; k < g.size(); ++k) CHECK(same_bits(g[k], h[k]));
  }
}

TEST_CASE("fusing: a failed prepare of one bucket among carried proposals fails that bucket only") {
  // Rank 1's prepare of bucket 1 fails at step 2; the announce of bucket 0 carries the first collective of all
  // three, flagged. With every rank fusing, the fused reduction fails together and each reruns alone; with
  // rank 0 not fusing (it carries bucket 0's alone: not summed), rank 1 prepares buckets 0 and 2 again (their
  // flags were set in the carried range). Either way only bucket 1 fails, on every rank, its state unchanged,
  // and the others have the bits of one by one. With a bf16 wire the announce carries the float32 parts of
  // the three, gathered (the flags among them): the same outcome.
  auto comm = connect("fusion-carried-failure");
  for (const WireDType wire : {WireDType::Float32, WireDType::BFloat16})
  for (const bool rank0_fuses : {true, false}) {
    INFO("rank 0 fuses: ", rank0_fuses, ", ", std::string(to_string(wire)));
    if (!rank0_fuses && comm->rank() == 0) setenv("PSGD_FUSE_REDUCTIONS", "0", 1);
    Config c;
    c.rank = 2;
    c.start_iter = 0;
    c.wire_dtype = wire;
    engine::Fault fault{engine::FaultPoint::Prepare, 2, true};
    fault.bucket = 1;
    engine::arm_fault(comm->rank() == 1 ? fault : engine::Fault{engine::FaultPoint::Hold, -1});
    Reducer r(*comm, c);
    for (const auto& shapes : kBuckets) r.add_bucket(shapes);
    unsetenv("PSGD_FUSE_REDUCTIONS");
    auto alone = plain_reducer(*comm, c);
    for (int64_t step = 0; step < 4; ++step) {
      INFO("step ", step);
      auto g = step_gradients(r, comm->rank(), step);
      auto h = g;
      std::vector<float> before(r.bucket_size(1)), after(r.bucket_size(1));
      r.error_feedback(1, before.data());
      const uint64_t rounds = comm->communication_rounds();
      std::vector<ReduceHandle> handles;
      for (int b = 0; b < r.num_buckets(); ++b) handles.push_back(r.reduce_async(b, g[static_cast<size_t>(b)].data()));
      std::vector<std::string> messages(3);
      for (size_t b = 0; b < 3; ++b) {
        try {
          handles[b].wait();
        } catch (const Error& e) {
          messages[b] = e.what();
        }
      }
      if (step != 2) {
        CHECK(messages == std::vector<std::string>(3));
        // Carried and summed: the announce, then Q (bf16: the announce carries the 16-bit P too).
        if (rank0_fuses) CHECK(comm->communication_rounds() - rounds == 2u);
        CHECK(reduce_one_by_one(*comm, *alone, h).codes == std::vector<int>{0, 0, 0});
        for (size_t k = 0; k < g.size(); ++k) CHECK_MESSAGE(same_bits(g[k], h[k]), "bucket ", k);
        continue;
      }
      CHECK(messages[0].empty());
      CHECK(messages[2].empty());
      INFO(messages[1]);
      CHECK(messages[1].find("injected fault") != std::string::npos);
      if (comm->rank() != 1) CHECK(messages[1].find("step 2, bucket 1 failed on rank 1") != std::string::npos);
      r.error_feedback(1, after.data());
      CHECK(same_bits(after, before));
      // The reference fails bucket 1 alike: its own prepare fault is not armed, so a NaN of rank 1 stands in.
      if (comm->rank() == 1) h[1][0] = std::numeric_limits<float>::quiet_NaN();
      CHECK(reduce_one_by_one(*comm, *alone, h).codes ==
            std::vector<int>{0, static_cast<int>(ErrorCode::NonFinite), 0});
      CHECK(same_bits(g[0], h[0]));
      CHECK(same_bits(g[2], h[2]));
    }
  }
}

namespace {

// A rank (the last: not rank 0, which carries the test's output) that dies or stalls at `point` of step 2,
// while its three queued reductions run fused, the announce carrying their first collective (with bf16 the
// float32 parts, the 16-bit P following): every survivor's three handles fail within the timeout (Io: a peer
// closed; Timeout: a stalled one), each bucket's error memory and data as they were. A stalled rank,
// continued after its peers gave up, fails the same way.
void lost_in_fused_step(engine::FaultPoint point, engine::FaultEffect effect, WireDType wire, const char* run_id) {
  constexpr int kLostTimeoutMs = 3000;  // also the rendezvous's: ample for processes started together
  constexpr int kStopMs = 8000;          // longer than a survivor may take, so that none succeeds by waiting
  auto comm = connect(run_id, kLostTimeoutMs);
  testing::require_staged_if_asked(*comm);  // the staged variants: staged over their pretend hosts
  const int me = comm->rank();
  const int victim = comm->size() - 1;
  engine::Fault fault{point, 2, true, effect, kStopMs};  // hold: each step's three reductions fused
  fault.bucket = 1;  // once: bucket 1's prepare (the held reduction's lookahead), or the fused step
  engine::arm_fault(me == victim ? fault : engine::Fault{engine::FaultPoint::Hold, -1});
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  c.wire_dtype = wire;
  Reducer r(*comm, c);
  for (const auto& shapes : kBuckets) r.add_bucket(shapes);
  for (int64_t step = 0; step < 2; ++step) {
    auto g = step_gradients(r, me, step);
    const StepResult result = reduce_queued(*comm, r, g, {0, 1, 2});
    CHECK(result.codes == std::vector<int>{0, 0, 0});
    CHECK(result.rounds == 2u);  // fused, the first collective carried (bf16: its float32 parts and factors)
  }
  auto g = step_gradients(r, me, 2);
  const auto data = g;
  std::vector<std::vector<float>> before;
  for (int b = 0; b < r.num_buckets(); ++b) {
    before.emplace_back(r.bucket_size(b));
    r.error_feedback(b, before.back().data());
  }
  comm->barrier();  // every rank has its snapshot before the victim goes
  const auto start = std::chrono::steady_clock::now();
  std::vector<ReduceHandle> handles;
  for (int b = 0; b < r.num_buckets(); ++b) handles.push_back(r.reduce_async(b, g[static_cast<size_t>(b)].data()));
  for (size_t b = 0; b < handles.size(); ++b) {
    int code = 0;
    std::string message;
    try {
      handles[b].wait();
    } catch (const Error& e) {
      code = static_cast<int>(e.code());
      message = e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO("bucket ", b, " after ", seconds, " s: ", message);
    CHECK((code == static_cast<int>(ErrorCode::Io) || code == static_cast<int>(ErrorCode::Timeout)));
    if (me != victim) {
      if (effect == engine::FaultEffect::Exit) CHECK(seconds < 5.0);
      else CHECK(seconds < (kLostTimeoutMs + 3000) / 1000.0);
      if (effect == engine::FaultEffect::Stop && comm->size() == 2) CHECK(code == static_cast<int>(ErrorCode::Timeout));
    }
    std::vector<float> after(r.bucket_size(static_cast<int>(b)));
    r.error_feedback(static_cast<int>(b), after.data());
    CHECK(same_bits(after, before[b]));
    CHECK(same_bits(g[b], data[b]));
  }
}

}  // namespace

TEST_CASE("fusing lost: a rank that dies before its fused step's first collective, float32") {
  lost_in_fused_step(engine::FaultPoint::Prepare, engine::FaultEffect::Exit, WireDType::Float32, "fusion-dies-prepare");
}
TEST_CASE("fusing lost: a rank that dies before its fused step's first collective, bf16") {
  lost_in_fused_step(engine::FaultPoint::Prepare, engine::FaultEffect::Exit, WireDType::BFloat16,
                     "fusion-dies-prepare-bf16");
}
TEST_CASE("fusing lost: a rank that dies between its fused step's P and Q, bf16") {
  lost_in_fused_step(engine::FaultPoint::Between, engine::FaultEffect::Exit, WireDType::BFloat16,
                     "fusion-dies-between-bf16");
}
TEST_CASE("fusing lost: a rank that stalls between its fused step's P and Q, float32") {
  lost_in_fused_step(engine::FaultPoint::Between, engine::FaultEffect::Stop, WireDType::Float32,
                     "fusion-stalls-between");
}
TEST_CASE("fusing lost: a rank that stalls before its fused step's first collective, bf16") {
  lost_in_fused_step(engine::FaultPoint::Prepare, engine::FaultEffect::Stop, WireDType::BFloat16,
                     "fusion-stalls-prepare-bf16");
}

TEST_CASE("fusing: a replica that drifted is still named by the divergence detector") {
  auto comm = connect("fusion-divergence");
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  c.divergence_check_interval = 1;
  // Rank 1 flips a bit of its output of step 2's first bucket (fusing here depends on timing: either way).
  if (comm->rank() == 1) engine::arm_fault({engine::FaultPoint::Output, 2});
  Reducer r(*comm, c);
  for (const auto& shapes : kBuckets) r.add_bucket(shapes);
  std::vector<int> first_failure;
  std::string message;
  for (int64_t step = 0; step < 4; ++step) {
    auto g = step_gradients(r, comm->rank(), step);
    std::vector<ReduceHandle> handles;
    for (int b = 0; b < r.num_buckets(); ++b) handles.push_back(r.reduce_async(b, g[static_cast<size_t>(b)].data()));
    for (auto& handle : handles) {
      try {
        handle.wait();
      } catch (const MismatchError& e) {
        if (message.empty()) {
          message = e.what();
          first_failure = {static_cast<int>(step)};
        }
      }
    }
  }
  INFO(message);
  CHECK(first_failure == std::vector<int>{3});
  CHECK(message.find("replicas diverged in step 2") != std::string::npos);
}

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) {
    std::fprintf(stderr, "test_fusion_mp: WORLD_SIZE is not set; run under powersgd-run (skipped)\n");
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}
