// The watchdog: a small process forked at start-up that cleans up after the
// launcher if the launcher dies without doing so itself (SIGKILL, crash).
// The launcher tells it, through a pipe, each worker process group and each
// network namespace it creates; when the pipe reaches EOF without a "released"
// message, the watchdog sends SIGKILL to those process groups (less the ones
// the launcher has reaped and unwatched) and deletes
// those namespaces, then exits. It ignores SIGINT, SIGTERM and SIGHUP and
// leads its own process group, so a Ctrl-C meant for the job does not reach it.
#pragma once

#include <sys/types.h>

#include <string>

#include "process.hpp"

namespace powersgd::run {

class Guardian {
 public:
  // Forks the watchdog. Call while the launcher has a single thread.
  Guardian();
  // release() if not done.
  ~Guardian() { release(); }
  Guardian(const Guardian&) = delete;
  Guardian& operator=(const Guardian&) = delete;

  void watch_group(pid_t pgid);
  // The group's leader is reaped (its pid may be reused): the watchdog no longer signals that group.
  void unwatch_group(pid_t pgid);
  void watch_namespace(const std::string& name);  // before it is created
  // watch_group and unwatch_group as the hooks of what spawns process groups (workers, link delayers).
  GroupHooks group_hooks() {
    return {[this](pid_t pgid) { watch_group(pgid); }, [this](pid_t pgid) { unwatch_group(pgid); }};
  }
  // The launcher has cleaned up itself: the watchdog exits without acting; waits for it.
  void release() noexcept;

 private:
  void send(const std::string& message);

  pid_t pid_ = -1;
  Fd pipe_;
};

}  // namespace powersgd::run
