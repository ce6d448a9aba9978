#include "compute/cpu/thread_pool.hpp"

#include "common/check.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace powersgd::compute::cpu {

namespace {

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins until done() or kSpin has passed; true when done() held.
template <typename Done>
bool spin_until(Done&& done) {
  const auto deadline = std::chrono::steady_clock::now() + ThreadPool::kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(int count, const std::function<void(int)>& task) {
  // A count that does not fit run_'s 8 bits would leave pending_ above 0 forever (a hang).
  PSGD_ASSERT(count <= kMaxCount, "thread pool: run() of ", count, " tasks, at most ", kMaxCount);
  if (count <= 1) {
    if (count == 1) task(0);
    return;
  }
  {
    std::lock_guard lock(mu_);
    while (static_cast<int>(threads_.size()) < count - 1) {
      const int index = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, index] { work(index); });
    }
    task_ = &task;
    pending_.store(count - 1, std::memory_order_relaxed);
    // Under mu_: a worker about to sleep either sees the new run in its wait
    // predicate or is already waiting and gets the notification.
    const uint64_t sequence = (run_.load(std::memory_order_relaxed) >> 8) + 1;
    run_.store(sequence << 8 | static_cast<uint64_t>(count), std::memory_order_release);
  }
  wake_.notify_all();
  task(0);
  if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock lock(mu_);
    done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  for (;;) {
    const auto fresh = [&] { return run_.load(std::memory_order_acquire) != seen; };
    if (!spin_until(fresh)) {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || fresh(); });
      if (stop_) return;
    }
    seen = run_.load(std::memory_order_acquire);
    if (index >= static_cast<int>(seen & 0xff)) continue;  // a smaller run than the pool: not this worker's
    // task_ was written before this run's word and stays until every worker of
    // the run has returned (run() waits for them).
    (*task_)(index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(mu_);  // pairs with the caller's predicate check under mu_
      done_.notify_one();
    }
  }
}

}  // namespace powersgd::compute::cpu
