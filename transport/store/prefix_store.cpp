// Prefix store: namespaces keys as "<prefix>/<key>" in a wrapped store; the
// per-job prefix derived from the token.
#include <boost/uuid/detail/sha1.hpp>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "common/check.hpp"
#include "store.hpp"

namespace powersgd::transport {
namespace {

class PrefixStore final : public Store {
 public:
  PrefixStore(Store& inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix) + "/") {
    set_timeout(inner.timeout());
  }

  void set(const std::string& key, const std::vector<char>& value) override { inner_.set(full(key), value); }

  // get(key) waits with this store's timeout, which may differ from the inner store's.
  using Store::get;
  std::vector<char> get(const std::string& key, std::chrono::milliseconds limit) override {
    return std::move(inner_.get_many({full(key)}, limit).front());
  }

  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys,
                                          std::chrono::milliseconds limit) override {
    return inner_.get_many(full(keys), limit);
  }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& limit) override {
    inner_.wait(full(keys), limit);
  }

  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(full(key), delta); }
  bool check(const std::vector<std::string>& keys) override { return inner_.check(full(keys)); }
  bool remove(const std::string& key) override { return inner_.remove(full(key)); }

 private:
  std::string full(const std::string& key) const {
    PSGD_REQUIRE(prefix_.size() + key.size() <= kMaxKeyBytes, InvalidArgumentError, "store key '", key,
                 "' with prefix '", prefix_, "' is ", prefix_.size() + key.size(), " bytes, the limit is ",
                 kMaxKeyBytes);
    return prefix_ + key;
  }
  std::vector<std::string> full(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(full(k));
    return out;
  }

  Store& inner_;
  std::string prefix_;
};

}  // namespace

std::unique_ptr<Store> make_prefix_store(Store& inner, const std::string& prefix) {
  PSGD_REQUIRE(!prefix.empty(), InvalidArgumentError, "store prefix must not be empty");
  return std::make_unique<PrefixStore>(inner, prefix);
}

std::string job_key_prefix(const std::string& token) {
  if (token.empty()) return {};
  static const std::string kDomain = "powersgd store key prefix v1:";
  boost::uuids::detail::sha1 sha;
  sha.process_bytes(kDomain.data(), kDomain.size());
  sha.process_bytes(token.data(), token.size());
  boost::uuids::detail::sha1::digest_type digest;
  sha.get_digest(digest);
  // SHA-1's 20 bytes in their standard order whatever Boost's digest_type: five 32-bit words before Boost
  // 1.86, 20 bytes since. Builds against either must make the same prefix (or ranks never meet: a timeout).
  using Element = std::remove_extent_t<decltype(digest)>;
  static_assert(sizeof(digest) == 20 && (sizeof(Element) == 4 || sizeof(Element) == 1));
  unsigned char bytes[20];
  for (size_t i = 0; i < 20; ++i) {
    if constexpr (sizeof(Element) == 1)
      bytes[i] = static_cast<unsigned char>(digest[i]);
    else  // each word's most significant byte first
      bytes[i] = static_cast<unsigned char>(static_cast<uint32_t>(digest[i / 4]) >> (8 * (3 - i % 4)));
  }
  std::string out = "job-";
  char hex[3];
  for (size_t i = 0; i < 16; ++i) {  // 128 of the 160 bits
    std::snprintf(hex, sizeof hex, "%02x", bytes[i]);
    out += hex;
  }
  return out;
}

}  // namespace powersgd::transport
