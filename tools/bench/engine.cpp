// powersgd-bench engine: PowerSGD step time on a model's parameter shapes.
// Single process: the step time against the minimal memory traffic of a step at
// this machine's streaming bandwidth, measured in the same run (STREAM-like copy
// and triad). Under powersgd-run: step time per rank. Rank 0 prints a table and
// writes the JSON.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "compute/backend.hpp"
#include "powersgd/comm.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::string shapes_path;
  int rank = 2;
  int steps = 20;
  int warmup = 3;
  double bucket_mb = 0;  // 0: one bucket for the whole model
  std::string mode = "sync";
  int channels = 1;        // communicator and Reducer pairs; bucket b on channel b % channels
  double stagger_ms = 0;   // async: the time between two buckets' submissions
  bool error_feedback = true;
  bool batch_same_shape = false;
  bool alternating = false;
  bool adaptive = false;
  int rank_low = 1;
  int rank_high = 0;  // 0: --rank (no second level: the policy never boosts)
  int64_t adaptive_interval = 100;
  int64_t divergence_check_interval = Config{}.divergence_check_interval;
  std::string device = "cpu";
  std::string wire_dtype = "f32";
  std::string json_path;
};

struct Model {
  std::string name;
  std::vector<Shape> shapes;
};

// File format (data/models/*.shapes): '#' comments, then one tensor per line:
// name followed by its dimensions.
Model read_shapes(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw IoError("powersgd-bench engine: cannot open shapes file " + path);
  Model model;
  model.name = path.substr(path.find_last_of('/') + 1);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    std::istringstream fields(line);
    std::string name;
    if (!(fields >> name) || name[0] == '#') continue;  // blank (spaces, a CRLF's \r) or a comment
    Shape shape;
    int64_t dim = 0;
    while (fields >> dim) shape.push_back(dim);
    if (!fields.eof())
      throw InvalidArgumentError("powersgd-bench engine: " + path + ":" + std::to_string(number) +
                                 ": expected a name and integer dimensions, got '" + line + "'");
    model.shapes.push_back(std::move(shape));
  }
  if (model.shapes.empty()) throw InvalidArgumentError("powersgd-bench engine: no tensors in " + path);
  return model;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Greedy buckets in model order of at most `mb` MiB (a tensor larger than that gets its own).
std::vector<std::vector<Shape>> make_buckets(const std::vector<Shape>& shapes, double mb) {
  std::vector<std::vector<Shape>> buckets(1);
  const double cap = mb * 1024 * 1024 / sizeof(float);
  double size = 0;
  for (const auto& s : shapes) {
    if (mb > 0 && size > 0 && size + static_cast<double>(numel(s)) > cap) {
      buckets.emplace_back();
      size = 0;
    }
    buckets.back().push_back(s);
    size += static_cast<double>(numel(s));
  }
  return buckets;
}

