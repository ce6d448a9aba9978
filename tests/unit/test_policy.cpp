// The rank policy (engine/policy.hpp) in one process (world size 1): warm-up,
// learning-rate notes and their boost, composed with a fixed rank and with the
// adaptive rule, the decision log, and the policy state in checkpoints. Across
// ranks (agreement, a note on one rank only): tests/multiprocess/test_engine_mp.cpp.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "compute/backend.hpp"
#include "engine/checkpoint.hpp"
#include "engine_reference.hpp"
#include "error_of.hpp"
#include "c_comm_of_one.hpp"
#include "powersgd/powersgd.h"

using namespace powersgd;
using powersgd::test::error_of;
using powersgd::test::gradients;

namespace {

std::unique_ptr<Communicator> solo() { return Communicator::create(CommOptions::single_process()); }

std::string temp_path(const char* tag) {
  return "/tmp/psgd-test-policy-" + std::to_string(::getpid()) + "-" + tag;
}

const std::vector<Shape> kShapes = {{24, 30}, {30}, {16, 20}};

struct Entry {
  int64_t step;
  int rank;
  RankReason reason;
  bool operator==(const Entry&) const = default;
};

std::vector<Entry> entries_of(const std::vector<RankDecision>& log, int bucket) {
  std::vector<Entry> out;
  for (const auto& d : log)
    if (d.bucket == bucket) out.push_back({d.step, d.rank, d.reason});
  return out;
}

doctest::String describe(const std::vector<Entry>& entries) {
  std::string text;
  for (const auto& e : entries)
    text += "{" + std::to_string(e.step) + "," + std::to_string(e.rank) + "," + rank_reason_name(e.reason) + "} ";
  return text.c_str();
}

// Runs `steps` steps of reduce_all over two buckets (steady gradients), noting a learning-rate change
// before each step in `notes`; returns bucket_rank(0) before each step (before its note).
std::vector<int> run(Reducer& reducer, int from, int to, const std::vector<int>& notes) {
  std::vector<int> ranks;
  for (int step = from; step < to; ++step) {
    ranks.push_back(reducer.bucket_rank(0));  // a note applies when the step's reduction announced it
    for (int n : notes)
      if (n == step) reducer.note_lr_change();
    std::vector<float> a = gradients(reducer.bucket_size(0), 0, step % 3);
    std::vector<float> b = gradients(reducer.bucket_size(1), 1, step % 3);
    std::vector<std::span<float>> data = {a, b};
    reducer.reduce_all(data);
  }
  return ranks;
}

}  // namespace

TEST_CASE("policy: warm-up and a learning-rate note boost a fixed rank to rank_high, then it returns") {
  auto comm = solo();
  Config c;
  c.rank = 1;
  c.rank_high = 3;
  c.start_iter = 2;
  c.warmup_steps = 3;
  c.lr_boost_steps = 2;
  Reducer reducer(*comm, c);
  reducer.add_bucket(kShapes);
  reducer.add_bucket({{16, 20}});
  // Steps 0, 1 uncompressed; 2..4 warm-up; a note before step 8 boosts steps 8, 9.
  const std::vector<int> ranks = run(reducer, 0, 12, {8});
  CHECK(ranks == std::vector<int>{3, 3, 3, 3, 3, 1, 1, 1, 1, 3, 1, 1});
  // Taken in parts, as psgd_reducer_decisions takes them: decisions(max) gives the oldest, the rest wait.
  CHECK(reducer.decisions(0).empty());
  std::vector<RankDecision> log = reducer.decisions(3);
  CHECK(log.size() == 3);
  for (const RankDecision& d : reducer.decisions()) log.push_back(d);
  const std::vector<Entry> expected = {{2, 3, RankReason::Warmup}, {5, 1, RankReason::Fixed},
                                       {8, 3, RankReason::LrNote}, {10, 1, RankReason::Fixed}};
  for (int b : {0, 1}) {
    CAPTURE(b);
    CAPTURE(describe(entries_of(log, b)));
    CHECK(entries_of(log, b) == expected);
  }
  CHECK(reducer.decisions().empty());  // taken
  CHECK(std::string(rank_reason_name(RankReason::NormChangeLow)) == "norm_change_low");
}

