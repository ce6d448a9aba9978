// Refused calls across real processes (issue 29, items 1, 2 and 4; docs/errors.md,
// "Failed calls lose nothing"): a refused call has finished its collectives when
// it throws, so the caller's next collective on the communicator pairs with the
// other ranks' (before: Gloo aborted the process); it raises no false divergence
// alarm and does not hide a real one; a call the C API refuses before the
// Reducer (a null path, ndims out of range) fails every rank at once (before:
// the others waited out PSGD_TIMEOUT_MS); an allocation that fails on one rank
// at its first call is such a refusal too. Every rank runs this binary under
// powersgd-run with one case selected:
//   powersgd-run -n 3 --timeout 300 -- test_refusal_mp -tc='refusal: a call refused*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "engine/fault_injection.hpp"
#include "engine_reference.hpp"
#include "error_of.hpp"
#include "powersgd/powersgd.h"

using namespace powersgd;
using powersgd::test::gradients;
using powersgd::test::Outcome;
using powersgd::test::outcome_of;

namespace {

// A refusal reaches every rank at once, not after the communicator's timeout
// (kTimeoutMs here, so the old behaviour shows as a failure, not a hang).
constexpr double kFailTogetherSeconds = 5.0;
constexpr int kTimeoutMs = 10000;

std::unique_ptr<Communicator> connect(const char* run_id) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  o.timeout = std::chrono::milliseconds(kTimeoutMs);
  return Communicator::create(o);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The caller's own collective after a refusal (a C trainer's metrics): one float
// summed, after some local work whose length differs between the ranks (so a
// collective the refused call left in flight meets it in another order on each).
void local_work(int rank) { std::this_thread::sleep_for(std::chrono::milliseconds(20 * rank)); }
void sum_one(Communicator& comm) {
  local_work(comm.rank());
  float x = 1.0f;
  comm.allreduce(&x, 1, DataType::Float32);
  CHECK(x == static_cast<float>(comm.size()));
}

std::vector<float> error_feedback(const Reducer& r, int b) {
  std::vector<float> e(r.bucket_size(b));
  r.error_feedback(b, std::span<float>(e));
  return e;
}

const std::vector<Shape> kBucket0 = {{16, 8}, {8}};
const std::vector<Shape> kBucket1 = {{12, 10}};

}  // namespace

