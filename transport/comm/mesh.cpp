#include "comm/mesh.hpp"

#include <unistd.h>

#include <climits>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/check.hpp"

namespace powersgd::transport {

namespace {

using Clock = std::chrono::steady_clock;

// How long a connect may go on after the deadline before its pair is closed: a few of the device loop's 10 ms
// ticks. Pair::close resets an established connection (SO_LINGER 0), and a peer whose device loop then accepts
// it aborts (getpeername fails in tcp::Pair::handleConnected, a GLOO_ENFORCE on the loop thread). A connect whose
// handshake is done turns CONNECTED within a tick and returns; its pair then closes normally (disarm says the
// deadline passed). Only a pair still waiting after the grace, with no connection made, is closed.
constexpr auto kCloseGrace = std::chrono::milliseconds(50);

// Closes the pair being connected when the deadline (and kCloseGrace) passed, so that its connect returns; a
// pair armed after the deadline is refused. One thread for the whole mesh.
class ConnectWatchdog {
 public:
  explicit ConnectWatchdog(Clock::time_point deadline)
      : thread_([this, deadline] {
          std::unique_lock lock(mutex_);
          if (wake_.wait_until(lock, deadline, [this] { return done_; })) return;
          fired_ = true;
          if (current_ == nullptr) return;
          // The same pair or none after the grace: disarm clears it, and arm refuses once fired_ is set.
          if (wake_.wait_for(lock, kCloseGrace, [this] { return done_ || current_ == nullptr; })) return;
          // Blocks until the connect waits (it holds the pair's lock until then); the close wakes it.
          current_->close();
        }) {}
  ~ConnectWatchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  ConnectWatchdog(const ConnectWatchdog&) = delete;
  ConnectWatchdog& operator=(const ConnectWatchdog&) = delete;

  // The pair about to be connected; false where the deadline passed already.
  bool arm(gloo::transport::Pair* pair) {
    std::lock_guard lock(mutex_);
    if (fired_) return false;
    current_ = pair;
    return true;
  }
  // After the connect returned or threw: whether the deadline passed meanwhile (the mesh then fails, whatever
  // connect said: the watchdog may have closed the pair).
  bool disarm() {
    bool fired = false;
    {
      std::lock_guard lock(mutex_);
      current_ = nullptr;
      fired = fired_;
    }
    wake_.notify_all();  // a watchdog in its grace: nothing left to close
    return fired;
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  gloo::transport::Pair* current_ = nullptr;
  bool fired_ = false;
  bool done_ = false;
  std::thread thread_;  // last: started once the members it reads are
};

}  // namespace

void MeshContext::connect_full_mesh(Store& store, const std::shared_ptr<gloo::transport::Device>& device,
                                    std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  setTimeout(timeout);
  auto not_reached = [&](int peer) {
    return MeshTimeout(detail::concat("rank ", rank, "'s pair with rank ", peer, " was not connected within ",
                                      timeout.count(), " ms"));
  };

  // What connectFullMesh publishes first (it derives a local rank that nothing in Debian's Gloo reads).
  char hostname[HOST_NAME_MAX + 1] = {};
  if (::gethostname(hostname, sizeof(hostname) - 1) != 0) throw std::system_error(errno, std::system_category());
  store.set("rank_" + std::to_string(rank), std::vector<char>(hostname, hostname + std::strlen(hostname)));

  std::shared_ptr<gloo::transport::Context> transport = device->createContext(rank, size);
  transport->setTimeout(timeout);
  std::vector<char> addresses;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const std::vector<char> bytes = transport->createPair(peer)->address().bytes();
    addresses.insert(addresses.end(), bytes.begin(), bytes.end());
  }
  store.set(std::to_string(rank), addresses);

  ConnectWatchdog watchdog(deadline);
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const std::string key = std::to_string(peer);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) throw not_reached(peer);
    store.wait({key}, left);
    std::vector<char> all = store.get(key);
    const std::vector<char> address = extractAddress(all, peer);
    const std::unique_ptr<gloo::transport::Pair>& pair = transport->getPair(peer);
    if (!watchdog.arm(pair.get())) throw not_reached(peer);
    try {
      pair->connect(address);
    } catch (...) {
      if (watchdog.disarm()) throw not_reached(peer);
      throw;
    }
    if (watchdog.disarm()) throw not_reached(peer);
  }
  device_ = device;
  transportContext_ = std::move(transport);
}

}  // namespace powersgd::transport
