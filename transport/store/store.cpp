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

}  // namespace powersgd::transport