// Before: the refused call returned at once while its announce (and the
// report gather of the refusal) still ran on the reducer's worker; the caller's
// next collective raced it and Gloo aborted the process (SIGABRT, pair.cc
// "op.preamble.length <= op.nbytes. 24 vs 0"), in most runs of one refusal.
TEST_CASE("refusal: a call refused on every rank has finished its collectives when it throws") {
  auto comm = connect("refusal-collectives");
  const int me = comm->rank();
  const std::string job_file = "/tmp/psgd-test-refusal-" + std::string(std::getenv("PSGD_STORE_PORT")) + ".job";
  Config c;
  c.rank = 2;
  c.start_iter = 3;  // plain and compressed steps
  constexpr int kSteps = 20;
  // Refusals that do not count as a reduction (a bad index, a bucket twice, add_bucket after the first reduce,
  // save_job / load_job mid-step), each followed by the caller's own collective: the valid calls' outputs and
  // error memories equal a run without them, bit for bit.
  std::vector<std::vector<float>> outputs[2];
  std::vector<float> errors[2];
  for (int with_refusals = 0; with_refusals < 2; ++with_refusals) {
    CAPTURE(with_refusals);
    Reducer r(*comm, c);
    r.add_bucket(kBucket0);
    r.add_bucket(kBucket1);
    const auto refused = [&](const std::function<void()>& call, const char* reason) {
      if (with_refusals == 0) return;
      const Outcome o = outcome_of(call);
      INFO(o.message);
      CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
      CHECK(contains(o.message, reason));
      CHECK(o.seconds < kFailTogetherSeconds);
      sum_one(*comm);  // at once: the refused call's collectives are done
    };
    for (int step = 0; step < kSteps; ++step) {
      CAPTURE(step);
      std::vector<float> g0 = gradients(r.bucket_size(0), me, step, 1), g1 = gradients(r.bucket_size(1), me, step, 2);
      switch (step % 5) {
        case 0:
          refused([&] { r.reduce(7, g0.data()); }, "bucket index 7: expected 0 to 1");
          r.reduce(0, g0.data());
          break;
        case 1:
          r.reduce(0, g0.data());
          refused([&] { r.reduce(0, g0.data()); }, "bucket 0 was already reduced in step");
          break;
        case 2: {
          ReduceHandle h = r.reduce_async(0, g0.data());
          refused([&] { r.reduce_async(0, g0.data()); }, "bucket 0 was already reduced in step");
          h.wait();
          break;
        }
        case 3: {
          // add_bucket's refusal is collective: ordered after the reduction in flight.
          ReduceHandle h = r.reduce_async(0, g0.data());
          refused([&] { r.add_bucket({{4}}); }, "add_bucket after the first reduce");
          h.wait();
          break;
        }
        case 4:
          r.reduce(0, g0.data());
          refused([&] { r.save_job(job_file); }, "save_job in the middle of step");
          refused([&] { r.load_job(job_file); }, "load_job in the middle of step");
          break;
      }
      r.reduce(1, g1.data());
      outputs[with_refusals].push_back(g0);
      outputs[with_refusals].push_back(g1);
    }
    CHECK(r.iteration() == kSteps);
    errors[with_refusals] = error_feedback(r, 0);
  }
  CHECK(outputs[0] == outputs[1]);
  CHECK(errors[0] == errors[1]);
  CHECK_FALSE(std::filesystem::exists(job_file));

  // Refusals that count as the bucket's (or reduce_all's, the step's) reduction, as on the other ranks: a null
  // pointer, a short span, reduce_async of a null pointer, reduce_all with a buffer missing. Nothing changes.
  Reducer r(*comm, c);
  r.add_bucket(kBucket0);
  r.add_bucket(kBucket1);
  for (int round = 0; round < kSteps; ++round) {
    CAPTURE(round);
    const int64_t step = r.iteration();
    std::vector<float> g0 = gradients(r.bucket_size(0), me, step, 1), g1 = gradients(r.bucket_size(1), me, step, 2);
    const auto data0 = g0;
    const std::vector<float> e0 = error_feedback(r, 0), e1 = error_feedback(r, 1);
    const int kind = round % 4;
    const Outcome o = outcome_of([&] {
      if (kind == 0) r.reduce(0, static_cast<float*>(nullptr));
      if (kind == 1) r.reduce(0, std::span<float>(g0).first(g0.size() - 1));
      if (kind == 2) r.reduce_async(0, static_cast<float*>(nullptr));
      if (kind == 3) {
        std::vector<float*> one{g0.data()};
        r.reduce_all(std::span<float* const>(one));
      }
    });
    INFO(o.message);
    CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
    CHECK(o.seconds < kFailTogetherSeconds);
    sum_one(*comm);
    CHECK(g0 == data0);
    CHECK(error_feedback(r, 0) == e0);
    CHECK(error_feedback(r, 1) == e1);
    if (kind == 3) {
      CHECK(r.iteration() == step + 1);  // the whole step
    } else {
      r.reduce(1, g1.data());  // the step's other bucket pairs with the other ranks' and succeeds
      CHECK(r.iteration() == step + 1);
      CHECK(error_feedback(r, 0) == e0);
    }
  }
}

// The same calls on every rank, yet only the last one is in the middle of a step:
// its second reduce of bucket 0 was refused there (it does not count), while the
// others' bucket 1 failed with its reason (that counts). Before: the last rank's
// save_job refused locally while the others waited out the timeout in its gather.
TEST_CASE("refusal: save_job and load_job refused on one rank only fail every rank at once") {
  auto comm = connect("refusal-job-one-rank");
  const int me = comm->rank(), last = comm->size() - 1;
  const std::string job_file = "/tmp/psgd-test-refusal-one-" + std::string(std::getenv("PSGD_STORE_PORT")) + ".job";
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  Reducer r(*comm, c);
  r.add_bucket(kBucket0);
  r.add_bucket(kBucket1);
  std::vector<float> g0 = gradients(r.bucket_size(0), me, 0, 7), g1 = gradients(r.bucket_size(1), me, 0, 8);
  r.reduce(0, g0.data());
  const Outcome twice = outcome_of([&] { r.reduce(me == last ? 0 : 1, me == last ? g0.data() : g1.data()); });
  CHECK(twice.code == static_cast<int>(ErrorCode::InvalidArgument));
  CHECK(r.iteration() == (me == last ? 0 : 1));
  for (const bool save : {true, false}) {
    CAPTURE(save);
    const Outcome o = outcome_of([&] { save ? r.save_job(job_file) : r.load_job(job_file); });
    INFO(o.message);
    CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
    CHECK(o.seconds < kFailTogetherSeconds);
    CHECK(contains(o.message, save ? "save_job in the middle of step 0" : "load_job in the middle of step 0"));
    if (me != last) CHECK(contains(o.message, std::string(save ? "save_job" : "load_job") + " failed on rank " +
                                                  std::to_string(last)));
    sum_one(*comm);
  }
  CHECK_FALSE(std::filesystem::exists(job_file));
}

