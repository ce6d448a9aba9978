// PowerSGD gradient reduction (Vogels et al. 2019) with error feedback, over a
// Communicator. Design, state and wire order: docs/engine.md.
//
// Usage: declare every bucket (a list of tensor shapes laid out contiguously in
// one flat float32 buffer) with add_bucket(), then once per training step reduce
// each bucket once, in the same order on every rank:
//   powersgd::Reducer reducer(comm, config);
//   int b = reducer.add_bucket({{64, 3, 7, 7}, {64}});
//   reducer.reduce(b, gradients);   // in place: local gradients in, averaged out
//
// Threading: a Reducer is used from one user thread at a time (a second
// thread's call is refused with InvalidArgumentError). It owns one
// worker thread that does all compute (through the compute backend) and issues
// the collectives, in submission order, on the communicator. Several Reducers
// may share a communicator (two models in one process): the collectives of
// their calls (reduce, reduce_async, reduce_all, add_bucket, save_job,
// load_job) run in the order the calls were made, whichever worker is faster
// (docs/engine.md, "Several reducers on one communicator"). That order is the
// same on every rank when the calls are: call the Reducers that share a
// communicator from one thread; Reducers used from different threads need a
// communicator each. While a reduction is in flight, do not issue other
// collectives on the same communicator yourself.
//
// Memory: `data` pointers are backend memory: host memory for Device::Cpu, CUDA
// device memory for Device::Cuda. Pointers passed to reduce_async / reduce_all
// must stay valid and untouched until the reduction is done. Device::Cuda: the
// engine's stream waits for the work queued before the call on the legacy
// default stream; gradients written on another stream must be synchronized
// with it (or that stream synchronized) before the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "powersgd/comm.hpp"

namespace powersgd {

enum class Device { Cpu, Cuda };

// The element type of the P and Q factors on the wire (Config::wire_dtype).
// Float32: as computed. BFloat16, Float16: each rank rounds its factors to
// nearest even once before their collective, the transport's sum rounds again
// at every hop of the ring (docs/engine.md, "Factors on the wire"), and error
// feedback absorbs the rounding. Float16 overflows beyond +-65504 (a
// NonFiniteError on every rank, state unchanged).
enum class WireDType { Float32, BFloat16, Float16 };
PSGD_API const char* to_string(WireDType type);  // "f32", "bf16", "fp16"

// The reference's fields (PyTorch's PowerSGDState) and defaults.
struct PSGD_API Config {
  int rank = 1;                             // matrix approximation rank r, >= 1 and <= 64
  int64_t start_iter = 1000;                // plain averaged allreduce while iteration < start_iter; >= 0
  double min_compression_rate = 2.0;        // compress n x m iff (n + m) * r * rate < n * m; finite, >= 0
                                            // (every tensor viewed as shape[0] x rest: 1-D n as n x 1)
  bool error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0.0;   // 0, or a normal float (1.18e-38 to 3.4e38): used as a float
  uint64_t seed = 0;                        // initial Q generator seed (identical on every rank)
  bool batch_same_shape = false;            // batched gemm over same-shaped matrices
  bool whole_bucket = false;                // the whole bucket as one zero-padded square matrix
  Device device = Device::Cpu;
  int device_index = 0;                     // >= 0
  // Adaptive rank (Accordion; docs/engine.md): every adaptive_interval compressed
  // steps each bucket switches between rank_low and rank_high on the relative
  // change of its averaged gradient's norm (>= adaptive_threshold, or the first
  // window: rank_high). With adaptive, `rank` is not used (still validated).
  // rank_low, rank_high: 1 <= rank_low <= rank_high <= 64, validated whether or not adaptive is on.
  bool adaptive = false;
  int rank_low = 1;
  int rank_high = 4;
  int64_t adaptive_interval = 100;          // >= 1 compressed steps per window
  double adaptive_threshold = 0.5;          // finite, >= 0
  // One collective per step: alternate the power-iteration halves (docs/engine.md).
  bool alternating = false;
  // Divergence detector (docs/engine.md, "Order guard and divergence detector"):
  // after every step t with (t + 1) % divergence_check_interval == 0 each rank
  // hashes each bucket's output and warm-start P and Q, and the bucket's next
  // reduction compares the hashes: a difference is a MismatchError on every
  // rank naming the ranks, the step and the bucket. >= 0; 0: off. Every rank
  // must use the same value; not saved in checkpoints.
  int64_t divergence_check_interval = 100;
  // Schedule-aware policy (docs/engine.md, "Rank policy and decision log"):
  // warmup_steps: the first warmup_steps compressed steps of each bucket use the
  // high rank; lr_boost_steps: after Reducer::note_lr_change(), each bucket's next
  // lr_boost_steps compressed steps use the high rank (0: notes change nothing).
  // The high rank: rank_high with adaptive, max(rank, rank_high) with a fixed
  // rank (so a fixed rank >= rank_high is never boosted). Both >= 0.
  int64_t warmup_steps = 0;
  int64_t lr_boost_steps = 100;

