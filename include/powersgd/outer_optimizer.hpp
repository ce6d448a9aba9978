// Local steps with a compressed outer step (DiLoCo: Douillard et al. 2023,
// arXiv 2311.08105), over a Reducer. Design: docs/local-steps.md.
//
// Each rank takes H inner steps with its own optimizer on its own data, with no
// communication; then every rank calls step(): each bucket's pseudo-gradient
// (start parameters minus current ones) is reduced by the Reducer (PowerSGD
// with error feedback on the pseudo-gradients, the Reducer's buckets, its state
// keyed by bucket index), and the average is applied from the synchronised
// start point with SGD and Nesterov momentum:
//   v = momentum * v + mean;   start = start - lr * (mean + momentum * v)
// (PyTorch's SGD with nesterov=True and dampening 0). The new start point is
// written into the caller's buffers, the same bits on every rank.
//
//   powersgd::Reducer reducer(comm, config);   // its buckets: the model's parameter buckets
//   ... reducer.add_bucket(...) for each bucket ...
//   powersgd::OuterOptimizer outer(comm, reducer, {.local_steps = 16}, params);  // params[b]: bucket b
//   for (int64_t t = 1; ...; ++t) {
//     inner_step(params);                      // local: gradient, inner optimizer
//     if (outer.due(t)) outer.step(params);    // collective
//   }
//
// The Reducer serves the outer steps only (each outer step is one whole step of
// it, Reducer::reduce_all), from one user thread, as the Reducer requires. CPU:
// the parameters are host memory (a Reducer on Device::Cuda is refused).
// Threading: one user thread; not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "powersgd/reducer.hpp"

namespace powersgd {

struct PSGD_API OuterConfig {
  int64_t local_steps = 1;  // H: inner steps per outer step (due()), >= 1
  // Defaults: plain model averaging. DiLoCo's 0.7 and 0.9 (with AdamW inner steps, H = 500) diverged here
  // with inner SGD with momentum at small H (docs/local-steps.md, "Defaults"): pass them for that regime.
  double lr = 1.0;          // outer learning rate, finite, > 0
  double momentum = 0.0;    // Nesterov momentum, 0 <= momentum < 1
  // Throws InvalidArgumentError naming the first invalid field, its value and the range expected.
  void validate() const;
};

class PSGD_API OuterOptimizer {
 public:
  // Collective (one small allgather, then one broadcast per bucket; no
  // reduction of `reducer` or of another Reducer on `comm` may be in flight).
  // params[b]: bucket b of `reducer` (every bucket declared; bucket_size(b)
  // floats each). Rank 0's parameters are broadcast into every rank's buffers
  // and become the start point; the outer momentum starts at zero. Refused on
  // every rank at once when it is refused on one (a bad config, a wrong buffer
  // count or size, a Reducer without buckets or on CUDA: the refusing rank's
  // error; the others the same code naming it), and with MismatchError on every
  // rank when the ranks' OuterConfigs differ. Keeps references to `comm` and
  // `reducer`: destroy the OuterOptimizer first.
  OuterOptimizer(Communicator& comm, Reducer& reducer, const OuterConfig& config,
                 std::span<const std::span<float>> params);
  ~OuterOptimizer();
  OuterOptimizer(const OuterOptimizer&) = delete;
  OuterOptimizer& operator=(const OuterOptimizer&) = delete;

  // Whether an outer step is due after `inner_steps` completed inner steps (counted from the start):
  // inner_steps > 0 and a multiple of config().local_steps.
  bool due(int64_t inner_steps) const;

  // Collective: one outer step (one Reducer::reduce_all of the pseudo-gradients).
  // On success every bucket's new start point is in params[b] and in start(b),
  // the same bits on every rank, and outer_steps() advances. Any failure of the
  // reduction (a refusal on any rank, a wrong buffer count or size, a null
  // buffer: InvalidArgumentError; NaN or Inf in any rank's pseudo-gradient:
  // NonFiniteError; ranks that disagree: MismatchError; a peer or timeout)
  // throws on every rank and leaves the start point, the outer momentum,
  // outer_steps(), params and the Reducer's error-feedback and warm-start memory
  // as they were (the Reducer's step count advances, as for any failed step of
  // it). The caller may then go on from its current parameters or from
  // start(b), and call step() again.
  void step(std::span<const std::span<float>> params);

  // The synchronised start point and the outer momentum of bucket b (bucket_size(b) floats), host memory, valid
  // until the next step() or load().
  std::span<const float> start(int bucket) const;
  std::span<const float> momentum(int bucket) const;
  // Successful outer steps.
  int64_t outer_steps() const;
  const OuterConfig& config() const;

  // Checkpoint of the outer state (config, outer step count, every bucket's start point and momentum), which is
  // the same on every rank; beside the Reducer's own (Reducer::save / save_job). Not collective; writes through a
  // temporary file, fsync and rename (docs/engine.md's conventions). Throws IoError.
  void save(const std::string& path) const;
  // Collective (one small allgather): every rank reads its `path` (any rank's file of this layout: the state is the
  // same on every rank). Refused on every rank, with every rank's state unchanged, when any rank's file is missing,
  // truncated or corrupted (IoError), of another config or layout (MismatchError), or when the ranks' files hold
  // different states (MismatchError naming the ranks). Does not touch the caller's parameters: after a load, the
  // caller resumes its own parameters (or copies start(b) into them) and loads the Reducer's checkpoint.
  void load(const std::string& path);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace powersgd
