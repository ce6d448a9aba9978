// Example training job: a 3-layer perceptron, a wide one or a small CNN (--model) on
// Fashion-MNIST, data-parallel over every rank of the job, gradients exchanged
// with PowerSGD.
//
//   powersgd-run -n 4 -- train-fashion-mnist --epochs 3 --rank 4
//
// Each rank trains on its own shard of every global batch; after backward the
// gradients of the two buckets (output layers first, as DDP orders them) are
// reduced with PowerSGD (or with a plain averaged allreduce, --no-compression,
// for comparison). The models are small enough for a 2-core machine and real
// enough to show accuracy and traffic side by side. Both buckets' gradients are
// ready together here (one backward, then the exchange), so by default they go
// to the Reducer together (--submit all: Reducer::reduce_all, one order-guard
// announce carrying both buckets' P, then one Q: 2 communication rounds per
// step where the fused P and Q fit the direct bound); --submit each reduces
// them one after the other (2 rounds per bucket), as a trainer that overlaps
// backward would. Neither applies to --no-compression (a plain allreduce per
// bucket) or --local-steps > 1 (the outer step's one reduce_all).
//
// The paper's ablations are flags: --no-error-feedback, --no-warm-start,
// --adaptive (--rank-low/--rank-high/--adaptive-interval/--adaptive-threshold)
// and --alternating set the Config fields of the same names, as do the rank
// policy's --warmup-steps and --lr-boost-steps; --lr-notes calls
// Reducer::note_lr_change() on every rank at each learning-rate decay, and
// --decision-log FILE has rank 0 write the decision log as JSON lines
// ({"step":..,"bucket":..,"rank":..,"reason":"..","lr":..}); --wire-dtype
// f32|bf16|fp16 sets Config::wire_dtype. --model wide
// (784-1024-1024-10) is the paper's regime: rank 2 sends about 157x fewer
// elements per step than a plain allreduce; rank 0 prints the model's
// parameters and that ratio at start. --seed varies the initialization, the
// data order and the engine's initial Q together (the same on every rank).
// Learning rate:
// --lr, multiplied by --lr-decay-factor from each epoch in --lr-decay-epochs on
// (default: x0.1 in the last epoch when there are more than 2). --train-limit
// and --test-limit train and test on the first N images. Each epoch prints rank
// 0's gradient payload of that epoch (Stats::bytes_sent, or the allreduced
// bytes with --no-compression); bench/paper_table.sh parses these lines.
//
// Local steps (--local-steps H > 1, docs/local-steps.md): each rank takes H
// inner steps (its own SGD with momentum on its own shard, no communication),
// then one outer step through powersgd::OuterOptimizer: the pseudo-gradients
// are reduced by the Reducer (PowerSGD with error feedback, or a plain averaged
// allreduce with --no-compression) and applied with Nesterov momentum
// (--outer-lr, --outer-momentum); the last step of the run is an outer step too.
// --start-iter then counts outer steps; the epoch's test accuracy is the
// synchronised start point's, and its bytes fall by about H.
#include <signal.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "powersgd/comm.hpp"
#include "powersgd/gradient_record.hpp"
#include "powersgd/outer_optimizer.hpp"
#include "powersgd/reducer.hpp"
#include "models.hpp"
#include "trainer_checkpoint.hpp"

namespace {

// ---- data ----

struct Dataset {
  std::vector<float> images;  // count x 784, scaled to [0, 1] then standardized
  std::vector<uint8_t> labels;
  size_t count = 0;  // images loaded
  size_t total = 0;  // images in the file
};

// The first `limit` bytes of the decompressed file (all of it when it is shorter):
// 16 ranks on 2 cores each decompressing 47 MB they do not use took most of a short run's start.
std::vector<uint8_t> read_gzip(const std::string& path, size_t limit) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error("cannot open " + path + " (install dataset-fashion-mnist)");
  std::vector<uint8_t> bytes;
  uint8_t chunk[1 << 16];
  int n = 0;
  while (bytes.size() < limit &&
         (n = gzread(file, chunk, unsigned(std::min(sizeof chunk, limit - bytes.size())))) > 0)
    bytes.insert(bytes.end(), chunk, chunk + n);
  gzclose(file);
  if (n < 0) throw std::runtime_error("corrupt gzip file " + path);
  return bytes;
}

