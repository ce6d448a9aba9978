// OuterOptimizer (include/powersgd/outer_optimizer.hpp, docs/local-steps.md) in
// one process (world size 1): the outer step's arithmetic against a reference
// computed here, bad arguments, a failed step that changes nothing, and a
// checkpoint that resumes bit for bit. tests/multiprocess/test_outer_mp.cpp has
// the properties that need several ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "c_comm_of_one.hpp"
#include "engine/checkpoint.hpp"
#include "error_of.hpp"
#include "powersgd/outer_optimizer.hpp"
#include "powersgd/powersgd.h"

using namespace powersgd;
using powersgd::test::error_of;

namespace {

std::unique_ptr<Communicator> solo() { return Communicator::create(CommOptions::single_process()); }

const std::vector<Shape> kBucket0 = {{16, 8}, {8}};
const std::vector<Shape> kBucket1 = {{12, 10}};

// Plain averaged allreduce for every step (an exact mean), or PowerSGD rank 1 with error feedback from step 0.
Config plain() {
  Config c;
  c.start_iter = std::numeric_limits<int64_t>::max();
  return c;
}
Config compressed() {
  Config c;
  c.rank = 1;
  c.start_iter = 0;
  return c;
}

// A model's parameters in the reducer's two buckets.
struct Params {
  std::vector<float> b0 = std::vector<float>(16 * 8 + 8), b1 = std::vector<float>(12 * 10);
  std::vector<std::span<float>> spans() { return {std::span<float>(b0), std::span<float>(b1)}; }
  std::vector<float>& operator[](size_t b) { return b == 0 ? b0 : b1; }
};

// Deterministic values: dyadic, so sums and differences of a few are exact.
float value(uint64_t seed, size_t i) { return static_cast<float>(static_cast<int>((seed * 7919 + i * 104729) % 64) - 32) / 64.0f; }

void init(Params& p, uint64_t seed) {
  for (size_t b = 0; b < 2; ++b)
    for (size_t i = 0; i < p[b].size(); ++i) p[b][i] = value(seed, i + 1000 * b);
}

// H "inner steps": a local move away from the start point.
void local_steps(Params& p, uint64_t seed) {
  for (size_t b = 0; b < 2; ++b)
    for (size_t i = 0; i < p[b].size(); ++i) p[b][i] -= value(seed + 17, i + 1000 * b) / 8.0f;
}

struct Job {
  std::unique_ptr<Communicator> comm = solo();
  std::unique_ptr<Reducer> reducer;
  std::unique_ptr<OuterOptimizer> outer;
  Params params;
  explicit Job(const Config& config, const OuterConfig& outer_config = {}, uint64_t seed = 1) {
    reducer = std::make_unique<Reducer>(*comm, config);
    reducer->add_bucket(kBucket0);
    reducer->add_bucket(kBucket1);
    init(params, seed);
    const auto spans = params.spans();
    outer = std::make_unique<OuterOptimizer>(*comm, *reducer, outer_config, spans);
  }
  void step() {
    const auto spans = params.spans();
    outer->step(spans);
  }
};

std::vector<float> error_feedback(const Reducer& r, int b) {
  std::vector<float> e(r.bucket_size(b));
  r.error_feedback(b, std::span<float>(e));
  return e;
}

std::vector<float> copy(std::span<const float> s) { return {s.begin(), s.end()}; }

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string("psgd-outer-") + std::to_string(::getpid()) + "-" + name))
      .string();
}

}  // namespace

