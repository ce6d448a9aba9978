// Example training job: a 3-layer perceptron on Fashion-MNIST, data-parallel
// over every rank of the job, gradients exchanged with PowerSGD.
//
//   powersgd-run -n 4 -- train-fashion-mnist --epochs 3 --rank 4
//
// Each rank trains on its own shard of every global batch; after backward the
// gradients of the two buckets (output layers first, as DDP orders them) are
// reduced with PowerSGD (or with a plain averaged allreduce, --no-compression,
// for comparison). The model is small enough for a 2-core machine and real
// enough to show accuracy and traffic side by side.
//
// --checkpoint-dir DIR --checkpoint-every N: per-rank checkpoints every N steps
// (trainer_checkpoint.hpp); at start the job resumes from the newest complete
// one, and the data order is replayed from its fixed seed, so a job killed and
// restarted ends with the same parameters, bit for bit, as an uninterrupted one.
#include <cblas.h>
#include <signal.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "powersgd/comm.hpp"
#include "powersgd/gradient_record.hpp"
#include "powersgd/reducer.hpp"
#include "trainer_checkpoint.hpp"

namespace {

// ---- data ----

struct Dataset {
  std::vector<float> images;  // count x 784, scaled to [0, 1] then standardized
  std::vector<uint8_t> labels;
  size_t count = 0;
};

std::vector<uint8_t> read_gzip(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error("cannot open " + path + " (install dataset-fashion-mnist)");
  std::vector<uint8_t> bytes;
  uint8_t chunk[1 << 16];
  int n;
  while ((n = gzread(file, chunk, sizeof chunk)) > 0) bytes.insert(bytes.end(), chunk, chunk + n);
  gzclose(file);
  if (n < 0) throw std::runtime_error("corrupt gzip file " + path);
  return bytes;
}

uint32_t big_endian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

Dataset load(const std::string& dir, const std::string& split) {
  auto images = read_gzip(dir + "/" + split + "-images-idx3-ubyte.gz");
  auto labels = read_gzip(dir + "/" + split + "-labels-idx1-ubyte.gz");
  if (images.size() < 16 || big_endian32(images.data()) != 2051 || labels.size() < 8 ||
      big_endian32(labels.data()) != 2049)
    throw std::runtime_error("not IDX files in " + dir);
  Dataset d;
  d.count = big_endian32(images.data() + 4);
  if (big_endian32(images.data() + 8) * big_endian32(images.data() + 12) != 784 ||
      big_endian32(labels.data() + 4) != d.count || images.size() != 16 + d.count * 784)
    throw std::runtime_error("unexpected IDX sizes in " + dir);
  d.images.resize(d.count * 784);
  // Fashion-MNIST pixel mean 0.286 and std 0.353 (of the training set).
  for (size_t i = 0; i < d.images.size(); ++i) d.images[i] = (images[16 + i] / 255.0f - 0.286f) / 0.353f;
  d.labels.assign(labels.begin() + 8, labels.end());
  return d;
}

// ---- model: 784 -> h1 -> h2 -> 10, ReLU, softmax cross-entropy ----

// A dense layer's weight (out x in) and bias (out) lie contiguously in one bucket.
struct Layer {
  int in = 0, out = 0;
  int bucket = 0;
  size_t offset = 0;  // of the weight in the bucket's buffer; the bias follows it
};

class Mlp {
 public:
  Mlp(int h1, int h2, uint64_t seed) {
    dims_ = {784, h1, h2, 10};
    // Bucket 0 holds the two output layers, bucket 1 the first (DDP's reverse order).
    params_[0].resize(size_t(h2) * h1 + h2 + size_t(10) * h2 + 10);
    params_[1].resize(size_t(h1) * 784 + h1);
    grads_[0].resize(params_[0].size());
    grads_[1].resize(params_[1].size());
    layers_.resize(3);
    layers_[0] = {784, h1, 1, 0};
    layers_[1] = {h1, h2, 0, 0};
    layers_[2] = {h2, 10, 0, size_t(h2) * h1 + h2};
    std::mt19937_64 rng(seed);
    for (auto& layer : layers_) {
      // He initialization; identical on every rank because the seed is.
      std::normal_distribution<float> normal(0.0f, std::sqrt(2.0f / layer.in));
      float* w = weight(params_, layer);
      for (int i = 0; i < layer.in * layer.out; ++i) w[i] = normal(rng);
    }
  }