uint32_t big_endian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// The first `limit` images of a split (0: all).
Dataset load(const std::string& dir, const std::string& split, size_t limit) {
  const size_t max_bytes = size_t(-1);
  auto images = read_gzip(dir + "/" + split + "-images-idx3-ubyte.gz", limit ? 16 + limit * 784 : max_bytes);
  auto labels = read_gzip(dir + "/" + split + "-labels-idx1-ubyte.gz", limit ? 8 + limit : max_bytes);
  if (images.size() < 16 || big_endian32(images.data()) != 2051 || labels.size() < 8 ||
      big_endian32(labels.data()) != 2049)
    throw std::runtime_error("not IDX files in " + dir);
  Dataset d;
  d.total = big_endian32(images.data() + 4);
  d.count = limit > 0 ? std::min(limit, d.total) : d.total;
  if (big_endian32(images.data() + 8) * big_endian32(images.data() + 12) != 784 ||
      big_endian32(labels.data() + 4) != d.total || images.size() != 16 + d.count * 784 ||
      labels.size() != 8 + d.count)
    throw std::runtime_error("unexpected IDX sizes in " + dir);
  d.images.resize(d.count * 784);
  // Fashion-MNIST pixel mean 0.286 and std 0.353 (of the training set).
  for (size_t i = 0; i < d.images.size(); ++i) d.images[i] = (images[16 + i] / 255.0f - 0.286f) / 0.353f;
  d.labels.assign(labels.begin() + 8, labels.end());
  return d;
}

// Elements and bytes of one compressed step by the engine's rule
// (Config::min_compression_rate: a tensor viewed as shape[0] x rest is compressed
// iff (n + m) r rate < n m, and then sends (n + m) min(n, m, r) elements; every
// other tensor goes whole) against a plain allreduce, at the configured rank
// (with adaptive: at rank_low and rank_high; none with --no-compression).
std::string compression_line(const fashion_mnist::Model& model, const powersgd::Config& config, bool plain_only) {
  auto elements_at = [&](int r) {
    uint64_t sent = 0;
    for (int b = 0; b < fashion_mnist::Model::kBuckets; ++b)
      for (const powersgd::Shape& s : model.bucket_shapes(b)) {
        int64_t n = 1;
        for (int64_t d : s) n *= d;
        const int64_t rows = s[0], cols = s.size() >= 2 ? n / rows : 1;
        const int64_t rr = std::min<int64_t>({rows, cols, int64_t(r)});
        const bool compress = s.size() >= 2 && double(rows + cols) * double(rr) * config.min_compression_rate <
                                                   double(rows) * double(cols);
        sent += compress ? uint64_t(rows + cols) * uint64_t(rr) : uint64_t(n);
      }
    return sent;
  };
  const uint64_t plain = model.parameter_count();
  std::string line = "compression by the engine's rule: plain allreduce " + std::to_string(plain * 4) +
                     " bytes per step";
  std::vector<int> ranks = {config.rank};
  if (config.adaptive) ranks = {config.rank_low, config.rank_high};
  if (plain_only) ranks.clear();
  for (int r : ranks) {
    const uint64_t sent = elements_at(r);
    char buf[128];
    std::snprintf(buf, sizeof buf, "; rank %d %llu bytes per compressed step (%.1fx)", r,
                  static_cast<unsigned long long>(sent * 4), double(plain) / double(sent));
    line += buf;
  }
  return line;
}

}  // namespace