// Best-of-5 STREAM copy (a = b) and triad (a = b + s * c) bandwidth in GB/s over
// arrays far larger than the caches; bytes counted as STREAM does. `threads`
// threads each take a contiguous slice, as the CPU backend's kernels split
// large matrices over its threads. The arrays are zeroed by the calling thread
// (first touch): on a NUMA host their pages are its node's, which understates
// the bandwidth of many threads (this project's measurements ran on one node).
// Gradient buffers aligned as a training framework's are (PyTorch's CPU
// allocator: 64 bytes), not as malloc's large blocks happen to be (16 bytes).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT(google-explicit-constructor): allocator rebind
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) noexcept { std::free(p); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
using GradientBuffer = std::vector<float, CacheLineAllocator<float>>;

std::pair<double, double> stream_bandwidth(int threads) {
  const size_t n = size_t{32} << 20;  // 128 MiB per array
  std::vector<float> a(n), b(n), c(n);
  auto parallel = [&](auto&& body) {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
    body(0);
    for (auto& th : pool) th.join();
  };
  auto slice = [&](int t) {
    return std::pair{n * static_cast<size_t>(t) / static_cast<size_t>(threads),
                     n * static_cast<size_t>(t + 1) / static_cast<size_t>(threads)};
  };
  parallel([&](int t) {
    const auto [i0, i1] = slice(t);
    std::fill(a.begin() + static_cast<std::ptrdiff_t>(i0), a.begin() + static_cast<std::ptrdiff_t>(i1), 1.0f);
    std::fill(b.begin() + static_cast<std::ptrdiff_t>(i0), b.begin() + static_cast<std::ptrdiff_t>(i1), 2.0f);
    std::fill(c.begin() + static_cast<std::ptrdiff_t>(i0), c.begin() + static_cast<std::ptrdiff_t>(i1), 0.5f);
  });
  double copy = 0, triad = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    parallel([&](int t) {
      const auto [i0, i1] = slice(t);
      std::copy(b.begin() + static_cast<std::ptrdiff_t>(i0), b.begin() + static_cast<std::ptrdiff_t>(i1),
                a.begin() + static_cast<std::ptrdiff_t>(i0));
    });
    auto t1 = Clock::now();
    parallel([&](int t) {
      const auto [i0, i1] = slice(t);
      const float s = 3.0f;
      for (size_t i = i0; i < i1; ++i) a[i] = b[i] + s * c[i];
    });
    auto t2 = Clock::now();
    copy = std::max(copy, 2.0 * n * sizeof(float) / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    triad = std::max(triad, 3.0 * n * sizeof(float) / std::chrono::duration<double>(t2 - t1).count() / 1e9);
  }
  if (a[n / 2] != 3.5f) throw InternalError("powersgd-bench engine: STREAM triad computed a wrong value");
  return {copy, triad};
}

std::unique_ptr<Communicator> make_comm() {
  if (std::getenv("WORLD_SIZE") != nullptr) return Communicator::from_env();
  return Communicator::create(CommOptions::single_process());  // alone: a private store
}

// One communicator and its Reducer.
struct Channel {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Reducer> reducer;
};

// The channels' statistics together: counts and worker seconds summed (the channels' workers run at once, so
// their seconds can add up to more than a step), per-bucket figures in the model's bucket order (`placed`: each
// model bucket's channel and its index there), the largest channel's total relative error.
Stats combined_stats(const std::vector<Channel>& channels, const std::vector<std::pair<Channel*, int>>& placed) {
  std::vector<Stats> each;
  for (const auto& channel : channels) each.push_back(channel.reducer->stats());
  Stats all = each.front();
  for (size_t c = 1; c < each.size(); ++c) {
    const Stats& s = each[c];
    all.numel_before += s.numel_before;
    all.numel_after += s.numel_after;
    all.bytes_sent += s.bytes_sent;
    all.last_step_bytes += s.last_step_bytes;
    all.total_relative_error = std::max(all.total_relative_error, s.total_relative_error);
    all.compress_seconds += s.compress_seconds;
    all.communicate_seconds += s.communicate_seconds;
    all.decompress_seconds += s.decompress_seconds;
    all.guard_seconds += s.guard_seconds;
    all.check_seconds += s.check_seconds;
  }
  all.relative_error.clear();
  all.current_rank.clear();
  for (const auto& [channel, index] : placed) {
    const Stats& s = each[static_cast<size_t>(channel - channels.data())];
    all.relative_error.push_back(s.relative_error.at(static_cast<size_t>(index)));
    all.current_rank.push_back(s.current_rank.at(static_cast<size_t>(index)));
  }
  return all;
}

void run(const Settings& settings) {
  const Model model = read_shapes(settings.shapes_path);
  if (settings.mode != "sync" && settings.mode != "async" && settings.mode != "fused")
    throw InvalidArgumentError("powersgd-bench engine: --mode '" + settings.mode + "': expected sync, async or fused");
  if (settings.device != "cpu" && settings.device != "cuda")
    throw InvalidArgumentError("powersgd-bench engine: --device '" + settings.device + "': expected cpu or cuda");
  if (settings.stagger_ms > 0 && settings.mode != "async") {
    std::ostringstream message;
    message << "powersgd-bench engine: --stagger-ms " << settings.stagger_ms << " with --mode '" << settings.mode
            << "': expected --mode async";
    throw InvalidArgumentError(message.str());
  }
  const auto buckets = make_buckets(model.shapes, settings.bucket_mb);
  if (static_cast<size_t>(settings.channels) > buckets.size()) {
    std::ostringstream message;
    message << "powersgd-bench engine: --channels " << settings.channels << " with " << buckets.size()
            << " bucket(s) (--bucket-mb " << settings.bucket_mb << "): expected at most one channel per bucket";
    throw InvalidArgumentError(message.str());
  }
  std::vector<Channel> channels(static_cast<size_t>(settings.channels));
  channels.front().comm = make_comm();
  for (size_t c = 1; c < channels.size(); ++c)
    channels[c].comm = channels.front().comm->create_channel(static_cast<int>(c));  // overlaps channel 0's
  Communicator* const comm = channels.front().comm.get();
  const int world = comm->size();
  const bool print = comm->rank() == 0;

  Config config;
  config.rank = settings.rank;
  config.start_iter = 0;  // every measured step compressed
  config.error_feedback = settings.error_feedback;
  config.batch_same_shape = settings.batch_same_shape;
  config.alternating = settings.alternating;
  config.adaptive = settings.adaptive;
  config.rank_low = settings.rank_low;
  config.rank_high = settings.rank_high > 0 ? settings.rank_high : settings.rank;
  config.adaptive_interval = settings.adaptive_interval;
  config.divergence_check_interval = settings.divergence_check_interval;
  config.device = settings.device == "cpu" ? Device::Cpu : Device::Cuda;
  config.wire_dtype = settings.wire_dtype == "bf16"   ? WireDType::BFloat16
                      : settings.wire_dtype == "fp16" ? WireDType::Float16
                                                      : WireDType::Float32;
  const size_t floats_before = compute::allocated_floats();  // the engine's buffers: what the reducer adds
  for (auto& channel : channels) channel.reducer = std::make_unique<Reducer>(*channel.comm, config);
  std::vector<std::pair<Channel*, int>> placed;  // per model bucket: its channel and its index there
  for (size_t b = 0; b < buckets.size(); ++b) {
    Channel& channel = channels[b % channels.size()];
    placed.emplace_back(&channel, channel.reducer->add_bucket(buckets[b]));
  }
  const Reducer& reducer = *channels.front().reducer;  // what every channel's reducer has alike

  // Gradients: fresh copies of fixed random values every step (outside the timing).
  std::mt19937 gen(static_cast<unsigned>(comm->rank() + 1));
  std::normal_distribution<float> dist;
  std::vector<GradientBuffer> source, host;
  size_t total = 0;
  for (const auto& [channel, index] : placed) {
    source.emplace_back(channel->reducer->bucket_size(index));
    for (auto& v : source.back()) v = dist(gen);
    host.push_back(source.back());
    total += source.back().size();
  }
  std::unique_ptr<compute::Backend> device;
  std::vector<compute::DeviceBuffer> device_data;
  if (config.device == Device::Cuda) {
    device = compute::make_backend(compute::DeviceKind::Cuda, 0);
    for (auto& h : host) device_data.push_back(device->allocate(h.size()));
  }
  std::vector<float*> data;
  for (size_t b = 0; b < host.size(); ++b) data.push_back(device ? device_data[b].data() : host[b].data());

  std::vector<double> times;
  uint64_t rounds = 0;  // communication rounds within the timed steps (Communicator::communication_rounds)
  uint64_t bytes_before = 0;  // bytes_sent when the timed steps begin
  double guard_before = 0, check_before = 0;  // guard_seconds and check_seconds then
  Stats at_warmup{};  // the worker's times then: the figures printed are the timed steps'

  // One channel's share of a step in the modes where each channel goes its own way (sync, fused): the model's
  // last bucket first, as a backward pass makes them.
  const auto reduce_channel = [&](Channel& channel) {
    if (settings.mode == "fused") {
      std::vector<float*> mine;  // in the channel's bucket order, which is the model's
      for (size_t b = 0; b < placed.size(); ++b)
        if (placed[b].first == &channel) mine.push_back(data[b]);
      channel.reducer->reduce_all(mine);
    } else {
      for (size_t b = placed.size(); b-- > 0;)
        if (placed[b].first == &channel) channel.reducer->reduce(placed[b].second, data[b]);
    }
  };
  const auto rounds_per_channel = [&] {  // a channel's rounds are one after the other; the channels overlap
    std::vector<uint64_t> counts;
    for (const auto& channel : channels) counts.push_back(channel.comm->communication_rounds());
    return counts;
  };

  for (int step = 0; step < settings.warmup + settings.steps; ++step) {
    if (step == settings.warmup) {
      const Stats s = combined_stats(channels, placed);
      bytes_before = s.bytes_sent;
      guard_before = s.guard_seconds;
      check_before = s.check_seconds;
      at_warmup = s;
    }
    for (size_t b = 0; b < host.size(); ++b) {
      if (device)
        device->copy_from_host(data[b], source[b].data(), source[b].size());
      else
        std::copy(source[b].begin(), source[b].end(), host[b].begin());
    }
    if (device) device->synchronize();
    comm->barrier();
    const std::vector<uint64_t> rounds_at_start = rounds_per_channel();
    const auto start = Clock::now();
    if (settings.mode == "async") {
      std::vector<ReduceHandle> handles;
      for (size_t b = buckets.size(); b-- > 0;) {
        if (settings.stagger_ms > 0 && b + 1 < buckets.size())
          std::this_thread::sleep_until(start + std::chrono::duration<double, std::milli>(
                                                    settings.stagger_ms * static_cast<double>(buckets.size() - 1 - b)));
        handles.push_back(placed[b].first->reducer->reduce_async(placed[b].second, data[b]));
      }
      for (auto& h : handles) h.wait();
    } else if (channels.size() == 1) {
      reduce_channel(channels.front());
    } else {
      std::vector<std::thread> threads;
      std::vector<std::exception_ptr> failures(channels.size());
      for (size_t c = 0; c < channels.size(); ++c)
        threads.emplace_back([&, c] {
          try {
            reduce_channel(channels[c]);
          } catch (...) {
            failures[c] = std::current_exception();
          }
        });
      for (auto& t : threads) t.join();
      for (const auto& failure : failures)
        if (failure) std::rethrow_exception(failure);
    }
    if (step >= settings.warmup) {
      times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      const std::vector<uint64_t> rounds_now = rounds_per_channel();
      uint64_t most = 0;
      for (size_t c = 0; c < channels.size(); ++c) most = std::max(most, rounds_now[c] - rounds_at_start[c]);
      rounds += most;
    }
  }
  size_t engine_floats = compute::allocated_floats() - floats_before;
  for (const auto& d : device_data) engine_floats -= d.size();
  const double step_s = median(times);
  // The fastest step: on a shared machine, what the code does when it is not preempted
  // (the STREAM figure beside it is a best of 5 too).
  const double best_s = *std::min_element(times.begin(), times.end());
  std::vector<double> per_rank(static_cast<size_t>(world));
  comm->allgather(&step_s, per_rank.data(), sizeof(double));
  const Stats stats = combined_stats(channels, placed);
  const double compress_s = stats.compress_seconds - at_warmup.compress_seconds;
  const double communicate_s = stats.communicate_seconds - at_warmup.communicate_seconds;
  const double decompress_s = stats.decompress_seconds - at_warmup.decompress_seconds;
  const double bytes_per_step = static_cast<double>(stats.bytes_sent - bytes_before) / settings.steps;
  // Order guard (announce, waiting included) and divergence detector (hashing), per timed step.
  const double guard_ms = (stats.guard_seconds - guard_before) / settings.steps * 1e3;
  const double check_ms = (stats.check_seconds - check_before) / settings.steps * 1e3;
  // The announce includes waiting for the slowest rank (which the first data collective would wait for
  // otherwise); the least over the ranks is the rank that arrived last: about the collective's own latency.
  std::vector<double> guard_per_rank(static_cast<size_t>(world));
  comm->allgather(&guard_ms, guard_per_rank.data(), sizeof(double));
  const double guard_min_ms = *std::min_element(guard_per_rank.begin(), guard_per_rank.end());

  // Minimal memory traffic of one step (bytes), per element. A compressed
  // matrix needs three passes over M = g + e, each depending on a reduction
  // over all of M (P = M Q, then Q = M^T P of the orthogonalized, allreduced P,
  // then the output P Q^T of the allreduced Q), and M (tens of MB) does not stay
  // in cache between them: with error feedback 28 (read g and e, write M; read M;
  // read M, write output and e), without 12 (read g twice, write output);
  // uncompressed 16 / 8 (read g and e, write output and e / read g, write output).
  // Bytes are counted as STREAM counts them (no write-allocate reads). The I/O
  // floor (each of g, e, output, new e crossing the bus once: 16 / 8 per element,
  // as if M stayed in cache) is reported beside it.
  double compressed = 0, uncompressed = 0;
  for (const auto& b : buckets) {
    // The reducer's plan decides; recount with the same test here for the model.
    for (const auto& s : b) {
      const int64_t n = numel(s);
      bool c = s.size() >= 2 && n > 0;
      if (c) {
        const int64_t rows = s[0], cols = n / rows, r = std::min<int64_t>({rows, cols, settings.rank});
        c = static_cast<double>(rows + cols) * static_cast<double>(r) * config.min_compression_rate <
            static_cast<double>(rows) * static_cast<double>(cols);
      }
      (c ? compressed : uncompressed) += static_cast<double>(n);
    }
  }
  const double min_bytes = settings.error_feedback ? 28 * compressed + 16 * uncompressed
                                                   : 12 * compressed + 8 * uncompressed;
  const double io_bytes = (settings.error_feedback ? 16.0 : 8.0) * (compressed + uncompressed);
  nlohmann::json doc = {{"benchmark", "engine"},
                        {"model", model.name},
                        {"tensors", model.shapes.size()},
                        {"elements", total},
                        {"buckets", buckets.size()},
                        {"rank", settings.rank},
                        {"mode", settings.mode},
                        {"channels", settings.channels},
                        {"stagger_ms", settings.stagger_ms},
                        {"error_feedback", settings.error_feedback},
                        {"alternating", settings.alternating},
                        {"adaptive", settings.adaptive},
                        {"bytes_per_step", bytes_per_step},
                        {"wire_dtype", settings.wire_dtype},
                        {"current_rank", stats.current_rank},
                        {"numel_before", stats.numel_before - at_warmup.numel_before},
                        {"numel_after", stats.numel_after - at_warmup.numel_after},
                        {"rank_high", config.rank_high},
                        {"engine_bytes", engine_floats * sizeof(float)},
                        {"device", settings.device},
                        {"backend", reducer.backend_name()},
                        {"ranks", world},
                        {"steps", settings.steps},
                        {"step_ms_per_rank", nlohmann::json::array()},
                        {"step_ms_max", 0.0},
                        {"compression_rate", stats.compression_rate()},
                        {"relative_error", stats.total_relative_error},
                        {"divergence_check_interval", settings.divergence_check_interval},
                        {"guard_ms_per_step", guard_ms},
                        {"rounds_per_step", static_cast<double>(rounds) / settings.steps},
                        {"guard_ms_per_step_least_rank", guard_min_ms},
                        {"check_ms_per_step", check_ms},
                        {"seconds", {{"compress", compress_s},
                                     {"communicate", communicate_s},
                                     {"decompress", decompress_s}}}};
  for (double t : per_rank) doc["step_ms_per_rank"].push_back(t * 1e3);
  doc["step_ms_max"] = *std::max_element(per_rank.begin(), per_rank.end()) * 1e3;
  if (print) {
    std::printf("# powersgd-bench engine: %s, %zu tensors, %zu elements, %zu bucket(s), rank %d, %s, %d channel(s), "
                "%d rank(s), %s\n",
                model.name.c_str(), model.shapes.size(), total, buckets.size(), settings.rank, settings.mode.c_str(),
                settings.channels, world, reducer.backend_name().c_str());
    for (int r = 0; r < world; ++r) std::printf("step time rank %d: %.3f ms (median of %d)\n", r, per_rank[static_cast<size_t>(r)] * 1e3, settings.steps);
    std::printf("%s%s, %s factors: %.0f bytes sent per step per rank (mean of the timed steps)\n",
                settings.alternating ? "alternating" : "default (P then Q)", settings.adaptive ? ", adaptive" : "",
                settings.wire_dtype.c_str(), bytes_per_step);
    const char* const summed = settings.channels > 1 ? " (summed over the channels)" : "";
    std::printf("compression rate %.1fx, relative error %.3f%s; worker time of the timed steps%s: compress %.3f s, "
                "communicate %.3f s, decompress %.3f s\n",
                stats.compression_rate(), stats.total_relative_error,
                settings.channels > 1 ? " (the largest channel's)" : "", summed, compress_s, communicate_s,
                decompress_s);
    std::printf("engine buffers %.1f MiB on rank 0 (arenas and per-bucket buffers; rank_high %d)\n",
                static_cast<double>(engine_floats * sizeof(float)) / (1 << 20), config.rank_high);
    std::printf("order guard%s %.3f ms per step on rank 0, %.3f ms on the rank that waited least (announce, "
                "waiting included); divergence detector (interval %lld) %.3f ms per step on rank 0 (hashing)\n",
                summed, guard_ms, guard_min_ms, static_cast<long long>(settings.divergence_check_interval), check_ms);
    std::printf("communication rounds per step: %.1f (one after the other%s; each at least one one-way delay)\n",
                static_cast<double>(rounds) / settings.steps, settings.channels > 1 ? " on the busiest channel" : "");
  }
  if (world == 1 && config.device == Device::Cpu) {
    // The bound at the bandwidth of as many threads as the backend's kernels use
    // (its thread count), and at one thread's beside it.
    const int threads = compute::cpu_blas_threads();
    const auto [copy1, triad1] = stream_bandwidth(1);
    const auto [copy, triad] = threads > 1 ? stream_bandwidth(threads) : std::pair{copy1, triad1};
    const double bw = std::max(copy, triad), bw1 = std::max(copy1, triad1);
    const double min_s = min_bytes / (bw * 1e9);
    doc["stream_threads"] = threads;
    doc["stream_copy_GBps"] = copy;
    doc["stream_triad_GBps"] = triad;
    doc["stream_copy_GBps_1_thread"] = copy1;
    doc["stream_triad_GBps_1_thread"] = triad1;
    doc["minimal_traffic_bytes"] = min_bytes;
    doc["minimal_traffic_ms"] = min_s * 1e3;
    doc["minimal_traffic_ms_1_thread"] = min_bytes / (bw1 * 1e9) * 1e3;
    doc["ratio_to_minimal"] = step_s / min_s;
    doc["best_step_ms"] = best_s * 1e3;
    doc["best_ratio_to_minimal"] = best_s / min_s;
    doc["io_floor_bytes"] = io_bytes;
    doc["io_floor_ms"] = io_bytes / (bw * 1e9) * 1e3;
    std::printf("STREAM copy %.2f GB/s, triad %.2f GB/s (%d thread(s), as the kernels); 1 thread: copy %.2f, triad %.2f\n",
                copy, triad, threads, copy1, triad1);
    std::printf("minimal traffic %.1f MB -> %.3f ms at %.2f GB/s; step %.3f ms = %.2fx the minimum (%.2fx at 1 thread's bandwidth)\n",
                min_bytes / 1e6, min_s * 1e3, bw, step_s * 1e3, step_s / min_s, step_s / (min_bytes / (bw1 * 1e9)));
    std::printf("fastest step %.3f ms = %.2fx the minimum\n", best_s * 1e3, best_s / min_s);
    std::printf("I/O floor %.1f MB (g, e, output, e once each) -> %.3f ms; step = %.2fx the floor\n", io_bytes / 1e6,
                io_bytes / (bw * 1e9) * 1e3, step_s / (io_bytes / (bw * 1e9)));
  }
  if (print && !settings.json_path.empty()) write_json(settings.json_path, doc, "engine");
}

}  // namespace

