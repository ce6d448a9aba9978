#include "models.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace fashion_mnist {
namespace {

// Softmax cross-entropy over rows of `logits` (batch x 10). With `gradient`,
// the logits are replaced by d(mean loss)/d(logits) = (softmax - onehot) / batch.
std::pair<double, int> softmax_cross_entropy(float* logits, const uint8_t* y, int batch, bool gradient) {
  double loss = 0;
  int correct = 0;
  for (int b = 0; b < batch; ++b) {
    float* row = logits + size_t(b) * kClasses;
    float max = *std::max_element(row, row + kClasses);
    double sum = 0;
    for (int k = 0; k < kClasses; ++k) sum += std::exp(double(row[k] - max));
    int best = int(std::max_element(row, row + kClasses) - row);
    correct += best == y[b];
    loss += -(double(row[y[b]] - max) - std::log(sum));
    if (gradient)
      for (int k = 0; k < kClasses; ++k)
        row[k] = float((std::exp(double(row[k] - max)) / sum - (k == y[b] ? 1.0 : 0.0)) / batch);
  }
  return {loss, correct};
}

// out (batch x n_out) = in (batch x n_in) W^T + b, W is n_out x n_in.
void dense_forward(const float* in, const float* w, const float* b, int batch, int n_in, int n_out, float* out) {
  for (int i = 0; i < batch; ++i) std::copy(b, b + n_out, out + size_t(i) * n_out);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, n_out, n_in, 1.0f, in, n_in, w, n_in, 1.0f, out, n_out);
}

// dW = dout^T in, db = column sums of dout, and (when din is not null) din = dout W.
void dense_backward(const float* in, const float* w, const float* dout, int batch, int n_in, int n_out, float* dw,
                    float* db, float* din) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_out, n_in, batch, 1.0f, dout, n_out, in, n_in, 0.0f, dw,
              n_in);
  std::fill(db, db + n_out, 0.0f);
  for (int b = 0; b < batch; ++b)
    for (int o = 0; o < n_out; ++o) db[o] += dout[size_t(b) * n_out + o];
  if (din != nullptr)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, n_in, n_out, 1.0f, dout, n_out, w, n_in, 0.0f, din,
                n_in);
}

// Zeroes the gradient where the ReLU's output was not positive.
void relu_backward(const std::vector<float>& activation, float* gradient) {
  for (size_t i = 0; i < activation.size(); ++i)
    if (activation[i] <= 0.0f) gradient[i] = 0.0f;
}

// He initialization of `count` weights with `fan_in` inputs each.
void he_normal(float* w, size_t count, int fan_in, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, std::sqrt(2.0f / float(fan_in)));
  for (size_t i = 0; i < count; ++i) w[i] = normal(rng);
}

// ---- 3-layer perceptron ----

class Mlp final : public Model {
 public:
  Mlp(int h1, int h2, uint64_t seed) : dims_{kImageSize, h1, h2, kClasses} {
    // Bucket 0: the two output layers; bucket 1: the first.
    layers_[0] = {kImageSize, h1, 1, 0};
    layers_[1] = {h1, h2, 0, 0};
    layers_[2] = {h2, kClasses, 0, size_t(h2) * h1 + h2};
    params_[0].resize(size_t(h2) * h1 + h2 + size_t(kClasses) * h2 + kClasses);
    params_[1].resize(size_t(h1) * kImageSize + h1);
    for (int b = 0; b < kBuckets; ++b) grads_[b].resize(params_[b].size());
    std::mt19937_64 rng(seed);
    for (auto& layer : layers_) he_normal(weight(params_, layer), size_t(layer.in) * layer.out, layer.in, rng);
  }

  std::vector<powersgd::Shape> bucket_shapes(int bucket) const override {
    if (bucket == 0) return {{dims_[2], dims_[1]}, {dims_[2]}, {dims_[3], dims_[2]}, {dims_[3]}};
    return {{dims_[1], dims_[0]}, {dims_[1]}};
  }

  std::pair<double, int> train_step(const float* x, const uint8_t* y, int batch) override {
    forward(x, batch);
    auto result = softmax_cross_entropy(acts_[3].data(), y, batch, /*gradient=*/true);
    std::vector<float>& delta = acts_[3];
    for (int l = 2; l >= 0; --l) {
      const Layer& layer = layers_[l];
      const float* input = l == 0 ? x : acts_[l].data();
      if (l == 0) {
        dense_backward(input, weight(params_, layer), delta.data(), batch, layer.in, layer.out,
                       weight(grads_, layer), bias(grads_, layer), nullptr);
        break;
      }
      std::vector<float> prev(size_t(batch) * layer.in);
      dense_backward(input, weight(params_, layer), delta.data(), batch, layer.in, layer.out, weight(grads_, layer),
                     bias(grads_, layer), prev.data());
      relu_backward(acts_[l], prev.data());
      delta.swap(prev);
    }
    return result;
  }

