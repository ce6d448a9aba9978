#include "compute/cpu/thread_pool.hpp"

namespace powersgd::compute::cpu {

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(int count, const std::function<void(int)>& task) {
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
    count_ = count;
    pending_ = count - 1;
    ++generation_;
  }
  wake_.notify_all();
  task(0);
  std::unique_lock lock(mu_);
  done_.wait(lock, [this] { return pending_ == 0; });
  task_ = nullptr;
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  std::unique_lock lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (index >= count_) continue;  // a smaller run than the pool: not this worker's
    const std::function<void(int)>* task = task_;
    lock.unlock();
    (*task)(index);
    lock.lock();
    if (--pending_ == 0) done_.notify_one();
  }
}

}  // namespace powersgd::compute::cpu