  // P and Q in 16 bits on the wire (WireDType): the factors' bytes halve. The
  // packed uncompressed tensors, the finite flags and the steps before
  // start_iter stay float32. Every rank must use the same value (it is in the
  // fingerprint); not saved in checkpoints (a resumed run may change it). CPU
  // only: Device::Cuda with a 16-bit wire is refused by the Reducer (UnsupportedError).
  WireDType wire_dtype = WireDType::Float32;

  // Throws InvalidArgumentError naming the first invalid field, its value and the range expected (or the rule
  // of two fields broken), UnsupportedError for a 16-bit wire_dtype with Device::Cuda. The Reducer's
  // constructor calls it; psgd_config_validate is this from C.
  void validate() const;
};

using Shape = std::vector<int64_t>;

struct PSGD_API Stats {
  // Cumulative over compressed steps, as the reference counts them: elements of
  // the buckets, and elements actually reduced (P, Q and uncompressed tensors).
  uint64_t numel_before = 0;
  uint64_t numel_after = 0;
  double compression_rate() const { return numel_after == 0 ? 0.0 : double(numel_before) / double(numel_after); }
  // Cumulative payload bytes this rank passed to collectives.
  uint64_t bytes_sent = 0;
  // Last step's ||M - P Q^T||_F / ||M||_F over the compressed matrices, per bucket
  // (M: local gradient plus error; NaN before the bucket's first compressed step)
  // and over all buckets together.
  std::vector<double> relative_error;
  double total_relative_error = 0.0;
  // Cumulative worker-thread seconds: local compute before and between the
  // collectives, waiting for collectives (including host staging), and writing
  // the output and the error back.
  double compress_seconds = 0.0;
  double communicate_seconds = 0.0;
  double decompress_seconds = 0.0;
  // Per bucket: the rank its compressed matrices use in the next compressed step
  // (config.rank; with adaptive, rank_low or rank_high; per matrix min(n, m, that)).
  std::vector<int> current_rank;
  // Payload bytes this rank passed to collectives in the last completed step.
  uint64_t last_step_bytes = 0;
  // Cumulative worker-thread seconds in the order guard's announce collective
  // (one small allreduce before every reduction, waiting for the slowest rank
  // included), and hashing outputs for the divergence detector.
  double guard_seconds = 0.0;
  double check_seconds = 0.0;
};

// Why a bucket's rank was chosen (the decision log, Reducer::decisions()).
enum class RankReason : int {
  Fixed = 0,           // config.rank (no adaptive; no warm-up or boost in force)
  Warmup = 1,          // within the first config.warmup_steps compressed steps: the high rank
  LrNote = 2,          // within config.lr_boost_steps compressed steps of a note_lr_change(): the high rank
  FirstWindow = 3,     // adaptive, no norm window completed yet: rank_high
  NormChangeHigh = 4,  // adaptive, the window's norm changed by >= adaptive_threshold: rank_high
  NormChangeLow = 5,   // adaptive, it changed by less: rank_low
};
// "fixed", "warmup", "lr_note", "first_window", "norm_change_high", "norm_change_low".
PSGD_API const char* rank_reason_name(RankReason reason);

// One entry of the decision log: from step `step` on, bucket `bucket`'s
// compressed matrices use rank `rank` (per matrix min(n, m, rank)), because of
// `reason`. Identical on every rank.
struct RankDecision {
  int64_t step = 0;
  int bucket = 0;
  int rank = 0;
  RankReason reason = RankReason::Fixed;
};

// Completion handle of reduce_async. wait() blocks until the reduction finished
// and rethrows its error. Copyable; copies refer to the same reduction.
// When a reduction was submitted (reduce_async), started on the reducer's
// worker (after the reductions queued before it) and finished, in seconds of
// std::chrono::steady_clock (CLOCK_MONOTONIC on Linux, Python's time.monotonic()).
struct ReduceTimes {
  double submitted = 0.0, started = 0.0, finished = 0.0;
};

class PSGD_API ReduceHandle {
 public:
  ReduceHandle() = default;
  void wait() const;
  bool done() const;
  bool valid() const { return state_ != nullptr; }
  // The reduction's times; InvalidArgumentError while it is in flight (or for an empty handle).
  ReduceTimes times() const;

