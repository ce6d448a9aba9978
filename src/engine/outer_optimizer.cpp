// OuterOptimizer (include/powersgd/outer_optimizer.hpp, docs/local-steps.md):
// the outer step of local SGD over a Reducer. Nothing the caller can see
// changes before the reduction of every bucket succeeded: the pseudo-gradients
// are formed in buffers of this class, reduced there in one Reducer step
// (reduce_all, which commits every bucket or none), and only then applied.
#include "powersgd/outer_optimizer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <exception>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/agreed_collectives.hpp"
#include "common/check.hpp"
#include "common/comm_turns.hpp"
#include "engine/checkpoint.hpp"
#include "engine/order_guard.hpp"
#include "engine/rank_reports.hpp"
#include "engine/refused_calls.hpp"

namespace powersgd {
namespace {

bool same(const OuterConfig& a, const OuterConfig& b) {
  return a.local_steps == b.local_steps && std::bit_cast<uint64_t>(a.lr) == std::bit_cast<uint64_t>(b.lr) &&
         std::bit_cast<uint64_t>(a.momentum) == std::bit_cast<uint64_t>(b.momentum);
}

// The config as a rank report's values, and back.
OuterConfig config_of(const engine::RankReport& report) {
  return {static_cast<int64_t>(report.values[0]), std::bit_cast<double>(report.values[1]),
          std::bit_cast<double>(report.values[2])};
}

std::string describe(const OuterConfig& c) {
  return detail::concat("local_steps = ", c.local_steps, ", lr = ", c.lr, ", momentum = ", c.momentum);
}

// The construction's agreement: every rank's config, or its refusal (then it throws on every rank).
std::vector<engine::RankReport> agree_on_construction(Communicator& comm, std::exception_ptr refused,
                                                      const OuterConfig& config) {
  const auto reports = engine::gather_reports(
      comm, refused != nullptr ? engine::report_failure(refused)
                               : engine::report_values({static_cast<uint64_t>(config.local_steps),
                                                        std::bit_cast<uint64_t>(config.lr),
                                                        std::bit_cast<uint64_t>(config.momentum)}));
  engine::throw_if_any_failed(reports, refused, "OuterOptimizer construction", "nothing set up on any rank");
  return reports;
}

// A load's agreement: every rank's loaded state (its hash, its outer steps), or its failure (then it throws on
// every rank, `what` naming the load).
std::vector<engine::RankReport> agree_on_load(Communicator& comm, std::exception_ptr failed, uint64_t state_hash,
                                              int64_t outer_steps, const std::string& what) {
  const auto reports = engine::gather_reports(
      comm, failed != nullptr ? engine::report_failure(failed)
                              : engine::report_values({state_hash, static_cast<uint64_t>(outer_steps)}));
  engine::throw_if_any_failed(reports, failed, what, "nothing loaded on any rank");
  return reports;
}

// The optimizer's own collectives (construction, load) go in their turn among the communicator's users
// (common/comm_turns.hpp), on the caller's thread: a reduction of a Reducer on the same communicator still in
// flight issues its collectives first, on every rank alike (they interleaved with it, and the group broke).
// Held until the returned turn is destroyed.
detail::CommTurns::Turn in_turn(Communicator& comm) {
  detail::CommTurns::Turn turn = detail::comm_turns(&comm)->take();
  turn.wait();
  return turn;
}

}  // namespace

void detail::RefusedCalls::outer_create(Communicator& comm, std::exception_ptr error) {
  const detail::CommTurns::Turn turn = in_turn(comm);
  agree_on_construction(comm, error, {});
  std::rethrow_exception(error);  // not reached: the agreement threw it
}

void detail::RefusedCalls::outer_load(Communicator& comm, std::exception_ptr error) {
  const detail::CommTurns::Turn turn = in_turn(comm);
  agree_on_load(comm, error, 0, 0, "OuterOptimizer::load");
  std::rethrow_exception(error);  // not reached
}

void OuterConfig::validate() const {
  PSGD_REQUIRE(local_steps >= 1, InvalidArgumentError, "outer.local_steps = ", local_steps,
               ": expected at least 1 inner step per outer step");
  // The step computes in float: checked as the float it becomes (1e39 was an infinite rate, 1e-50 none at all,
  // 0.99999999999 a momentum of 1).
  const float lr_f = static_cast<float>(lr), momentum_f = static_cast<float>(momentum);
  PSGD_REQUIRE(std::isfinite(lr) && lr > 0 && std::isfinite(lr_f) && std::isnormal(lr_f), InvalidArgumentError,
               "outer.lr = ", lr, ": expected a finite learning rate > 0 that float holds (",
               std::numeric_limits<float>::min(), " to ", std::numeric_limits<float>::max(), ")");
  PSGD_REQUIRE(std::isfinite(momentum) && momentum >= 0 && momentum < 1 && momentum_f < 1.0f, InvalidArgumentError,
               "outer.momentum = ", momentum, ": expected 0 <= momentum < 1 (below 1 also as a float)");
}

struct OuterOptimizer::Impl {
  Communicator& comm;
  Reducer& reducer;
  OuterConfig config;
  std::vector<std::vector<float>> start, momentum;
  std::vector<std::vector<float>> work;  // the pseudo-gradients, then their mean
  int64_t outer_steps = 0;

