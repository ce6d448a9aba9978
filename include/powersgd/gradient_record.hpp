// Gradient records: a few training steps of one worker's local gradients, in
// the bucket layout the reducer sees, for replaying through the engine offline
// (`powersgd-bench sweep`). Header-only; format in docs/gradient-record.md.
//
//   GradientRecordWriter out("grads.psgdrec", {shapes_of_bucket0, shapes_of_bucket1});
//   out.append_step({bucket0.data(), bucket1.data()});   // once per step
//   GradientRecord rec = read_gradient_record("grads.psgdrec");
//
// All integers and floats are little-endian. Errors throw powersgd::IoError
// naming the file and what was wrong; a reader never trusts a size it has not
// checked against the file's length.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "powersgd/error.hpp"
#include "powersgd/reducer.hpp"

namespace powersgd {

inline constexpr char kGradientRecordMagic[8] = {'P', 'S', 'G', 'D', 'G', 'R', 'A', 'D'};
inline constexpr uint32_t kGradientRecordVersion = 1;

struct GradientRecord {
  std::vector<std::vector<Shape>> buckets;  // tensor shapes per bucket, in buffer order
  std::vector<size_t> bucket_sizes;         // elements per bucket
  // steps[s][b]: bucket b's local gradient at recorded step s.
  std::vector<std::vector<std::vector<float>>> steps;
};

namespace gradient_record_detail {

inline bool little_endian_host() {
  uint16_t probe = 1;
  unsigned char first;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

inline void put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

inline size_t elements(const std::vector<Shape>& shapes, const std::string& what) {
  size_t total = 0;
  for (const auto& shape : shapes) {
    size_t n = 1;
    for (int64_t d : shape) {
      if (d < 0) throw InvalidArgumentError(what + ": negative dimension " + std::to_string(d));
      n *= static_cast<size_t>(d);
    }
    total += n;
  }
  return total;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace gradient_record_detail

// Appends steps to a new record file (truncates an existing one). Not thread-safe.
class GradientRecordWriter {
 public:
  GradientRecordWriter(const std::string& path, std::vector<std::vector<Shape>> buckets)
      : path_(path), buckets_(std::move(buckets)) {
    namespace d = gradient_record_detail;
    if (!d::little_endian_host()) throw UnsupportedError("gradient records are written on little-endian hosts only");
    if (buckets_.empty()) throw InvalidArgumentError("gradient record " + path + ": no buckets");
    std::string header(kGradientRecordMagic, sizeof kGradientRecordMagic);
    d::put(header, kGradientRecordVersion, 4);
    d::put(header, buckets_.size(), 4);
    for (const auto& shapes : buckets_) {
      sizes_.push_back(d::elements(shapes, "gradient record " + path));
      d::put(header, shapes.size(), 4);
      for (const auto& shape : shapes) {
        d::put(header, shape.size(), 4);
        for (int64_t dim : shape) d::put(header, static_cast<uint64_t>(dim), 8);
      }
    }
    file_.reset(std::fopen(path.c_str(), "wb"));
    if (!file_) throw IoError("gradient record " + path + ": cannot create: " + std::strerror(errno));
    write(header.data(), header.size());
  }

  // data[b] points to bucket_sizes[b] floats.
  void append_step(std::span<const float* const> data) {
    if (data.size() != buckets_.size())
      throw InvalidArgumentError("gradient record " + path_ + ": append_step got " + std::to_string(data.size()) +
                                 " buckets, expected " + std::to_string(buckets_.size()));
    for (size_t b = 0; b < data.size(); ++b) write(data[b], sizes_[b] * sizeof(float));
    if (std::fflush(file_.get()) != 0) throw IoError("gradient record " + path_ + ": write failed: " + std::strerror(errno));
  }

 private:
  void write(const void* p, size_t n) {
    if (n != 0 && std::fwrite(p, 1, n, file_.get()) != n)
      throw IoError("gradient record " + path_ + ": write failed: " + std::strerror(errno));
  }

  std::string path_;
  std::vector<std::vector<Shape>> buckets_;
  std::vector<size_t> sizes_;
  gradient_record_detail::File file_;
};

// Reads a whole record. Throws IoError on a missing, truncated or malformed file
// (a partial last step, as left by a killed writer, is an error too).
inline GradientRecord read_gradient_record(const std::string& path) {
  namespace d = gradient_record_detail;
  if (!d::little_endian_host()) throw UnsupportedError("gradient records are read on little-endian hosts only");
  d::File file(std::fopen(path.c_str(), "rb"));
  if (!file) throw IoError("gradient record " + path + ": cannot open: " + std::strerror(errno));
  std::vector<unsigned char> bytes;
  unsigned char chunk[1 << 16];
  size_t got;
  while ((got = std::fread(chunk, 1, sizeof chunk, file.get())) > 0) bytes.insert(bytes.end(), chunk, chunk + got);
  if (std::ferror(file.get())) throw IoError("gradient record " + path + ": read failed");

  size_t at = 0;
  auto fail = [&](const std::string& what) -> IoError {
    return IoError("gradient record " + path + ": " + what + " (at byte " + std::to_string(at) + " of " +
                   std::to_string(bytes.size()) + ")");
  };
  auto get = [&](int n) -> uint64_t {
    if (bytes.size() - at < static_cast<size_t>(n)) throw fail("truncated header");
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{bytes[at + i]} << (8 * i);
    at += static_cast<size_t>(n);
    return v;
  };
  if (bytes.size() < sizeof kGradientRecordMagic ||
      std::memcmp(bytes.data(), kGradientRecordMagic, sizeof kGradientRecordMagic) != 0)
    throw fail("not a gradient record (bad magic)");
  at = sizeof kGradientRecordMagic;
  uint64_t version = get(4);
  if (version != kGradientRecordVersion)
    throw fail("version " + std::to_string(version) + ", expected " + std::to_string(kGradientRecordVersion));
  GradientRecord rec;
  uint64_t num_buckets = get(4);
  if (num_buckets == 0 || num_buckets > 1'000'000) throw fail("bucket count " + std::to_string(num_buckets));
  size_t step_bytes = 0;
  for (uint64_t b = 0; b < num_buckets; ++b) {
    uint64_t tensors = get(4);
    if (tensors == 0 || tensors > bytes.size()) throw fail("tensor count " + std::to_string(tensors));
    std::vector<Shape> shapes;
    size_t bucket_elements = 0;
    for (uint64_t t = 0; t < tensors; ++t) {
      uint64_t ndim = get(4);
      if (ndim > 16) throw fail("tensor with " + std::to_string(ndim) + " dimensions");
      Shape shape;
      size_t n = 1;
      for (uint64_t k = 0; k < ndim; ++k) {
        uint64_t dim = get(8);
        if (dim > (uint64_t{1} << 31)) throw fail("dimension " + std::to_string(dim));
        if (dim != 0 && n > (std::numeric_limits<size_t>::max() / 4) / dim) throw fail("tensor too large");
        n *= dim;
        shape.push_back(static_cast<int64_t>(dim));
      }
      bucket_elements += n;
      if (bucket_elements > bytes.size()) throw fail("bucket larger than the file");
      shapes.push_back(std::move(shape));
    }
    rec.buckets.push_back(std::move(shapes));
    rec.bucket_sizes.push_back(bucket_elements);
    step_bytes += bucket_elements * sizeof(float);
  }
  size_t body = bytes.size() - at;
  if (step_bytes == 0) throw fail("empty buckets");
  if (body % step_bytes != 0)
    throw fail("body of " + std::to_string(body) + " bytes is not a whole number of " + std::to_string(step_bytes) +
               "-byte steps (truncated write?)");
  for (size_t s = 0; s < body / step_bytes; ++s) {
    std::vector<std::vector<float>> step;
    for (size_t n : rec.bucket_sizes) {
      std::vector<float> values(n);
      std::memcpy(values.data(), bytes.data() + at, n * sizeof(float));
      at += n * sizeof(float);
      step.push_back(std::move(values));
    }
    rec.steps.push_back(std::move(step));
  }
  return rec;
}

}  // namespace powersgd
