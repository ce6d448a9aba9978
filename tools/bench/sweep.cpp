// powersgd-bench sweep: how low can communication go on real gradients?
//
// Replays a gradient record (include/powersgd/gradient_record.hpp, written by
// e.g. `train-fashion-mnist --record-gradients`) through the engine once per
// rank r in a list, with warm start and error feedback as configured, in one
// process. After every step it measures, per tensor, the relative approximation
// error ||M - out|| / ||M||, where M is the gradient plus the error memory the
// step started from and `out` the reducer's output (at world size 1 the
// decompressed P Q^T; uncompressed tensors come out exact). It reports the error
// after the last of the k recorded steps, the compression rate and the elements
// and bytes reduced per step per rank: a table, and JSON for bench/plot_sweep.py.
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hpp"
#include "powersgd/comm.hpp"
#include "powersgd/error.hpp"
#include "powersgd/gradient_record.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::bench {
namespace {

struct Settings {
  std::string record_path;
  std::vector<int> ranks{1, 2, 4, 8, 16, 32};
  double min_compression_rate = 2.0;
  bool warm_start = true;
  bool error_feedback = true;
  std::string json_path;
};

struct TensorRef {
  int bucket;
  size_t offset, size;
  Shape shape;
};

std::vector<TensorRef> tensors_of(const GradientRecord& rec) {
  std::vector<TensorRef> out;
  for (size_t b = 0; b < rec.buckets.size(); ++b) {
    size_t offset = 0;
    for (const auto& shape : rec.buckets[b]) {
      size_t n = 1;
      for (int64_t d : shape) n *= static_cast<size_t>(d);
      out.push_back({static_cast<int>(b), offset, n, shape});
      offset += n;
    }
  }
  return out;
}

std::string shape_text(const Shape& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "x" : "") + std::to_string(s[i]);
  return out.empty() ? "scalar" : out;
}

struct RankResult {
  int rank = 0;
  std::vector<double> step_error;          // overall, per recorded step
  std::vector<double> final_tensor_error;  // per tensor, last step
  double compression_rate = 0;
  double elements_per_step = 0;
};

RankResult replay(Communicator& comm, const GradientRecord& rec, const std::vector<TensorRef>& tensors,
                  const Settings& settings, int rank) {
  Config config;
  config.rank = rank;
  config.start_iter = 0;  // every replayed step compressed
  config.min_compression_rate = settings.min_compression_rate;
  config.warm_start = settings.warm_start;
  config.error_feedback = settings.error_feedback;
  Reducer reducer(comm, config);
  for (const auto& shapes : rec.buckets) reducer.add_bucket(std::span<const Shape>(shapes));

  RankResult result;
  result.rank = rank;
  std::vector<std::vector<float>> memory(rec.buckets.size()), output(rec.buckets.size());
  std::vector<double> residual(tensors.size()), norm(tensors.size());  // per tensor, of the current step
  for (const auto& step : rec.steps) {
    for (size_t b = 0; b < rec.buckets.size(); ++b) {
      memory[b].resize(rec.bucket_sizes[b]);
      reducer.error_feedback(static_cast<int>(b), memory[b].data());  // e before this step
      output[b] = step[b];
      reducer.reduce(static_cast<int>(b), output[b].data());
    }
    for (size_t t = 0; t < tensors.size(); ++t) {
      const TensorRef& ref = tensors[t];
      const float* g = step[static_cast<size_t>(ref.bucket)].data() + ref.offset;
      const float* e = memory[static_cast<size_t>(ref.bucket)].data() + ref.offset;
      const float* out = output[static_cast<size_t>(ref.bucket)].data() + ref.offset;
      double r2 = 0, m2 = 0;
      for (size_t i = 0; i < ref.size; ++i) {
        double m = double(g[i]) + double(e[i]);
        double d = m - double(out[i]);
        r2 += d * d;
        m2 += m * m;
      }
      residual[t] = r2;
      norm[t] = m2;
    }
    double r_all = 0, m_all = 0;
    for (size_t t = 0; t < tensors.size(); ++t) {
      r_all += residual[t];
      m_all += norm[t];
    }
    result.step_error.push_back(m_all > 0 ? std::sqrt(r_all / m_all) : 0.0);
  }
  for (size_t t = 0; t < tensors.size(); ++t)  // of the last step
    result.final_tensor_error.push_back(norm[t] > 0 ? std::sqrt(residual[t] / norm[t]) : 0.0);
  Stats stats = reducer.stats();
  result.compression_rate = stats.compression_rate();
  result.elements_per_step = double(stats.numel_after) / double(rec.steps.size());
  return result;
}