  // Shapes of each bucket's tensors, in buffer order.
  std::vector<std::vector<int64_t>> bucket_shapes(int bucket) const {
    if (bucket == 0) return {{dims_[2], dims_[1]}, {dims_[2]}, {dims_[3], dims_[2]}, {dims_[3]}};
    return {{dims_[1], dims_[0]}, {dims_[1]}};
  }
  std::vector<float>& grads(int bucket) { return grads_[bucket]; }
  std::vector<float>& params(int bucket) { return params_[bucket]; }
  std::vector<float>& velocity(int bucket) { return velocity_[bucket]; }  // empty before the first step
  size_t parameter_count() const { return params_[0].size() + params_[1].size(); }

  // Forward and backward on `batch` samples; returns the summed loss and the
  // number of correct predictions. Gradients are of the mean loss.
  std::pair<double, int> train_step(const float* x, const uint8_t* y, int batch) {
    forward(x, batch);
    int correct = 0;
    double loss = 0;
    // d(mean loss)/d(logits) = (softmax - onehot) / batch
    std::vector<float>& delta = acts_[3];
    for (int b = 0; b < batch; ++b) {
      float* row = &delta[size_t(b) * 10];
      float max = *std::max_element(row, row + 10);
      double sum = 0;
      for (int k = 0; k < 10; ++k) sum += std::exp(double(row[k] - max));
      int best = int(std::max_element(row, row + 10) - row);
      correct += best == y[b];
      loss += -(double(row[y[b]] - max) - std::log(sum));
      for (int k = 0; k < 10; ++k)
        row[k] = float((std::exp(double(row[k] - max)) / sum - (k == y[b] ? 1.0 : 0.0)) / batch);
    }
    for (int l = 2; l >= 0; --l) {
      const Layer& layer = layers_[l];
      const float* input = l == 0 ? x : acts_[l].data();
      float* dw = weight(grads_, layer);
      float* db = bias(grads_, layer);
      // dW = delta^T input (out x in); db = column sums of delta.
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, layer.out, layer.in, batch, 1.0f, delta.data(),
                  layer.out, input, layer.in, 0.0f, dw, layer.in);
      std::fill(db, db + layer.out, 0.0f);
      for (int b = 0; b < batch; ++b)
        for (int o = 0; o < layer.out; ++o) db[o] += delta[size_t(b) * layer.out + o];
      if (l == 0) break;
      // delta_prev = (delta W) * relu'(act)
      std::vector<float> prev(size_t(batch) * layer.in);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, layer.in, layer.out, 1.0f, delta.data(),
                  layer.out, weight(params_, layer), layer.in, 0.0f, prev.data(), layer.in);
      for (size_t i = 0; i < prev.size(); ++i)
        if (acts_[l][i] <= 0.0f) prev[i] = 0.0f;
      delta.swap(prev);
    }
    return {loss, correct};
  }

  int count_correct(const float* x, const uint8_t* y, int batch) {
    forward(x, batch);
    int correct = 0;
    for (int b = 0; b < batch; ++b) {
      const float* row = &acts_[3][size_t(b) * 10];
      correct += int(std::max_element(row, row + 10) - row) == y[b];
    }
    return correct;
  }

  // SGD with momentum and weight decay on every parameter.
  void sgd(float lr, float momentum, float weight_decay) {
    for (int bucket = 0; bucket < 2; ++bucket) {
      auto& p = params_[bucket];
      auto& g = grads_[bucket];
      auto& v = velocity_[bucket];
      if (v.empty()) v.assign(p.size(), 0.0f);
      for (size_t i = 0; i < p.size(); ++i) {
        v[i] = momentum * v[i] + g[i] + weight_decay * p[i];
        p[i] -= lr * v[i];
      }
    }
  }

 private:
  static float* weight(std::vector<float>* storage, const Layer& l) { return storage[l.bucket].data() + l.offset; }
  static float* bias(std::vector<float>* storage, const Layer& l) {
    return weight(storage, l) + size_t(l.in) * l.out;
  }

  void forward(const float* x, int batch) {
    for (int l = 0; l < 3; ++l) {
      const Layer& layer = layers_[l];
      const float* input = l == 0 ? x : acts_[l].data();
      auto& out = acts_[l + 1];
      out.resize(size_t(batch) * layer.out);
      const float* b = bias(params_, layer);
      for (int i = 0; i < batch; ++i) std::copy(b, b + layer.out, &out[size_t(i) * layer.out]);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, layer.out, layer.in, 1.0f, input, layer.in,
                  weight(params_, layer), layer.in, 1.0f, out.data(), layer.out);
      if (l < 2)
        for (auto& v : out) v = std::max(v, 0.0f);
    }
  }

  std::vector<int64_t> dims_;
  std::vector<float> params_[2], grads_[2], velocity_[2];
  std::vector<Layer> layers_;
  std::vector<float> acts_[4];
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Trains a 3-layer perceptron on Fashion-MNIST, data-parallel with PowerSGD. Run it under "
               "powersgd-run, e.g. powersgd-run -n 4 -- train-fashion-mnist"};
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int epochs = 3, global_batch = 256, rank = 4, hidden1 = 256, hidden2 = 128;
  int64_t start_iter = 10;
  float lr = 0.05f;
  bool no_compression = false;
  std::string record_path;
  int record_steps = 10;
  int64_t record_from = 0;
  size_t train_limit = 0, test_limit = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0, crash_at_step = -1;
  int crash_rank = 0;
  app.add_option("--data", data_dir, "Directory of the Fashion-MNIST IDX .gz files")->check(CLI::ExistingDirectory);
  app.add_option("--epochs", epochs, "Passes over the training set")->check(CLI::Range(1, 100));
  app.add_option("--batch", global_batch, "Global batch size (split over the ranks)")->check(CLI::Range(1, 60000));
  app.add_option("--rank", rank, "PowerSGD rank r")->check(CLI::Range(1, 64));
  app.add_option("--start-iter", start_iter, "Plain averaged allreduce before this step")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", lr, "Learning rate (SGD with momentum 0.9)");
  app.add_option("--hidden", hidden1, "Width of the first hidden layer")->check(CLI::Range(8, 4096));
  app.add_flag("--no-compression", no_compression, "Average gradients with a plain allreduce instead");
  app.add_option("--record-gradients", record_path,
                 "Rank 0 writes its local gradients of some steps to this file, for powersgd-bench sweep");
  app.add_option("--record-steps", record_steps, "Steps to record")->check(CLI::Range(1, 100000));
  app.add_option("--record-from", record_from, "First global step to record")->check(CLI::NonNegativeNumber);
  app.add_option("--train-limit", train_limit, "Train on the first N training images only (0: all 60000)");
  app.add_option("--test-limit", test_limit, "Test on the first N test images only (0: all 10000)");
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "Checkpoint into this directory every --checkpoint-every steps; resume from its newest complete "
                 "checkpoint at start")->check(CLI::ExistingDirectory);
  app.add_option("--checkpoint-every", checkpoint_every, "Steps between checkpoints")->check(CLI::PositiveNumber);
  app.add_option("--crash-at-step", crash_at_step,
                 "Test of resuming: rank --crash-rank kills itself with SIGKILL at this step (at a checkpoint step: "
                 "after writing its own files, before the checkpoint is complete)")->check(CLI::NonNegativeNumber);
  app.add_option("--crash-rank", crash_rank, "The rank --crash-at-step kills")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (checkpoint_dir.empty() != (checkpoint_every == 0)) {
    std::fprintf(stderr, "--checkpoint-dir and --checkpoint-every go together\n");
    return 2;
  }
  // Progress lines reach the launcher as they are printed, also when the job is stopped.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  try {
    auto comm = powersgd::Communicator::from_env();
    const int world = comm->size();
    const int me = comm->rank();
    if (global_batch % world != 0) {
      std::fprintf(stderr, "--batch %d must be a multiple of the world size %d\n", global_batch, world);
      return 2;
    }
    const int local_batch = global_batch / world;
    Dataset train = load(data_dir, "train");
    Dataset test = load(data_dir, "t10k");
    if (train_limit > 0) {
      if (train_limit < size_t(global_batch) || train_limit > train.count) {
        std::fprintf(stderr, "--train-limit %zu: expected 0 or %d (--batch) .. %zu images\n", train_limit,
                     global_batch, train.count);
        return 2;
      }
      train.count = train_limit;
    }
    if (test_limit > 0) {
      if (test_limit > test.count) {
        std::fprintf(stderr, "--test-limit %zu: expected 0 .. %zu images\n", test_limit, test.count);
        return 2;
      }
      test.count = test_limit;
    }

    Mlp model(hidden1, hidden2, /*seed=*/42);
    powersgd::Config config;
    config.rank = rank;
    config.start_iter = start_iter;
    powersgd::Reducer reducer(*comm, config);
    int buckets[2] = {reducer.add_bucket(model.bucket_shapes(0)), reducer.add_bucket(model.bucket_shapes(1))};
    if (me == 0)
      std::printf("training %zu parameters on %d ranks, global batch %d, %s\n", model.parameter_count(), world,
                  global_batch,
                  no_compression ? "plain allreduce" : ("PowerSGD rank " + std::to_string(rank)).c_str());

    std::unique_ptr<powersgd::GradientRecordWriter> recorder;
    if (me == 0 && !record_path.empty())
      recorder = std::make_unique<powersgd::GradientRecordWriter>(
          record_path, std::vector<std::vector<powersgd::Shape>>{model.bucket_shapes(0), model.bucket_shapes(1)});
    int64_t global_step = 0;

    // Checkpoints: what they hold, and the options a resumed job must share.
    std::vector<float>* tensors[4] = {&model.params(0), &model.params(1), &model.velocity(0), &model.velocity(1)};
    const size_t tensor_sizes[4] = {model.params(0).size(), model.params(1).size(), model.params(0).size(),
                                    model.params(1).size()};
    uint64_t options = 0;
    for (const int64_t v : {int64_t(world), int64_t(global_batch), int64_t(rank), int64_t(hidden1), int64_t(hidden2),
                            start_iter, int64_t(epochs), int64_t(train.count), int64_t(no_compression)})
      options = fashion_mnist::fnv1a(&v, sizeof v, options);
    options = fashion_mnist::fnv1a(&lr, sizeof lr, options);
    std::optional<fashion_mnist::TrainerCheckpoints> checkpoints;
    fashion_mnist::TrainerState resumed;
    if (!checkpoint_dir.empty()) {
      checkpoints.emplace(checkpoint_dir, checkpoint_every, options, *comm, reducer);
      if (auto state = checkpoints->resume(tensors, tensor_sizes)) {
        resumed = *state;
        global_step = resumed.step;
        if (me == 0)
          std::printf("resumed from %s at step %lld\n", checkpoint_dir.c_str(), static_cast<long long>(global_step));
      }
    }

    std::vector<size_t> order(train.count);
    std::iota(order.begin(), order.end(), size_t{0});
    std::vector<float> x(size_t(local_batch) * 784);
    std::vector<uint8_t> y(local_batch);
    std::mt19937_64 shuffle_rng(7);  // same permutation on every rank; each takes its slice
    const int steps_per_epoch = int(train.count / global_batch);
    uint64_t plain_bytes = 0;
    auto t0 = std::chrono::steady_clock::now();
    const int64_t first_epoch = global_step / steps_per_epoch;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      std::shuffle(order.begin(), order.end(), shuffle_rng);  // also of the epochs a resumed job skips: replayed
      if (epoch < first_epoch) continue;
      // Resumed inside this epoch: its accumulators so far.
      const bool resumed_here = epoch == first_epoch && resumed.step > first_epoch * steps_per_epoch;
      double loss_sum = resumed_here ? resumed.loss_sum : 0;
      int correct = resumed_here ? int(resumed.correct) : 0;
      float epoch_lr = lr * (epoch + 1 == epochs && epochs > 2 ? 0.1f : 1.0f);
      for (int step = int(global_step - int64_t(epoch) * steps_per_epoch); step < steps_per_epoch; ++step) {
        if (global_step == crash_at_step && me == crash_rank && !(checkpoints && checkpoints->due(global_step)))
          ::raise(SIGKILL);  // a real crash, mid-epoch (test of resuming)
        for (int b = 0; b < local_batch; ++b) {
          size_t index = order[size_t(step) * global_batch + size_t(me) * local_batch + b];
          std::copy_n(&train.images[index * 784], 784, &x[size_t(b) * 784]);
          y[b] = train.labels[index];
        }
        auto [loss, ok] = model.train_step(x.data(), y.data(), local_batch);
        loss_sum += loss;
        correct += ok;
        if (recorder && global_step >= record_from && global_step < record_from + record_steps) {
          const float* local[2] = {model.grads(0).data(), model.grads(1).data()};
          recorder->append_step(local);
        }
        ++global_step;
        for (int bucket : buckets) {
          auto& g = model.grads(bucket);
          if (no_compression) {
            comm->allreduce(g.data(), g.size(), powersgd::DataType::Float32);
            for (auto& v : g) v /= float(world);
            plain_bytes += g.size() * sizeof(float);
          } else {
            reducer.reduce(bucket, g.data());
          }
        }
        model.sgd(epoch_lr, 0.9f, 5e-4f);
        if (checkpoints && checkpoints->due(global_step))
          checkpoints->save({global_step, loss_sum, correct}, tensors,
                            global_step == crash_at_step && me == crash_rank);
      }
      // Accuracy on the whole test set, split over ranks and summed.
      int test_correct = 0;
      for (size_t i = size_t(me); i < test.count; i += size_t(world))
        test_correct += model.count_correct(&test.images[i * 784], &test.labels[i], 1);
      double totals[3] = {loss_sum, double(correct), double(test_correct)};
      comm->allreduce(totals, 3, powersgd::DataType::Float64);
      double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (me == 0) {
        double samples = double(steps_per_epoch) * global_batch;
        std::printf("epoch %d: train loss %.4f, train accuracy %.2f%%, test accuracy %.2f%%, %.1f s\n", epoch + 1,
                    totals[0] / samples, 100.0 * totals[1] / samples, 100.0 * totals[2] / double(test.count),
                    seconds);
      }
    }
    if (me == 0) {
      uint64_t hash = fashion_mnist::fnv1a(nullptr, 0);
      for (int b = 0; b < 2; ++b)
        hash = fashion_mnist::fnv1a(model.params(b).data(), model.params(b).size() * sizeof(float), hash);
      std::printf("parameters fnv1a64 %016llx after %lld steps\n", static_cast<unsigned long long>(hash),
                  static_cast<long long>(global_step));
      if (no_compression) {
        std::printf("sent %.1f MB of gradients per rank (uncompressed)\n", plain_bytes / 1e6);
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