// An allocation that fails on one rank (out of memory) at the first call that needs the buffers. Before: each
// rank allocated at its first reduce, save or load alone; the failing rank threw without taking part in the
// announce the others sent, so its next collective met theirs and Gloo aborted the process (SIGABRT,
// pair.cc "op.preamble.length <= op.nbytes. 32 vs 0"), or the others waited out the timeout (save_job); and
// the reducer counted itself started, so a retried reduce ran on buffers never allocated (SIGSEGV).
TEST_CASE("refusal: an allocation that fails on one rank fails every rank at once; the next call allocates") {
  auto comm = connect("refusal-allocation");
  const int me = comm->rank();
  const std::string job_file =
      "/tmp/psgd-test-refusal-alloc-" + std::string(std::getenv("PSGD_STORE_PORT")) + ".job";
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  constexpr int kSteps = 4;
  {
    Reducer saver(*comm, c);  // a job checkpoint of the same layout for load_job, two steps in
    saver.add_bucket(kBucket0);
    saver.add_bucket(kBucket1);
    for (int step = 0; step < 2; ++step)
      for (int b = 0; b < 2; ++b) {
        std::vector<float> g = gradients(saver.bucket_size(b), me, step, 3);
        saver.reduce(b, g.data());
      }
    saver.save_job(job_file);
  }
  const char* const kinds[] = {"reduce", "reduce_async", "reduce_all", "save_job", "load_job"};
  for (int kind = 0; kind < 5; ++kind) {
    CAPTURE(kinds[kind]);
    // Outputs of the steps after the first call: [0] its allocation failed on rank 1, [1] rank 1 passed a null
    // buffer instead (a refusal that counts as the reduction, as documented): the same afterwards, bit for bit.
    std::vector<std::vector<float>> outputs[2];
    for (int injected = 1; injected >= 0; --injected) {
      CAPTURE(injected);
      if (injected == 1 && me == 1) engine::arm_fault({engine::FaultPoint::Allocate, 0});
      Reducer r(*comm, c);  // takes the armed fault
      r.add_bucket(kBucket0);
      r.add_bucket(kBucket1);
      std::vector<float> g0 = gradients(r.bucket_size(0), me, 0, 1), g1 = gradients(r.bucket_size(1), me, 0, 2);
      const auto data0 = g0;
      const bool null_buffer = injected == 0 && me == 1;
      if (injected == 0 && kind >= 3) continue;  // save_job and load_job: no such refusal to compare with
      const Outcome o = outcome_of([&] {
        float* data = null_buffer ? nullptr : g0.data();
        if (kind == 0) r.reduce(0, data);
        if (kind == 1) r.reduce_async(0, data).wait();
        if (kind == 2) {
          std::vector<float*> all{data, g1.data()};
          r.reduce_all(std::span<float* const>(all));
        }
        if (kind == 3) r.save_job(job_file + ".new");
        if (kind == 4) r.load_job(job_file);
      });
      INFO(o.message);
      CHECK(o.code != 0);
      CHECK(o.seconds < kFailTogetherSeconds);
      if (injected == 1) CHECK(contains(o.message, "injected fault"));
      if (injected == 1 && me != 1) CHECK(contains(o.message, "rank 1"));
      sum_one(*comm);  // at once: the failed call's collectives are done
      CHECK(g0 == data0);
      if (kind == 3 || kind == 4) {
        // Nothing saved or loaded anywhere; the same call again allocates and succeeds on every rank.
        CHECK(r.iteration() == 0);
        if (kind == 3) CHECK_FALSE(std::filesystem::exists(job_file + ".new"));
        if (kind == 3) r.save_job(job_file + ".new");
        if (kind == 4) r.load_job(job_file);
        CHECK(r.iteration() == (kind == 4 ? 2 : 0));
      } else if (kind != 2) {
        r.reduce(1, g1.data());  // closes step 0: the failed reduce counted as bucket 0's
      }
      CHECK(r.iteration() == (kind == 4 ? 2 : kind == 3 ? 0 : 1));
      for (int step = 0; step < kSteps; ++step)
        for (int b = 0; b < 2; ++b) {
          std::vector<float> g = gradients(r.bucket_size(b), me, r.iteration(), 5 + static_cast<uint64_t>(b));
          r.reduce(b, g.data());
          outputs[injected].push_back(g);
        }
      // Replicas: rank 0's outputs on every rank.
      for (const auto& out : outputs[injected]) {
        std::vector<float> first = out;
        comm->broadcast(first.data(), first.size() * sizeof(float), 0);
        CHECK(first == out);
      }
    }
    if (kind < 3) CHECK(outputs[0] == outputs[1]);
  }
  comm->barrier();
  if (me == 0) {
    std::filesystem::remove(job_file);
    std::filesystem::remove(job_file + ".new");
  }
}

