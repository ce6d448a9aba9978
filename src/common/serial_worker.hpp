// One worker thread running submitted items one at a time, in submission order
// (FIFO). The communicator runs its collectives on one (the order of
// collectives must be the submission order on every rank); the engine's
// reduction queue is the other user, and peek_front() is there for its
// lookahead (prepare the next items while the current one communicates).
//
// Contract:
// - submit() queues an item and returns its Done (a Completion, or a type
//   derived from it). The worker calls run(item); Done finishes with nothing,
//   or with the exception run threw; its times() say when it was submitted,
//   started and finished. Thread-safe.
// - stop(nullptr) drains: every queued item still runs, then the thread ends.
//   stop(error) cancels: the items not yet started finish with `error`; the
//   running one completes. Either way stop() returns once the thread has ended,
//   and items submitted afterwards finish at once with the stop error (or, after
//   a drain, with an IoError naming the worker). Idempotent. Never call it from
//   run (that would wait for itself: InternalError).
// - The destructor cancels with IoError("<name> destroyed before the operation ran").
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "check.hpp"
#include "completion.hpp"

namespace powersgd {

template <typename Item, typename Done = Completion>
class SerialWorker {
 public:
  using Run = std::function<void(Item&)>;

  // `name` appears in the errors of cancelled and late items. Starts the thread.
  SerialWorker(std::string name, Run run) : name_(std::move(name)), run_(std::move(run)) {
    thread_ = std::thread([this] { loop(); });
    worker_id_ = thread_.get_id();
  }
  ~SerialWorker() {
    stop(std::make_exception_ptr(IoError(detail::concat(name_, " destroyed before the operation ran"))));
  }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  std::shared_ptr<Done> submit(Item item) {
    // Here, not at class scope: Done may still be incomplete where the worker is declared.
    static_assert(std::is_base_of_v<Completion, Done>, "Done must be a Completion");
    auto done = std::make_shared<Done>();
    std::exception_ptr refused;
    {
      std::lock_guard lock(mutex_);
      if (!stopping_) {
        queue_.push_back(Entry{std::move(item), done});
        wake_.notify_one();
        return done;
      }
      refused = stop_error_ != nullptr
                    ? stop_error_
                    : std::make_exception_ptr(IoError(detail::concat(name_, " has stopped: operation refused")));
    }
    done->finish(refused);
    return done;
  }

  // A copy of the next queued item (not the running one), left in the queue;
  // nullopt when none is queued. The item may start running right after.
  std::optional<Item> peek_next() const
    requires std::is_copy_constructible_v<Item>
  {
    auto front = peek_front(1, [](const Item& item) { return item; });
    if (front.empty()) return std::nullopt;
    return std::move(front.front());
  }
  // project(item) of the first `max` queued items (not the running one), in queue order, under the queue's
  // lock: lets a caller read one field of each without copying all of it. The items may start running right after.
  template <typename Project>
  auto peek_front(size_t max, Project project) const -> std::vector<decltype(project(std::declval<const Item&>()))> {
    std::vector<decltype(project(std::declval<const Item&>()))> out;
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < queue_.size() && i < max; ++i) out.push_back(project(queue_[i].item));
    return out;
  }

  // An item taken out of the queue by claim_front, with its Done: the caller
  // (the worker thread, inside run) runs it itself and finishes `done`, or
  // puts it back with requeue_front. One destroyed otherwise (a failure of the
  // caller between the two, such as out of memory) finishes its Done with an
  // InternalError: no waiter waits for good.
  struct Claimed {
    Item item;
    std::shared_ptr<Done> done;
    Claimed(Item claimed_item, std::shared_ptr<Done> claimed_done)
        : item(std::move(claimed_item)), done(std::move(claimed_done)) {}
    Claimed(Claimed&&) noexcept = default;
    Claimed& operator=(Claimed&& other) noexcept {
      if (this == &other) return *this;
      dropped();
      item = std::move(other.item);
      done = std::move(other.done);
      return *this;
    }
    ~Claimed() { dropped(); }

   private:
    void dropped() noexcept {
      if (done == nullptr) return;
      try {
        if (done->done()) return;
        done->finish(std::make_exception_ptr(
            InternalError("an operation taken from the worker's queue was dropped before it ran or finished (a "
                          "failure of this rank between the two, such as out of memory)")));
      } catch (...) {  // out of memory for the error itself
      }
    }
  };
  // Worker thread, inside run: moves out the longest run of queued items from
  // the front, at most `max`, for which accept(previous, item) holds
  // (`previous`: the item before it, or null for the first). The engine fuses
  // queued reductions with the running one this way.
  template <typename Accept>
  std::vector<Claimed> claim_front(size_t max, Accept accept) {
    std::vector<Claimed> claimed;
    std::lock_guard lock(mutex_);
    while (claimed.size() < max && !queue_.empty() &&
           accept(claimed.empty() ? nullptr : &claimed.back().item, queue_.front().item)) {
      claimed.push_back(Claimed{std::move(queue_.front().item), std::move(queue_.front().done)});
      queue_.pop_front();
    }
    return claimed;
  }
  // Worker thread, inside run: puts claimed items back at the front of the
  // queue in their order, as if never claimed; after a cancelling stop they
  // finish with its error instead.
  void requeue_front(std::vector<Claimed> claimed) {
    std::exception_ptr cancelled;
    {
      std::lock_guard lock(mutex_);
      if (stopping_ && stop_error_ != nullptr) {
        cancelled = stop_error_;
      } else {
        for (auto it = claimed.rbegin(); it != claimed.rend(); ++it)
          queue_.push_front(Entry{std::move(it->item), std::move(it->done)});
        return;
      }
    }
    for (auto& c : claimed) c.done->finish(cancelled);
  }

  // Worker thread, inside run (nothing else waits for submissions then): waits
  // until at least `count` items are queued or `timeout` passed; whether they are.
  template <typename Duration>
  bool wait_queued(size_t count, Duration timeout) {
    std::unique_lock lock(mutex_);
    return wake_.wait_for(lock, timeout, [&] { return stopping_ || queue_.size() >= count; }) &&
           queue_.size() >= count;
  }

  void stop(std::exception_ptr cancel_with) {
    PSGD_ASSERT(std::this_thread::get_id() != worker_id_, name_, ": stop() called from its own thread");
    std::deque<Entry> cancelled;
    {
      std::lock_guard lock(mutex_);
      if (!stopping_) {
        stopping_ = true;
        stop_error_ = cancel_with;
        if (cancel_with != nullptr) cancelled.swap(queue_);
      }
    }
    wake_.notify_all();
    for (auto& entry : cancelled) entry.done->finish(cancel_with);
    std::lock_guard join_lock(join_mutex_);
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Entry {
    Item item;
    std::shared_ptr<Done> done;
  };

  void loop() {
    for (;;) {
      std::optional<Entry> entry;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        entry.emplace(std::move(queue_.front()));
        queue_.pop_front();
      }
      std::exception_ptr error;
      entry->done->start();
      try {
        run_(entry->item);
      } catch (...) {
        error = std::current_exception();
      }
      entry->done->finish(std::move(error));
    }
  }

  const std::string name_;
  const Run run_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> queue_;
  bool stopping_ = false;
  std::exception_ptr stop_error_;
  std::mutex join_mutex_;  // concurrent stop() calls: one joins, the others wait for it
  std::thread thread_;
  std::thread::id worker_id_;  // set once in the constructor
};

}  // namespace powersgd
