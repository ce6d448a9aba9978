// Double-precision reference of PowerSGD for the engine tests: the reference
// algorithm (docs/engine.md) written plainly, over all ranks' gradients at once,
// starting from the engine's initial Q (engine::standard_normal). Shared by
// tests/unit/test_engine.cpp and tests/multiprocess/test_engine_mp.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/plan.hpp"
#include "engine/random.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd::test {

// Gram-Schmidt as the reference: column /= (norm + eps), then removed from the
// later columns; a zero column with eps 0 stays 0 (as the engine's backends).
inline void orthogonalize(double* m, int64_t rows, int64_t cols, double eps) {
  for (int64_t c = 0; c < cols; ++c) {
    double norm = 0;
    for (int64_t i = 0; i < rows; ++i) norm += m[i * cols + c] * m[i * cols + c];
    const double div = std::sqrt(norm) + eps;
    for (int64_t i = 0; i < rows; ++i) m[i * cols + c] = div == 0 ? 0.0 : m[i * cols + c] / div;
    for (int64_t c2 = c + 1; c2 < cols; ++c2) {
      double dot = 0;
      for (int64_t i = 0; i < rows; ++i) dot += m[i * cols + c] * m[i * cols + c2];
      for (int64_t i = 0; i < rows; ++i) m[i * cols + c2] -= dot * m[i * cols + c];
    }
  }
}

// PyTorch's powerSGD_hook (torch 1.13) on one tensor: matrix = tensor.view(shape[0], -1),
// r = min(n, m, rank), compressed iff _should_compress: (n + m) * r * rate < n * m.
// A 1-D tensor of n elements is n x 1. Where the reference raises (0-D:
// shape[0]; a first dimension of 0: an ambiguous view) the engine's documented
// choice: a 0-D tensor is 1 x 1, an empty tensor is never compressed.
inline bool reference_compresses(const Shape& shape, const Config& config) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (numel == 0) return false;
  const int64_t n = shape.empty() ? 1 : shape[0], m = numel / n;
  const int64_t r = std::min({n, m, static_cast<int64_t>(config.rank)});
  return static_cast<double>((n + m) * r) * config.min_compression_rate < static_cast<double>(n * m);
}

// One bucket of the reference reducer, for `world` ranks. The Q layout (and so
// the initial Q's draw) is the engine's plan; which tensors are compressed is
// the reference's own rule, and the plan must agree with it.
class Reference {
 public:
  Reference(std::vector<Shape> shapes, const Config& config, int world, int bucket = 0)
      : config_(config), world_(world), bucket_(bucket),
        plan_(engine::make_plan(shapes, config)),
        // batched_powerSGD_hook keeps the error of the whole padded square (side * side).
        error_(static_cast<size_t>(world),
               std::vector<double>(static_cast<size_t>(plan_.whole ? plan_.side * plan_.side : plan_.numel), 0.0)),
        q_(static_cast<size_t>(plan_.q_numel), 0.0) {
    for (size_t i = 0; i < shapes.size(); ++i)
      if (!plan_.whole && plan_.tensors[i].compressed != reference_compresses(shapes[i], config))
        throw std::logic_error("the engine's plan disagrees with the reference's compression rule on tensor " +
                               std::to_string(i));
  }

  const engine::BucketPlan& plan() const { return plan_; }
  // Rank `rank`'s error memory of the bucket's elements (what Reducer::error_feedback returns).
  std::vector<double> error(int rank) const {
    const auto& e = error_[static_cast<size_t>(rank)];
    return {e.begin(), e.begin() + static_cast<std::ptrdiff_t>(plan_.numel)};
  }
  // Whole bucket: rank `rank`'s error of the zero padding (empty otherwise).
  std::vector<double> padding_error(int rank) const {
    const auto& e = error_[static_cast<size_t>(rank)];
    return {e.begin() + static_cast<std::ptrdiff_t>(plan_.numel), e.end()};
  }

