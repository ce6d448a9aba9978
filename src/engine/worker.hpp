// SerialWorker: one thread that runs submitted items, and calls, strictly in
// submission order. The engine's reductions run here, so the collectives a
// Reducer issues follow the order the user submitted them on every rank.
// next_item() lets the running item look at the one queued after it (the step
// runner prepares it while its own collectives are in flight).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "common/completion.hpp"

namespace powersgd::engine {

template <typename Item>
class SerialWorker {
 public:
  using Run = std::function<void(Item&)>;

  // Starts the thread; `run` executes one item on it.
  explicit SerialWorker(Run run) : run_(std::move(run)), thread_([this] { loop(); }) {}
  // Runs what is queued, then joins.
  ~SerialWorker() { stop(); }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  // Queues `item`; the completion finishes when run returned, with its exception if it threw.
  std::shared_ptr<Completion> submit(std::shared_ptr<Item> item) { return push({std::move(item), nullptr}); }

  // Runs fn on the worker thread after everything queued before it; waits and rethrows its exception.
  void call(std::function<void()> fn) { push({nullptr, std::move(fn)})->wait(); }

  // The item queued to run next, or null when the queue is empty or a call is next.
  // Worker thread (from within run).
  std::shared_ptr<Item> next_item() {
    std::lock_guard lock(mutex_);
    if (queue_.empty()) return nullptr;
    return queue_.front().item;
  }

  // Runs what is queued, then joins. Idempotent.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Entry {
    std::shared_ptr<Item> item;  // either an item
    std::function<void()> call;  // or a call
    std::shared_ptr<Completion> done = std::make_shared<Completion>();
  };

  std::shared_ptr<Completion> push(Entry entry) {
    auto done = entry.done;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(entry));
    }
    wake_.notify_one();
    return done;
  }

  void loop() {
    for (;;) {
      Entry entry;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        entry = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        if (entry.call)
          entry.call();
        else
          run_(*entry.item);
      } catch (...) {
        error = std::current_exception();
      }
      entry.done->finish(std::move(error));
    }
  }

  Run run_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after, and joins before, the members above
};

}  // namespace powersgd::engine