 private:
  friend class Reducer;  // the only maker of non-empty handles
  explicit ReduceHandle(std::shared_ptr<Completion> state) : state_(std::move(state)) {}
  std::shared_ptr<Completion> state_;
};

namespace detail {
struct RefusedCalls;  // the C API's refusals (src/engine/refused_calls.hpp)
}

class PSGD_API Reducer {
 public:
  // Validates config and creates the compute backend. Not collective. Destroy
  // the Reducer before `comm`: a communicator destroyed first waits for the
  // reductions in flight, then every later call on the Reducer throws
  // InvalidArgumentError (docs/engine.md). A world of more than 4095 ranks is
  // refused (InvalidArgumentError): the failure flags are exact below 4096.
  Reducer(Communicator& comm, const Config& config);
  // Waits for in-flight reductions (their errors are dropped), then stops the worker.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Collective. Declares the next bucket and returns its index (0, 1, ...).
  // Refused: an empty list, total size 0, a negative dimension, more than
  // 2^31 - 2 elements, or a call after the first reduce. Throws MismatchError naming the
  // first rank whose layout or configuration differs from rank 0's. A bucket
  // refused on one rank fails every rank at once with that rank's error code
  // (the others' message names the rank and its reason); nothing is declared.
  int add_bucket(std::span<const Shape> shapes);
  int add_bucket(std::initializer_list<Shape> shapes) { return add_bucket(std::span<const Shape>(shapes.begin(), shapes.size())); }

  int num_buckets() const;
  size_t bucket_size(int bucket) const;        // elements of the bucket's flat buffer
  std::span<const Shape> bucket_shapes(int bucket) const;
  // The rank the bucket's compressed matrices use in its next compressed step
  // (Stats::current_rank[bucket]; waits for in-flight reductions). A pending
  // note_lr_change() is not in it yet: it applies within the next reduction.
  int bucket_rank(int bucket) const;

  // Collective, in place. Reducing a bucket twice in one step is an
  // InvalidArgumentError; a step completes when every bucket was reduced once.
  // NaN/Inf in any rank's bucket: NonFiniteError on every rank, `data`, the
  // error-feedback and warm-start state unchanged (the bucket still counts as
  // reduced in this step). A local failure on one rank (its compute before or
  // between the collectives) fails the reduction on every rank at once the same
  // way, with that rank's error code; the others' message names the rank and
  // its reason (docs/errors.md). Ranks resumed from different states (step,
  // warm start) get a MismatchError on every rank at their next reduce,
  // naming the first differing rank, state unchanged, until a consistent load.
  //
  // Before its data collectives every reduction checks, in one small
  // collective, that every rank reduces the same bucket of the same step from
  // the same state (docs/engine.md, "Order guard and divergence detector"):
  // otherwise MismatchError on every rank naming the ranks and what differs
  // ("step 3: rank 1 reduces bucket 1 (32 floats) where rank 0 reduces bucket
  // 0 (128 floats)"), nothing changed. A call refused on this rank (bad index,
  // null data, wrong size, a bucket twice, reduce_all not at a step boundary)
  // fails the matching reduction of every other rank with its reason and
  // throws here once that reduction's collectives are done (reduce_async's
  // too): a refused call leaves no collective in flight (docs/errors.md). A
  // call while another thread is inside a call of this Reducer is an
  // InvalidArgumentError and submits nothing; reduce() counts as inside until
  // it returns.
  // Size-checked: the span's size must be bucket_size(bucket)
  // (InvalidArgumentError naming both). The pointer forms are unchecked: `data`
  // must hold bucket_size(bucket) floats.
  void reduce(int bucket, std::span<float> data);
  ReduceHandle reduce_async(int bucket, std::span<float> data);
  void reduce(int bucket, float* data);
  ReduceHandle reduce_async(int bucket, float* data);
  // One whole step: data[i] is bucket i. The collectives of all buckets are fused
  // (one for the uncompressed tensors, one for P, one for Q). Must start a step.
  void reduce_all(std::span<const std::span<float>> data);  // size-checked
  void reduce_all(std::span<float* const> data);

