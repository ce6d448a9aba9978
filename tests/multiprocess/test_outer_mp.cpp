// OuterOptimizer (docs/local-steps.md) across real processes: replicas bitwise
// identical after every outer step while each rank's inner steps differ; the
// uncompressed outer step against a reference computed here from every rank's
// pseudo-gradient; a failed outer step (NaN on one rank, a buffer refused on
// one rank) changes nothing on any rank and the next one gives the bits of a
// run that never tried it; a rank that dies or stalls inside an outer step fails
// every survivor within the timeout, nothing changed; a bucket whose
// pseudo-gradient is zero in the first outer steps is learned afterwards; the
// constructor and load agree across ranks. Every rank runs this binary under
// powersgd-run with one case selected:
//   powersgd-run -n 3 --timeout 120 -- test_outer_mp -tc='outer: replicas*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "engine/fault_injection.hpp"
#include "engine/order_guard.hpp"
#include "error_of.hpp"
#include "powersgd/outer_optimizer.hpp"

using namespace powersgd;
using powersgd::test::error_of;
using powersgd::test::Outcome;
using powersgd::test::outcome_of;

namespace {

constexpr int kTimeoutMs = 20000;

std::unique_ptr<Communicator> connect(const char* run_id, int timeout_ms = kTimeoutMs) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return Communicator::create(o);
}

const std::vector<Shape> kBucket0 = {{16, 8}, {8}};
const std::vector<Shape> kBucket1 = {{12, 10}};

Config plain() {
  Config c;
  c.start_iter = std::numeric_limits<int64_t>::max();
  return c;
}
Config compressed() {
  Config c;
  c.rank = 1;
  c.start_iter = 0;
  c.divergence_check_interval = 1;  // every outer step's outputs compared across the ranks too
  return c;
}

struct Params {
  std::vector<float> b0 = std::vector<float>(16 * 8 + 8), b1 = std::vector<float>(12 * 10);
  std::vector<std::span<float>> spans() { return {std::span<float>(b0), std::span<float>(b1)}; }
  std::vector<float>& operator[](size_t b) { return b == 0 ? b0 : b1; }
};

// Dyadic values: sums of a few are exact in float, whatever their order.
float value(uint64_t seed, size_t i) {
  return static_cast<float>(static_cast<int>((seed * 7919 + i * 104729) % 64) - 32) / 64.0f;
}
// H "inner steps" of rank `rank`: a move of its own (ranks differ).
void local_steps(Params& p, uint64_t seed, int rank) {
  for (size_t b = 0; b < 2; ++b)
    for (size_t i = 0; i < p[b].size(); ++i) p[b][i] -= value(seed * 31 + uint64_t(rank) * 101 + 17, i + 1000 * b) / 8.0f;
}

// A reducer of the two buckets and its OuterOptimizer, from parameters that differ per rank (the constructor
// broadcasts rank 0's).
struct Job {
  std::unique_ptr<Reducer> reducer;
  std::unique_ptr<OuterOptimizer> outer;
  Params params;
  Job(Communicator& comm, const Config& config, const OuterConfig& outer_config = {}) {
    reducer = std::make_unique<Reducer>(comm, config);
    reducer->add_bucket(kBucket0);
    reducer->add_bucket(kBucket1);
    for (size_t b = 0; b < 2; ++b)
      for (size_t i = 0; i < params[b].size(); ++i) params[b][i] = value(uint64_t(comm.rank()) + 5, i + 1000 * b);
    const auto spans = params.spans();
    outer = std::make_unique<OuterOptimizer>(comm, *reducer, outer_config, spans);
  }
  void step() {
    const auto spans = params.spans();
    outer->step(spans);
  }
};

// Every rank's hash of its parameters, start point and momentum, equal to rank 0's.
void check_identical(Communicator& comm, Job& job) {
  uint64_t h = 0;
  for (int b = 0; b < 2; ++b) {
    h = engine::hash_floats(job.params[size_t(b)].data(), job.params[size_t(b)].size(), h);
    h = engine::hash_floats(job.outer->start(b).data(), job.outer->start(b).size(), h);
    h = engine::hash_floats(job.outer->momentum(b).data(), job.outer->momentum(b).size(), h);
  }
  std::vector<uint64_t> all(size_t(comm.size()));
  comm.allgather(&h, all.data(), sizeof h);
  for (int r = 1; r < comm.size(); ++r) CHECK_MESSAGE(all[size_t(r)] == all[0], "rank ", r, " differs from rank 0");
}

