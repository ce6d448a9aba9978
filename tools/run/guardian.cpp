#include "guardian.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <vector>

#include "common/check.hpp"
#include "netns.hpp"

namespace powersgd::run {
namespace {

[[noreturn]] void watchdog(int pipe_fd) {
  ::setpgid(0, 0);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, SIG_IGN);
  int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null_fd >= 0) {
    ::dup2(null_fd, 0);
    ::dup2(null_fd, 1);  // keeps no reader of the launcher's stdout waiting; stderr stays for warnings
  }
  ::dup2(pipe_fd, 3);
  // The watchdog must hold no end of the launcher's pipes (a worker's output
  // would never reach EOF). Failing that, it is better without a watchdog.
  if (int err = close_descriptors_from(4, false); err != 0) {
    std::fprintf(stderr, "powersgd-run: warning: watchdog cannot close inherited descriptors: %s\n",
                 detail::errno_text(err).c_str());
    ::_exit(1);
  }

  std::vector<pid_t> groups;
  std::vector<std::string> namespaces;
  std::string buffer;
  char chunk[512];
  for (;;) {
    ssize_t n = ::read(3, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buffer.append(chunk, static_cast<size_t>(n));
    for (size_t nl; (nl = buffer.find('\n')) != std::string::npos; buffer.erase(0, nl + 1)) {
      std::string line = buffer.substr(0, nl);
      if (line == "released") ::_exit(0);
      if (line.rfind("group ", 0) == 0) groups.push_back(static_cast<pid_t>(std::stol(line.substr(6))));
      if (line.rfind("ungroup ", 0) == 0) std::erase(groups, static_cast<pid_t>(std::stol(line.substr(8))));
      if (line.rfind("netns ", 0) == 0) namespaces.push_back(line.substr(6));
    }
  }
  // The launcher is gone without cleaning up.
  for (pid_t g : groups) ::kill(-g, SIGKILL);
  for (const auto& name : namespaces) {
    kill_namespace_members(name);
    try {
      run_command({find_tool("ip"), "netns", "delete", name});
    } catch (const std::exception& e) {
      std::fprintf(stderr, "powersgd-run watchdog: cannot delete network namespace %s: %s\n", name.c_str(), e.what());
    }
  }
  ::_exit(0);
}

}  // namespace

Guardian::Guardian() {
  int fds[2];
  PSGD_CHECK_SYS(::pipe2(fds, O_CLOEXEC));
  Fd read_end(fds[0]);
  pipe_ = Fd(fds[1]);
  pid_ = PSGD_CHECK_SYS(::fork());
  if (pid_ == 0) {
    pipe_.reset();
    watchdog(read_end.get());
  }
}

void Guardian::send(const std::string& message) {
  // Losing the watchdog only loses the protection against the launcher being killed.
  if (int err = pipe_ ? write_all(pipe_.get(), message.data(), message.size()) : 0; err != 0)
    std::fprintf(stderr, "powersgd-run: warning: lost the watchdog process: %s\n", detail::errno_text(err).c_str());
}

void Guardian::watch_group(pid_t pgid) { send(detail::concat("group ", pgid, "\n")); }
void Guardian::unwatch_group(pid_t pgid) { send(detail::concat("ungroup ", pgid, "\n")); }
void Guardian::watch_namespace(const std::string& name) { send("netns " + name + "\n"); }

void Guardian::release() noexcept {
  if (pid_ <= 0) return;
  send("released\n");
  pipe_.reset();
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

}  // namespace powersgd::run