int main(int argc, char** argv) {
  CLI::App app{"Trains a 3-layer perceptron or a small CNN on Fashion-MNIST, data-parallel with PowerSGD. Run it "
               "under powersgd-run, e.g. powersgd-run -n 4 -- train-fashion-mnist"};
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string model_name = "mlp";
  int epochs = 3, global_batch = 256, rank = 4, hidden1 = 256, hidden2 = 128;
  uint64_t seed = 0;
  int64_t start_iter = 10;
  size_t train_limit = 0, test_limit = 0;
  float lr = 0.05f, lr_decay_factor = 0.1f;
  std::vector<int> lr_decay_epochs;
  bool no_compression = false, no_error_feedback = false, no_warm_start = false;
  powersgd::Config defaults;
  bool adaptive = false, alternating = false;
  int rank_low = defaults.rank_low, rank_high = defaults.rank_high;
  int64_t adaptive_interval = defaults.adaptive_interval;
  double adaptive_threshold = defaults.adaptive_threshold;
  std::string record_path;
  int record_steps = 10;
  int64_t record_from = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0, crash_at_step = -1;
  int crash_rank = 0;
  int64_t warmup_steps = defaults.warmup_steps, lr_boost_steps = defaults.lr_boost_steps;
  bool lr_notes = false;
  std::string decision_log_path;
  powersgd::OuterConfig outer_config;
  app.add_option("--data", data_dir, "Directory of the Fashion-MNIST IDX .gz files")->check(CLI::ExistingDirectory);
  app.add_option("--model", model_name,
                 "mlp: 784-256-128-10 perceptron (--hidden sets the 256); wide: 784-1024-1024-10 perceptron (the "
                 "paper's regime, about 157x at rank 2); cnn: conv 5x5 16 ch, max-pool 2, conv 5x5 32 ch, max-pool 2, "
                 "dense 128, dense 10")
      ->check(CLI::IsMember({"mlp", "wide", "cnn"}));
  app.add_option("--seed", seed,
                 "Seed of the model's initialization, the data order and the engine's initial Q (Config::seed), the "
                 "same on every rank; 0 (default) repeats the runs made before this option");
  app.add_option("--epochs", epochs, "Passes over the training set")->check(CLI::Range(1, 100));
  app.add_option("--batch", global_batch, "Global batch size (split over the ranks)")->check(CLI::Range(1, 60000));
  // At most an IDX file's count field (32 bits), checked before load() sizes its read from it.
  app.add_option("--train-limit", train_limit, "Train on the first N training images only (0: all 60000)")
      ->check(CLI::Range(size_t{0}, size_t{0xffffffff}));
  app.add_option("--test-limit", test_limit, "Test on the first N test images only (0: all 10000)")
      ->check(CLI::Range(size_t{0}, size_t{0xffffffff}));
  app.add_option("--rank", rank, "PowerSGD rank r")->check(CLI::Range(1, 64));
  app.add_option("--start-iter", start_iter, "Plain averaged allreduce before this step")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", lr, "Learning rate (SGD with momentum 0.9)");
  app.add_option("--lr-decay-epochs", lr_decay_epochs,
                 "Comma-separated epochs (1-based) from which on the learning rate is multiplied by "
                 "--lr-decay-factor, cumulatively; default: the last epoch when --epochs > 2")
      ->delimiter(',')
      ->check(CLI::Range(1, 100));
  app.add_option("--lr-decay-factor", lr_decay_factor, "Factor of each learning-rate decay (1: no decay)")
      ->check(CLI::Range(0.0f, 1.0f));
  app.add_option("--hidden", hidden1, "Width of the MLP's first hidden layer")->check(CLI::Range(8, 4096));
  app.add_flag("--no-compression", no_compression, "Average gradients with a plain allreduce instead");
  app.add_flag("--no-error-feedback", no_error_feedback, "PowerSGD without error feedback (Config::error_feedback)");
  app.add_flag("--no-warm-start", no_warm_start, "PowerSGD without warm start of Q (Config::warm_start)");
  app.add_flag("--adaptive", adaptive,
               "Adaptive rank (Config::adaptive): each bucket switches between --rank-low and --rank-high; "
               "--rank is not used");
  app.add_option("--rank-low", rank_low, "Adaptive rank: the low rank")->check(CLI::Range(1, 64));
  app.add_option("--rank-high", rank_high, "Adaptive rank: the high rank")->check(CLI::Range(1, 64));
  app.add_option("--adaptive-interval", adaptive_interval, "Adaptive rank: compressed steps per decision window")
      ->check(CLI::PositiveNumber);
  app.add_option("--adaptive-threshold", adaptive_threshold,
                 "Adaptive rank: relative change of the gradient norm that selects --rank-high")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--alternating", alternating,
               "One collective per step: alternate the power-iteration halves (Config::alternating)");
  app.add_option("--warmup-steps", warmup_steps,
                 "Rank policy: the first N compressed steps of each bucket at the high rank (Config::warmup_steps)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lr-boost-steps", lr_boost_steps,
                 "Rank policy: compressed steps at the high rank after a learning-rate note (Config::lr_boost_steps)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--local-steps", outer_config.local_steps,
                 "Inner steps per outer step (DiLoCo, docs/local-steps.md): 1 (default) reduces every step's "
                 "gradients; H > 1 takes H local steps, then reduces the pseudo-gradients in one outer step")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  auto* outer_lr_option = app.add_option("--outer-lr", outer_config.lr,
                                         "Outer learning rate of --local-steps (Nesterov SGD; default 1: plain averaging; DiLoCo: 0.7)");
  auto* outer_momentum_option = app.add_option("--outer-momentum", outer_config.momentum,
                                               "Outer Nesterov momentum of --local-steps, in [0, 1) (default 0; DiLoCo: 0.9)");
  app.add_flag("--lr-notes", lr_notes, "Call Reducer::note_lr_change() at each learning-rate decay");
  app.add_option("--decision-log", decision_log_path,
                 "Rank 0 writes the reducer's rank decisions to this file as JSON lines");
  std::string submit = "all";
  app.add_option("--submit", submit,
                 "How the buckets' gradients go to the Reducer: all (Reducer::reduce_all: both in one reduction) or "
                 "each (Reducer::reduce, one bucket after the other); no effect with --no-compression or "
                 "--local-steps > 1")
      ->check(CLI::IsMember({"all", "each"}));
  std::string wire_dtype = "f32";
  app.add_option("--wire-dtype", wire_dtype,
                 "Element type of the P and Q factors on the wire (Config::wire_dtype): f32, bf16 or fp16")
      ->check(CLI::IsMember({"f32", "bf16", "fp16"}));
  app.add_option("--record-gradients", record_path,
                 "Rank 0 writes its local gradients of some steps to this file, for powersgd-bench sweep");
  app.add_option("--record-steps", record_steps, "Steps to record")->check(CLI::Range(1, 100000));
  app.add_option("--record-from", record_from, "First global step to record")->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "Checkpoint into this directory every --checkpoint-every steps; resume from its newest complete "
                 "checkpoint at start")->check(CLI::ExistingDirectory);
  app.add_option("--checkpoint-every", checkpoint_every, "Steps between checkpoints")->check(CLI::PositiveNumber);
  app.add_option("--crash-at-step", crash_at_step,
                 "Test of resuming: rank --crash-rank kills itself with SIGKILL at this step (at a checkpoint step: "
                 "after writing its own files, before the checkpoint is complete)")->check(CLI::NonNegativeNumber);
  app.add_option("--crash-rank", crash_rank, "The rank --crash-at-step kills")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (!(lr > 0.0f) || !std::isfinite(lr)) {
    std::fprintf(stderr, "--lr %g: expected a finite learning rate > 0\n", double(lr));
    return 2;
  }
  if (!(lr_decay_factor >= 0.0f && lr_decay_factor <= 1.0f)) {  // CLI::Range lets NaN through
    std::fprintf(stderr, "--lr-decay-factor %g: expected a factor in [0, 1]\n", double(lr_decay_factor));
    return 2;
  }
  if (checkpoint_dir.empty() != (checkpoint_every == 0)) {
    std::fprintf(stderr, "--checkpoint-dir and --checkpoint-every go together\n");
    return 2;
  }
  // Progress lines reach the launcher as they are printed, also when the job is stopped.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  for (int e : lr_decay_epochs)
    if (e > epochs) {
      std::fprintf(stderr, "--lr-decay-epochs %d: expected an epoch in 1..%d (--epochs)\n", e, epochs);
      return 2;
    }
  if (app.count("--lr-decay-epochs") == 0 && epochs > 2) lr_decay_epochs = {epochs};
  const bool local_steps = outer_config.local_steps > 1;
  const bool submit_all = submit == "all";
  if (!local_steps && (outer_lr_option->count() > 0 || outer_momentum_option->count() > 0)) {
    std::fprintf(stderr, "--outer-lr and --outer-momentum need --local-steps > 1\n");
    return 2;
  }
  try {
    outer_config.validate();
  } catch (const powersgd::Error& e) {
    std::fprintf(stderr, "train-fashion-mnist: %s\n", e.what());
    return 2;
  }

  try {
    auto comm = powersgd::Communicator::from_env();
    const int world = comm->size();
    const int me = comm->rank();
    if (global_batch % world != 0) {
      std::fprintf(stderr, "--batch %d must be a multiple of the world size %d\n", global_batch, world);
      return 2;
    }
    const int local_batch = global_batch / world;
    Dataset train = load(data_dir, "train", train_limit);
    Dataset test = load(data_dir, "t10k", test_limit);
    if (train_limit > 0 && (train_limit < size_t(global_batch) || train_limit > train.total)) {
      std::fprintf(stderr, "--train-limit %zu: expected 0 or %d (--batch) .. %zu images\n", train_limit,
                   global_batch, train.total);
      return 2;
    }
    if (test_limit > test.total) {
      std::fprintf(stderr, "--test-limit %zu: expected 0 .. %zu images\n", test_limit, test.total);
      return 2;
    }

    if (model_name == "wide") hidden1 = hidden2 = 1024;
    // Seed 0 keeps the streams of the runs made before --seed (initialization 42, data order 7).
    auto model = model_name == "cnn" ? fashion_mnist::make_cnn(16, 32, 128, 42 + seed)
                                     : fashion_mnist::make_mlp(hidden1, hidden2, 42 + seed);
    powersgd::Config config;
    config.rank = rank;
    // With local steps and --no-compression the outer steps are plain averaged allreduces of the Reducer.
    config.start_iter = local_steps && no_compression ? std::numeric_limits<int64_t>::max() : start_iter;
    config.error_feedback = !no_error_feedback;
    config.warm_start = !no_warm_start;
    config.adaptive = adaptive;
    config.rank_low = rank_low;
    config.rank_high = rank_high;
    config.adaptive_interval = adaptive_interval;
    config.adaptive_threshold = adaptive_threshold;
    config.alternating = alternating;
    config.seed = seed;
    config.warmup_steps = warmup_steps;
    config.lr_boost_steps = lr_boost_steps;
    config.wire_dtype = wire_dtype == "bf16"   ? powersgd::WireDType::BFloat16
                        : wire_dtype == "fp16" ? powersgd::WireDType::Float16
                                               : powersgd::WireDType::Float32;
    powersgd::Reducer reducer(*comm, config);
    int buckets[2] = {reducer.add_bucket(model->bucket_shapes(0)), reducer.add_bucket(model->bucket_shapes(1))};
    if (me == 0) {
      std::string method = "plain allreduce";
      if (!no_compression) {
        method = adaptive ? "PowerSGD adaptive rank " + std::to_string(rank_low) + ".." + std::to_string(rank_high)
                          : "PowerSGD rank " + std::to_string(rank);
        if (alternating) method += ", alternating";
        if (no_error_feedback) method += ", no error feedback";
        if (no_warm_start) method += ", no warm start";
        if (warmup_steps > 0) method += ", warm-up " + std::to_string(warmup_steps) + " steps";
        if (lr_notes) method += ", learning-rate notes (boost " + std::to_string(lr_boost_steps) + " steps)";
        if (wire_dtype != "f32") method += ", " + wire_dtype + " factors on the wire";
      }
      if (local_steps) {
        char outer[160];
        std::snprintf(outer, sizeof outer, ", %lld local steps per outer step (outer lr %g, momentum %g)",
                      static_cast<long long>(outer_config.local_steps), outer_config.lr, outer_config.momentum);
        method += outer;
      }
      std::printf("training %zu parameters (%s) on %d ranks, global batch %d, %zu training images, %s, seed %llu\n",
                  model->parameter_count(), model_name.c_str(), world, global_batch, train.count, method.c_str(),
                  static_cast<unsigned long long>(seed));
      std::printf("%s\n", compression_line(*model, config, no_compression).c_str());
    }

    // Local steps: the outer optimizer over the reducer; rank 0's parameters become every rank's start point.
    std::optional<powersgd::OuterOptimizer> outer;
    const auto param_spans = [&] {
      return std::vector<std::span<float>>{std::span<float>(model->params(0)), std::span<float>(model->params(1))};
    };
    if (local_steps) outer.emplace(*comm, reducer, outer_config, param_spans());

    std::unique_ptr<powersgd::GradientRecordWriter> recorder;
    if (me == 0 && !record_path.empty())
      recorder = std::make_unique<powersgd::GradientRecordWriter>(
          record_path, std::vector<std::vector<powersgd::Shape>>{model->bucket_shapes(0), model->bucket_shapes(1)});
    int64_t global_step = 0;

    // Checkpoints: what they hold, and the options a resumed job must share.
    std::vector<float>* tensors[4] = {&model->params(0), &model->params(1), &model->velocity(0), &model->velocity(1)};
    const size_t tensor_sizes[4] = {model->params(0).size(), model->params(1).size(), model->params(0).size(),
                                    model->params(1).size()};
    uint64_t options = fashion_mnist::fnv1a(model_name.data(), model_name.size());
    for (const int64_t v : {int64_t(world), int64_t(global_batch), int64_t(rank), int64_t(hidden1), int64_t(hidden2),
                            start_iter, int64_t(epochs), int64_t(train.count), int64_t(no_compression),
                            int64_t(no_error_feedback), int64_t(no_warm_start), int64_t(adaptive), int64_t(rank_low),
                            int64_t(rank_high), adaptive_interval, int64_t(alternating), warmup_steps,
                            lr_boost_steps, int64_t(lr_notes)})
      options = fashion_mnist::fnv1a(&v, sizeof v, options);
    if (seed != 0) options = fashion_mnist::fnv1a(&seed, sizeof seed, options);  // older checkpoints: seed 0
    for (const float v : {lr, lr_decay_factor}) options = fashion_mnist::fnv1a(&v, sizeof v, options);
    if (local_steps) {  // older checkpoints: one local step
      options = fashion_mnist::fnv1a(&outer_config.local_steps, sizeof outer_config.local_steps, options);
      options = fashion_mnist::fnv1a(&outer_config.lr, sizeof outer_config.lr, options);
      options = fashion_mnist::fnv1a(&outer_config.momentum, sizeof outer_config.momentum, options);
    }
    // The wire type changes the rounding of the run: a resumed job must use the same one.
    if (wire_dtype != "f32") options = fashion_mnist::fnv1a(wire_dtype.data(), wire_dtype.size(), options);
    for (const int e : lr_decay_epochs) options = fashion_mnist::fnv1a(&e, sizeof e, options);
    options = fashion_mnist::fnv1a(&adaptive_threshold, sizeof adaptive_threshold, options);
    std::optional<fashion_mnist::TrainerCheckpoints> checkpoints;
    fashion_mnist::TrainerState resumed;
    if (!checkpoint_dir.empty()) {
      checkpoints.emplace(checkpoint_dir, checkpoint_every, options, *comm, reducer, outer ? &*outer : nullptr);
      if (auto state = checkpoints->resume(tensors, tensor_sizes)) {
        resumed = *state;
        global_step = resumed.step;
        if (me == 0)
          std::printf("resumed from %s at step %lld\n", checkpoint_dir.c_str(), static_cast<long long>(global_step));
      }
    }

    // The decision log (rank 0; every rank drains its reducer's identical log).
    std::unique_ptr<FILE, int (*)(FILE*)> decision_log(nullptr, &std::fclose);
    if (me == 0 && !decision_log_path.empty()) {
      decision_log.reset(std::fopen(decision_log_path.c_str(), global_step > 0 ? "a" : "w"));
      if (!decision_log) throw std::runtime_error("cannot open --decision-log " + decision_log_path);
    }
    const auto write_decisions = [&](float step_lr) {
      if (no_compression || decision_log_path.empty()) return;
      for (const powersgd::RankDecision& d : reducer.decisions())
        if (decision_log)
          std::fprintf(decision_log.get(), "{\"step\":%lld,\"bucket\":%d,\"rank\":%d,\"reason\":\"%s\",\"lr\":%g}\n",
                       static_cast<long long>(d.step), d.bucket, d.rank, powersgd::rank_reason_name(d.reason),
                       double(step_lr));
    };

    std::vector<size_t> order(train.count);
    std::iota(order.begin(), order.end(), size_t{0});
    std::vector<float> x(size_t(local_batch) * 784);
    std::vector<uint8_t> y(local_batch);
    std::mt19937_64 shuffle_rng(7 + seed);  // same permutation on every rank; each takes its slice
    const int steps_per_epoch = int(train.count / global_batch);
    const int64_t total_steps = int64_t(epochs) * steps_per_epoch;
    // Whose bytes the epoch lines count: the Reducer's, or the plain allreduces of --no-compression's.
    const bool through_reducer = !no_compression || local_steps;
    uint64_t plain_bytes = 0, bytes_before_epoch = 0;
    auto t0 = std::chrono::steady_clock::now();
    const int64_t first_epoch = global_step / steps_per_epoch;
    // Resumed: this epoch's bytes count from the resumed step on.
    if (global_step > 0 && through_reducer) bytes_before_epoch = reducer.stats().bytes_sent;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      std::shuffle(order.begin(), order.end(), shuffle_rng);  // also of the epochs a resumed job skips: replayed
      if (epoch < first_epoch) continue;
      // Resumed inside this epoch: its accumulators so far.
      const bool resumed_here = epoch == first_epoch && resumed.step > first_epoch * steps_per_epoch;
      double loss_sum = resumed_here ? resumed.loss_sum : 0;
      int correct = resumed_here ? int(resumed.correct) : 0;
      float epoch_lr = lr, previous_lr = lr;
      for (int e : lr_decay_epochs) {
        if (e <= epoch + 1) epoch_lr *= lr_decay_factor;
        if (e <= epoch) previous_lr *= lr_decay_factor;
      }
      // At the epoch's first step (a job resumed later in the epoch has the note in its reducer checkpoint).
      if (lr_notes && !no_compression && epoch_lr < previous_lr && global_step == int64_t(epoch) * steps_per_epoch)
        reducer.note_lr_change();
      // Communication rounds of the epoch's steps (Communicator::communication_rounds), per step.
      const uint64_t rounds_before = comm->communication_rounds();
      const int64_t steps_before = global_step;
      for (int step = int(global_step - int64_t(epoch) * steps_per_epoch); step < steps_per_epoch; ++step) {
        if (global_step == crash_at_step && me == crash_rank && !(checkpoints && checkpoints->due(global_step)))
          ::raise(SIGKILL);  // a real crash, mid-epoch (test of resuming)
        for (int b = 0; b < local_batch; ++b) {
          size_t index = order[size_t(step) * global_batch + size_t(me) * local_batch + b];
          std::copy_n(&train.images[index * 784], 784, &x[size_t(b) * 784]);
          y[b] = train.labels[index];
        }
        auto [loss, ok] = model->train_step(x.data(), y.data(), local_batch);
        loss_sum += loss;
        correct += ok;
        if (recorder && global_step >= record_from && global_step - record_from < record_steps) {
          const float* local[2] = {model->grads(0).data(), model->grads(1).data()};
          recorder->append_step(local);
        }
        ++global_step;
        if (local_steps) {
          // none: each rank steps on its own gradient
        } else if (no_compression) {
          for (int bucket : buckets) {
            auto& g = model->grads(bucket);
            comm->allreduce(g.data(), g.size(), powersgd::DataType::Float32);
            for (auto& v : g) v /= float(world);
            plain_bytes += g.size() * sizeof(float);
          }
        } else if (submit_all) {
          float* const grads[2] = {model->grads(buckets[0]).data(), model->grads(buckets[1]).data()};
          reducer.reduce_all(std::span<float* const>(grads));
        } else {
          for (int bucket : buckets) reducer.reduce(bucket, model->grads(bucket).data());
        }
        model->sgd(epoch_lr, 0.9f, 5e-4f);
        if (outer && (outer->due(global_step) || global_step == total_steps)) outer->step(param_spans());
        write_decisions(epoch_lr);
        if (checkpoints && checkpoints->due(global_step))
          checkpoints->save({global_step, loss_sum, correct}, tensors,
                            global_step == crash_at_step && me == crash_rank);
      }
      // Accuracy on the test set, split into one contiguous share per rank and summed.
      const size_t test_begin = test.count * size_t(me) / size_t(world);
      const size_t test_end = test.count * size_t(me + 1) / size_t(world);
      // With local steps the synchronised start point is the model (each rank's own differs between outer steps).
      std::vector<float> own[2];
      for (int b = 0; outer && b < 2; ++b) {
        own[b] = model->params(b);
        model->params(b).assign(outer->start(b).begin(), outer->start(b).end());
      }
      int test_correct = model->evaluate(&test.images[test_begin * 784], &test.labels[test_begin],
                                         int(test_end - test_begin)).second;
      for (int b = 0; outer && b < 2; ++b) model->params(b).swap(own[b]);
      const double rounds_per_step = global_step == steps_before ? 0.0
          : double(comm->communication_rounds() - rounds_before) / double(global_step - steps_before);
      double totals[3] = {loss_sum, double(correct), double(test_correct)};
      comm->allreduce(totals, 3, powersgd::DataType::Float64);
      double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const powersgd::Stats stats = reducer.stats();
      const uint64_t bytes_so_far = through_reducer ? stats.bytes_sent : plain_bytes;
      if (me == 0) {
        double samples = double(steps_per_epoch) * global_batch;
        std::string ranks;  // adaptive: each bucket's rank for the next step
        for (size_t b = 0; adaptive && b < stats.current_rank.size(); ++b)
          ranks += (b == 0 ? ", bucket ranks " : "/") + std::to_string(stats.current_rank[b]);
        // "%.1f s" is the time since training began; the bytes are this epoch's gradient payload of rank 0.
        std::printf("epoch %d: train loss %.4f, train accuracy %.2f%%, test accuracy %.2f%%, %.1f s, lr %g, "
                    "%llu bytes sent per rank%s, %.1f communication rounds per step\n",
                    epoch + 1, totals[0] / samples, 100.0 * totals[1] / samples,
                    100.0 * totals[2] / double(test.count), seconds, double(epoch_lr),
                    static_cast<unsigned long long>(bytes_so_far - bytes_before_epoch), ranks.c_str(), rounds_per_step);
        std::fflush(stdout);
      }
      bytes_before_epoch = bytes_so_far;
    }
    if (me == 0) {
      uint64_t hash = fashion_mnist::fnv1a(nullptr, 0);
      for (int b = 0; b < 2; ++b)
        hash = fashion_mnist::fnv1a(model->params(b).data(), model->params(b).size() * sizeof(float), hash);
      std::printf("parameters fnv1a64 %016llx after %lld steps\n", static_cast<unsigned long long>(hash),
                  static_cast<long long>(global_step));
      if (no_compression) {
        std::printf("sent %.1f MB of gradients per rank (uncompressed)\n",
                    (through_reducer ? double(reducer.stats().bytes_sent) : double(plain_bytes)) / 1e6);
      } else {
        powersgd::Stats stats = reducer.stats();
        std::printf("PowerSGD: %.1fx fewer elements than the uncompressed gradients after start_iter, "
                    "%.1f MB sent per rank in all\n",
                    stats.compression_rate(), stats.bytes_sent / 1e6);
      }
    }
    return 0;
  } catch (const powersgd::Error& e) {
    std::fprintf(stderr, "train-fashion-mnist: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train-fashion-mnist: %s\n", e.what());
    return 1;
  }
}