  // Notes a learning-rate change (docs/engine.md, "Rank policy and decision
  // log"): from the next step on, each bucket's next config.lr_boost_steps
  // compressed steps use the high rank (a second note restarts the count).
  // At a step boundary (InvalidArgumentError otherwise, or before any
  // add_bucket); waits for in-flight reductions; not collective, but due on
  // every rank before the same step: the next reduction of each bucket carries
  // the note in its order-guard announce, and a note on some ranks only is a
  // MismatchError on every rank naming them, nothing reduced or changed, the
  // note still pending (note on the other ranks too, or load a checkpoint).
  void note_lr_change();
  // The decision log: the entries since the last call, oldest first (waits for
  // in-flight reductions). An entry is written when a bucket's rank or its
  // reason changes, at each adaptive window's decision, at a note, and at each
  // bucket's first compressed step. At most kMaxDecisions are kept between
  // calls (the oldest are dropped). Not saved in checkpoints.
  static constexpr size_t kMaxDecisions = 65536;
  std::vector<RankDecision> decisions();
  // The same, at most the `max` oldest entries; the rest wait for the next call (psgd_reducer_decisions).
  std::vector<RankDecision> decisions(size_t max);

  // Completed steps (waits for in-flight reductions).
  int64_t iteration() const;
  // This rank's error-feedback memory of a bucket into host memory `out`
  // (bucket_size floats; zeros before compression starts or without error feedback).
  // whole_bucket: the bucket's elements; the zero padding's error is carried
  // internally (and checkpointed) but not returned.
  void error_feedback(int bucket, std::span<float> out) const;  // size-checked, as reduce
  void error_feedback(int bucket, float* out) const;
  Stats stats() const;
  const Config& config() const;
  // Fingerprint of configuration and declared layout (the one ranks compare).
  uint64_t fingerprint() const;
  std::string backend_name() const;

  // Checkpoint of this rank's whole state; at a step boundary only (waits for
  // in-flight reductions). load() refuses, with a clear error, a truncated or
  // corrupted file (IoError) or one of another configuration or layout
  // (MismatchError), and then leaves the state unchanged. Not collective, but
  // load is due on every rank before the next reduce (checkpoints of one step;
  // the next reduce checks that, see reduce).
  void save(const std::string& path) const;
  void load(const std::string& path);
  // Loads a per-rank checkpoint saved by any rank of a group of any size, as the
  // state every rank shares: the step count, the warm-start factors and the rank
  // policy's state (equal on every rank of the saving job), with this rank's
  // error memory set to zero (error memory is a rank's own residual: another
  // rank's is not this one's). Refusals as load(). Not collective, but due on
  // every rank, from the same file, before the next reduce (which checks it).
  // For one checkpoint file read by every rank (PyTorch's "save on rank 0").
  void load_shared(const std::string& path);

  // Job checkpoint: the whole job's state in one file, resumable on any world
  // size. Collective, at a step boundary (waits for in-flight reductions).
  // save_job: the ranks average their error memories; rank 0 writes one file
  // (completed steps, configuration and layout, warm-start P and Q, the mean
  // error memory), the others write nothing; every rank returns once the file is
  // durable, and a failure on rank 0 (bad path, full disk) is thrown on every
  // rank. load_job, on any number of ranks: rank 0 reads the file and broadcasts
  // it (no shared filesystem needed); every rank takes the mean as its error
  // memory, the step count and the warm-start state. Refused on every rank, with
  // the state unchanged everywhere: a missing, truncated or corrupted file
  // (IoError), another configuration or layout, or a per-rank file
  // (MismatchError); a call refused on one rank (in the middle of a step) fails
  // every rank at once. The averaged update depends on the error memories only
  // through their mean, so with the same mean gradients the resumed run's
  // outputs equal the uninterrupted run's (to rounding). Format: docs/engine.md.
  void save_job(const std::string& path) const;
  void load_job(const std::string& path);

 private:
  friend struct detail::RefusedCalls;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace powersgd
