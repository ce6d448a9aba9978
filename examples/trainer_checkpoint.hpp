// Checkpoint and resume for the example trainer, per rank. Every `every` steps
// each rank writes its trainer state (model parameters, momentum, the epoch's
// accumulators), its reducer's per-rank checkpoint (Reducer::save) and, with
// local steps, its outer optimizer's (OuterOptimizer::save) into DIR/step-<S>/; after a barrier rank 0 writes DIR/step-<S>/COMPLETE. Every
// file goes through a temporary file, fsync and rename, so a process killed at
// any point leaves the previous complete set usable and the interrupted one
// without COMPLETE (ignored). The newest complete set and the one before it
// are kept. Files are in host byte order: a set resumes on the machine type
// that wrote it, at the same world size (Reducer::load refuses another).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "powersgd/comm.hpp"
#include "powersgd/outer_optimizer.hpp"
#include "powersgd/reducer.hpp"

namespace fashion_mnist {

// FNV-1a over bytes, continuing from `hash`: the options fingerprint and the parameter hash the trainer prints.
uint64_t fnv1a(const void* data, size_t size, uint64_t hash = 0xCBF29CE484222325ULL);

// The trainer's state at a step boundary, besides its tensors.
struct TrainerState {
  int64_t step = 0;      // completed global steps
  double loss_sum = 0;   // the current epoch's accumulators
  int64_t correct = 0;
};

class TrainerCheckpoints {
 public:
  // `options`: fingerprint of the options that change the run; resume refuses a set written with others.
  // `outer`: the outer optimizer of --local-steps, or null.
  TrainerCheckpoints(std::string dir, int64_t every, uint64_t options, powersgd::Communicator& comm,
                     powersgd::Reducer& reducer, powersgd::OuterOptimizer* outer = nullptr)
      : dir_(std::move(dir)), every_(every), options_(options), comm_(comm), reducer_(reducer), outer_(outer) {}

  // Collective: rank 0 picks the newest complete set; every rank reads its own
  // files of it into `tensors` (each must hold sizes[i] floats in the file) and
  // into the reducer (and the outer optimizer). nullopt when there is no complete set. Throws std::runtime_error
  // (or the reducer's error) naming the file.
  std::optional<TrainerState> resume(std::span<std::vector<float>* const> tensors, std::span<const size_t> sizes);

  bool due(int64_t step) const { return step > 0 && step % every_ == 0; }
  // Collective, after step state.step. `crash_before_complete` (a test of
  // resuming) kills this rank with SIGKILL once its own files are written,
  // before the set is complete.
  void save(const TrainerState& state, std::span<const std::vector<float>* const> tensors, bool crash_before_complete);

 private:
  std::string dir_;
  int64_t every_;
  uint64_t options_;
  powersgd::Communicator& comm_;
  powersgd::Reducer& reducer_;
  powersgd::OuterOptimizer* outer_;
};

}  // namespace fashion_mnist