  std::pair<double, int> evaluate(const float* x, const uint8_t* y, int batch) override {
    forward(x, batch);
    return softmax_cross_entropy(acts_[3].data(), y, batch, /*gradient=*/false);
  }

 private:
  // A dense layer's weight (out x in) and bias (out) lie contiguously in one bucket.
  struct Layer {
    int in = 0, out = 0;
    int bucket = 0;
    size_t offset = 0;  // of the weight in the bucket's buffer; the bias follows it
  };
  static float* weight(std::vector<float>* storage, const Layer& l) { return storage[l.bucket].data() + l.offset; }
  static float* bias(std::vector<float>* storage, const Layer& l) {
    return weight(storage, l) + size_t(l.in) * l.out;
  }

  void forward(const float* x, int batch) {
    for (int l = 0; l < 3; ++l) {
      const Layer& layer = layers_[l];
      auto& out = acts_[l + 1];
      out.resize(size_t(batch) * layer.out);
      dense_forward(l == 0 ? x : acts_[l].data(), weight(params_, layer), bias(params_, layer), batch, layer.in,
                    layer.out, out.data());
      if (l < 2)
        for (auto& v : out) v = std::max(v, 0.0f);
    }
  }

  std::vector<int64_t> dims_;
  Layer layers_[3];
  std::vector<float> acts_[4];
};

// ---- convolutional network ----

constexpr int kKernel = 5, kPad = 2;

// col (C*K*K x H*W) from one image (C x H x W): stride 1, zero padding kPad,
// so the output has the input's height and width.
void im2col(const float* in, int channels, int side, float* col) {
  const int plane = side * side;
  for (int c = 0; c < channels; ++c)
    for (int ky = 0; ky < kKernel; ++ky)
      for (int kx = 0; kx < kKernel; ++kx) {
        float* row = col + size_t((c * kKernel + ky) * kKernel + kx) * plane;
        for (int y = 0; y < side; ++y) {
          const int iy = y + ky - kPad;
          for (int x = 0; x < side; ++x) {
            const int ix = x + kx - kPad;
            row[y * side + x] =
                iy >= 0 && iy < side && ix >= 0 && ix < side ? in[size_t(c) * plane + iy * side + ix] : 0.0f;
          }
        }
      }
}

// The adjoint of im2col: adds each column entry back to the pixel it came from.
void col2im(const float* col, int channels, int side, float* in) {
  const int plane = side * side;
  std::fill(in, in + size_t(channels) * plane, 0.0f);
  for (int c = 0; c < channels; ++c)
    for (int ky = 0; ky < kKernel; ++ky)
      for (int kx = 0; kx < kKernel; ++kx) {
        const float* row = col + size_t((c * kKernel + ky) * kKernel + kx) * plane;
        for (int y = 0; y < side; ++y) {
          const int iy = y + ky - kPad;
          if (iy < 0 || iy >= side) continue;
          for (int x = 0; x < side; ++x) {
            const int ix = x + kx - kPad;
            if (ix >= 0 && ix < side) in[size_t(c) * plane + iy * side + ix] += row[y * side + x];
          }
        }
      }
}

// 2x2 max-pool, stride 2, of one image (C x side x side); `argmax` receives the
// index within the image of each output's maximum.
void max_pool(const float* in, int channels, int side, float* out, int32_t* argmax) {
  const int half = side / 2;
  for (int c = 0; c < channels; ++c)
    for (int y = 0; y < half; ++y)
      for (int x = 0; x < half; ++x) {
        int32_t best = c * side * side + 2 * y * side + 2 * x;
        for (int dy = 0; dy < 2; ++dy)
          for (int dx = 0; dx < 2; ++dx) {
            const int32_t at = c * side * side + (2 * y + dy) * side + 2 * x + dx;
            if (in[at] > in[best]) best = at;
          }
        const size_t o = size_t(c) * half * half + y * half + x;
        out[o] = in[best];
        argmax[o] = best;
      }
}

class Cnn final : public Model {
 public:
  Cnn(int channels1, int channels2, int hidden, uint64_t seed) : c1_(channels1), c2_(channels2), hidden_(hidden) {
    // Bucket 0: dense 1 (weight, bias), dense 2 (weight, bias).
    fc1_ = 0;
    fc2_ = fc1_ + size_t(hidden_) * flat() + hidden_;
    params_[0].resize(fc2_ + size_t(kClasses) * hidden_ + kClasses);
    // Bucket 1: conv 1 (weight, bias), conv 2 (weight, bias).
    conv1_ = 0;
    conv2_ = conv1_ + size_t(c1_) * kKernel * kKernel + c1_;
    params_[1].resize(conv2_ + size_t(c2_) * c1_ * kKernel * kKernel + c2_);
    for (int b = 0; b < kBuckets; ++b) grads_[b].resize(params_[b].size());
    std::mt19937_64 rng(seed);
    he_normal(&params_[1][conv1_], size_t(c1_) * kKernel * kKernel, kKernel * kKernel, rng);
    he_normal(&params_[1][conv2_], size_t(c2_) * c1_ * kKernel * kKernel, c1_ * kKernel * kKernel, rng);
    he_normal(&params_[0][fc1_], size_t(hidden_) * flat(), flat(), rng);
    he_normal(&params_[0][fc2_], size_t(kClasses) * hidden_, hidden_, rng);
  }

