#include "comm/mesh.hpp"

#include <gloo/transport/tcp/device.h>

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/check.hpp"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace powersgd::transport {

namespace {

using Clock = std::chrono::steady_clock;

// How long a connect may go on after the deadline before its pair is closed: a few of the device loop's 10 ms
// ticks. Pair::close resets an established connection (SO_LINGER 0), and a peer whose device loop then accepts
// it aborts (getpeername fails in tcp::Pair::handleConnected, a GLOO_ENFORCE on the loop thread). A connect whose
// handshake is done turns CONNECTED within a tick and returns; its pair then closes normally (disarm says the
// deadline passed). Only a pair still waiting after the grace is closed, one at a time (a connect that returns
// meanwhile keeps its pair).
constexpr auto kCloseGrace = std::chrono::milliseconds(50);

// Closes a pair whose connect outlived the deadline. Its own function so that ThreadSanitizer's suppression can
// name it: Gloo's Pair::close tail-calls pthread_mutex_unlock, so TSan, told to ignore what libgloo calls
// (called_from_lib), misses the lock but sees the unlock as ours and reports it unlocked (tsan-gloo.supp).
[[gnu::noinline]] void close_connecting_pair(gloo::transport::Pair& pair) { pair.close(); }

// How long a LoopWaker waits for the loop to take its descriptor out (microseconds where the loop ticks) before
// it takes it out itself, waiting for a tick.
constexpr auto kLoopWakerStopWait = std::chrono::seconds(1);

// Keeps Gloo's device loop ticking without its 10 ms wait while it lives: an eventfd, readable from the start
// and never read, registered with the loop (level-triggered, so every epoll_wait returns at once). A pair's
// close waits for the loop's next tick (tcp::Loop::unregisterDescriptor), so with this it waits microseconds.
// The loop spins meanwhile: hold one only while pairs close. Taken out of the loop by the loop's own thread, in
// the handler (where unregisterDescriptor does not wait; from another thread it would wait a whole tick: this
// descriptor gone, nothing wakes the loop). Throws where the eventfd cannot be made or registered.
class LoopWaker final : public gloo::transport::tcp::Handler {
 public:
  explicit LoopWaker(std::shared_ptr<gloo::transport::tcp::Device> device)
      : device_(std::move(device)), fd_(::eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0) throw std::system_error(errno, std::system_category(), "eventfd");
    // The loop's thread gets this through epoll (registered here, returned by its epoll_wait, both called from
    // uninstrumented Gloo): a hand-over ThreadSanitizer does not see, told to it here and in handleEvents.
#if defined(__SANITIZE_THREAD__)
    __tsan_release(this);
#endif
    try {
      device_->registerDescriptor(fd_, EPOLLIN, this);
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  ~LoopWaker() override {
    phase_ = Phase::Stopping;
    const auto give_up = Clock::now() + kLoopWakerStopWait;
    while (phase_ != Phase::Unregistered) {
      Phase stopping = Phase::Stopping;
      if (Clock::now() >= give_up && phase_.compare_exchange_strong(stopping, Phase::Abandoned)) {
        device_->unregisterDescriptor(fd_, this);  // after a tick: the loop no longer calls this
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    ::close(fd_);
  }
  LoopWaker(const LoopWaker&) = delete;
  LoopWaker& operator=(const LoopWaker&) = delete;

  // On the loop's thread. Its store of Unregistered is its last touch of `this`.
  void handleEvents(int /*events*/) override {
#if defined(__SANITIZE_THREAD__)
    __tsan_acquire(this);
#endif
    Phase stopping = Phase::Stopping;
    if (!phase_.compare_exchange_strong(stopping, Phase::Unregistering)) {
      std::this_thread::yield();  // spinning: where cores are few, the closing thread's turn comes sooner
      return;
    }
    device_->unregisterDescriptor(fd_, this);
    phase_ = Phase::Unregistered;
  }

 private:
  // Running until the destructor; then taken out by the loop (Unregistering, Unregistered) or, where the loop
  // did not come within kLoopWakerStopWait, by the destructor (Abandoned).
  enum class Phase { Running, Stopping, Unregistering, Unregistered, Abandoned };
  // Held: the context's pairs, closing, may drop the device's last other reference.
  const std::shared_ptr<gloo::transport::tcp::Device> device_;
  const int fd_;
  std::atomic<Phase> phase_{Phase::Running};
};

// Keeps `device`'s loop ticking while it lives, where the device is TCP's and a LoopWaker can be had; null
// otherwise (no descriptor to spare, or a device not owned by a shared_ptr): pairs then close a tick after
// another, as Gloo closes them.
std::unique_ptr<LoopWaker> wake_loop(gloo::transport::Device* device) {
  auto* tcp = dynamic_cast<gloo::transport::tcp::Device*>(device);
  if (tcp == nullptr) return nullptr;  // TCP's only: its loop's tick is the cost; ibverbs' pairs close as they do
  try {
    return std::make_unique<LoopWaker>(tcp->shared_from_this());
  } catch (const std::exception&) {
    return nullptr;
  }
}

// The most pairs connected at once, each on a thread of its own; beyond, one after the other.
constexpr int kMaxConcurrentConnects = 256;

// Closes the pairs still connecting when the deadline (and kCloseGrace) passed, so that their connects return;
// a pair armed after the deadline is refused. expire() brings the deadline forward to now (a connect failed, or
// the mesh gave up): the others end after the grace instead of the timeout. One thread for the whole mesh.
class ConnectWatchdog {
 public:
  ConnectWatchdog(Clock::time_point deadline, gloo::transport::Device* device)
      : thread_([this, deadline, device] {
          std::unique_lock lock(mutex_);
          if (wake_.wait_until(lock, deadline, [this] { return done_ || expired_; }) && done_) return;
          fired_ = true;
          // Only pairs still armed after the grace: disarm removes them, and arm refuses once fired_ is set.
          if (wake_.wait_for(lock, kCloseGrace, [this] { return done_ || armed_.empty(); })) return;
          // One at a time, unlocked while closing: a close waits for its connect to wait (the connect holds the
          // pair's lock until then) and for a tick of the device loop (a LoopWaker makes that microseconds, not
          // up to 10 ms: 255 stalled peers' pairs took 2.6 s), and a connect that returns meanwhile takes its
          // pair out of armed_ rather than have it reset. The pairs outlive this thread.
          const auto waker = wake_loop(device);
          while (!done_ && !armed_.empty()) {
            gloo::transport::Pair* pair = armed_.front();
            armed_.erase(armed_.begin());
            lock.unlock();
            close_connecting_pair(*pair);
            lock.lock();
          }
          lock.unlock();  // the waker goes first, unlocked: it waits for the loop to take it out
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

  // A pair about to be connected; false where the deadline passed already.
  bool arm(gloo::transport::Pair* pair) {
    std::lock_guard lock(mutex_);
    if (fired_) return false;
    armed_.push_back(pair);
    return true;
  }
  // After its connect returned or threw: whether the deadline passed meanwhile (the mesh then fails, whatever
  // connect said: the watchdog may have closed the pair).
  bool disarm(gloo::transport::Pair* pair) {
    bool fired = false;
    {
      std::lock_guard lock(mutex_);
      const auto at = std::find(armed_.begin(), armed_.end(), pair);
      if (at != armed_.end()) armed_.erase(at);  // absent: the watchdog took it to close it
      fired = fired_;
    }
    wake_.notify_all();  // a watchdog in its grace: perhaps nothing left to close
    return fired;
  }
  void expire() {
    {
      std::lock_guard lock(mutex_);
      expired_ = true;
    }
    wake_.notify_all();
  }
  bool expired() {
    std::lock_guard lock(mutex_);
    return expired_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<gloo::transport::Pair*> armed_;
  bool expired_ = false;
  bool fired_ = false;
  bool done_ = false;
  std::thread thread_;  // last: started once the members it reads are
};

// Which peer's addresses this rank waited for in vain, for the mesh's timeout: the lowest of `keys` (peers'
// ranks, ascending) that the store does not hold, found by halving (a check of the first keys each, log2(keys)
// round trips, on this failure only).
std::string unpublished(Store& store, int rank, const std::vector<std::string>& keys) {
  try {
    size_t present = 0, absent = keys.size();  // the first `present` keys are held; not all of the first `absent`
    if (store.check(keys)) return detail::concat("rank ", rank, " did not get every peer's addresses");
    while (absent - present > 1) {
      const size_t half = present + (absent - present) / 2;
      if (store.check(std::vector<std::string>(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(half))))
        present = half;
      else
        absent = half;
    }
    return detail::concat("rank ", rank, " never got rank ", keys[present], "'s addresses (a rank died or stalled ",
                          "before publishing them?)");
  } catch (const std::exception&) {  // the store failed too: its timeout says enough
  }
  return detail::concat("rank ", rank, " did not get every peer's addresses");
}

// What became of one pair's connect: not connected (not yet, refused by the watchdog, or closed by it past the
// deadline), connected, or failed on its own (the mesh's error then).
enum class PairOutcome { NotConnected, Connected, Failed };

}  // namespace

void close_context(std::shared_ptr<gloo::transport::Context>& transport, gloo::transport::Device* device) {
  if (!transport || transport.use_count() != 1) {
    transport.reset();
    return;
  }
  const auto waker = wake_loop(device);
  transport.reset();
}

MeshContext::~MeshContext() { close_context(transportContext_, device_.get()); }

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
  // On a failure the pairs go with `transport`, at once (a connect thread or the watchdog may still touch them:
  // declared before those, this guard runs after they were joined).
  struct ContextCloser {
    std::shared_ptr<gloo::transport::Context>& transport;
    gloo::transport::Device* device;
    ~ContextCloser() { close_context(transport, device); }
  } closer{transport, device.get()};
  transport->setTimeout(timeout);
  std::vector<char> addresses;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const std::vector<char> bytes = transport->createPair(peer)->address().bytes();
    addresses.insert(addresses.end(), bytes.begin(), bytes.end());
  }
  store.set(std::to_string(rank), addresses);

  // The peers' addresses in one request (one round trip where the store has one; a peer's own after another
  // were two each, or three through a prefix store), or in a few for a large world. Each pair's connect needs
  // its peer to have read this rank's addresses too, so none could start much before the last peer published.
  // Each peer's addresses are as long as this rank's: one Gloo address per pair.
  const size_t per_get = Store::keys_per_get_many(addresses.size());
  std::vector<std::vector<char>> published;  // peer p's at p, or p - 1 above this rank
  published.reserve(static_cast<size_t>(size));
  std::vector<std::string> keys;  // the peers' ranks
  for (int peer = 0; peer < size; ++peer) {
    if (peer != rank) keys.push_back(std::to_string(peer));
    if (keys.size() < per_get && peer + 1 < size) continue;
    if (keys.empty()) break;
    const auto left = std::max(std::chrono::milliseconds(0),
                               std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    try {
      for (std::vector<char>& value : store.get_many(keys, left)) published.push_back(std::move(value));
    } catch (const TimeoutError& e) {
      throw TimeoutError(detail::concat(unpublished(store, rank, keys), ": ", e.what()));
    }
    keys.clear();
  }

  // Each pair connects on a thread of its own, all started at once: a connect waits a round trip as the
  // connecting side, and until the peer reaches it as the listening side, so one after the other they took up
  // to a round trip per peer. All at once, not a bounded pool: a pool's threads could all wait as listeners for
  // peers whose own pools wait likewise. Above kMaxConcurrentConnects peers, or where a thread cannot be
  // started, they connect one after the other, as connectFullMesh does. The first connect that fails ends the
  // others after the grace, as the deadline would.
  bool concurrent = size - 1 <= kMaxConcurrentConnects;
  ConnectWatchdog watchdog(deadline, device.get());
  std::vector<PairOutcome> outcomes(static_cast<size_t>(size), PairOutcome::NotConnected);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  // Each thread writes its peer's entries only; they are read once every thread was joined.
  auto connect_pair = [&](int peer, gloo::transport::Pair* pair, const std::vector<char>& address) {
    PairOutcome& outcome = outcomes[static_cast<size_t>(peer)];
    if (!watchdog.arm(pair)) {
      outcome = PairOutcome::NotConnected;
      return;
    }
    try {
      pair->connect(address);
      outcome = PairOutcome::Connected;
    } catch (...) {
      outcome = PairOutcome::Failed;
      errors[static_cast<size_t>(peer)] = std::current_exception();
    }
    // Past the deadline (or another's failure) the watchdog may have closed the pair: whatever connect said,
    // it was not connected in time. A failure before that is the mesh's.
    if (watchdog.disarm(pair)) outcome = PairOutcome::NotConnected;
    if (outcome == PairOutcome::Failed) watchdog.expire();
  };
  // Joined before the watchdog ends and before the pairs go, on every path out of here; on a throw, the
  // connects still going end after the grace, not at the deadline.
  struct Joiner {
    ConnectWatchdog& watchdog;
    std::vector<std::thread> threads;
    void join() {
      for (std::thread& thread : threads) thread.join();
      threads.clear();
    }
    ~Joiner() {
      if (!threads.empty()) watchdog.expire();
      join();
    }
  } connects{watchdog, {}};
  // Until a connect failed (only that expires the watchdog while this loop runs).
  for (int peer = 0; peer < size && !watchdog.expired(); ++peer) {
    if (peer == rank) continue;
    std::vector<char> address = extractAddress(published[static_cast<size_t>(peer < rank ? peer : peer - 1)], peer);
    gloo::transport::Pair* pair = transport->getPair(peer).get();
    if (concurrent) {
      try {
        connects.threads.emplace_back(connect_pair, peer, pair, address);
        continue;
      } catch (const std::system_error&) {
        concurrent = false;  // no thread to be had (a pids limit): this pair and the rest here
      }
    }
    connect_pair(peer, pair, address);
    if (outcomes[static_cast<size_t>(peer)] != PairOutcome::Connected) break;
  }
  connects.join();
  // The lowest peer whose connect failed names the failure, else the lowest not connected by the deadline.
  for (int peer = 0; peer < size; ++peer)
    if (outcomes[static_cast<size_t>(peer)] == PairOutcome::Failed)
      std::rethrow_exception(errors[static_cast<size_t>(peer)]);
  for (int peer = 0; peer < size; ++peer)
    if (peer != rank && outcomes[static_cast<size_t>(peer)] != PairOutcome::Connected) throw not_reached(peer);
  device_ = device;
  transportContext_ = std::move(transport);
}

}  // namespace powersgd::transport
