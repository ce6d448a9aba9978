// OuterOptimizer (docs/local-steps.md) across real processes: replicas bitwise
// identical after every outer step while each rank's inner steps differ; the
// uncompressed outer step against a reference computed here from every rank's
// pseudo-gradient; a failed outer step (NaN on one rank, a buffer refused on
// one rank) changes nothing on any rank and the next one gives the bits of a
// run that never tried it; the constructor and load agree across ranks. Every
// rank runs this binary under powersgd-run with one case selected:
//   powersgd-run -n 3 --timeout 120 -- test_outer_mp -tc='outer: replicas*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "engine/order_guard.hpp"
#include "error_of.hpp"
#include "powersgd/outer_optimizer.hpp"

using namespace powersgd;
using powersgd::test::error_of;
using powersgd::test::Outcome;
using powersgd::test::outcome_of;

namespace {

constexpr int kTimeoutMs = 20000;

std::unique_ptr<Communicator> connect(const char* run_id) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  o.timeout = std::chrono::milliseconds(kTimeoutMs);
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
  const std::vector<float> start0 = copy(job.outer->start(0)), start1 = copy(job.outer->start(1));
  const std::vector<float> momentum0 = copy(job.outer->momentum(0)), momentum1 = copy(job.outer->momentum(1));
  const std::vector<float> error0 = error_feedback(*job.reducer, 0), error1 = error_feedback(*job.reducer, 1);
  REQUIRE(error0 != std::vector<float>(error0.size(), 0.0f));
  const auto unchanged = [&] {
    CHECK(job.params.b0 == before.b0);
    CHECK(job.params.b1 == before.b1);
    CHECK(copy(job.outer->start(0)) == start0);
    CHECK(copy(job.outer->start(1)) == start1);
    CHECK(copy(job.outer->momentum(0)) == momentum0);
    CHECK(copy(job.outer->momentum(1)) == momentum1);
    CHECK(job.outer->outer_steps() == 2);
    CHECK(error_feedback(*job.reducer, 0) == error0);
    CHECK(error_feedback(*job.reducer, 1) == error1);
  };

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
  std::filesystem::remove_all(dir);
}

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) return 77;
  return powersgd::testing::run_selected_tests(argc, argv);
}