std::vector<float> error_feedback(const Reducer& r, int b) {
  std::vector<float> e(r.bucket_size(b));
  r.error_feedback(b, std::span<float>(e));
  return e;
}
std::vector<float> copy(std::span<const float> s) { return {s.begin(), s.end()}; }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// What a failed outer step must leave as it was: the caller's parameters, the start point, the outer momentum,
// the error memory, the outer step count.
struct Snapshot {
  Params params;
  std::vector<std::vector<float>> start, momentum, error;
  int64_t outer_steps;
  explicit Snapshot(const Job& job) : params(job.params), outer_steps(job.outer->outer_steps()) {
    for (int b = 0; b < 2; ++b) {
      start.push_back(copy(job.outer->start(b)));
      momentum.push_back(copy(job.outer->momentum(b)));
      error.push_back(error_feedback(*job.reducer, b));
    }
  }
  void check_unchanged(const Job& job) const {
    CHECK(job.params.b0 == params.b0);
    CHECK(job.params.b1 == params.b1);
    for (int b = 0; b < 2; ++b) {
      CAPTURE(b);
      CHECK(copy(job.outer->start(b)) == start[size_t(b)]);
      CHECK(copy(job.outer->momentum(b)) == momentum[size_t(b)]);
      CHECK(error_feedback(*job.reducer, b) == error[size_t(b)]);
    }
    CHECK(job.outer->outer_steps() == outer_steps);
  }
};

}  // namespace

TEST_CASE("outer: replicas bitwise identical after every outer step") {
  auto comm = connect("outer-replicas");
  Job job(*comm, compressed(), OuterConfig{4, 0.7, 0.9});
  check_identical(*comm, job);  // rank 0's start point everywhere
  for (int t = 0; t < 6; ++t) {
    local_steps(job.params, uint64_t(t), comm->rank());
    job.step();
    check_identical(*comm, job);
  }
  CHECK(job.outer->outer_steps() == 6);
  CHECK(job.reducer->iteration() == 6);
}

// Uncompressed: the Reducer's output is the mean of the ranks' pseudo-gradients, times 1/W as the engine
// scales. With W a power of two and lr = momentum = 0.5 every value stays a short dyadic fraction, so every
// sum is exact whatever its order and the outer step is checked bit for bit against a reference that
// computes every rank's parameters here.
TEST_CASE("outer: the uncompressed outer step equals the reference from every rank's pseudo-gradient") {
  auto comm = connect("outer-exact");
  const int world = comm->size();
  REQUIRE((world & (world - 1)) == 0);
  Job job(*comm, plain(), OuterConfig{2, 0.5, 0.5});
  Params start = job.params, v;
  for (size_t b = 0; b < 2; ++b) std::fill(v[b].begin(), v[b].end(), 0.0f);
  const float mu = 0.5f, lr = 0.5f, inv = 1.0f / static_cast<float>(world);
  for (int t = 0; t < 3; ++t) {
    std::vector<Params> local(size_t(world), start);  // every rank's parameters after its local steps
    for (int r = 0; r < world; ++r) local_steps(local[size_t(r)], uint64_t(t), r);
    for (size_t b = 0; b < 2; ++b)
      for (size_t i = 0; i < v[b].size(); ++i) {
        float sum = 0;
        double exact = 0;
        for (int r = 0; r < world; ++r) {
          const float g = start[b][i] - local[size_t(r)][b][i];
          sum += g;
          exact += double(g);
        }
        REQUIRE(double(sum) == exact);  // the reference's premise: no rounding in the sum
        const float mean = sum * inv;
        v[b][i] = mu * v[b][i] + mean;
        start[b][i] = start[b][i] - lr * (mean + mu * v[b][i]);
      }
    local_steps(job.params, uint64_t(t), comm->rank());
    job.step();
    for (size_t b = 0; b < 2; ++b) {
      CHECK(job.params[b] == start[b]);
      CHECK(copy(job.outer->start(int(b))) == start[b]);
      CHECK(copy(job.outer->momentum(int(b))) == v[b]);
    }
  }
}

