#include "process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "common/check.hpp"

extern char** environ;

namespace powersgd::run {

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
constexpr const char* kSteps[] = {"setpgid", "prctl(PR_SET_PDEATHSIG)", "setns",      "dup2",
                                  "execve",  "parent died",             "close_range", "setrlimit(RLIMIT_NOFILE)"};

[[noreturn]] void child_fail(int pipe_fd, int step, int err = errno) {
  ChildFailure f{step, err};
  (void)!::write(pipe_fd, &f, sizeof f);
  ::_exit(127);
}

}  // namespace

namespace {
// The descriptor limit the launcher was started with, given back to what it spawns (raise_descriptor_limit).
rlimit inherited_files{};
bool raised_files = false;
}  // namespace

uint64_t raise_descriptor_limit() {
  rlimit files{};
  PSGD_CHECK_SYS(::getrlimit(RLIMIT_NOFILE, &files));
  inherited_files = files;
  if (files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    raised_files = ::setrlimit(RLIMIT_NOFILE, &files) == 0;
    if (!raised_files) files.rlim_cur = inherited_files.rlim_cur;
  }
  return files.rlim_cur;
}

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
    if (int failed = close_descriptors_from(3, true); failed != 0) child_fail(report, 6, failed);
    // After the closes, whose last resort walks the launcher's (raised) limit.
    if (raised_files && ::setrlimit(RLIMIT_NOFILE, &inherited_files) != 0) child_fail(report, 7);
    ::execve(argv[0], argv.data(), envp.data());
    child_fail(report, 4);
  }
  ::setpgid(pid, pid);  // also here, so the group exists before the parent signals it (EACCES after exec is fine)
  status.w.reset();
  ChildFailure failure{};
  ssize_t n = PSGD_CHECK_SYS_RETRY(::read(status.r.get(), &failure, sizeof failure));
  if (n == static_cast<ssize_t>(sizeof failure)) {
    int wstatus = 0;
    PSGD_CHECK_SYS_RETRY(::waitpid(pid, &wstatus, 0));
    PSGD_THROW_ERRNO(IoError, failure.err, "cannot start '", spec.argv[0], "': ", kSteps[failure.step], " failed");
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

CommandResult run_command(const std::vector<std::string>& argv, int netns_fd) {
  SpawnSpec spec;
  spec.argv = argv;
  spec.netns_fd = netns_fd;
  for (char** e = environ; *e != nullptr; ++e) spec.env.emplace_back(*e);
  Child child = spawn(spec);
  CommandResult result;
  pollfd fds[2] = {{child.stdout_r.get(), POLLIN, 0}, {child.stderr_r.get(), POLLIN, 0}};
  int open = 2;
  while (open > 0) {
    if (PSGD_CHECK_SYS_RETRY(::poll(fds, 2, -1)) == 0) continue;
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
  PSGD_CHECK_SYS_RETRY(::waitpid(child.pid, &wstatus, 0));
  result.code = exit_code_of(wstatus);
  return result;
}

}  // namespace powersgd::run