  // grads[w]: rank w's bucket. Returns the averaged output every rank receives.
  std::vector<double> step(const std::vector<std::vector<float>>& grads) {
    const auto n = static_cast<size_t>(plan_.numel);
    std::vector<double> out(n, 0.0);
    if (iter_++ < config_.start_iter) {
      for (const auto& g : grads)
        for (size_t i = 0; i < n; ++i) out[i] += g[i];
      for (auto& v : out) v /= world_;
      return out;
    }
    // The input plus the error memory; whole bucket (batched_powerSGD_hook):
    // resized to side * side, the padding set to 0, then the error of the whole square added.
    const size_t len = error_[0].size();
    std::vector<std::vector<double>> in(grads.size(), std::vector<double>(len, 0.0));
    for (size_t w = 0; w < grads.size(); ++w)
      for (size_t i = 0; i < len; ++i)
        in[w][i] = (i < n ? grads[w][i] : 0.0) + (config_.error_feedback ? error_[w][i] : 0.0);
    if (!config_.warm_start || !q_initialized_) {
      std::vector<float> q(q_.size());
      engine::standard_normal(config_.seed, static_cast<uint64_t>(bucket_), draws_++, q);
      for (size_t i = 0; i < q.size(); ++i) q_[i] = q[i];
    }
    q_initialized_ = true;
    if (plan_.whole) {
      const int64_t s = plan_.side;
      std::vector<double> full(static_cast<size_t>(s * s));
      matrix_step(in, 0, s, s, plan_.groups[0].rank, q_.data(), full.data());
      // error = input_tensor_cp - input_tensor over the square, then resize_(total_length).
      if (config_.error_feedback)
        for (size_t w = 0; w < in.size(); ++w)
          for (size_t i = 0; i < len; ++i) error_[w][i] = in[w][i] - full[i];
      std::copy(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n), out.begin());
      return out;
    } else {
      for (const auto& t : plan_.tensors) {
        if (t.compressed) {
          const auto& g = plan_.groups[static_cast<size_t>(t.group)];
          matrix_step(in, t.offset, g.rows, g.cols, g.rank, q_.data() + t.q_offset, out.data() + t.offset);
        } else {
          for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
            for (const auto& x : in) out[static_cast<size_t>(i)] += x[static_cast<size_t>(i)];
            out[static_cast<size_t>(i)] /= world_;
          }
        }
      }
    }
    if (config_.error_feedback)
      for (size_t w = 0; w < in.size(); ++w)
        for (size_t i = 0; i < n; ++i) error_[w][i] = in[w][i] - out[i];
    return out;
  }

 private:
  // One compressed matrix at `offset` of every rank's input; q: cols x r, updated
  // to the averaged Q; out: rows x cols.
  void matrix_step(const std::vector<std::vector<double>>& in, int64_t offset, int64_t rows, int64_t cols, int64_t r,
                   double* q, double* out) {
    orthogonalize(q, cols, r, config_.orthogonalization_epsilon);
    std::vector<double> p(static_cast<size_t>(rows * r), 0.0);
    for (const auto& x : in) {
      const double* m = x.data() + offset;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t k = 0; k < r; ++k) {
          double sum = 0;
          for (int64_t j = 0; j < cols; ++j) sum += m[i * cols + j] * q[j * r + k];
          p[static_cast<size_t>(i * r + k)] += sum;
        }
    }
    orthogonalize(p.data(), rows, r, config_.orthogonalization_epsilon);
    std::vector<double> qn(static_cast<size_t>(cols * r), 0.0);
    for (const auto& x : in) {
      const double* m = x.data() + offset;
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t k = 0; k < r; ++k) {
          double sum = 0;
          for (int64_t i = 0; i < rows; ++i) sum += m[i * cols + j] * p[static_cast<size_t>(i * r + k)];
          qn[static_cast<size_t>(j * r + k)] += sum;
        }
    }
    for (size_t i = 0; i < qn.size(); ++i) q[i] = qn[i] / world_;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        double sum = 0;
        for (int64_t k = 0; k < r; ++k) sum += p[static_cast<size_t>(i * r + k)] * q[j * r + k];
        out[i * cols + j] = sum;
      }
  }

  Config config_;
  int world_;
  int bucket_;
  engine::BucketPlan plan_;
  std::vector<std::vector<double>> error_;
  std::vector<double> q_;
  bool q_initialized_ = false;
  uint64_t draws_ = 0;
  int64_t iter_ = 0;
};

// Deterministic gradients of rank `rank` at `step`: identical in every process.
inline std::vector<float> gradients(size_t n, int rank, int64_t step, uint64_t salt = 0) {
  std::mt19937_64 gen(salt * 1000003ULL + static_cast<uint64_t>(rank) * 7919ULL + static_cast<uint64_t>(step) * 104729ULL + 1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> g(n);
  for (auto& v : g) v = dist(gen);
  return g;
}

// max |a - b| / (1 + max |b|)
inline double relative_difference(const std::vector<float>& a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / (1.0 + scale);
}

// Compressing from step 1 at `rank`, with the options that bits of `flags` turn
// on: 1 error feedback, 2 warm start, 4 same-shape batching, 8 whole bucket.
inline Config config_for(int rank, int flags) {
  Config c;
  c.rank = rank;
  c.start_iter = 1;
  c.error_feedback = flags & 1;
  c.warm_start = flags & 2;
  c.batch_same_shape = flags & 4;
  c.whole_bucket = flags & 8;
  return c;
}

}  // namespace powersgd::test