  std::vector<powersgd::Shape> bucket_shapes(int bucket) const override {
    if (bucket == 0) return {{hidden_, flat()}, {hidden_}, {kClasses, hidden_}, {kClasses}};
    return {{c1_, 1, kKernel, kKernel}, {c1_}, {c2_, c1_, kKernel, kKernel}, {c2_}};
  }

  std::pair<double, int> train_step(const float* x, const uint8_t* y, int batch) override {
    forward(x, batch);
    auto result = softmax_cross_entropy(logits_.data(), y, batch, /*gradient=*/true);
    float* g0 = grads_[0].data();
    float* g1 = grads_[1].data();
    const float* p0 = params_[0].data();
    const float* p1 = params_[1].data();

    std::vector<float> dhidden(hidden_act_.size());
    dense_backward(hidden_act_.data(), p0 + fc2_, logits_.data(), batch, hidden_, kClasses, g0 + fc2_,
                   g0 + fc2_ + size_t(kClasses) * hidden_, dhidden.data());
    relu_backward(hidden_act_, dhidden.data());
    std::vector<float> dpool2(pool2_.size());
    dense_backward(pool2_.data(), p0 + fc1_, dhidden.data(), batch, flat(), hidden_, g0 + fc1_,
                   g0 + fc1_ + size_t(hidden_) * flat(), dpool2.data());

    // Through pool 2, ReLU and conv 2 (whose input gradient goes through pool 1 and ReLU to conv 1).
    std::vector<float> dconv2(conv2_act_.size(), 0.0f), dpool1(pool1_.size()), dconv1(conv1_act_.size(), 0.0f);
    const int side2 = kImageSide / 2, plane2 = side2 * side2, plane1 = kImageSide * kImageSide;
    const int patch2 = c1_ * kKernel * kKernel, patch1 = kKernel * kKernel;
    std::vector<float> dcol(size_t(patch2) * plane2);
    float* dw2 = g1 + conv2_;
    float* db2 = dw2 + size_t(c2_) * patch2;
    float* dw1 = g1 + conv1_;
    float* db1 = dw1 + size_t(c1_) * patch1;
    std::fill(dw2, db2 + c2_, 0.0f);
    std::fill(dw1, db1 + c1_, 0.0f);
    for (int b = 0; b < batch; ++b) {
      scatter(&dpool2[size_t(b) * flat()], &argmax2_[size_t(b) * flat()], flat(), &dconv2[size_t(b) * c2_ * plane2]);
    }
    relu_backward(conv2_act_, dconv2.data());
    for (int b = 0; b < batch; ++b) {
      const float* d = &dconv2[size_t(b) * c2_ * plane2];
      const float* col = &col2_[size_t(b) * patch2 * plane2];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, c2_, patch2, plane2, 1.0f, d, plane2, col, plane2, 1.0f,
                  dw2, patch2);
      add_row_sums(d, c2_, plane2, db2);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, patch2, plane2, c2_, 1.0f, p1 + conv2_, patch2, d, plane2,
                  0.0f, dcol.data(), plane2);
      col2im(dcol.data(), c1_, side2, &dpool1[size_t(b) * c1_ * plane2]);
      scatter(&dpool1[size_t(b) * c1_ * plane2], &argmax1_[size_t(b) * c1_ * plane2], c1_ * plane2,
              &dconv1[size_t(b) * c1_ * plane1]);
    }
    relu_backward(conv1_act_, dconv1.data());
    for (int b = 0; b < batch; ++b) {
      const float* d = &dconv1[size_t(b) * c1_ * plane1];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, c1_, patch1, plane1, 1.0f, d, plane1,
                  &col1_[size_t(b) * patch1 * plane1], plane1, 1.0f, dw1, patch1);
      add_row_sums(d, c1_, plane1, db1);
    }
    return result;
  }

  std::pair<double, int> evaluate(const float* x, const uint8_t* y, int batch) override {
    // In chunks, to bound the memory of the im2col buffers.
    constexpr int kChunk = 128;
    std::pair<double, int> total{0.0, 0};
    for (int start = 0; start < batch; start += kChunk) {
      const int n = std::min(kChunk, batch - start);
      forward(x + size_t(start) * kImageSize, n);
      auto [loss, correct] = softmax_cross_entropy(logits_.data(), y + start, n, /*gradient=*/false);
      total.first += loss;
      total.second += correct;
    }
    return total;
  }

 private:
  int64_t flat() const { return int64_t(c2_) * (kImageSide / 4) * (kImageSide / 4); }

  static void scatter(const float* from, const int32_t* to, int64_t count, float* into) {
    for (int64_t i = 0; i < count; ++i) into[to[i]] += from[i];
  }
  static void add_row_sums(const float* m, int rows, int cols, float* sums) {
    for (int r = 0; r < rows; ++r) {
      double s = 0;
      for (int c = 0; c < cols; ++c) s += m[size_t(r) * cols + c];
      sums[r] += float(s);
    }
  }

  // conv (im2col + sgemm, bias) then ReLU, for one image.
  static void conv_relu(const float* in, int in_channels, int out_channels, int side, const float* w, float* col,
                        float* out) {
    const int plane = side * side, patch = in_channels * kKernel * kKernel;
    im2col(in, in_channels, side, col);
    const float* bias = w + size_t(out_channels) * patch;
    for (int c = 0; c < out_channels; ++c) std::fill(out + size_t(c) * plane, out + size_t(c + 1) * plane, bias[c]);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, out_channels, plane, patch, 1.0f, w, patch, col, plane,
                1.0f, out, plane);
    for (int i = 0; i < out_channels * plane; ++i) out[i] = std::max(out[i], 0.0f);
  }

  void forward(const float* x, int batch) {
    const int side1 = kImageSide, side2 = kImageSide / 2, plane1 = side1 * side1, plane2 = side2 * side2;
    const int patch1 = kKernel * kKernel, patch2 = c1_ * kKernel * kKernel;
    col1_.resize(size_t(batch) * patch1 * plane1);
    conv1_act_.resize(size_t(batch) * c1_ * plane1);
    pool1_.resize(size_t(batch) * c1_ * plane2);
    argmax1_.resize(pool1_.size());
    col2_.resize(size_t(batch) * patch2 * plane2);
    conv2_act_.resize(size_t(batch) * c2_ * plane2);
    pool2_.resize(size_t(batch) * flat());
    argmax2_.resize(pool2_.size());
    hidden_act_.resize(size_t(batch) * hidden_);
    logits_.resize(size_t(batch) * kClasses);
    const float* p0 = params_[0].data();
    const float* p1 = params_[1].data();
    for (int b = 0; b < batch; ++b) {
      float* a1 = &conv1_act_[size_t(b) * c1_ * plane1];
      float* q1 = &pool1_[size_t(b) * c1_ * plane2];
      conv_relu(x + size_t(b) * kImageSize, 1, c1_, side1, p1 + conv1_, &col1_[size_t(b) * patch1 * plane1], a1);
      max_pool(a1, c1_, side1, q1, &argmax1_[size_t(b) * c1_ * plane2]);
      float* a2 = &conv2_act_[size_t(b) * c2_ * plane2];
      conv_relu(q1, c1_, c2_, side2, p1 + conv2_, &col2_[size_t(b) * patch2 * plane2], a2);
      max_pool(a2, c2_, side2, &pool2_[size_t(b) * flat()], &argmax2_[size_t(b) * flat()]);
    }
    dense_forward(pool2_.data(), p0 + fc1_, p0 + fc1_ + size_t(hidden_) * flat(), batch, int(flat()), hidden_,
                  hidden_act_.data());
    for (auto& v : hidden_act_) v = std::max(v, 0.0f);
    dense_forward(hidden_act_.data(), p0 + fc2_, p0 + fc2_ + size_t(kClasses) * hidden_, batch, hidden_, kClasses,
                  logits_.data());
  }

  int c1_, c2_, hidden_;
  size_t fc1_ = 0, fc2_ = 0, conv1_ = 0, conv2_ = 0;  // weight offsets in their bucket; each bias follows
  std::vector<float> col1_, conv1_act_, pool1_, col2_, conv2_act_, pool2_, hidden_act_, logits_;
  std::vector<int32_t> argmax1_, argmax2_;
};

}  // namespace

void Model::sgd(float lr, float momentum, float weight_decay) {
  for (int bucket = 0; bucket < kBuckets; ++bucket) {
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

std::unique_ptr<Model> make_mlp(int hidden1, int hidden2, uint64_t seed) {
  return std::make_unique<Mlp>(hidden1, hidden2, seed);
}

std::unique_ptr<Model> make_cnn(int channels1, int channels2, int hidden, uint64_t seed) {
  return std::make_unique<Cnn>(channels1, channels2, hidden, seed);
}

}  // namespace fashion_mnist
