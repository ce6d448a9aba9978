#include "process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <linux/close_range.h>

#include "common/check.hpp"

extern char** environ;

namespace powersgd::run {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int Fd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

namespace {

struct Pipe {
  Fd r, w;
};

Pipe make_pipe() {
  int fds[2];
  PSGD_CHECK_SYS(::pipe2(fds, O_CLOEXEC));
  return {Fd(fds[0]), Fd(fds[1])};
}

// What the child reports through the exec-error pipe.
struct ChildFailure {
  int step;
  int err;
};
constexpr const char* kSteps[] = {"setpgid", "prctl(PR_SET_PDEATHSIG)", "setns", "dup2", "execve", "parent died"};

[[noreturn]] void child_fail(int pipe_fd, int step) {
  ChildFailure f{step, errno};
  (void)!::write(pipe_fd, &f, sizeof f);
  ::_exit(127);
}

}  // namespace

Child spawn(const SpawnSpec& spec) {
  PSGD_ASSERT(!spec.argv.empty());
  // Everything the child needs is prepared here: between fork and exec only
  // async-signal-safe calls are allowed (the launcher has other threads).
  std::vector<char*> argv, envp;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  Pipe status = make_pipe();
  Pipe out = make_pipe();
  Pipe err = make_pipe();
  Pipe in;
  Fd dev_null;
  if (spec.stdin_pipe) in = make_pipe();
  else dev_null = Fd(PSGD_CHECK_SYS(::open("/dev/null", O_RDONLY | O_CLOEXEC)));
  int stdin_fd = spec.stdin_pipe ? in.r.get() : dev_null.get();

  pid_t parent = ::getpid();
  pid_t pid = PSGD_CHECK_SYS(::fork());
  if (pid == 0) {
    int report = status.w.get();
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);  // the launcher ignores it; workers get the default
    if (::setpgid(0, 0) != 0) child_fail(report, 0);
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) child_fail(report, 1);
    if (::getppid() != parent) child_fail(report, 5);  // the launcher died before prctl took effect
    if (spec.netns_fd >= 0 && ::setns(spec.netns_fd, CLONE_NEWNET) != 0) child_fail(report, 2);
    if (::dup2(stdin_fd, 0) < 0 || ::dup2(out.w.get(), 1) < 0 || ::dup2(err.w.get(), 2) < 0) child_fail(report, 3);
    // Descriptors opened without O_CLOEXEC by libraries (Asio's sockets) must not leak into workers.
    ::syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
    ::execve(argv[0], argv.data(), envp.data());
    child_fail(report, 4);
  }
  ::setpgid(pid, pid);  // also here, so the group exists before the parent signals it (EACCES after exec is fine)
  status.w.reset();
  ChildFailure failure{};
  ssize_t n;
  do n = ::read(status.r.get(), &failure, sizeof failure);
  while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof failure)) {
    int wstatus = 0;
    ::waitpid(pid, &wstatus, 0);
    PSGD_THROW(IoError, "cannot start '", spec.argv[0], "': ", kSteps[failure.step], " failed: ",
               std::strerror(failure.err));
  }
  Child child;
  child.pid = pid;
  child.stdout_r = std::move(out.r);
  child.stderr_r = std::move(err.r);
  if (spec.stdin_pipe) child.stdin_w = std::move(in.w);
  for (int fd : {child.stdout_r.get(), child.stderr_r.get()})
    PSGD_CHECK_SYS(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK));
  return child;
}

CommandResult run_command(const std::vector<std::string>& argv) {
  SpawnSpec spec;
  spec.argv = argv;
  for (char** e = environ; *e != nullptr; ++e) spec.env.emplace_back(*e);
  Child child = spawn(spec);
  CommandResult result;
  pollfd fds[2] = {{child.stdout_r.get(), POLLIN, 0}, {child.stderr_r.get(), POLLIN, 0}};
  int open = 2;
  while (open > 0) {
    if (::poll(fds, 2, -1) < 0) {
      PSGD_REQUIRE(errno == EINTR, IoError, "poll: ", std::strerror(errno));
      continue;
    }
    for (auto& p : fds) {
      if (p.fd < 0 || p.revents == 0) continue;
      char buffer[4096];
      ssize_t n = ::read(p.fd, buffer, sizeof buffer);
      if (n > 0) result.output.append(buffer, static_cast<size_t>(n));
      else if (n == 0 || errno != EAGAIN) {
        p.fd = -1;
        --open;
      }
    }
  }
  int wstatus = 0;
  while (::waitpid(child.pid, &wstatus, 0) < 0) PSGD_REQUIRE(errno == EINTR, IoError, "waitpid: ", std::strerror(errno));
  result.code = exit_code_of(wstatus);
  return result;
}

}  // namespace powersgd::run
