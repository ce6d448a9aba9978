// powersgd-bench allreduce: latency and bus bandwidth of float32 allreduce
// versus message size, per algorithm. Every rank runs it (under powersgd-run);
// rank 0 prints the table and writes the JSON.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hpp"
#include "comm/communicator.hpp"

namespace powersgd::bench {
namespace {

using transport::Algorithm;
using transport::GlooApi;
using transport::GlooCommunicator;

struct Settings {
  size_t min_bytes = 4;
  size_t max_bytes = size_t{64} << 20;
  std::vector<std::string> algorithms{"ring", "bcube", "halving-doubling", "ring-legacy"};
  double seconds_per_size = 0.2;  // target time per (algorithm, size)
  int max_iterations = 1000;
  std::string json_path;
};

struct Variant {
  Algorithm algorithm;
  GlooApi api;
};

const std::map<std::string, Variant> kVariants = {
    {"ring", {Algorithm::Ring, GlooApi::New}},
    {"bcube", {Algorithm::Bcube, GlooApi::New}},
    {"direct", {Algorithm::Direct, GlooApi::New}},
    {"scatter-gather", {Algorithm::ScatterGather, GlooApi::New}},
    {"halving-doubling", {Algorithm::HalvingDoubling, GlooApi::Legacy}},
    {"ring-legacy", {Algorithm::Ring, GlooApi::Legacy}},
};

// Slowest rank's value: the collective is as fast as its slowest member.
double max_over_ranks(Communicator& comm, double value) {
  std::vector<double> all(static_cast<size_t>(comm.size()));
  comm.allgather(&value, all.data(), sizeof(double));
  return *std::max_element(all.begin(), all.end());
}

// Seconds per allreduce of `count` floats, agreed by all ranks: the median
// over iterations (robust against scheduler hiccups on shared hosts) of the
// slowest rank.
double time_allreduce(GlooCommunicator& comm, std::vector<float>& data, size_t count, Algorithm algorithm,
                      const Settings& settings) {
  using Clock = std::chrono::steady_clock;
  auto once = [&] {
    auto start = Clock::now();
    comm.allreduce_async(data.data(), count, DataType::Float32, algorithm).wait();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  once();  // warm-up
  comm.barrier();
  // Iteration count from one timed call, agreed so all ranks run the same number.
  double estimate = max_over_ranks(comm, once());
  // At least 5 iterations, but never more than --max-iterations (which may be 3 or 4): std::clamp would need
  // 5 <= --max-iterations.
  int iterations = static_cast<int>(std::min(std::max(settings.seconds_per_size / std::max(estimate, 1e-7), 5.0),
                                             static_cast<double>(settings.max_iterations)));
  std::vector<double> times(static_cast<size_t>(iterations));
  comm.barrier();
  for (double& t : times) t = once();
  return max_over_ranks(comm, median(std::move(times)));
}

void run(const Settings& settings) {
  if (settings.min_bytes > settings.max_bytes)
    throw InvalidArgumentError("--min-bytes " + std::to_string(settings.min_bytes) + " above --max-bytes " +
                               std::to_string(settings.max_bytes) + ": expected at most --max-bytes");
  for (const auto& name : settings.algorithms)
    if (!kVariants.count(name))
      throw InvalidArgumentError("unknown algorithm '" + name +
                                 "': expected ring, bcube, direct, scatter-gather, halving-doubling or ring-legacy");
  CommOptions options = CommOptions::from_env();
  // One communicator per Gloo API: mixing both on one context slows both down.
  std::map<GlooApi, std::unique_ptr<GlooCommunicator>> comms;
  for (GlooApi api : {GlooApi::New, GlooApi::Legacy}) {
    bool used = std::any_of(settings.algorithms.begin(), settings.algorithms.end(),
                            [&](const std::string& name) { return kVariants.at(name).api == api; });
    if (!used) continue;
    CommOptions o = options;
    o.run_id = options.run_id + (api == GlooApi::New ? "bench-new" : "bench-legacy");
    o.host_store = options.host_store && comms.empty();  // the first one's store serves both
    comms[api] = GlooCommunicator::create(o, api);
  }
  GlooCommunicator& any = *comms.begin()->second;
  const int n = any.size();
  const bool print = any.rank() == 0;
  const double bus_factor = n > 1 ? 2.0 * (n - 1) / n : 1.0;

  std::vector<float> data(settings.max_bytes / sizeof(float) + 1, 1.0f);
  nlohmann::json results = nlohmann::json::array();
  if (print)
    std::printf("# allreduce float32, %d ranks, transport %s\n# %-17s %12s %12s %12s %12s\n", n,
                options.transport == TransportKind::Tcp ? "tcp" : "ibverbs", "algorithm", "bytes", "latency_us",
                "algbw_GB/s", "busbw_GB/s");
  for (const auto& name : settings.algorithms) {
    const Variant& variant = kVariants.at(name);
    GlooCommunicator& comm = *comms.at(variant.api);
    for (size_t bytes = settings.min_bytes; bytes <= settings.max_bytes; bytes *= 2) {
      size_t count = std::max<size_t>(1, bytes / sizeof(float));
      double seconds = time_allreduce(comm, data, count, variant.algorithm, settings);
      double algbw = static_cast<double>(count * sizeof(float)) / seconds / 1e9;
      if (print) {
        std::printf("  %-17s %12zu %12.1f %12.4f %12.4f\n", name.c_str(), count * sizeof(float), seconds * 1e6,
                    algbw, algbw * bus_factor);
        std::fflush(stdout);
      }
      results.push_back({{"algorithm", name},
                         {"bytes", count * sizeof(float)},
                         {"latency_us", seconds * 1e6},
                         {"algbw_GBps", algbw},
                         {"busbw_GBps", algbw * bus_factor}});
    }
  }
  // Crossover per API: the smallest size from which the ring is faster than
  // the small-message algorithm at every larger size measured.
  nlohmann::json crossover = nlohmann::json::object();
  for (auto [ring, small] : {std::pair{"ring", "bcube"}, std::pair{"ring-legacy", "halving-doubling"}}) {
    std::map<size_t, double> ring_us, small_us;
    for (const auto& r : results) {
      if (r["algorithm"] == ring) ring_us[r["bytes"].get<size_t>()] = r["latency_us"].get<double>();
      if (r["algorithm"] == small) small_us[r["bytes"].get<size_t>()] = r["latency_us"].get<double>();
    }
    if (ring_us.empty() || small_us.empty()) continue;
    size_t from = 0;  // 0: the ring never wins through to the largest size
    for (auto it = ring_us.rbegin(); it != ring_us.rend() && small_us.count(it->first); ++it) {
      if (it->second >= small_us[it->first]) break;
      from = it->first;
    }
    crossover[std::string(ring) + "/" + small] = from;
    if (print) std::printf("# crossover %s vs %s: ring faster from %zu bytes\n", ring, small, from);
  }
  if (print && !settings.json_path.empty()) {
    nlohmann::json doc = {{"benchmark", "allreduce"},
                          {"dtype", "float32"},
                          {"ranks", n},
                          {"transport", options.transport == TransportKind::Tcp ? "tcp" : "ibverbs"},
                          {"ring_threshold_bytes", options.ring_threshold_bytes},
                          {"crossover_bytes", crossover},
                          {"results", results}};
    write_json(settings.json_path, doc, "allreduce");
  }
}

}  // namespace

void add_allreduce_command(CLI::App& app) {
  auto settings = std::make_shared<Settings>();
  CLI::App* cmd = app.add_subcommand(
      "allreduce", "Allreduce latency and bus bandwidth (2(n-1)/n * bytes / time) vs message size, per algorithm");
  cmd->add_option("--min-bytes", settings->min_bytes, "Smallest message")->capture_default_str()->check(
      CLI::Range(size_t{4}, size_t{1} << 40));
  cmd->add_option("--max-bytes", settings->max_bytes, "Largest message (sizes double from --min-bytes)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{4}, size_t{1} << 40));
  cmd->add_option("--algorithms", settings->algorithms,
                  "Algorithms: ring, bcube, direct, scatter-gather (Gloo's new API), halving-doubling, ring-legacy (old API, as on ibverbs)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--seconds-per-size", settings->seconds_per_size, "Target measuring time per size")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 60.0));
  cmd->add_option("--max-iterations", settings->max_iterations,
                  "Upper bound of timed iterations per size (the count: --seconds-per-size over one call's time, "
                  "at least 5, at most this bound)")
      ->capture_default_str()
      ->check(CLI::Range(3, 1000000));
  cmd->add_option("--json", settings->json_path, "Also write the results as JSON to this file (rank 0)");
  cmd->callback([settings] { run(*settings); });
}

}  // namespace powersgd::bench