TEST_CASE("outer: a failed outer step changes nothing on any rank, and the next equals a run without it") {
  auto comm = connect("outer-failure");
  const int me = comm->rank();
  const int culprit = comm->size() - 1;
  // Two jobs on one communicator, called from this thread: `twin` never fails.
  Job job(*comm, compressed()), twin(*comm, compressed());
  for (int t = 0; t < 2; ++t) {
    local_steps(job.params, uint64_t(t), me);
    local_steps(twin.params, uint64_t(t), me);
    job.step();
    twin.step();
  }
  local_steps(job.params, 2, me);
  const Params before = job.params;
  const Snapshot snapshot(job);
  REQUIRE(snapshot.error[0] != std::vector<float>(snapshot.error[0].size(), 0.0f));
  const auto unchanged = [&] { snapshot.check_unchanged(job); };

  // NaN in one parameter of the last rank: NonFiniteError on every rank.
  if (me == culprit) job.params.b1[7] = std::nan("");
  const Outcome nan = outcome_of([&] { job.step(); });
  CHECK(nan.code == static_cast<int>(ErrorCode::NonFinite));
  CHECK(contains(nan.message, "outer step 2: "));
  if (me == culprit) job.params.b1[7] = before.b1[7];
  unchanged();

  // A buffer of the wrong size on the last rank: refused on every rank at once, naming it.
  std::vector<float> short_b(119);
  std::vector<std::span<float>> spans = job.params.spans();
  if (me == culprit) spans[1] = std::span<float>(short_b);
  const Outcome refused = outcome_of([&] { job.outer->step(spans); });
  CHECK(refused.code == static_cast<int>(ErrorCode::InvalidArgument));
  CHECK(contains(refused.message, "data[1] has 119 elements, bucket 1 has 120"));
  if (me != culprit) CHECK(contains(refused.message, "failed on rank " + std::to_string(culprit)));
  CHECK(refused.seconds < kTimeoutMs / 2000.0);  // at once, not after the timeout
  unchanged();

  // The next outer steps succeed, with the bits of the twin that never failed, on every rank.
  for (int t = 2; t < 5; ++t) {
    if (t > 2) local_steps(job.params, uint64_t(t), me);
    local_steps(twin.params, uint64_t(t), me);
    job.step();
    twin.step();
    CHECK(job.params.b0 == twin.params.b0);
    CHECK(job.params.b1 == twin.params.b1);
    CHECK(copy(job.outer->momentum(1)) == copy(twin.outer->momentum(1)));
    check_identical(*comm, job);
  }
  CHECK(job.outer->outer_steps() == 5);
}