TEST_CASE("policy: a fixed rank at or above rank_high is never boosted; lr_boost_steps 0 ignores notes") {
  auto comm = solo();
  Config c;
  c.rank = 4;
  c.rank_high = 2;
  c.start_iter = 0;
  c.warmup_steps = 2;
  Reducer reducer(*comm, c);
  reducer.add_bucket(kShapes);
  reducer.add_bucket({{16, 20}});
  CHECK(run(reducer, 0, 5, {3}) == std::vector<int>{4, 4, 4, 4, 4});

  Config off;
  off.rank = 1;
  off.start_iter = 0;
  off.lr_boost_steps = 0;
  Reducer quiet(*comm, off);
  quiet.add_bucket(kShapes);
  quiet.add_bucket({{16, 20}});
  CHECK(run(quiet, 0, 4, {1}) == std::vector<int>{1, 1, 1, 1});
  CHECK(entries_of(quiet.decisions(), 0) == std::vector<Entry>{{0, 1, RankReason::Fixed}});
}

TEST_CASE("policy: note_lr_change only at a step boundary, after add_bucket; fields validated") {
  auto comm = solo();
  Config c;
  c.start_iter = 0;
  Reducer reducer(*comm, c);
  CHECK(error_of([&] { reducer.note_lr_change(); }).find("before any add_bucket") != std::string::npos);
  reducer.add_bucket(kShapes);
  reducer.add_bucket({{16, 20}});
  std::vector<float> a = gradients(reducer.bucket_size(0), 0, 0);
  reducer.reduce(0, a.data());
  CHECK_THROWS_AS(reducer.note_lr_change(), InvalidArgumentError);
  std::vector<float> b = gradients(reducer.bucket_size(1), 0, 0);
  reducer.reduce(1, b.data());
  reducer.note_lr_change();
  Config bad;
  bad.warmup_steps = -1;
  CHECK(error_of([&] { bad.validate(); }).find("config.warmup_steps = -1: expected >= 0") != std::string::npos);
  bad = Config{};
  bad.lr_boost_steps = -5;
  CHECK(error_of([&] { bad.validate(); }).find("config.lr_boost_steps = -5") != std::string::npos);
}

// The note's level switch ran before the step: a step that then failed (NaN, a local failure) kept the new
// level, the rewritten warm P and Q and error memory, and the note's decision, and said "state unchanged".
TEST_CASE("policy: a noted step that fails leaves the rank, warm start, error memory and log as they were") {
  auto comm = solo();
  Config c;
  c.rank = 1;
  c.rank_high = 4;
  c.start_iter = 0;
  c.lr_boost_steps = 3;
  Reducer a(*comm, c), b(*comm, c);  // a fails the noted step, b skips it
  for (Reducer* r : {&a, &b}) {
    r->add_bucket(kShapes);
    r->add_bucket({{16, 20}});
  }
  const auto step = [&](Reducer& r, int t, bool poisoned) {
    std::vector<float> x = gradients(r.bucket_size(0), 0, t), y = gradients(r.bucket_size(1), 1, t);
    if (poisoned) x[5] = NAN;
    std::vector<std::span<float>> data = {x, y};
    r.reduce_all(data);
    return std::pair{x, y};
  };
  for (int t = 0; t < 3; ++t) CHECK(step(a, t, false) == step(b, t, false));
  a.note_lr_change();
  b.note_lr_change();
  std::vector<float> error_before(a.bucket_size(0));
  a.error_feedback(0, error_before);
  CHECK_THROWS_AS(step(a, 3, true), NonFiniteError);
  CHECK(a.bucket_rank(0) == 1);
  std::vector<float> error_after(a.bucket_size(0));
  a.error_feedback(0, error_after);
  CHECK(std::memcmp(error_before.data(), error_after.data(), error_before.size() * sizeof(float)) == 0);
  CHECK(entries_of(a.decisions(), 0) == entries_of(b.decisions(), 0));  // no LrNote of a step that failed
  // The note still pending applies on the next step: the boost, the same bits as b's.
  for (int t = 4; t < 9; ++t) {
    CAPTURE(t);
    CHECK(step(a, t, false) == step(b, t, false));
    CHECK(a.bucket_rank(0) == b.bucket_rank(0));
  }
  // A failed step is a step (a's 4th, b's 3rd): the boost of 3 steps from the note's, then the fixed rank.
  const std::vector<Entry> got = entries_of(a.decisions(), 0);
  CAPTURE(describe(got));
  CHECK(got == std::vector<Entry>{{4, 4, RankReason::LrNote}, {7, 1, RankReason::Fixed}});
  CHECK(entries_of(b.decisions(), 0) == std::vector<Entry>{{3, 4, RankReason::LrNote}, {6, 1, RankReason::Fixed}});
}

