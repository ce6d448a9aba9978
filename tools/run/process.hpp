// Starting child processes: workers (own process group, killed when the
// launcher dies, optionally inside a network namespace) and helper commands
// (ip, tc). Call only from the main thread: PR_SET_PDEATHSIG fires when the
// *thread* that forked the child exits.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "common/fd.hpp"

namespace powersgd::run {

// The watchdog's hooks (guardian.hpp): spawned(pid) as soon as a process group exists, reaped(pid) once its
// leader is reaped (after that its id may name another process's group).
struct GroupHooks {
  std::function<void(pid_t)> spawned;
  std::function<void(pid_t)> reaped;
};

struct SpawnSpec {
  std::vector<std::string> argv;  // argv[0]: absolute path of the program
  std::vector<std::string> env;   // complete environment, "K=V"
  int netns_fd = -1;              // >= 0: setns() into this network namespace first
  bool stdin_pipe = false;        // true: stdin is a pipe the caller writes to; false: /dev/null
};

struct Child {
  pid_t pid = -1;  // also its process group id
  Fd stdin_w;      // when SpawnSpec::stdin_pipe
  Fd stdout_r;     // non-blocking
  Fd stderr_r;     // non-blocking
};

// Raises this process's soft RLIMIT_NOFILE to its hard limit and returns the soft limit now: the launcher
// holds pipes of every worker and emulated host and the store's connection of every rank (the usual soft 1024
// ran out at about 500 workers). Processes spawn() starts get the soft limit back as it was (programs that
// use select() count on it). Call once, before any spawn.
uint64_t raise_descriptor_limit();

// Forks and execs. The child leads its own process group, gets SIGKILL when the
// calling thread exits (closing the race with getppid()), starts with default
// signal dispositions, an empty signal mask and the descriptor limit the launcher
// was started with, and inherits no other descriptor. Throws IoError when fork or exec fails (exec errors are reported
// back through a close-on-exec pipe, so "cannot execute" is never a silent 127).
Child spawn(const SpawnSpec& spec);

// Runs a helper command to completion (stdin /dev/null), returning its exit code
// (128+signal when killed) and its combined output; netns_fd >= 0: inside that
// network namespace. Throws IoError when it cannot start.
struct CommandResult {
  int code = 0;
  std::string output;
};
CommandResult run_command(const std::vector<std::string>& argv, int netns_fd = -1);

// Exit code in the shell's convention: the code, or 128+signal.
int exit_code_of(int wait_status);

}  // namespace powersgd::run