// Bucket 1 is not moved by any rank in outer steps 0-2 (a layer that gets no gradient at first: its
// pseudo-gradient is exactly zero), then every rank moves it along one rank-1 direction, by (rank + 1) times a
// step size: the mean pseudo-gradient is rank 1, and PowerSGD of rank >= 1 gives it back within rounding once
// the warm start recovers from the zero steps. Outer lr 1 and momentum 0: the start point moves by the mean.
TEST_CASE("outer: a bucket whose pseudo-gradient is zero in the first outer steps is learned afterwards, alike on every rank") {
  auto comm = connect("outer-zero");
  const int me = comm->rank(), world = comm->size();
  std::vector<float> direction(12 * 10);  // u v^T, u and v dyadic and non-zero: exact in float
  for (size_t i = 0; i < 12; ++i)
    for (size_t j = 0; j < 10; ++j) direction[i * 10 + j] = (value(1, i) + 0.75f) * (value(2, j) - 0.75f);
  for (const int rank : {1, 2}) {
    CAPTURE(rank);
    Config config = compressed();
    config.rank = rank;
    Job job(*comm, config, OuterConfig{4, 1.0, 0.0});
    const std::vector<float> initial = copy(job.outer->start(1));
    std::vector<float> memory(initial.size(), 0.0f);  // this rank's error memory of bucket 1
    for (int t = 0; t < 6; ++t) {
      CAPTURE(t);
      const bool zero = t < 3;
      const float size = 0.25f * static_cast<float>(t - 2);  // the step size of outer step t, dyadic
      const std::vector<float> before = copy(job.outer->start(1));
      const std::vector<float> b1 = job.params.b1;
      local_steps(job.params, uint64_t(t), me);
      job.params.b1 = b1;  // bucket 1 only as this case moves it
      if (!zero)
        for (size_t i = 0; i < direction.size(); ++i)
          job.params.b1[i] -= static_cast<float>(me + 1) * size * direction[i];
      job.step();
      check_identical(*comm, job);
      const std::vector<float> error = error_feedback(*job.reducer, 1);
      if (zero) {
        CHECK(copy(job.outer->start(1)) == initial);
        CHECK(copy(job.outer->momentum(1)) == std::vector<float>(initial.size(), 0.0f));
        CHECK(error == std::vector<float>(initial.size(), 0.0f));
        continue;
      }
      // The mean pseudo-gradient: (W + 1) / 2 x size x direction. This rank's error memory: its own
      // pseudo-gradient plus the memory it had, minus what the ranks got back.
      const float scale = static_cast<float>(world + 1) / 2.0f * size;
      double worst = 0, worst_error = 0, largest = 0;
      for (size_t i = 0; i < direction.size(); ++i) {
        const double mean = double(scale) * double(direction[i]);
        const double own = double(me + 1) * double(size) * double(direction[i]);
        const double output = double(before[i]) - double(job.outer->start(1)[i]);
        largest = std::max({largest, std::abs(own), std::abs(double(memory[i]))});
        worst = std::max(worst, std::abs(output - mean));
        worst_error = std::max(worst_error, std::abs(double(error[i]) - (double(memory[i]) + own - output)));
      }
      CHECK(worst < 1e-4 * largest);
      CHECK(worst_error < 1e-4 * largest);
      memory = error;
      CHECK(job.params.b1 == copy(job.outer->start(1)));
    }
    CHECK(job.outer->outer_steps() == 6);
  }
}

namespace {

// A rank that dies or stalls inside outer step 2, at `point` of its Reducer's step (Prepare: before its first
// collective; Between: after the P collective succeeded everywhere, before Q): every survivor's step fails
// within the timeout with a PeerError, and nothing it can see changed: parameters, start point, outer momentum,
// error memory, the step counts. A stalled rank, continued after its peers gave up, fails the same way.
void lost_in_outer_step(engine::FaultPoint point, engine::FaultEffect effect, const char* run_id) {
  constexpr int kLostTimeoutMs = 3000;  // also the rendezvous's: ample for processes started together
  constexpr int kStopMs = 8000;  // longer than a survivor may take, so that none succeeds by waiting it out
  auto comm = connect(run_id, kLostTimeoutMs);
  const int me = comm->rank();
  const int victim = comm->size() - 1;  // not rank 0: it would take the test's output with it
  if (me == victim) engine::arm_fault({point, 2, false, effect, kStopMs});
  Job job(*comm, compressed());
  for (int t = 0; t < 2; ++t) {
    local_steps(job.params, uint64_t(t), me);
    job.step();
  }
  local_steps(job.params, 2, me);
  const Snapshot snapshot(job);
  REQUIRE(snapshot.error[1] != std::vector<float>(snapshot.error[1].size(), 0.0f));
  comm->barrier();  // every rank has its snapshot before the victim goes

  const Outcome lost = outcome_of([&] { job.step(); });
  INFO(lost.message);
  CHECK(lost.code != 0);  // a PeerError: its code is Io (a peer closed) or Timeout
  CHECK((lost.code == static_cast<int>(ErrorCode::Io) || lost.code == static_cast<int>(ErrorCode::Timeout)));
  if (me != victim) {
    if (effect == engine::FaultEffect::Exit) CHECK(lost.seconds < 5.0);
    else CHECK(lost.seconds < (kLostTimeoutMs + 3000) / 1000.0);
    if (effect == engine::FaultEffect::Stop && comm->size() == 2)
      CHECK(lost.code == static_cast<int>(ErrorCode::Timeout));
    // A timeout names no survivor as the peer (docs/transport.md, "Failures").
    if (lost.code == static_cast<int>(ErrorCode::Timeout))
      for (int r = 0; r < victim; ++r) CHECK(!contains(lost.message, "with peer rank " + std::to_string(r) + ":"));
  }
  snapshot.check_unchanged(job);
  CHECK(job.reducer->iteration() == 3);  // a failed step counts as taken (docs/errors.md)
}

}  // namespace

