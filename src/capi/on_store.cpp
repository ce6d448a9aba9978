// A transport::Store over the caller's callbacks, and the communicator on it.
// The callbacks come from another language (Python's ctypes over
// torch.distributed's store): every result is checked, and a failure becomes
// the Error of the status it returned, never a crash.
#include "capi/on_store.hpp"

#include <cstring>

#include "comm/communicator.hpp"
#include "comm/options.hpp"
#include "common/check.hpp"
#include "store/store.hpp"

namespace powersgd::capi {
namespace {

constexpr size_t kErrorBytes = 1024;

class CallbackStore final : public transport::Store {
 public:
  explicit CallbackStore(const psgd_store_callbacks& callbacks) : c_(callbacks) {}

  void set(const std::string& key, const std::vector<char>& value) override {
    char error[kErrorBytes] = {};
    check(c_.set(c_.user, key.c_str(), value.data(), value.size(), error, sizeof error), "set", key, error);
  }

  using Store::get;
  std::vector<char> get(const std::string& key, std::chrono::milliseconds limit) override {
    char error[kErrorBytes] = {};
    psgd_store_value value;
    check(c_.get(c_.user, key.c_str(), limit.count(), &value, error, sizeof error), "get", key, error);
    PSGD_REQUIRE(value.set, InternalError, "the caller's store: get of key '", key,
                 "' returned PSGD_OK without a value (psgd_store_value_set not called)");
    return std::move(value.bytes);
  }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& limit) override {
    PSGD_REQUIRE(call_wait(keys, limit.count()), TimeoutError, "the caller's store: keys ", joined(keys),
                 " did not appear within ", limit.count(), " ms");
  }

  int64_t add(const std::string& key, int64_t delta) override {
    char error[kErrorBytes] = {};
    int64_t result = 0;
    check(c_.add(c_.user, key.c_str(), delta, &result, error, sizeof error), "add", key, error);
    return result;
  }

  bool check(const std::vector<std::string>& keys) override { return call_wait(keys, 0); }

  bool remove(const std::string& key) override {
    char error[kErrorBytes] = {};
    int existed = 0;
    check(c_.remove(c_.user, key.c_str(), &existed, error, sizeof error), "remove", key, error);
    return existed != 0;
  }

 private:
  // True when every key exists; false when they did not appear within timeout_ms (PSGD_ERR_TIMEOUT).
  bool call_wait(const std::vector<std::string>& keys, int64_t timeout_ms) {
    std::vector<const char*> pointers;
    pointers.reserve(keys.size());
    for (const auto& key : keys) pointers.push_back(key.c_str());
    char error[kErrorBytes] = {};
    int status = c_.wait(c_.user, pointers.data(), pointers.size(), timeout_ms, error, sizeof error);
    if (status == PSGD_ERR_TIMEOUT) return false;
    check(status, "wait", joined(keys), error);
    return true;
  }

  // The first 8 keys and how many there are (a mesh's wait names every peer's).
  static std::string joined(const std::vector<std::string>& keys) {
    std::string out;
    for (size_t i = 0; i < keys.size() && i < 8; ++i) out += (i ? ", '" : "'") + keys[i] + "'";
    if (keys.size() > 8) out += detail::concat(", ... (", keys.size(), " keys)");
    return out;
  }

  static void check(int status, const char* what, const std::string& key, char* error) {
    if (status == PSGD_OK) return;
    error[kErrorBytes - 1] = '\0';
    std::string message = detail::concat("the caller's store: ", what, " of key '", key, "' failed",
                                         error[0] != '\0' ? ": " : "", error);
    switch (status) {
      case PSGD_ERR_TIMEOUT:
        throw TimeoutError(message);
      case PSGD_ERR_IO:
        throw IoError(message);
      case PSGD_ERR_INVALID_ARGUMENT:
        throw InvalidArgumentError(message);
      case PSGD_ERR_MISMATCH:
        throw MismatchError(message);
      case PSGD_ERR_UNSUPPORTED:
        throw UnsupportedError(message);
      default:
        throw InternalError(detail::concat(message, " (status ", status, ")"));
    }
  }

  psgd_store_callbacks c_;
};

}  // namespace

std::unique_ptr<Communicator> create_on_callback_store(int rank, int size, const std::string& run_id,
                                                       const psgd_store_callbacks& callbacks, const char* address) {
  PSGD_REQUIRE(callbacks.set != nullptr && callbacks.get != nullptr && callbacks.add != nullptr &&
                   callbacks.wait != nullptr && callbacks.remove != nullptr,
               InvalidArgumentError, "store: every callback (set, get, add, wait, remove) must be set");
  PSGD_REQUIRE(size >= 1, InvalidArgumentError, "size ", size, ": expected >= 1");
  PSGD_REQUIRE(rank >= 0 && rank < size, InvalidArgumentError, "rank ", rank, ": expected 0 to ", size - 1);
  CommOptions options;
  options.rank = rank;
  options.world_size = size;
  options.run_id = run_id;
  // PSGD_TOKEN among them: keys carry the prefix derived from the token (job_key_prefix), as on powersgd's
  // own store; under powersgd-run the caller's store is torch's, open to anyone who reaches it.
  transport::apply_env_settings(options);
  if (options.transport == TransportKind::Tcp && options.iface.empty() && options.address.empty()) {
    PSGD_REQUIRE(address != nullptr && address[0] != '\0', InvalidArgumentError,
                 "no local address for the TCP transport: pass `address`, or set PSGD_IFACE or PSGD_ADDR");
    options.address = address;
  }
  return transport::GlooCommunicator::create_on_store(options, std::make_unique<CallbackStore>(callbacks),
                                                      "the caller's store");
}

}  // namespace powersgd::capi
