// Reducer::Impl (reducer_impl.hpp), the user thread's side of the calls that
// submit work: declaring buckets, the three ways to reduce, and the refusal
// path that turns a call refused on one rank into the same failure on every
// rank (docs/errors.md, "Failed calls lose nothing").
#include <exception>
#include <memory>
#include <utility>

#include "common/check.hpp"
#include "engine/fingerprint.hpp"
#include "engine/order_guard.hpp"
#include "engine/plan.hpp"
#include "engine/policy.hpp"
#include "engine/rank_reports.hpp"
#include "engine/reducer_impl.hpp"

namespace powersgd {

int Reducer::Impl::add_bucket(std::span<const Shape> shapes, std::exception_ptr refused) {
  const OneCaller one(user_mutex_, "add_bucket");
  require_comm();
  const int index = num_buckets();
  // A rank that refuses the bucket still takes part in the layout check (a
  // fixed-size gather of reports), so every rank fails at once with its reason.
  std::vector<int> ranks;
  std::vector<engine::BucketPlan> levels;
  uint64_t layout = 0;
  if (refused == nullptr) {
    try {
      PSGD_REQUIRE(!started_, InvalidArgumentError, "add_bucket after the first reduce (or load): declare all ",
                   "buckets before reducing; bucket ", buckets_.size(), " refused");
      ranks = engine::rank_levels(config_);
      for (int rank : ranks) levels.push_back(engine::make_plan(shapes, config_, rank));
      layout = engine::extend_layout_fingerprint(layout_fingerprint_, index, shapes);
    } catch (...) {
      refused = std::current_exception();
    }
  }
  // On the worker, in its turn among the communicator's users: after the reductions in flight (a refused
  // add_bucket after reduce_async) and after every call made before it, other reducers' too.
  collective_call([&] {
    const auto reports = engine::gather_reports(
        comm_, refused != nullptr ? engine::report_failure(refused)
                                  : engine::report_values({engine::reducer_fingerprint(layout, config_)}));
    engine::throw_if_any_failed(reports, refused, detail::concat("add_bucket of bucket ", index));
    for (size_t r = 1; r < reports.size(); ++r)
      if (reports[r].values[0] != reports[0].values[0])
        engine::raise_layout_mismatch(comm_, config_, index, shapes, reports);  // every rank takes this branch
  });
  layout_fingerprint_ = layout;
  auto bucket = std::make_unique<BucketState>(std::vector<Shape>(shapes.begin(), shapes.end()), std::move(levels),
                                              ranks);
  bucket->rule_level = ranks.size() - 1;  // the adaptive rule starts high (its first window)
  const engine::LevelChoice first = engine::choose_level(config_, *bucket);
  bucket->level = first.level;
  bucket->reason = first.reason;
  bucket->plan = bucket->levels[first.level];
  bucket->current_rank = ranks[first.level];
  buckets_.push_back(std::move(bucket));
  steps_.add_bucket();
  return index;
}

void Reducer::Impl::reduce(int b, float* data, size_t count) {
  const OneCaller one(user_mutex_, "reduce");  // held until the reduction is done
  submit(b, data, count)->wait();
}

std::shared_ptr<Completion> Reducer::Impl::reduce_async(int b, float* data, size_t count,
                                                        std::exception_ptr refused) {
  const OneCaller one(user_mutex_, "reduce_async");
  return submit(b, data, count, refused);
}

void Reducer::Impl::reduce_all(std::span<float* const> data, std::span<const size_t> counts) {
  const OneCaller one(user_mutex_, "reduce_all");
  PSGD_REQUIRE(!buckets_.empty(), InvalidArgumentError, "reduce_all before any add_bucket");
  auto reduction = std::make_shared<Reduction>();
  for (int b = 0; b < num_buckets(); ++b) reduction->buckets.push_back(b);
  try {
    PSGD_REQUIRE(data.size() == buckets_.size(), InvalidArgumentError, "reduce_all got ", data.size(),
                 " buffers: expected one per bucket, ", buckets_.size());
    for (size_t i = 0; i < data.size(); ++i) {
      PSGD_REQUIRE(data[i] != nullptr, InvalidArgumentError, "reduce_all: data[", i, "] is null");
      if (!counts.empty())
        PSGD_REQUIRE(counts[i] == bucket_size(static_cast<int>(i)), InvalidArgumentError, "reduce_all: data[", i,
                     "] has ", counts[i], " elements, bucket ", i, " has ", bucket_size(static_cast<int>(i)));
    }
  } catch (...) {
    // At a step boundary the refused step counts as done, as on the other ranks.
    refuse(std::move(reduction), std::current_exception(), steps_.at_boundary(), true);
  }
  try {
    start();
  } catch (...) {  // this rank's buffers could not be allocated: a refusal of this rank alone
    refuse(std::move(reduction), std::current_exception(), steps_.at_boundary(), true);
  }
  reduction->data.assign(data.begin(), data.end());
  try {
    steps_.record(*reduction, config_.start_iter, true);
  } catch (...) {
    refuse(std::move(reduction), std::current_exception(), false, true);
  }
  worker_.submit(WorkerTask{std::move(reduction), nullptr, turns_->take()})->wait();
}

std::shared_ptr<Completion> Reducer::Impl::submit(int b, float* data, size_t count, std::exception_ptr refused) {
  auto reduction = std::make_shared<Reduction>();
  reduction->buckets = {b};
  const bool valid = b >= 0 && b < num_buckets();
  try {
    if (refused != nullptr) std::rethrow_exception(refused);
    checked(b);
    PSGD_REQUIRE(data != nullptr, InvalidArgumentError, "reduce of bucket ", b, ": data is null");
    PSGD_REQUIRE(count == kUnchecked || count == bucket_size(b), InvalidArgumentError, "reduce of bucket ", b,
                 ": the buffer has ", count, " elements, the bucket has ", bucket_size(b));
  } catch (...) {
    // A valid bucket not yet reduced in this step counts as reduced, as on the other ranks.
    refuse(std::move(reduction), std::current_exception(), valid && !steps_.reduced(b), false);
  }
  try {
    start();
  } catch (...) {  // this rank's buffers could not be allocated: a refusal of this rank alone
    refuse(std::move(reduction), std::current_exception(), true, false);
  }
  reduction->data = {data};
  try {
    steps_.record(*reduction, config_.start_iter, false);
  } catch (...) {
    refuse(std::move(reduction), std::current_exception(), false, false);
  }
  return worker_.submit(WorkerTask{std::move(reduction), nullptr, turns_->take()});
}

void Reducer::Impl::refuse(std::shared_ptr<Reduction> reduction, std::exception_ptr error, bool record,
                            bool whole_step) {
  if (!buckets_.empty()) {
    // The layout is final here as on the ranks whose call went on; a poisoned announce needs no buffers
    // (this rank's are allocated by its next call).
    started_ = true;
    reduction->poisoned = error;
    reduction->prepared = true;  // the runner's lookahead leaves it alone
    reduction->data.clear();
    if (record)
      steps_.record(*reduction, config_.start_iter, whole_step);
    else
      reduction->iteration = steps_.submitted_steps();
    try {
      worker_.submit(WorkerTask{std::move(reduction), nullptr, turns_->take()})->wait();
    } catch (...) {  // this rank's outcome is `error` (a broken communicator fails the next call)
    }
  }
  std::rethrow_exception(error);
}

void Reducer::Impl::agree_on_refusal(std::exception_ptr refused, const char* what) {
  const auto reports =
      engine::gather_reports(comm_, refused != nullptr ? engine::report_failure(refused) : engine::RankReport{});
  engine::throw_if_any_failed(reports, refused, what, "nothing saved or loaded on any rank");
}

}  // namespace powersgd