TEST_CASE("policy: with adaptive, a boost overrides the rule, which keeps measuring and decides after it") {
  auto comm = solo();
  Config c;
  c.start_iter = 0;
  c.adaptive = true;
  c.rank_low = 1;
  c.rank_high = 4;
  c.adaptive_interval = 4;
  c.lr_boost_steps = 5;
  Reducer reducer(*comm, c);
  reducer.add_bucket(kShapes);
  reducer.add_bucket({{16, 20}});
  // Windows end after steps 3, 7, 11, 15: the first at rank_high, steady ones (the same three gradients
  // in turn) at rank_low. A note before step 10 boosts 10..14; the rule's choice is back at step 15.
  const std::vector<int> ranks = run(reducer, 0, 17, {10});
  CHECK(ranks == std::vector<int>{4, 4, 4, 4, 4, 4, 4, 4, 1, 1, 1, 4, 4, 4, 4, 1, 1});
  const std::vector<Entry> got = entries_of(reducer.decisions(), 0);
  CAPTURE(describe(got));
  CHECK(got == std::vector<Entry>{{0, 4, RankReason::FirstWindow},
                                  {4, 4, RankReason::FirstWindow},
                                  {8, 1, RankReason::NormChangeLow},
                                  {10, 4, RankReason::LrNote},
                                  {15, 1, RankReason::NormChangeLow},
                                  {16, 1, RankReason::NormChangeLow}});
}

TEST_CASE("policy: a checkpoint mid-boost resumes bit-identically, decisions included; C API and log") {
  for (bool adaptive : {false, true}) {
    CAPTURE(adaptive);
    auto comm = solo();
    Config c;
    c.start_iter = 1;
    c.adaptive = adaptive;
    c.adaptive_interval = 3;
    c.warmup_steps = 2;
    c.lr_boost_steps = 4;
    const std::string path = temp_path("mid"), a_end = path + ".a", b_end = path + ".b";
    Reducer a(*comm, c);
    a.add_bucket(kShapes);
    a.add_bucket({{16, 20}});
    run(a, 0, 7, {5});
    a.note_lr_change();  // pending across the save
    a.save(path);
    (void)a.decisions();
    const std::vector<int> a_ranks = run(a, 7, 16, {9});
    const std::vector<RankDecision> a_log = a.decisions();
    a.save(a_end);

    Reducer b(*comm, c);
    b.add_bucket(kShapes);
    b.add_bucket({{16, 20}});
    b.load(path);
    CHECK(run(b, 7, 16, {9}) == a_ranks);
    const std::vector<RankDecision> b_log = b.decisions();
    REQUIRE(b_log.size() == a_log.size());
    for (size_t i = 0; i < a_log.size(); ++i) {
      CHECK(b_log[i].step == a_log[i].step);
      CHECK(b_log[i].bucket == a_log[i].bucket);
      CHECK(b_log[i].rank == a_log[i].rank);
      CHECK(b_log[i].reason == a_log[i].reason);
    }
    b.save(b_end);
    CHECK(engine::read_checkpoint_file(a_end) == engine::read_checkpoint_file(b_end));
    for (const auto& p : {path, a_end, b_end}) std::remove(p.c_str());
  }
}