TEST_CASE("outer: a bad config is refused naming the field, its value and the range") {
  CHECK(error_of([] { OuterConfig{0, 0.7, 0.9}.validate(); }) ==
        "outer.local_steps = 0: expected at least 1 inner step per outer step");
  CHECK(error_of([] { OuterConfig{-3, 0.7, 0.9}.validate(); }).starts_with("outer.local_steps = -3: "));
  CHECK(error_of([] { OuterConfig{4, 0.0, 0.9}.validate(); })
            .starts_with("outer.lr = 0: expected a finite learning rate > 0 that float holds (1.17549e-38 to "));
  // Checked as the float the step computes with: infinite, zero, and a momentum of 1.
  CHECK(error_of([] { OuterConfig{4, 1e39, 0.9}.validate(); }).starts_with("outer.lr = 1e+39: "));
  CHECK(error_of([] { OuterConfig{4, 1e-50, 0.9}.validate(); }).starts_with("outer.lr = 1e-50: "));
  CHECK(error_of([] { OuterConfig{4, 0.7, 0.99999999999}.validate(); }).starts_with("outer.momentum = 1: "));
  CHECK(error_of([] { OuterConfig{4, -1.0, 0.9}.validate(); }).starts_with("outer.lr = -1: "));
  CHECK(error_of([] { OuterConfig{4, std::nan(""), 0.9}.validate(); }).starts_with("outer.lr = nan: "));
  CHECK(error_of([] { OuterConfig{4, INFINITY, 0.9}.validate(); }).starts_with("outer.lr = inf: "));
  CHECK(error_of([] { OuterConfig{4, 0.7, 1.0}.validate(); }) ==
        "outer.momentum = 1: expected 0 <= momentum < 1 (below 1 also as a float)");
  CHECK(error_of([] { OuterConfig{4, 0.7, -0.1}.validate(); }).starts_with("outer.momentum = -0.1: "));
  CHECK(error_of([] { OuterConfig{4, 0.7, std::nan("")}.validate(); }).starts_with("outer.momentum = nan: "));
  CHECK(error_of([] { OuterConfig{1, 1.0, 0.0}.validate(); }).empty());
  CHECK(error_of([] { OuterConfig{}.validate(); }).empty());
  // The constructor validates it too, and a refused construction is an InvalidArgumentError.
  CHECK_THROWS_AS(Job(plain(), OuterConfig{4, 0.7, 1.5}), InvalidArgumentError);
}

TEST_CASE("outer: the constructor refuses buffers that are not the reducer's buckets, and a reducer without buckets") {
  auto comm = solo();
  Reducer reducer(*comm, plain());
  std::vector<float> a(16 * 8 + 8), b(12 * 10), short_b(12 * 10 - 1);
  std::vector<std::span<float>> one = {std::span<float>(a)};
  CHECK(error_of([&] { OuterOptimizer(*comm, reducer, {}, one); }) ==
        "OuterOptimizer: the reducer has no buckets: declare every bucket (add_bucket) first");
  reducer.add_bucket(kBucket0);
  reducer.add_bucket(kBucket1);
  CHECK(error_of([&] { OuterOptimizer(*comm, reducer, {}, one); }) ==
        "OuterOptimizer: 1 parameter buffers: expected one per bucket of the reducer, 2");
  std::vector<std::span<float>> wrong = {std::span<float>(a), std::span<float>(short_b)};
  CHECK(error_of([&] { OuterOptimizer(*comm, reducer, {}, wrong); }) ==
        "OuterOptimizer: params[1] has 119 floats, bucket 1 has 120");
  std::vector<std::span<float>> null = {std::span<float>(), std::span<float>(b)};
  CHECK(error_of([&] { OuterOptimizer(*comm, reducer, {}, null); }) == "OuterOptimizer: params[0] is null");
  std::vector<std::span<float>> good = {std::span<float>(a), std::span<float>(b)};
  CHECK(error_of([&] { OuterOptimizer(*comm, reducer, {}, good); }).empty());
}

TEST_CASE("outer: due() every local_steps inner steps") {
  Job job(plain(), OuterConfig{4, 0.7, 0.9});
  CHECK(!job.outer->due(0));
  CHECK(!job.outer->due(3));
  CHECK(job.outer->due(4));
  CHECK(!job.outer->due(5));
  CHECK(job.outer->due(8));
  CHECK(job.outer->config().local_steps == 4);
}