void run(const Settings& settings) {
  for (int r : settings.ranks)
    if (r < 1 || r > 64) throw InvalidArgumentError("powersgd-bench sweep: --ranks " + std::to_string(r) +
                                                    ": expected ranks between 1 and 64");
  GradientRecord rec = read_gradient_record(settings.record_path);
  if (rec.steps.empty()) throw InvalidArgumentError("powersgd-bench sweep: " + settings.record_path + " holds no steps");
  const auto tensors = tensors_of(rec);
  auto comm = Communicator::create(CommOptions::single_process());

  double total_elements = 0;
  for (size_t n : rec.bucket_sizes) total_elements += double(n);
  std::printf("record %s: %zu steps, %zu buckets, %zu tensors, %.0f elements per step\n", settings.record_path.c_str(),
              rec.steps.size(), rec.buckets.size(), tensors.size(), total_elements);
  std::printf("%6s %14s %12s %12s %16s\n", "rank", "bytes/step", "compression", "rel. error", "error at step 1");
  std::printf("%6s %14.0f %12.2f %12.4f %16.4f\n", "plain", total_elements * 4, 1.0, 0.0, 0.0);

  nlohmann::json doc = {{"benchmark", "sweep"},
                        {"record", settings.record_path},
                        {"steps", rec.steps.size()},
                        {"warm_start", settings.warm_start},
                        {"error_feedback", settings.error_feedback},
                        {"min_compression_rate", settings.min_compression_rate},
                        {"uncompressed_bytes_per_step", total_elements * 4},
                        {"tensors", nlohmann::json::array()},
                        {"ranks", nlohmann::json::array()}};
  for (const auto& t : tensors)
    doc["tensors"].push_back({{"bucket", t.bucket}, {"shape", t.shape}, {"elements", t.size}});
  for (int r : settings.ranks) {
    RankResult res = replay(*comm, rec, tensors, settings, r);
    double bytes = res.elements_per_step * sizeof(float);
    std::printf("%6d %14.0f %12.2f %12.4f %16.4f\n", r, bytes, res.compression_rate, res.step_error.back(),
                res.step_error.front());
    doc["ranks"].push_back({{"rank", r},
                            {"bytes_per_step", bytes},
                            {"elements_per_step", res.elements_per_step},
                            {"compression_rate", res.compression_rate},
                            {"relative_error", res.step_error.back()},
                            {"relative_error_per_step", res.step_error},
                            {"tensor_relative_error", res.final_tensor_error}});
  }
  std::printf("per tensor, relative error after %zu steps:\n%-8s %-16s", rec.steps.size(), "bucket", "shape");
  for (int r : settings.ranks) std::printf(" %8s", ("r=" + std::to_string(r)).c_str());
  std::printf("\n");
  for (size_t t = 0; t < tensors.size(); ++t) {
    std::printf("%-8d %-16s", tensors[t].bucket, shape_text(tensors[t].shape).c_str());
    for (const auto& entry : doc["ranks"]) std::printf(" %8.4f", entry["tensor_relative_error"][t].get<double>());
    std::printf("\n");
  }
  if (!settings.json_path.empty()) write_json(settings.json_path, doc, "sweep");
}

}  // namespace

void add_sweep_command(CLI::App& app) {
  auto settings = std::make_shared<Settings>();
  CLI::App* cmd = app.add_subcommand(
      "sweep", "Replays recorded gradients through the engine for each rank r: approximation error vs bytes per step");
  cmd->add_option("--gradients", settings->record_path, "Gradient record (train-fashion-mnist --record-gradients)")
      ->required();
  cmd->add_option("--ranks", settings->ranks, "Ranks to try")->delimiter(',')->capture_default_str();
  cmd->add_option("--min-compression-rate", settings->min_compression_rate,
                  "Compress a tensor only when it shrinks by this factor (the reference's rule)")
      ->capture_default_str();
  cmd->add_flag("!--no-warm-start", settings->warm_start, "Start every step from a fresh random Q");
  cmd->add_flag("!--no-error-feedback", settings->error_feedback, "Disable error feedback");
  cmd->add_option("--json", settings->json_path, "Write results as JSON to this file");
  cmd->callback([settings] { run(*settings); });
}

}  // namespace powersgd::bench