TEST_CASE("policy: a fixed rank that never notes holds buffers for its rank only; a note lays out rank_high") {
  // The defaults' shape: a fixed rank below rank_high, lr_boost_steps > 0, no warm-up, not adaptive.
  Config c;
  c.rank = 1;
  c.rank_high = 3;
  c.start_iter = 0;
  c.lr_boost_steps = 2;
  Config rank_only = c;
  rank_only.lr_boost_steps = 0;  // levels {rank}: what the rank alone needs
  Config eager = c;
  eager.warmup_steps = 1;  // the high level in reach from the start: laid out at the first reduce
  auto comm = solo();
  // The engine's floats (compute::allocated_floats) held by a reducer after `steps` steps.
  const auto floats_after = [&](const Config& config, int steps, const std::vector<int>& notes) {
    const size_t before = compute::allocated_floats();
    Reducer reducer(*comm, config);
    reducer.add_bucket(kShapes);
    reducer.add_bucket({{16, 20}});
    run(reducer, 0, steps, notes);
    return compute::allocated_floats() - before;
  };
  const size_t lazy = floats_after(c, 3, {});
  CHECK(lazy == floats_after(rank_only, 3, {}));
  CHECK(lazy < floats_after(eager, 3, {}));
  CHECK(floats_after(c, 3, {1}) == floats_after(eager, 3, {}));  // a note before step 1 lays rank_high out

  // The buffers laid out at the note carry the warm state bit for bit: `a` grows at its note, `e` had the
  // high level's buffers before it (laid out by loading a file saved mid-boost, then resumed at a's state).
  const std::string mid = temp_path("lazy-mid"), at3 = temp_path("lazy-3"), a_end = at3 + ".a", e_end = at3 + ".e";
  Reducer boosted(*comm, c);
  boosted.add_bucket(kShapes);
  boosted.add_bucket({{16, 20}});
  run(boosted, 0, 2, {1});
  REQUIRE(boosted.bucket_rank(0) == 3);
  boosted.save(mid);
  Reducer a(*comm, c), e(*comm, c);
  for (Reducer* r : {&a, &e}) {
    r->add_bucket(kShapes);
    r->add_bucket({{16, 20}});
  }
  run(a, 0, 3, {});
  a.save(at3);
  e.load(mid);
  e.load(at3);
  std::vector<std::vector<float>> outputs[2];
  for (int i = 0; i < 2; ++i) {
    Reducer& r = i == 0 ? a : e;
    for (int step = 3; step < 8; ++step) {
      if (step == 4) r.note_lr_change();
      std::vector<float> x = gradients(r.bucket_size(0), 0, step % 3);
      std::vector<float> y = gradients(r.bucket_size(1), 1, step % 3);
      std::vector<std::span<float>> data = {x, y};
      r.reduce_all(data);
      outputs[i].push_back(x);
      outputs[i].push_back(y);
      if (step == 4) CHECK(r.bucket_rank(0) == 3);  // the boost in force
    }
  }
  CHECK(a.bucket_rank(0) == 1);  // boost over (steps 4 and 5)
  CHECK(outputs[0] == outputs[1]);
  a.save(a_end);
  e.save(e_end);
  CHECK(engine::read_checkpoint_file(a_end) == engine::read_checkpoint_file(e_end));
  for (const auto& p : {mid, at3, a_end, e_end}) std::remove(p.c_str());
}

TEST_CASE("policy: the C API's config fields, note and decision log") {
  psgd_comm* comm = test::c_comm_of_one();
  psgd_config config = psgd_config_default();
  CHECK(config.warmup_steps == 0);
  CHECK(config.lr_boost_steps == 100);
  config.start_iter = 0;
  config.rank = 1;
  config.rank_high = 2;
  config.lr_boost_steps = 1;
  psgd_reducer* r = nullptr;
  REQUIRE(psgd_reducer_create(comm, &config, &r) == PSGD_OK);
  const int ndims[1] = {2};
  const int64_t dims[2] = {16, 20};
  int bucket = -1;
  REQUIRE(psgd_reducer_add_bucket(r, 1, ndims, dims, &bucket) == PSGD_OK);
  std::vector<float> g = gradients(320, 0, 0);
  REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  REQUIRE(psgd_reducer_note_lr_change(r) == PSGD_OK);
  for (int step = 1; step < 3; ++step) REQUIRE(psgd_reducer_reduce(r, 0, g.data()) == PSGD_OK);
  // {0, 1, fixed}, {1, 2, lr_note}, {2, 1, fixed}: taken two at a time.
  int64_t steps[2];
  int buckets[2], ranks[2], reasons[2];
  size_t count = 0;
  REQUIRE(psgd_reducer_decisions(r, steps, buckets, ranks, reasons, 2, &count) == PSGD_OK);
  REQUIRE(count == 2);
  CHECK(steps[1] == 1);
  CHECK(ranks[1] == 2);
  CHECK(std::string(psgd_rank_reason_name(reasons[1])) == "lr_note");
  REQUIRE(psgd_reducer_decisions(r, steps, nullptr, ranks, reasons, 2, &count) == PSGD_OK);
  REQUIRE(count == 1);
  CHECK(steps[0] == 2);
  CHECK(std::string(psgd_rank_reason_name(reasons[0])) == "fixed");
  CHECK(psgd_rank_reason_name(6) == nullptr);
  CHECK(psgd_reducer_decisions(r, steps, buckets, ranks, reasons, 2, nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(psgd_reducer_note_lr_change(nullptr) == PSGD_ERR_INVALID_ARGUMENT);
  config.warmup_steps = -2;
  psgd_reducer* refused = nullptr;
  CHECK(psgd_reducer_create(comm, &config, &refused) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("warmup_steps = -2") != std::string::npos);
  psgd_reducer_destroy(r);
  psgd_comm_destroy(comm);
}
int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
