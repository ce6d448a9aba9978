// A fixed set of worker threads for the CPU backend's row and column blocks.
// Contract: run() is called from one thread at a time (the backend's); it runs
// task(0) on the caller and task(1..count-1) on workers, and returns when all
// have returned. Tasks must not throw. Workers start on first use and are
// joined by the destructor; between calls they sleep on a condition variable.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace powersgd::compute::cpu {

class ThreadPool {
 public:
  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  void run(int count, const std::function<void(int)>& task);

 private:
  void work(int index);

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* task_ = nullptr;  // valid while pending_ > 0
  uint64_t generation_ = 0;
  int count_ = 0, pending_ = 0;
  bool stop_ = false;
};

}  // namespace powersgd::compute::cpu