// With a plain averaged allreduce of one rank the reduced pseudo-gradient is
// exactly the local one; the update is PyTorch's SGD(nesterov=True): v = mu v + g,
// p = p - lr (g + mu v).
TEST_CASE("outer: Nesterov momentum from the start point, against a reference") {
  SUBCASE("one value by hand") {
    Job job(plain(), OuterConfig{4, 0.5, 0.5});
    const float start = job.params[0][0];
    job.params[0][0] = start - 1.0f;  // pseudo-gradient 1
    job.step();
    // v = 1, p = start - 0.5 (1 + 0.5) = start - 0.75
    CHECK(job.outer->momentum(0)[0] == 1.0f);
    CHECK(job.params[0][0] == start - 0.75f);
    CHECK(job.outer->start(0)[0] == start - 0.75f);
    job.params[0][0] -= 2.0f;  // pseudo-gradient 2
    job.step();
    // v = 0.5 + 2 = 2.5, p -= 0.5 (2 + 1.25) = 1.625
    CHECK(job.outer->momentum(0)[0] == 2.5f);
    CHECK(job.params[0][0] == start - 0.75f - 1.625f);
    CHECK(job.outer->outer_steps() == 2);
  }
  SUBCASE("every element, five steps, bit for bit") {
    const OuterConfig oc{3, 0.7, 0.9};
    Job job(plain(), oc);
    Params start = job.params, v;
    for (size_t b = 0; b < 2; ++b) std::fill(v[b].begin(), v[b].end(), 0.0f);
    const float mu = 0.9f, lr = 0.7f;
    for (int t = 0; t < 5; ++t) {
      local_steps(job.params, t);
      Params expected;
      for (size_t b = 0; b < 2; ++b)
        for (size_t i = 0; i < v[b].size(); ++i) {
          const float g = start[b][i] - job.params[b][i];
          v[b][i] = mu * v[b][i] + g;
          start[b][i] = start[b][i] - lr * (g + mu * v[b][i]);
        }
      job.step();
      for (size_t b = 0; b < 2; ++b) {
        CHECK(job.params[b] == start[b]);
        CHECK(copy(job.outer->start(int(b))) == start[b]);
        CHECK(copy(job.outer->momentum(int(b))) == v[b]);
      }
    }
    CHECK(job.reducer->iteration() == 5);
  }
}

TEST_CASE("outer: a failed outer step changes nothing, and the next one equals a run without it") {
  // Twin jobs with PowerSGD and error feedback; one takes a failing step in between.
  Job failing(compressed()), twin(compressed());
  for (int t = 0; t < 2; ++t) {
    local_steps(failing.params, t);
    local_steps(twin.params, t);
    failing.step();
    twin.step();
  }
  const std::vector<float> start0 = copy(failing.outer->start(0)), momentum1 = copy(failing.outer->momentum(1));
  const std::vector<float> error0 = error_feedback(*failing.reducer, 0), error1 = error_feedback(*failing.reducer, 1);
  REQUIRE(error0 != std::vector<float>(error0.size(), 0.0f));  // there is error memory to keep
  local_steps(failing.params, 7);
  const Params before = failing.params;

  SUBCASE("NaN in a parameter") {
    failing.params[1][5] = std::nan("");
    CHECK_THROWS_AS(failing.step(), NonFiniteError);
    CHECK(std::isnan(failing.params[1][5]));  // the caller's buffers as they were
    failing.params = before;
  }
  SUBCASE("a buffer of the wrong size") {
    std::vector<float> short_b(119);
    std::vector<std::span<float>> wrong = {std::span<float>(failing.params.b0), std::span<float>(short_b)};
    const std::string message = error_of([&] { failing.outer->step(wrong); });
    CHECK(message.starts_with("outer step 2: "));
    CHECK(message.find("has 119 elements, bucket 1 has 120") != std::string::npos);
    CHECK(message.find("start point, outer momentum and parameters unchanged") != std::string::npos);
    std::vector<std::span<float>> one = {std::span<float>(failing.params.b0)};
    CHECK_THROWS_AS(failing.outer->step(one), InvalidArgumentError);
  }
  CHECK(failing.params.b0 == before.b0);
  CHECK(failing.params.b1 == before.b1);
  CHECK(copy(failing.outer->start(0)) == start0);
  CHECK(copy(failing.outer->momentum(1)) == momentum1);
  CHECK(failing.outer->outer_steps() == 2);
  CHECK(error_feedback(*failing.reducer, 0) == error0);
  CHECK(error_feedback(*failing.reducer, 1) == error1);

  // The next steps succeed and equal the twin's, which never failed (warm start and error memory kept).
  for (int t = 7; t < 10; ++t) {
    if (t > 7) local_steps(failing.params, t);
    local_steps(twin.params, t);
    failing.step();
    twin.step();
    CHECK(failing.params.b0 == twin.params.b0);
    CHECK(failing.params.b1 == twin.params.b1);
    CHECK(copy(failing.outer->momentum(0)) == copy(twin.outer->momentum(0)));
  }
  CHECK(failing.outer->outer_steps() == 5);
}