// Before: the refusing rank's poisoned announce carried no divergence hash while
// the other ranks' announces consumed theirs, so the next reduction compared a
// hash with none: "replicas diverged in step -1, bucket 0 ..." on every rank
// (with 3 or more ranks naming an innocent rank as the drifted one).
TEST_CASE("refusal: a refused reduce raises no false divergence alarm") {
  auto comm = connect("refusal-divergence-false");
  const int me = comm->rank();
  for (int64_t interval : {int64_t{1}, int64_t{100}})
    for (bool everyone : {false, true}) {
      CAPTURE(interval);
      CAPTURE(everyone);
      Config c;
      c.rank = 2;
      c.start_iter = 0;
      c.divergence_check_interval = interval;
      Reducer r(*comm, c);
      r.add_bucket(kBucket0);
      const int64_t refused_step = interval;  // its announce carries the hash of step interval - 1
      for (int64_t step = 0; step < refused_step + 3; ++step) {
        CAPTURE(step);
        auto g = gradients(r.bucket_size(0), me, step, 3);
        const bool refuse = step == refused_step && (everyone || me == 1);
        const Outcome o = outcome_of([&] { r.reduce(0, refuse ? static_cast<float*>(nullptr) : g.data()); });
        INFO(o.message);
        if (step == refused_step) {
          CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
          CHECK(contains(o.message, "reduce of bucket 0: data is null"));
          if (!refuse) CHECK(contains(o.message, "failed on rank 1"));
        } else {
          CHECK(o.code == 0);
        }
      }
      CHECK(r.iteration() == refused_step + 3);
    }
}

// A reducer of two buckets whose output drifts on rank 1 at step `drift` (the test-only fault point flips one bit),
// hashed for the next step's announce.
std::unique_ptr<Reducer> drifting_reducer(Communicator& comm, int64_t drift) {
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  c.divergence_check_interval = 2;  // (3 + 1) % 2 == 0: the outputs of step 3 are hashed
  if (comm.rank() == 1) engine::arm_fault({engine::FaultPoint::Output, drift});
  auto r = std::make_unique<Reducer>(comm, c);
  r->add_bucket(kBucket0);
  r->add_bucket(kBucket1);
  return r;
}

// Rank 1's output drifts at step 3 (the test-only fault point flips one bit);
// the announces of step 4 carry the hashes of step 3. Before: when such an
// announce failed for another reason (a refusal on one rank, buckets swapped),
// the ranks had consumed their hashes (the refusing rank not), so the drift was
// reported as "in step -1" or not at all.
TEST_CASE("refusal: a real divergence is reported at the next agreed announce after a refusal or another failure") {
  auto comm = connect("refusal-divergence-real");
  const int me = comm->rank(), last = comm->size() - 1;
  constexpr int64_t kDrift = 3;
  for (int kind = 0; kind < 2; ++kind) {  // 0: rank 1 refuses bucket 0 of step 4; 1: the last rank swaps step 4's buckets
    CAPTURE(kind);
    const auto reducer = drifting_reducer(*comm, kDrift);
    Reducer& r = *reducer;
    const auto diverged = [&](const Outcome& o, int b) {
      INFO(o.message);
      CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
      CHECK(contains(o.message, "replicas diverged in step 3, bucket " + std::to_string(b) + " ("));
      CHECK(contains(o.message, comm->size() >= 3 ? "rank 1 computed another output" : "rank 0 / rank 1"));
    };
    for (int64_t step = 0; step < 8; ++step) {
      CAPTURE(step);
      std::vector<std::vector<float>> g{gradients(r.bucket_size(0), me, step, 4), gradients(r.bucket_size(1), me, step, 5)};
      const auto reduce = [&](int b, bool null) {
        return outcome_of([&] { r.reduce(b, null ? static_cast<float*>(nullptr) : g[static_cast<size_t>(b)].data()); });
      };
      if (step == kDrift + 1 && kind == 0) {
        const Outcome o = reduce(0, me == 1);
        INFO(o.message);
        CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
        diverged(reduce(1, false), 1);  // bucket 1's announce agreed on all but the hash
      } else if (step == kDrift + 1) {
        for (int b : me == last ? std::vector<int>{1, 0} : std::vector<int>{0, 1}) {
          const Outcome o = reduce(b, false);
          INFO(o.message);
          CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
          CHECK(contains(o.message, "where rank 0 reduces bucket"));
        }
      } else if (step == kDrift + 2) {
        diverged(reduce(0, false), 0);  // the hash the failed announce carried, reported now
        if (kind == 0) {
          const Outcome o = reduce(1, false);  // reported at step 4 already
          INFO(o.message);
          CHECK(o.code == 0);
        } else {
          diverged(reduce(1, false), 1);
        }
      } else {
        for (int b = 0; b < 2; ++b) {
          const Outcome o = reduce(b, false);
          INFO(o.message);
          CHECK(o.code == 0);
        }
      }
    }
    CHECK(r.iteration() == 8);
  }
}

