// What every store has in common: get_many where the store has no request of its own for it.
#include "store.hpp"

#include <algorithm>

namespace powersgd::transport {

std::vector<std::vector<char>> Store::get_many(const std::vector<std::string>& keys,
                                               std::chrono::milliseconds timeout) {
  if (keys.empty()) return {};
  const auto deadline = std::chrono::steady_clock::now() + std::max(timeout, std::chrono::milliseconds(0));
  wait(keys, timeout);
  std::vector<std::vector<char>> values;
  values.reserve(keys.size());
  // Present, as wait returned, unless another client removed one since: its get then waits what is left of
  // `timeout`, not the store's own.
  for (const auto& key : keys) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    values.push_back(get(key, std::max(left, std::chrono::milliseconds(0))));
  }
  return values;
}

size_t Store::keys_per_get_many(size_t value_bytes) {
  constexpr size_t kMaxBytesPerGet = size_t{16} << 20;
  constexpr size_t kMaxKeysPerGet = 1024;
  return std::clamp<size_t>(kMaxBytesPerGet / std::max<size_t>(value_bytes, 1), 1, kMaxKeysPerGet);
}

}  // namespace powersgd::transport