// A bucket given to the Reducer after the optimizer was made: the optimizer's check refused the step, but it
// passed the caller's buffers on, which the Reducer (one bucket more) took and reduced in place.
TEST_CASE("outer: a reducer given another bucket after the optimizer: steps refused, nothing touched") {
  Job job(compressed());
  job.reducer->add_bucket({{6, 6}});  // allowed until the Reducer's first reduction
  local_steps(job.params, 1);
  std::vector<float> extra(36, 0.25f);
  const Params before = job.params;
  const std::vector<float> error = error_feedback(*job.reducer, 0), start = copy(job.outer->start(0));
  std::vector<std::span<float>> three = {std::span<float>(job.params.b0), std::span<float>(job.params.b1),
                                         std::span<float>(extra)};
  for (const std::vector<std::span<float>>* buffers : {&three, static_cast<decltype(&three)>(nullptr)}) {
    const std::string message = error_of([&] {
      if (buffers != nullptr) job.outer->step(*buffers);
      else job.step();
    });
    CHECK(message == "OuterOptimizer::step: the reducer has 3 buckets, this OuterOptimizer was made for 2: declare "
                     "every bucket (add_bucket) before making it");
    CHECK(job.params.b0 == before.b0);
    CHECK(job.params.b1 == before.b1);
    CHECK(std::all_of(extra.begin(), extra.end(), [](float v) { return v == 0.25f; }));
    CHECK(error_feedback(*job.reducer, 0) == error);
    CHECK(copy(job.outer->start(0)) == start);
  }
}

// An update past float's range wrote infinities into the start point and the parameters, as a success.
TEST_CASE("outer: a step whose update would not be finite fails, the start point and parameters unchanged") {
  Job job(plain(), OuterConfig{1, 10.0, 0.0});
  const std::vector<float> start = copy(job.outer->start(0));
  job.params.b0[3] = -3e38f;  // a pseudo-gradient of 3e38, times lr 10
  const Params before = job.params;
  const std::string message = error_of([&] { job.step(); });
  CHECK(message.starts_with("outer step 0: bucket 0 element 3 would leave the start point or the outer momentum "
                            "non-finite"));
  CHECK(copy(job.outer->start(0)) == start);
  CHECK(job.params.b0 == before.b0);
  CHECK(job.outer->outer_steps() == 0);
  job.params.b0[3] = job.outer->start(0)[3];  // back in range: the next step goes on
  job.step();
  CHECK(job.outer->outer_steps() == 1);
}