TEST_CASE("outer: a rank that dies before its first collective of an outer step") {
  lost_in_outer_step(engine::FaultPoint::Prepare, engine::FaultEffect::Exit, "outer-dies-prepare");
}
TEST_CASE("outer: a rank that dies between the P and Q collectives of an outer step") {
  lost_in_outer_step(engine::FaultPoint::Between, engine::FaultEffect::Exit, "outer-dies-between");
}
TEST_CASE("outer: a rank that stalls between the P and Q collectives of an outer step") {
  lost_in_outer_step(engine::FaultPoint::Between, engine::FaultEffect::Stop, "outer-stalls-between");
}

TEST_CASE("outer: the ranks agree on the config and on what they load") {
  auto comm = connect("outer-agree");
  const int me = comm->rank();
  const int culprit = comm->size() - 1;
  {
    // Another outer learning rate on one rank: MismatchError on every rank, naming it.
    const Outcome o = outcome_of([&] { Job job(*comm, compressed(), OuterConfig{4, me == culprit ? 0.5 : 0.7, 0.9}); });
    CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
    CHECK(contains(o.message, "rank " + std::to_string(culprit) + "'s config (local_steps = 4, lr = 0.5"));
  }
  {
    // A bad momentum on one rank: InvalidArgumentError on every rank, the others naming it.
    const Outcome o = outcome_of([&] { Job job(*comm, compressed(), OuterConfig{4, 0.7, me == culprit ? 1.0 : 0.9}); });
    CHECK(o.code == static_cast<int>(ErrorCode::InvalidArgument));
    CHECK(contains(o.message, "outer.momentum = 1: expected 0 <= momentum < 1"));
    if (me != culprit) CHECK(contains(o.message, "failed on rank " + std::to_string(culprit)));
  }
  // Files of two outer steps: a rank loading the other one fails every rank, nothing loaded.
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("psgd-outer-agree-" + std::to_string(::getppid()) + "-" + std::to_string(me));
  std::filesystem::create_directories(dir);
  Job job(*comm, compressed());
  local_steps(job.params, 0, me);
  job.step();
  job.outer->save(dir + "/step1");
  local_steps(job.params, 1, me);
  job.step();
  job.outer->save(dir + "/step2");
  const std::vector<float> start = copy(job.outer->start(1));
  const Outcome o = outcome_of([&] { job.outer->load(dir + (me == culprit ? "/step1" : "/step2")); });
  CHECK(o.code == static_cast<int>(ErrorCode::Mismatch));
  CHECK(contains(o.message, "nothing loaded on any rank"));
  CHECK(copy(job.outer->start(1)) == start);
  CHECK(job.outer->outer_steps() == 2);
  // A missing file on one rank: IoError on every rank.
  const Outcome missing = outcome_of([&] { job.outer->load(dir + (me == culprit ? "/none" : "/step1")); });
  CHECK(missing.code == static_cast<int>(ErrorCode::Io));
  CHECK(job.outer->outer_steps() == 2);
  // Every rank loading the same step: loaded.
  CHECK(error_of([&] { job.outer->load(dir + "/step1"); }).empty());
  CHECK(job.outer->outer_steps() == 1);
  check_identical(*comm, job);
  // Another Reducer on the same communicator with a reduction in flight, rank 0 late to it: the load's agreement
  // takes its turn after that reduction on every rank (it interleaved with it, and the group broke: a timeout on
  // one rank, a closed connection on another).
  Reducer other(*comm, plain());
  other.add_bucket(kBucket0);
  std::vector<float> g(other.bucket_size(0), static_cast<float>(me + 1));
  if (me == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const ReduceHandle handle = other.reduce_async(0, g.data());
  CHECK(error_of([&] { job.outer->load(dir + "/step2"); }).empty());
  CHECK(error_of([&] { handle.wait(); }).empty());
  const float mean = static_cast<float>(comm->size() + 1) / 2.0f;  // of 1 .. n: exact
  CHECK(std::all_of(g.begin(), g.end(), [&](float v) { return v == mean; }));
  CHECK(job.outer->outer_steps() == 2);
  check_identical(*comm, job);
  std::filesystem::remove_all(dir);
}

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) return 77;
  return powersgd::testing::run_selected_tests(argc, argv);
}