  // The caller's buffers: one per bucket, each non-null and of the bucket's size; and the reducer's buckets
  // still those this optimizer was made for (add_bucket may follow it).
  void check(std::span<const std::span<float>> params, const char* what) const {
    PSGD_REQUIRE(static_cast<size_t>(reducer.num_buckets()) == start.size(), InvalidArgumentError, what,
                 ": the reducer has ", reducer.num_buckets(), " buckets, this OuterOptimizer was made for ",
                 start.size(), ": declare every bucket (add_bucket) before making it");
    PSGD_REQUIRE(params.size() == start.size(), InvalidArgumentError, what, ": ", params.size(),
                 " parameter buffers: expected one per bucket of the reducer, ", start.size());
    for (size_t b = 0; b < params.size(); ++b) {
      PSGD_REQUIRE(params[b].data() != nullptr, InvalidArgumentError, what, ": params[", b, "] is null");
      PSGD_REQUIRE(params[b].size() == start[b].size(), InvalidArgumentError, what, ": params[", b, "] has ",
                   params[b].size(), " floats, bucket ", b, " has ", start[b].size());
    }
  }

  uint64_t state_hash() const {
    uint64_t h = static_cast<uint64_t>(outer_steps);
    for (size_t b = 0; b < start.size(); ++b) {
      h = engine::hash_floats(start[b].data(), start[b].size(), h);
      h = engine::hash_floats(momentum[b].data(), momentum[b].size(), h);
    }
    return h;
  }
};

OuterOptimizer::OuterOptimizer(Communicator& comm, Reducer& reducer, const OuterConfig& config,
                               std::span<const std::span<float>> params)
    : impl_(std::make_unique<Impl>(Impl{comm, reducer, config, {}, {}, {}, 0})) {
  Impl& s = *impl_;
  // A rank that refuses still takes part in the agreement, so every rank fails at once.
  const std::exception_ptr refused = detail::exception_of([&] {
    config.validate();
    PSGD_REQUIRE(reducer.num_buckets() > 0, InvalidArgumentError,
                 "OuterOptimizer: the reducer has no buckets: declare every bucket (add_bucket) first");
    PSGD_REQUIRE(reducer.config().device == Device::Cpu, UnsupportedError,
                 "OuterOptimizer: a reducer on Device::Cuda: the outer step works on host memory (Device::Cpu)");
    for (int b = 0; b < reducer.num_buckets(); ++b) {
      s.start.emplace_back(reducer.bucket_size(b));
      s.momentum.emplace_back(reducer.bucket_size(b), 0.0f);
      s.work.emplace_back(reducer.bucket_size(b));
    }
    s.check(params, "OuterOptimizer");
  });
  const detail::CommTurns::Turn turn = in_turn(comm);
  const auto reports = agree_on_construction(comm, refused, config);
  for (size_t r = 1; r < reports.size(); ++r)
    if (!same(config_of(reports[r]), config_of(reports[0])))
      PSGD_THROW(MismatchError, "OuterOptimizer: rank ", r, "'s config (", describe(config_of(reports[r])),
                 ") differs from rank 0's (", describe(config_of(reports[0])), "); nothing set up on any rank");
  // Every rank starts from rank 0's parameters.
  for (size_t b = 0; b < params.size(); ++b) {
    detail::broadcast_agreed_async(comm, params[b].data(), params[b].size_bytes(), 0).wait();  // agreed above
    std::copy(params[b].begin(), params[b].end(), s.start[b].begin());
  }
}

OuterOptimizer::~OuterOptimizer() = default;

bool OuterOptimizer::due(int64_t inner_steps) const {
  return inner_steps > 0 && inner_steps % impl_->config.local_steps == 0;
}

void OuterOptimizer::step(std::span<const std::span<float>> params) {
  Impl& s = *impl_;
  // A rank that refuses its buffers still gives the Reducer some, which it refuses on every rank at once
  // (docs/errors.md), where a local throw would leave the others waiting: the caller's where the Reducer's
  // buckets are still this optimizer's (its checks are then this one's, naming the buffer on every rank), else
  // empty ones. Given the caller's, a Reducer with another bucket since could take them, and reduced the
  // parameters themselves in place.
  const bool same_buckets = static_cast<size_t>(s.reducer.num_buckets()) == s.start.size();
  std::vector<std::span<float>> reduced =
      same_buckets ? std::vector<std::span<float>>(params.begin(), params.end())
                   : std::vector<std::span<float>>(static_cast<size_t>(s.reducer.num_buckets()));
  std::exception_ptr refused = detail::exception_of([&] { s.check(params, "OuterOptimizer::step"); });
  if (refused == nullptr)
    for (size_t b = 0; b < params.size(); ++b) {
      std::vector<float>& delta = s.work[b];
      for (size_t i = 0; i < delta.size(); ++i) delta[i] = s.start[b][i] - params[b][i];
      reduced[b] = delta;
    }
  try {
    s.reducer.reduce_all(reduced);
  } catch (const PeerError&) {
    throw;  // its peer and operation are the caller's to see
  } catch (const Error& e) {
    if (refused != nullptr && !same_buckets) std::rethrow_exception(refused);  // this rank's reason
    engine::throw_error(e.code(), detail::concat("outer step ", s.outer_steps, ": ", e.what(),
                                                 "; start point, outer momentum and parameters unchanged"));
  }
  if (refused != nullptr) std::rethrow_exception(refused);  // the Reducer refused it too; not reached
  // Nesterov momentum, as PyTorch's SGD(nesterov=True, dampening=0), in float: the same bits on every rank.
  const float mu = static_cast<float>(s.config.momentum);
  const float lr = static_cast<float>(s.config.lr);
  // Element i of bucket b after the step: its outer momentum and start point.
  const auto stepped = [&](size_t b, size_t i) {
    const float v = mu * s.momentum[b][i] + s.work[b][i];
    return std::pair{v, s.start[b][i] - lr * (s.work[b][i] + mu * v)};
  };
  // First whether the step stays finite (a mean pseudo-gradient near float's limit, a large lr): else it fails
  // on every rank alike (the same bits), nothing changed, where it wrote infinities into the start point.
  for (size_t b = 0; b < params.size(); ++b)
    for (size_t i = 0; i < s.work[b].size(); ++i) {
      const auto [v, next] = stepped(b, i);
      PSGD_REQUIRE(std::isfinite(v) && std::isfinite(next), NonFiniteError, "outer step ", s.outer_steps,
                   ": bucket ", b, " element ", i, " would leave the start point or the outer momentum non-finite ",
                   "(its mean pseudo-gradient ", s.work[b][i], ", lr ", lr, "); start point, outer momentum and "
                   "parameters unchanged (the Reducer's error memory took the step's reduction)");
    }
  for (size_t b = 0; b < params.size(); ++b)
    for (size_t i = 0; i < s.work[b].size(); ++i) {
      std::tie(s.momentum[b][i], s.start[b][i]) = stepped(b, i);
      params[b][i] = s.start[b][i];
    }
  ++s.outer_steps;
}

std::span<const float> OuterOptimizer::start(int bucket) const {
  PSGD_REQUIRE(bucket >= 0 && static_cast<size_t>(bucket) < impl_->start.size(), InvalidArgumentError, "bucket ",
               bucket, ": expected 0 to ", impl_->start.size() - 1);
  return impl_->start[static_cast<size_t>(bucket)];
}

std::span<const float> OuterOptimizer::momentum(int bucket) const {
  start(bucket);  // the index check
  return impl_->momentum[static_cast<size_t>(bucket)];
}

int64_t OuterOptimizer::outer_steps() const { return impl_->outer_steps; }
const OuterConfig& OuterOptimizer::config() const { return impl_->config; }

// Payload: i64 local_steps | f64 lr | f64 momentum | i64 outer steps | u32 buckets |
// per bucket: u64 n + n f32 start point | u64 n + n f32 outer momentum.
void OuterOptimizer::save(const std::string& path) const {
  const Impl& s = *impl_;
  engine::Writer w;
  w.put(s.config.local_steps);
  w.put(s.config.lr);
  w.put(s.config.momentum);
  w.put(s.outer_steps);
  w.put(static_cast<uint32_t>(s.start.size()));
  for (size_t b = 0; b < s.start.size(); ++b)
    for (const std::vector<float>* values : {&s.start[b], &s.momentum[b]}) {
      w.put(static_cast<uint64_t>(values->size()));
      w.put_floats(*values);
    }
  engine::write_checkpoint_file(
      path, engine::frame_checkpoint(engine::kOuterCheckpointMagic, engine::kOuterCheckpointVersion, w.bytes()));
}

void OuterOptimizer::load(const std::string& path) {
  Impl& s = *impl_;
  Impl loaded{s.comm, s.reducer, s.config, {}, {}, {}, 0};
  const std::exception_ptr failed = detail::exception_of([&] {
    const std::vector<char> file = engine::read_checkpoint_file(path);
    uint32_t version = 0;
    engine::Reader r(engine::checked_payload(file, path, engine::kOuterCheckpointMagic, engine::kOuterCheckpointVersion,
                                             engine::kOuterCheckpointVersion, version),
                     path);
    OuterConfig saved;
    saved.local_steps = r.get<int64_t>("local_steps");
    saved.lr = r.get<double>("lr");
    saved.momentum = r.get<double>("momentum");
    PSGD_REQUIRE(same(saved, s.config), MismatchError, "checkpoint ", path, " was saved with outer config ", describe(saved),
                 ", this OuterOptimizer has ", describe(s.config));
    loaded.outer_steps = r.get<int64_t>("outer steps");
    PSGD_REQUIRE(loaded.outer_steps >= 0, IoError, "checkpoint ", path, " is malformed: outer step ",
                 loaded.outer_steps);
    const auto buckets = r.get<uint32_t>("bucket count");
    PSGD_REQUIRE(buckets == s.start.size(), MismatchError, "checkpoint ", path, " has ", buckets,
                 " buckets, this OuterOptimizer's reducer ", s.start.size());
    for (size_t b = 0; b < buckets; ++b)
      for (auto* values : {&loaded.start, &loaded.momentum}) {
        const auto n = r.get<uint64_t>("bucket size");
        PSGD_REQUIRE(n == s.start[b].size(), MismatchError, "checkpoint ", path, ": bucket ", b, " has ", n,
                     " floats, this reducer's ", s.start[b].size());
        values->push_back(r.get_floats(static_cast<size_t>(n), "bucket state"));
      }
    PSGD_REQUIRE(r.at_end(), IoError, "checkpoint ", path, " is malformed: bytes after its last bucket");
    // What no optimizer saves (its steps stay finite), refused as the Reducer's loader does: loaded, a NaN start
    // point failed every later step.
    for (size_t b = 0; b < buckets; ++b) {
      engine::require_values_finite(loaded.start[b], "outer start point", path, b);
      engine::require_values_finite(loaded.momentum[b], "outer momentum", path, b);
    }
  });
  const detail::CommTurns::Turn turn = in_turn(s.comm);
  const auto reports = agree_on_load(s.comm, failed, failed != nullptr ? 0 : loaded.state_hash(),
                                     loaded.outer_steps, "OuterOptimizer::load of " + path);
  for (size_t r = 1; r < reports.size(); ++r)
    if (reports[r].values != reports[0].values)
      PSGD_THROW(MismatchError, "OuterOptimizer::load of ", path, ": rank ", r, "'s file holds another outer state (",
                 reports[r].values[1], " outer steps) than rank 0's (", reports[0].values[1],
                 " outer steps): load files of one checkpoint on every rank; nothing loaded on any rank");
  s.start = std::move(loaded.start);
  s.momentum = std::move(loaded.momentum);
  s.outer_steps = loaded.outer_steps;
}

}  // namespace powersgd