// A drift repaired by a load is not reported: rank 1's output drifts at step 3 (hashed for step 4's announce),
// then every rank loads its checkpoint of step 2. Before: the first reduction after the load failed on every
// rank with "replicas diverged in step 3", of outputs the load had replaced.
TEST_CASE("refusal: a load forgets the divergence hashes of the state it replaced") {
  auto comm = connect("refusal-divergence-load");
  const int me = comm->rank();
  constexpr int64_t kDrift = 3;
  const std::string path = "/tmp/psgd-test-refusal-drift-" + std::string(std::getenv("PSGD_STORE_PORT")) + "-" +
                           std::to_string(me) + ".ckpt";
  const auto reducer = drifting_reducer(*comm, kDrift);
  Reducer& r = *reducer;
  const auto step_ok = [&](int64_t step) {
    CAPTURE(step);
    std::vector<std::vector<float>> g{gradients(r.bucket_size(0), me, step, 4),
                                      gradients(r.bucket_size(1), me, step, 5)};
    for (int b = 0; b < 2; ++b) {
      const Outcome o = outcome_of([&] { r.reduce(b, g[static_cast<size_t>(b)].data()); });
      INFO(o.message);
      CHECK(o.code == 0);
    }
  };
  for (int64_t step = 0; step < 2; ++step) step_ok(step);
  r.save(path);
  for (int64_t step = 2; step <= kDrift; ++step) step_ok(step);
  r.load(path);
  CHECK(r.iteration() == 2);
  step_ok(2);
  std::filesystem::remove(path);
}

// A load whose application fails part-way (out of memory after its first bucket: the fault point Apply, on
// rank 1). Before: each bucket was applied as it was prepared, so bucket 0 held the file's state and bucket 1
// its own, the step count unchanged; and load_job applied after its agreement, so rank 1 failed alone.
TEST_CASE("refusal: a load that fails part-way changes nothing; load_job fails on every rank") {
  auto comm = connect("refusal-apply");
  const int me = comm->rank();
  const std::string stem = "/tmp/psgd-test-refusal-apply-" + std::string(std::getenv("PSGD_STORE_PORT"));
  const std::string job_file = stem + ".job", own_file = stem + "-" + std::to_string(me) + ".ckpt";
  Config c;
  c.rank = 2;
  c.start_iter = 0;
  if (me == 1) engine::arm_fault({engine::FaultPoint::Apply, 2});
  Reducer r(*comm, c);  // takes the armed fault
  r.add_bucket(kBucket0);
  r.add_bucket(kBucket1);
  const auto step = [&] {
    for (int b = 0; b < 2; ++b) {
      std::vector<float> g = gradients(r.bucket_size(b), me, r.iteration(), 11 + static_cast<uint64_t>(b));
      r.reduce(b, g.data());
    }
  };
  step();
  step();
  r.save(own_file);
  r.save_job(job_file);
  step();
  step();
  for (const bool job : {true, false}) {
    CAPTURE(job);
    const int64_t at = r.iteration();
    const std::vector<float> before0 = error_feedback(r, 0), before1 = error_feedback(r, 1);
    const Outcome o = outcome_of([&] { job ? r.load_job(job_file) : r.load(own_file); });
    INFO(o.message);
    if (job || me == 1) {
      CHECK(o.code == static_cast<int>(ErrorCode::Io));
      CHECK(contains(o.message, "injected fault"));
      CHECK(o.seconds < kFailTogetherSeconds);
      CHECK(r.iteration() == at);
      CHECK(error_feedback(r, 0) == before0);
      CHECK(error_feedback(r, 1) == before1);
    } else {
      CHECK(o.code == 0);
      CHECK(r.iteration() == 2);
    }
    if (job) step();  // every rank still at the same step: the next reduction succeeds everywhere
    sum_one(*comm);
  }
  std::filesystem::remove(own_file);
  if (me == 0) std::filesystem::remove(job_file);
}

