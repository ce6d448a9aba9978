#include "link_delay.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "common/check.hpp"

extern char** environ;

#ifndef PSGD_RUN_HAVE_DELAYER
#define PSGD_RUN_HAVE_DELAYER 0
#endif

namespace powersgd::run {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
constexpr const char* kDelayer = "powersgd-delay";

bool executable_file(const fs::path& path) {
  std::error_code error;
  return fs::is_regular_file(path, error) && ::access(path.c_str(), X_OK) == 0;
}

fs::path launcher_dir() {
  std::error_code error;
  return fs::read_symlink("/proc/self/exe", error).parent_path();
}

// Whatever the child has written to `fd` so far (non-blocking), without a trailing newline.
std::string drain(const Fd& fd) {
  std::string text;
  char buffer[4096];
  for (ssize_t n; fd && (n = ::read(fd.get(), buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<size_t>(n));
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

std::string status_text(int wait_status) {
  if (WIFSIGNALED(wait_status)) return detail::concat("was killed by signal ", WTERMSIG(wait_status));
  return detail::concat("exited with code ", exit_code_of(wait_status));
}

}  // namespace

std::string find_delayer() {
  const fs::path dir = launcher_dir();
  for (const fs::path& candidate : {dir / kDelayer, dir.parent_path() / "delay" / kDelayer})
    if (!dir.empty() && executable_file(candidate)) return candidate.string();
  if (const char* path = std::getenv("PATH")) {
    std::stringstream dirs(path);
    for (std::string d; std::getline(dirs, d, ':');)
      if (!d.empty() && executable_file(fs::path(d) / kDelayer)) return (fs::path(d) / kDelayer).string();
  }
  return {};
}

std::string delayer_problem() {
  if (!PSGD_RUN_HAVE_DELAYER)
    return "powersgd-run was built without its NFQUEUE delayer, powersgd-delay (libnetfilter-queue-dev was "
           "missing: install it, e.g. with scripts/setup.sh, and rebuild)";
  return detail::concat("powersgd-delay is neither beside powersgd-run (", launcher_dir().string(),
                        ") nor in PATH");
}

void LinkDelayers::start(const std::string& program, const std::string& name, int netns_fd,
                         std::chrono::nanoseconds delay, const GroupHooks& hooks) {
  SpawnSpec spec;
  spec.argv = {program, "--delay", detail::concat(delay.count(), "ns"), "--queue", "0", "--name", name};
  spec.netns_fd = netns_fd;
  for (char** e = environ; *e != nullptr; ++e) spec.env.emplace_back(*e);
  delayers_.push_back({name, spawn(spec), true});
  Delayer& d = delayers_.back();
  on_reap_ = hooks.reaped;
  if (hooks.spawned) hooks.spawned(d.child.pid);

  // Ready when it says so on stdout: then it holds the queue and the rule may send it packets.
  std::string said;
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (said.find("ready\n") == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{d.child.stdout_r.get(), POLLIN, 0};
    if (left <= 0 || PSGD_CHECK_SYS_RETRY(::poll(&p, 1, static_cast<int>(left))) == 0) {
      stop();
      PSGD_THROW(IoError, "--link-delay: the delayer of ", name, " (", program, ") was not ready within 10 s",
                 said.empty() ? "" : ": ", said);
    }
    char buffer[256];
    const ssize_t n = ::read(d.child.stdout_r.get(), buffer, sizeof buffer);
    if (n > 0) {
      said.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    int status = 0;  // EOF: it has exited or is exiting
    PSGD_CHECK_SYS_RETRY(::waitpid(d.child.pid, &status, 0));
    reaped(d);
    const std::string words = drain(d.child.stderr_r);
    PSGD_THROW(IoError, "--link-delay: the delayer of ", name, " (", program, ") ", status_text(status),
               words.empty() ? "" : ": ", words);
  }
  // A warning it printed on the way (no real-time priority) is the user's to see.
  if (std::string words = drain(d.child.stderr_r); !words.empty()) std::fprintf(stderr, "%s\n", words.c_str());
}

std::string LinkDelayers::check() {
  for (auto& d : delayers_) {
    if (!d.running) continue;
    int status = 0;
    if (::waitpid(d.child.pid, &status, WNOHANG) != d.child.pid) continue;
    reaped(d);
    const std::string words = drain(d.child.stderr_r);
    return detail::concat("the link delayer of ", d.name, " (pid ", d.child.pid, ") ", status_text(status),
                          words.empty() ? "" : ": ", words,
                          ": the traffic into that host is no longer delayed, so the job's timing means nothing");
  }
  return {};
}

void LinkDelayers::stop() noexcept {
  for (auto& d : delayers_)
    if (d.running) ::kill(d.child.pid, SIGTERM);
  const auto kill_at = Clock::now() + std::chrono::seconds(2);
  for (auto& d : delayers_) {
    while (d.running) {
      int status = 0;
      const pid_t done = ::waitpid(d.child.pid, &status, WNOHANG);
      if (done == d.child.pid || (done < 0 && errno != EINTR)) {
        reaped(d);
        break;
      }
      if (Clock::now() >= kill_at) {
        ::kill(d.child.pid, SIGKILL);
        while (::waitpid(d.child.pid, &status, 0) < 0 && errno == EINTR) {
        }
        reaped(d);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  delayers_.clear();
}

void LinkDelayers::reaped(Delayer& d) noexcept {
  d.running = false;
  try {
    if (on_reap_) on_reap_(d.child.pid);
  } catch (...) {  // only the watchdog's protection is lost (stop() must not throw)
  }
}

}  // namespace powersgd::run
