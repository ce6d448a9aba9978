// The example trainer's models (examples/models.hpp): each hand-written
// backward pass against central finite differences of the forward pass, on
// parameters spread over every tensor of both buckets.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "models.hpp"

namespace {

using fashion_mnist::Model;

struct Agreement {
  double worst = 0;   // largest |analytic - numeric| / (|analytic| + |numeric| + floor)
  double median = 0;  // median of the same
};

// Checks `per_tensor` parameters of every tensor of both buckets.
Agreement check_gradients(Model& model, int batch, int per_tensor) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(batch) * fashion_mnist::kImageSize);
  for (auto& v : x) v = normal(rng);
  std::vector<uint8_t> y(batch);
  for (int b = 0; b < batch; ++b) y[b] = uint8_t(b * 7 % fashion_mnist::kClasses);

  model.train_step(x.data(), y.data(), batch);
  std::vector<float> analytic[Model::kBuckets] = {model.grads(0), model.grads(1)};
  // Gradients are of the mean loss; evaluate() returns the summed loss.
  auto mean_loss = [&] { return model.evaluate(x.data(), y.data(), batch).first / batch; };
  const double base = mean_loss();
  CHECK(std::isfinite(base));

  // Step: large enough that float rounding of the loss (~1e-7 relative) stays
  // far below the differences, small enough that few ReLU/max-pool kinks are
  // crossed. A convolution weight moves thousands of pre-activations, so a few
  // percent of kink noise remain there: hence a loose bound on the worst
  // parameter and a tight one on the median (an indexing error fails both).
  constexpr float kStep = 1e-3f;
  constexpr double kFloor = 1e-3;
  std::vector<double> relatives;
  int checked = 0, nonzero = 0;
  for (int bucket = 0; bucket < Model::kBuckets; ++bucket) {
    size_t offset = 0;
    for (const auto& shape : model.bucket_shapes(bucket)) {
      size_t numel = 1;
      for (auto d : shape) numel *= size_t(d);
      std::uniform_int_distribution<size_t> pick(0, numel - 1);
      for (int k = 0; k < per_tensor; ++k) {
        const size_t i = offset + pick(rng);
        float& p = model.params(bucket)[i];
        const float saved = p;
        p = saved + kStep;
        const double plus = mean_loss();
        p = saved - kStep;
        const double minus = mean_loss();
        p = saved;
        const double numeric = (plus - minus) / (2.0 * kStep);
        const double a = analytic[bucket][i];
        const double relative = std::abs(a - numeric) / (std::abs(a) + std::abs(numeric) + kFloor);
        relatives.push_back(relative);
        if (relative > 0.02)
          std::printf("bucket %d element %zu: analytic %.6g numeric %.6g\n", bucket, i, a, numeric);
        ++checked;
        nonzero += std::abs(a) > 1e-4;
      }
      offset += numel;
    }
    CHECK(offset == model.params(bucket).size());
  }
  // A backward pass that returned zeros would pass the comparison: most checked gradients must not be zero.
  CHECK(nonzero > checked / 2);
  std::sort(relatives.begin(), relatives.end());
  Agreement agreement{relatives.back(), relatives[relatives.size() / 2]};
  std::printf("checked %d gradients, %d nonzero; relative difference: worst %.3g, median %.3g\n", checked, nonzero,
              agreement.worst, agreement.median);
  return agreement;
}

TEST_CASE("models: the MLP's gradients match finite differences") {
  auto model = fashion_mnist::make_mlp(32, 16, 5);
  Agreement agreement = check_gradients(*model, 4, 12);
  CHECK(agreement.worst < 0.1);
  CHECK(agreement.median < 0.005);
}

TEST_CASE("models: the CNN's gradients match finite differences") {
  auto model = fashion_mnist::make_cnn(4, 6, 16, 5);
  Agreement agreement = check_gradients(*model, 3, 12);
  CHECK(agreement.worst < 0.1);
  CHECK(agreement.median < 0.005);
}

TEST_CASE("models: the CNN's training step lowers the loss on a fixed batch") {
  auto model = fashion_mnist::make_cnn(4, 6, 16, 9);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int batch = 8;
  std::vector<float> x(size_t(batch) * fashion_mnist::kImageSize);
  for (auto& v : x) v = normal(rng);
  std::vector<uint8_t> y(batch);
  for (int b = 0; b < batch; ++b) y[b] = uint8_t(b % fashion_mnist::kClasses);
  const double first = model->train_step(x.data(), y.data(), batch).first;
  for (int step = 0; step < 20; ++step) {
    model->sgd(0.01f, 0.9f, 0.0f);
    model->train_step(x.data(), y.data(), batch);
  }
  CHECK(model->evaluate(x.data(), y.data(), batch).first < 0.5 * first);
}

}  // namespace

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