namespace {

struct COutcome {
  psgd_status status = PSGD_OK;
  std::string message;
  double seconds = 0;
};
COutcome c_outcome_of(const std::function<psgd_status()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  COutcome o;
  o.status = fn();
  if (o.status != PSGD_OK) o.message = psgd_last_error();
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

}  // namespace

// Before: the C wrapper refused these arguments on the refusing rank before
// calling the Reducer, whose refusal is collective: the other ranks waited in
// the call's collective until PSGD_TIMEOUT_MS and their next collective paired
// with the leftover one (a timeout, wrong sums, or a Gloo abort).
TEST_CASE("refusal: a call the C API refuses on one rank fails every rank at once; the communicator stays usable") {
  ::setenv("PSGD_TIMEOUT_MS", std::to_string(kTimeoutMs).c_str(), 1);
  ::setenv("PSGD_RUN_ID", "refusal-c-api", 1);
  psgd_comm* comm = nullptr;
  REQUIRE(psgd_comm_init_from_env(&comm) == PSGD_OK);
  const int me = psgd_comm_rank(comm), world = psgd_comm_size(comm), last = world - 1;
  psgd_config config = psgd_config_default();
  config.rank = 2;
  config.start_iter = 1;
  psgd_reducer* r = nullptr;
  REQUIRE(psgd_reducer_create(comm, &config, &r) == PSGD_OK);
  const auto sum_one_c = [&] {
    local_work(me);
    float x = 1.0f;
    CHECK(psgd_comm_allreduce_sum_f32(comm, &x, 1) == PSGD_OK);
    CHECK(x == static_cast<float>(world));
  };
  // An error on every rank, at once, naming the last rank and its reason; then the caller's own collective.
  const auto refused_everywhere = [&](const COutcome& o, const std::string& reason) {
    INFO(o.message);
    CHECK(o.status == PSGD_ERR_INVALID_ARGUMENT);
    CHECK(contains(o.message, reason));
    CHECK(o.seconds < kFailTogetherSeconds);
    if (me != last) CHECK(contains(o.message, "failed on rank " + std::to_string(last)));
    sum_one_c();
  };

  const int ndims[] = {2, 1}, too_many[] = {65, 1}, negative[] = {-1, 1};
  const int64_t dims[] = {16, 8, 8};
  int index = -1;
  const std::vector<std::string> reasons = {"ndims[0] = 65: expected 0 to 64", "ndims[0] = -1: expected 0 to 64",
                                            "argument 'ndims' is null", "argument 'dims' is null",
                                            "argument 'bucket_index' is null",
                                            "num_tensors = 4611686018427387904: expected at most 16777216 tensors"};
  for (size_t kind = 0; kind < reasons.size(); ++kind) {
    CAPTURE(kind);
    refused_everywhere(c_outcome_of([&] {
                         if (me != last) return psgd_reducer_add_bucket(r, 2, ndims, dims, &index);
                         if (kind == 0) return psgd_reducer_add_bucket(r, 2, too_many, dims, &index);
                         if (kind == 1) return psgd_reducer_add_bucket(r, 2, negative, dims, &index);
                         if (kind == 2) return psgd_reducer_add_bucket(r, 2, nullptr, dims, &index);
                         if (kind == 3) return psgd_reducer_add_bucket(r, 2, ndims, nullptr, &index);
                         if (kind == 4) return psgd_reducer_add_bucket(r, 2, ndims, dims, nullptr);
                         return psgd_reducer_add_bucket(r, size_t{1} << 62, ndims, dims, &index);  // not allocated
                       }),
                       reasons[kind]);
  }
  // Nothing was declared anywhere.
  REQUIRE(psgd_reducer_add_bucket(r, 2, ndims, dims, &index) == PSGD_OK);
  CHECK(index == 0);
  size_t n = 0;
  REQUIRE(psgd_reducer_bucket_size(r, 0, &n) == PSGD_OK);

  // Every rank refuses the same reduce, then sums one float (a C trainer's metrics), many times.
  for (int round = 0; round < 20; ++round) {
    std::vector<float> g = gradients(n, me, 0, 6);
    const COutcome o = c_outcome_of([&] { return psgd_reducer_reduce(r, 7, g.data()); });
    INFO(o.message);
    CHECK(o.status == PSGD_ERR_INVALID_ARGUMENT);
    sum_one_c();
  }
  CHECK(psgd_reducer_iteration(r) == 0);

  // reduce_async without a place for the handle on the last rank: the others' matching reduction fails with it.
  std::vector<float> g = gradients(n, me, 0, 6);
  refused_everywhere(c_outcome_of([&] {
                       if (me == last) return psgd_reducer_reduce_async(r, 0, g.data(), nullptr);
                       psgd_reduce_handle* h = nullptr;
                       psgd_status status = psgd_reducer_reduce_async(r, 0, g.data(), &h);
                       if (status == PSGD_OK) status = psgd_reduce_handle_wait(h);
                       psgd_reduce_handle_free(h);
                       return status;
                     }),
                     "argument 'out' is null");
  CHECK(psgd_reducer_iteration(r) == 1);  // the bucket counted as reduced in step 0, as on every rank
  for (int64_t step = 1; step < 3; ++step) {
    g = gradients(n, me, step, 6);
    REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  }

  // save_job / load_job with a null path on the last rank: nothing written, nothing loaded.
  const std::string path = "/tmp/psgd-test-refusal-c-" + std::string(std::getenv("PSGD_STORE_PORT")) + ".job";
  refused_everywhere(c_outcome_of([&] { return psgd_reducer_save_job(r, me == last ? nullptr : path.c_str()); }),
                     "argument 'path' is null");
  CHECK_FALSE(std::filesystem::exists(path));
  REQUIRE(psgd_reducer_save_job(r, path.c_str()) == PSGD_OK);
  g = gradients(n, me, 3, 6);
  REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  std::vector<float> error_before(n), error_after(n);
  REQUIRE(psgd_reducer_error_feedback(r, 0, error_before.data()) == PSGD_OK);
  refused_everywhere(c_outcome_of([&] { return psgd_reducer_load_job(r, me == last ? nullptr : path.c_str()); }),
                     "argument 'path' is null");
  CHECK(psgd_reducer_iteration(r) == 4);
  REQUIRE(psgd_reducer_error_feedback(r, 0, error_after.data()) == PSGD_OK);
  CHECK(error_after == error_before);
  REQUIRE(psgd_reducer_load_job(r, path.c_str()) == PSGD_OK);
  CHECK(psgd_reducer_iteration(r) == 3);
  g = gradients(n, me, 3, 6);
  CHECK(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  sum_one_c();
  if (me == 0) std::remove(path.c_str());

  // The communicator's own collectives with other sizes on the last rank (before: Gloo's I/O thread aborted the
  // process where a receiver passed fewer bytes, and a root that passed fewer left the receivers' last bytes
  // as they were): PSGD_ERR_MISMATCH on every rank at once, naming both calls; nothing changed; usable after.
  std::vector<uint8_t> bytes(4096, static_cast<uint8_t>(me + 1));
  for (const size_t odd : {size_t{2048}, size_t{4096 + 8}}) {
    CAPTURE(odd);
    const COutcome o = c_outcome_of([&] { return psgd_comm_broadcast(comm, bytes.data(), me == last ? odd : 4096, 0); });
    INFO(o.message);
    CHECK(o.status == PSGD_ERR_MISMATCH);
    CHECK(contains(o.message, "broadcast of " + std::to_string(odd) + " bytes from root 0"));
    CHECK(contains(o.message, "broadcast of 4096 bytes from root 0"));
    CHECK(o.seconds < kFailTogetherSeconds);
    CHECK(std::count(bytes.begin(), bytes.end(), static_cast<uint8_t>(me + 1)) == 4096);
    sum_one_c();
  }
  // Arguments the last rank refuses (a root out of range, a null data): PSGD_ERR_INVALID_ARGUMENT there,
  // PSGD_ERR_MISMATCH naming it on every other rank, at once; nothing changed; usable after (before, the
  // others waited out PSGD_TIMEOUT_MS and the communicator broke).
  for (const int bad : {0, 1}) {
    CAPTURE(bad);
    const COutcome o = c_outcome_of([&] {
      if (me != last) return psgd_comm_broadcast(comm, bytes.data(), 4096, 0);
      return bad == 0 ? psgd_comm_broadcast(comm, bytes.data(), 4096, world) : psgd_comm_broadcast(comm, nullptr, 4096, 0);
    });
    INFO(o.message);
    CHECK(o.status == (me == last ? PSGD_ERR_INVALID_ARGUMENT : PSGD_ERR_MISMATCH));
    CHECK(contains(o.message, me == last ? (bad == 0 ? "broadcast: root " + std::to_string(world) +
                                                           " is out of range: expected 0 to " + std::to_string(last)
                                                     : std::string("broadcast: data is null for 4096 bytes"))
                                         : "rank " + std::to_string(last) + " refused its broadcast"));
    CHECK(o.seconds < kFailTogetherSeconds);
    CHECK(std::count(bytes.begin(), bytes.end(), static_cast<uint8_t>(me + 1)) == 4096);
    sum_one_c();
  }
  float one = 1.0f;
  const COutcome null_data = c_outcome_of([&] {
    return psgd_comm_allreduce_sum_f32(comm, me == last ? nullptr : &one, 1);
  });
  INFO(null_data.message);
  CHECK(null_data.status == (me == last ? PSGD_ERR_INVALID_ARGUMENT : PSGD_ERR_MISMATCH));
  // The others' direct allreduce reads the last rank's refusal where it expects data (or, without the receives
  // posted ahead, its refusal where they send shapes).
  CHECK(contains(null_data.message, me == last ? "allreduce: data is null for 1 elements" : "refused"));
  CHECK(null_data.seconds < kFailTogetherSeconds);
  CHECK(one == 1.0f);
  sum_one_c();
  const COutcome zero = c_outcome_of([&] { return psgd_comm_allreduce_sum_f32(comm, &one, me == last ? 0 : 1); });
  INFO(zero.message);
  CHECK(zero.status == PSGD_ERR_MISMATCH);
  // The others' direct allreduce reads the last rank's shape where it expects data (or, without the receives
  // posted ahead, their shapes differ); each side names the mismatch.
  CHECK(contains(zero.message, "every rank must run the same collectives"));
  CHECK(zero.seconds < kFailTogetherSeconds);
  CHECK(one == 1.0f);
  sum_one_c();

  // Local SGD's outer optimizer (docs/local-steps.md): a null handle pointer, parameter array or path on the
  // last rank fails psgd_outer_create, psgd_outer_step and psgd_outer_load on every rank at once (before, the
  // others waited out PSGD_TIMEOUT_MS in the call's collective); nothing set up, stepped or loaded.
  std::vector<float> weights(n, 0.5f);
  float* params[] = {weights.data()};
  psgd_outer* o = nullptr;
  refused_everywhere(c_outcome_of([&] {
                       return psgd_outer_create(comm, r, 2, 0.7, 0.9, me == last ? nullptr : params, 1, &o);
                     }),
                     "argument 'params' is null");
  CHECK(o == nullptr);
  refused_everywhere(c_outcome_of([&] {
                       return psgd_outer_create(comm, r, 2, 0.7, 0.9, params, 1, me == last ? nullptr : &o);
                     }),
                     "argument 'out' is null");
  CHECK(o == nullptr);
  REQUIRE(psgd_outer_create(comm, r, 2, 0.7, 0.9, params, 1, &o) == PSGD_OK);
  const int64_t reduced_steps = psgd_reducer_iteration(r);
  const COutcome step = c_outcome_of([&] { return psgd_outer_step(o, me == last ? nullptr : params, 1); });
  INFO(step.message);
  CHECK(step.status == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(contains(step.message, me == last ? "argument 'params' is null" : "failed on rank " + std::to_string(last)));
  CHECK(step.seconds < kFailTogetherSeconds);
  CHECK(psgd_outer_steps(o) == 0);
  CHECK(std::count(weights.begin(), weights.end(), 0.5f) == static_cast<long>(n));
  CHECK(psgd_reducer_iteration(r) == reduced_steps + 1);  // the refused reduction counts, on every rank alike
  sum_one_c();
  REQUIRE(psgd_outer_step(o, params, 1) == PSGD_OK);
  CHECK(psgd_outer_steps(o) == 1);
  const std::string outer_path = "/tmp/psgd-test-refusal-c-outer-" + std::string(std::getenv("PSGD_STORE_PORT")) +
                                 "-" + std::to_string(me) + ".ckpt";
  REQUIRE(psgd_outer_save(o, outer_path.c_str()) == PSGD_OK);
  refused_everywhere(c_outcome_of([&] { return psgd_outer_load(o, me == last ? nullptr : outer_path.c_str()); }),
                     "argument 'path' is null");
  CHECK(psgd_outer_steps(o) == 1);
  CHECK(psgd_outer_load(o, outer_path.c_str()) == PSGD_OK);
  std::remove(outer_path.c_str());
  psgd_outer_destroy(o);
  psgd_reducer_destroy(r);
  psgd_comm_destroy(comm);
}

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) {
    std::fprintf(stderr, "test_refusal_mp: WORLD_SIZE is not set; run under powersgd-run (skipped)\n");
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}