void add_engine_command(CLI::App& app) {
  auto settings = std::make_shared<Settings>();
  CLI::App* cmd = app.add_subcommand("engine", "PowerSGD step time on a model's shapes (single process: against "
                                               "the minimal memory traffic at measured STREAM bandwidth)");
  cmd->add_option("--shapes", settings->shapes_path, "Model shapes file (data/models/*.shapes)")->required();
  cmd->add_option("--rank", settings->rank, "PowerSGD rank r")->capture_default_str();
  cmd->add_option("--steps", settings->steps, "Timed steps")->capture_default_str()->check(CLI::Range(1, 1000000));
  cmd->add_option("--warmup", settings->warmup, "Untimed steps first")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--bucket-mb", settings->bucket_mb, "Bucket cap in MiB (0: the model in one bucket)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--mode", settings->mode, "sync (reduce per bucket), async (all in flight) or fused (reduce_all)")
      ->capture_default_str();
  cmd->add_option("--channels", settings->channels,
                  "Communicators, each with its own Reducer: bucket b on channel b % N (sync and fused: a thread "
                  "per channel; their collectives overlap on the wire)")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  cmd->add_option("--stagger-ms", settings->stagger_ms,
                  "async: submit bucket after bucket this many ms apart, the last bucket first (a backward pass "
                  "on an accelerator); the step is timed from the first submission")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  cmd->add_flag("!--no-error-feedback", settings->error_feedback, "Disable error feedback");
  cmd->add_flag("--batch-same-shape", settings->batch_same_shape, "Batched gemm over same-shaped matrices");
  cmd->add_flag("--alternating", settings->alternating, "One collective per step (alternating P and Q halves)");
  cmd->add_flag("--adaptive", settings->adaptive, "Adaptive rank between --rank-low and --rank");
  cmd->add_option("--rank-low", settings->rank_low, "Adaptive: the low rank")->capture_default_str();
  cmd->add_option("--rank-high", settings->rank_high,
                  "Config::rank_high (default: --rank; above it a fixed rank's notes could boost to it)");
  cmd->add_option("--adaptive-interval", settings->adaptive_interval, "Adaptive: compressed steps per decision")
      ->capture_default_str();
  cmd->add_option("--divergence-check-interval", settings->divergence_check_interval,
                  "Divergence detector: hash and compare outputs every N steps (0: off)")
      ->capture_default_str();
  cmd->add_option("--device", settings->device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--wire-dtype", settings->wire_dtype, "P and Q on the wire (Config::wire_dtype): f32, bf16 or fp16")
      ->check(CLI::IsMember({"f32", "bf16", "fp16"}))
      ->capture_default_str();
  cmd->add_option("--json", settings->json_path, "Write results as JSON to this file (rank 0)");
  cmd->callback([settings] { run(*settings); });
}

}  // namespace powersgd::bench
