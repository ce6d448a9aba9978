// What every store has in common: get_many where the store has no request of its own for it.
#include "store.hpp"

namespace powersgd::transport {

std::vector<std::vector<char>> Store::get_many(const std::vector<std::string>& keys,
                                               std::chrono::milliseconds timeout) {
  if (keys.empty()) return {};
  wait(keys, timeout);
  std::vector<std::vector<char>> values;
  values.reserve(keys.size());
  for (const auto& key : keys) values.push_back(get(key));  // present: wait returned
  return values;
}

}  // namespace powersgd::transport
