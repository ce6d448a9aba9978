// --link-delay where the kernel has no netem: one powersgd-delay process
// (tools/delay) per emulated host, inside the host's namespace, fed by an
// iptables NFQUEUE rule on the traffic into the host. Design: docs/launcher.md,
// "Link delay". Call only from the launcher's main thread (process.hpp).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "process.hpp"

namespace powersgd::run {

// The path of powersgd-delay: beside this powersgd-run (installed), in the
// build tree's tools/delay, or in PATH. Empty when there is none; then
// `delayer_problem()` says why (not built, not found).
std::string find_delayer();
std::string delayer_problem();

class LinkDelayers {
 public:
  LinkDelayers() = default;
  ~LinkDelayers() { stop(); }
  LinkDelayers(const LinkDelayers&) = delete;
  LinkDelayers& operator=(const LinkDelayers&) = delete;

  // Starts `program` in the network namespace `netns_fd` (named `name` in
  // messages) holding queue 0's packets for `delay`, and returns once it has
  // bound the queue; `hooks` learn of its process group (kept for its reaping).
  // Throws IoError with the delayer's own message when it fails or is not
  // ready within 10 s (the one started is then stopped).
  void start(const std::string& program, const std::string& name, int netns_fd, std::chrono::nanoseconds delay,
             const GroupHooks& hooks);

  // Non-blocking: a message naming the first delayer that has exited since
  // (reaped here), with its exit status and last words; empty while all run.
  std::string check();

  // SIGTERM to every delayer, SIGKILL to any still running 2 s later; reaps
  // them. Idempotent, never throws.
  void stop() noexcept;

  bool empty() const { return delayers_.empty(); }

 private:
  struct Delayer {
    std::string name;
    Child child;
    bool running = true;
  };
  void reaped(Delayer& d) noexcept;

  std::vector<Delayer> delayers_;
  std::function<void(pid_t)> on_reap_;
};

}  // namespace powersgd::run
