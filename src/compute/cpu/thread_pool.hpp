// A fixed set of worker threads for the CPU backend's row blocks.
// Contract: run() is called from one thread at a time (the backend's); it runs
// task(0) on the caller and task(1..count-1) on workers (count <= kMaxCount: a
// larger count is an internal error, thrown before any task runs), and returns when all
// have returned. Tasks must not throw. Workers start on first use and are
// joined by the destructor.
//
// Hand-offs: a step runs the pool once per pass over every large matrix (tens
// of times), and waking a thread blocked on a condition variable costs tens of
// microseconds on a virtual machine. So a worker that finished spins up to
// kSpin for the next run before it sleeps, and the caller spins up to kSpin
// for the workers before it sleeps: back-to-back passes hand off in well under
// a microsecond, and an idle pool sleeps (it never spins longer than kSpin).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace powersgd::compute::cpu {

class ThreadPool {
 public:
  static constexpr std::chrono::microseconds kSpin{50};
  static constexpr int kMaxCount = 255;  // the count's 8 bits in run_

  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  void run(int count, const std::function<void(int)>& task);

 private:
  void work(int index);

  std::mutex mu_;  // guards the sleeping side of run_ and pending_, and stop_
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* task_ = nullptr;  // written before run_ changes
  // One word per run(), changed under mu_: (sequence number << 8) | count, so
  // that a worker reads which run and how many threads it has in one load (a
  // worker outside a smaller run is not waited for and may look late).
  std::atomic<uint64_t> run_{0};
  std::atomic<int> pending_{0};  // workers of this run not yet returned
  bool stop_ = false;
};

}  // namespace powersgd::compute::cpu
