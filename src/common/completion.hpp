// One-shot completion flag with an error slot, shared by the async handles of
// the transport (Work) and the engine (ReduceHandle). finish() is called once
// by the worker thread; wait() blocks until then and rethrows the error.
// It also keeps when the operation was submitted (construction), started
// (start(), called by the worker just before it runs it) and finished, on
// std::chrono::steady_clock, for timing breakdowns (issue 20). Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>

namespace powersgd {

class Completion {
 public:
  using Clock = std::chrono::steady_clock;
  struct Times {
    Clock::time_point submitted, started, finished;  // started: submitted when it never ran (cancelled)
  };

  void start() {
    std::lock_guard lock(mutex_);
    times_.started = Clock::now();
  }

  void finish(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
      error_ = std::move(error);
      times_.finished = Clock::now();
      if (times_.started == Clock::time_point{}) times_.started = times_.submitted;
    }
    finished_.notify_all();
  }

  void wait() {
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }

  bool done() {
    std::lock_guard lock(mutex_);
    return done_;
  }

  // The times so far; finished (and started, for an operation that never ran) is zero until finish().
  Times times() {
    std::lock_guard lock(mutex_);
    return times_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
  Times times_{Clock::now(), {}, {}};
};

}  // namespace powersgd
