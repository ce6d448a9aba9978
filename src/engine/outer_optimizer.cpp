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
#include <string>
#include <vector>

#include "common/agreed_collectives.hpp"
#include "common/check.hpp"
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

}  // namespace

void detail::RefusedCalls::outer_create(Communicator& comm, std::exception_ptr error) {
  agree_on_construction(comm, error, {});
  std::rethrow_exception(error);  // not reached: the agreement threw it
}

void detail::RefusedCalls::outer_load(Communicator& comm, std::exception_ptr error) {
  agree_on_load(comm, error, 0, 0, "OuterOptimizer::load");
  std::rethrow_exception(error);  // not reached
}

void OuterConfig::validate() const {
  PSGD_REQUIRE(local_steps >= 1, InvalidArgumentError, "outer.local_steps = ", local_steps,
               ": expected at least 1 inner step per outer step");
  PSGD_REQUIRE(std::isfinite(lr) && lr > 0, InvalidArgumentError, "outer.lr = ", lr,
               ": expected a finite learning rate > 0");
  PSGD_REQUIRE(std::isfinite(momentum) && momentum >= 0 && momentum < 1, InvalidArgumentError,
               "outer.momentum = ", momentum, ": expected 0 <= momentum < 1");
}

struct OuterOptimizer::Impl {
  Communicator& comm;
  Reducer& reducer;
  OuterConfig config;
  std::vector<std::vector<float>> start, momentum;
  std::vector<std::vector<float>> work;  // the pseudo-gradients, then their mean
  int64_t outer_steps = 0;

  // The caller's buffers: one per bucket, each non-null and of the bucket's size.
  void check(std::span<const std::span<float>> params, const char* what) const {
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
  // Buffers this rank would refuse go to the Reducer as they are: it refuses them on every rank at once
  // (docs/errors.md), naming this rank and the buffer, where a local throw would leave the others waiting.
  std::vector<std::span<float>> reduced(params.begin(), params.end());
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
    engine::throw_error(e.code(), detail::concat("outer step ", s.outer_steps, ": ", e.what(),
                                                 "; start point, outer momentum and parameters unchanged"));
  }
  if (refused != nullptr) std::rethrow_exception(refused);  // the Reducer refused it too; not reached
  // Nesterov momentum, as PyTorch's SGD(nesterov=True, dampening=0), in float: the same bits on every rank.
  const float mu = static_cast<float>(s.config.momentum);
  const float lr = static_cast<float>(s.config.lr);
  for (size_t b = 0; b < params.size(); ++b) {
    const std::vector<float>& mean = s.work[b];
    std::vector<float>& v = s.momentum[b];
    std::vector<float>& start = s.start[b];
    for (size_t i = 0; i < mean.size(); ++i) {
      v[i] = mu * v[i] + mean[i];
      start[i] = start[i] - lr * (mean[i] + mu * v[i]);
      params[b][i] = start[i];
    }
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
  });
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
