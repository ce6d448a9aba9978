// One-shot completion flag with an error slot, shared by the async handles of
// the transport (Work) and the engine (ReduceHandle). finish() is called once
// by the worker thread; wait() blocks until then and rethrows the error.
// Thread-safe.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

namespace powersgd {

class Completion {
 public:
  void finish(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
      error_ = std::move(error);
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

 private:
  std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace powersgd