TEST_CASE("outer: a checkpoint resumes bit for bit; a damaged or foreign file is refused, state unchanged") {
  const std::string outer_path = temp_path("outer.ckpt"), reducer_path = temp_path("reducer.ckpt");
  Job uninterrupted(compressed());
  for (int t = 0; t < 6; ++t) {
    local_steps(uninterrupted.params, t);
    uninterrupted.step();
  }
  Params saved_params;
  {
    Job first(compressed());
    for (int t = 0; t < 3; ++t) {
      local_steps(first.params, t);
      first.step();
    }
    first.outer->save(outer_path);
    first.reducer->save(reducer_path);
    saved_params = first.params;
  }
  Job resumed(compressed(), OuterConfig{}, /*seed=*/99);  // another start point until the load
  resumed.outer->load(outer_path);
  resumed.reducer->load(reducer_path);
  CHECK(resumed.outer->outer_steps() == 3);
  resumed.params = saved_params;
  for (int t = 3; t < 6; ++t) {
    local_steps(resumed.params, t);
    resumed.step();
  }
  CHECK(resumed.params.b0 == uninterrupted.params.b0);
  CHECK(resumed.params.b1 == uninterrupted.params.b1);
  CHECK(copy(resumed.outer->momentum(1)) == copy(uninterrupted.outer->momentum(1)));

  // Refusals leave the state as it was.
  const std::vector<float> start = copy(resumed.outer->start(0));
  const auto refused = [&](const std::string& path) {
    const std::string message = error_of([&] { resumed.outer->load(path); });
    CHECK(copy(resumed.outer->start(0)) == start);
    CHECK(resumed.outer->outer_steps() == 6);
    return message;
  };
  CHECK(refused("/nonexistent/outer.ckpt").starts_with("cannot open checkpoint /nonexistent/outer.ckpt"));
  CHECK(refused(reducer_path) == "checkpoint " + reducer_path + " is a per-rank checkpoint (Reducer::save), not an "
                                 "outer-optimizer checkpoint (OuterOptimizer::save): load it with Reducer::load "
                                 "or load_shared");
  {
    std::vector<char> bytes;
    {
      std::ifstream in(outer_path, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    bytes[bytes.size() / 2] ^= 1;
    const std::string corrupt = temp_path("corrupt.ckpt");
    std::ofstream(corrupt, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    CHECK(refused(corrupt).find("is corrupted: CRC-32") != std::string::npos);
    bytes.resize(bytes.size() - 10);
    std::ofstream(corrupt, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
    CHECK(refused(corrupt).find("is truncated") != std::string::npos);
    // A NaN in the start point under a valid CRC: refused (loaded, every later step failed).
    bytes.clear();
    {
      std::ifstream in(outer_path, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    std::vector<char> payload(bytes.begin() + engine::kCheckpointHeaderBytes, bytes.end());
    const float nan = std::nanf("");
    std::memcpy(payload.data() + 44, &nan, sizeof nan);  // bucket 0's first start value
    const std::vector<char> framed =
        engine::frame_checkpoint(engine::kOuterCheckpointMagic, engine::kOuterCheckpointVersion, payload);
    std::ofstream(corrupt, std::ios::binary | std::ios::trunc).write(framed.data(), std::streamsize(framed.size()));
    CHECK(refused(corrupt).find("is malformed: bucket 0's outer start point holds nan at 0") != std::string::npos);
    std::filesystem::remove(corrupt);
  }
  {
    Job other(compressed(), OuterConfig{1, 0.5, 0.9});
    const std::string message = error_of([&] { other.outer->load(outer_path); });
    CHECK(message == "checkpoint " + outer_path +
                         " was saved with outer config local_steps = 1, lr = 1, momentum = 0, this OuterOptimizer "
                         "has local_steps = 1, lr = 0.5, momentum = 0.9");
  }
  std::filesystem::remove(outer_path);
  std::filesystem::remove(reducer_path);
}
TEST_CASE("outer: the C API, against the C++ class") {
  psgd_comm* comm = powersgd::test::c_comm_of_one();
  psgd_config config = psgd_config_default();
  config.start_iter = 0;
  psgd_reducer* r = nullptr;
  REQUIRE(psgd_reducer_create(comm, &config, &r) == PSGD_OK);
  const int ndims[] = {2, 1};
  const int64_t dims0[] = {16, 8, 8};
  const int64_t dims1[] = {12, 10};
  int b = -1;
  REQUIRE(psgd_reducer_add_bucket(r, 2, ndims, dims0, &b) == PSGD_OK);
  REQUIRE(psgd_reducer_add_bucket(r, 1, ndims, dims1, &b) == PSGD_OK);
  Params p;
  init(p, 1);
  float* params[2] = {p.b0.data(), p.b1.data()};
  psgd_outer* o = nullptr;
  CHECK(psgd_outer_create(comm, r, 4, 0.7, 1.0, params, 2, &o) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) ==
        "psgd_outer_create: outer.momentum = 1: expected 0 <= momentum < 1 (below 1 also as a float)");
  CHECK(o == nullptr);
  CHECK(psgd_outer_create(comm, r, 4, 0.7, 0.9, params, 1, &o) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) ==
        "psgd_outer_create: num_buckets = 1: expected the reducer's bucket count, 2");
  // A count the caller's array cannot hold: refused from the count, no vector of that many made (it failed
  // this rank alone, out of memory, while the others waited).
  CHECK(psgd_outer_create(comm, r, 4, 0.7, 0.9, params, size_t{1} << 58, &o) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("num_buckets = 288230376151711744") != std::string::npos);
  CHECK(psgd_outer_create(comm, r, 4, 0.7, 0.9, nullptr, 2, &o) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) == "psgd_outer_create: argument 'params' is null");
  CHECK(psgd_outer_create(comm, nullptr, 4, 0.7, 0.9, params, 2, &o) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) == "psgd_outer_create: argument 'r' is null");
  CHECK(psgd_outer_create(comm, r, 4, 0.7, 0.9, params, 2, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) == "psgd_outer_create: argument 'out' is null");
  CHECK(psgd_outer_create(nullptr, r, 4, 0.7, 0.9, params, 2, &o) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(o == nullptr);
  REQUIRE(psgd_outer_create(comm, r, 4, 0.7, 0.9, params, 2, &o) == PSGD_OK);
  CHECK(psgd_outer_due(o, 4) == 1);
  CHECK(psgd_outer_due(o, 5) == 0);
  CHECK(psgd_outer_due(nullptr, 4) == -1);

  Job cpp(compressed(), OuterConfig{4, 0.7, 0.9});  // the same steps through the C++ class
  for (int t = 0; t < 3; ++t) {
    local_steps(p, t);
    local_steps(cpp.params, t);
    REQUIRE(psgd_outer_step(o, params, 2) == PSGD_OK);
    cpp.step();
    CHECK(p.b0 == cpp.params.b0);
    CHECK(p.b1 == cpp.params.b1);
  }
  CHECK(psgd_outer_steps(o) == 3);
  CHECK(psgd_outer_steps(nullptr) == -1);
  std::vector<float> start(120);
  CHECK(psgd_outer_start(o, 1, start.data()) == PSGD_OK);
  CHECK(start == copy(cpp.outer->start(1)));
  CHECK(psgd_outer_start(o, 2, start.data()) == PSGD_ERR_INVALID_ARGUMENT);

  // A null buffer: refused, nothing changed.
  float* null_params[2] = {p.b0.data(), nullptr};
  const Params before = p;
  CHECK(psgd_outer_step(o, null_params, 2) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("data[1] is null") != std::string::npos);
  CHECK(psgd_outer_step(o, params, 1) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) == "psgd_outer_step: num_buckets = 1: expected the reducer's bucket count, 2");
  CHECK(psgd_outer_step(o, params, SIZE_MAX) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("num_buckets = 18446744073709551615") != std::string::npos);
  CHECK(psgd_outer_step(o, nullptr, 2) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) == "psgd_outer_step: argument 'params' is null");
  CHECK(psgd_outer_steps(o) == 3);
  CHECK(p.b0 == before.b0);

  const std::string path = temp_path("c.ckpt");
  CHECK(psgd_outer_save(o, path.c_str()) == PSGD_OK);
  CHECK(psgd_outer_save(o, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  local_steps(p, 5);
  REQUIRE(psgd_outer_step(o, params, 2) == PSGD_OK);
  CHECK(psgd_outer_load(o, path.c_str()) == PSGD_OK);
  CHECK(psgd_outer_steps(o) == 3);
  CHECK(psgd_outer_load(o, "/nonexistent") == PSGD_ERR_IO);
  CHECK(psgd_outer_load(o, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()) == "psgd_outer_load: argument 'path' is null");
  CHECK(psgd_outer_steps(o) == 3);
  std::filesystem::remove(path);
  psgd_outer_destroy(o);
  psgd_outer_destroy(nullptr);
  psgd_reducer_destroy(r);
  psgd_comm_destroy(comm);
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
