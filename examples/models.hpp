// The example trainer's models, forward and backward written by hand on
// OpenBLAS: a 3-layer perceptron and a small convolutional network, both for
// 28 x 28 single-channel images and 10 classes, softmax cross-entropy loss.
//
// Parameters live in two flat buckets, the layout the trainer hands to the
// Reducer: bucket 0 holds the layers next to the output, bucket 1 the layers
// next to the input (DDP's reverse order). Each layer's weight is followed by
// its bias. Initialization depends only on the seed, so it is identical on
// every rank. Not thread-safe; one model per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "powersgd/reducer.hpp"

namespace fashion_mnist {

inline constexpr int kImageSide = 28;
inline constexpr int kImageSize = kImageSide * kImageSide;
inline constexpr int kClasses = 10;

class Model {
 public:
  virtual ~Model() = default;
  static constexpr int kBuckets = 2;

  // Shapes of a bucket's tensors, in buffer order.
  virtual std::vector<powersgd::Shape> bucket_shapes(int bucket) const = 0;
  // Forward and backward on `batch` images (batch x 784, row-major): fills
  // grads() with the gradient of the mean loss; returns the summed loss and
  // the number of correct predictions.
  virtual std::pair<double, int> train_step(const float* x, const uint8_t* y, int batch) = 0;
  // Forward only: the summed loss and the number of correct predictions.
  virtual std::pair<double, int> evaluate(const float* x, const uint8_t* y, int batch) = 0;

  std::vector<float>& params(int bucket) { return params_[bucket]; }
  std::vector<float>& grads(int bucket) { return grads_[bucket]; }
  std::vector<float>& velocity(int bucket) { return velocity_[bucket]; }  // empty before the first step
  size_t parameter_count() const { return params_[0].size() + params_[1].size(); }
  // SGD with momentum and weight decay on every parameter.
  void sgd(float lr, float momentum, float weight_decay);

 protected:
  std::vector<float> params_[kBuckets], grads_[kBuckets], velocity_[kBuckets];
};

// 784 -> hidden1 -> hidden2 -> 10, ReLU.
std::unique_ptr<Model> make_mlp(int hidden1, int hidden2, uint64_t seed);

// conv 5x5 (padding 2) with `channels1` channels -> ReLU -> max-pool 2 ->
// conv 5x5 with `channels2` channels -> ReLU -> max-pool 2 -> dense `hidden`
// -> ReLU -> dense 10. Convolutions are im2col plus sgemm, one image at a time.
std::unique_ptr<Model> make_cnn(int channels1, int channels2, int hidden, uint64_t seed);

}  // namespace fashion_mnist
