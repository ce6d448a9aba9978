// Fingerprints ranks compare (Communicator::check_same) and a checkpoint records:
// FNV-1a over the Shared and Agreed config fields (config_fields.hpp) and over the
// declared bucket layout. Not cryptographic.
#pragma once

#include <cstdint>
#include <span>

#include "powersgd/reducer.hpp"

namespace powersgd::engine {

class Fnv {
 public:
  // The value's bytes in host order: fingerprints are compared between ranks of
  // one job, and a checkpoint stores the layout's (same-endian hosts only).
  template <typename T>
  void add(const T& value) {
    const auto* p = reinterpret_cast<const unsigned char*>(&value);
    for (size_t i = 0; i < sizeof(T); ++i) hash_ = (hash_ ^ p[i]) * 0x100000001B3ULL;
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 0xCBF29CE484222325ULL;
};

// The fields every rank and a checkpoint must agree on (device and
// device_index may differ between ranks), those the configuration uses only
// (field_in_use, config_fields.hpp).
uint64_t config_fingerprint(const Config& config);

// The layout of buckets 0..index: the fingerprint of buckets 0..index-1
// (`previous`, 0 for the first) extended by bucket `index`'s shapes.
uint64_t extend_layout_fingerprint(uint64_t previous, int index, std::span<const Shape> shapes);

// What Reducer::fingerprint() returns and add_bucket compares: layout and config.
uint64_t reducer_fingerprint(uint64_t layout, const Config& config);

}  // namespace powersgd::engine
