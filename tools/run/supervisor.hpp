// The job's one event loop: starts the workers, relays their output line by
// line with a rank prefix, reaps them, and stops the job on the first failure,
// on --timeout, or on a signal to the launcher. Single-threaded: one poll()
// over a signalfd and every worker's stdout/stderr pipe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "process.hpp"

namespace powersgd::run {

struct WorkerLaunch {
  int rank = 0;
  std::string where;       // for messages: "localhost", "node1", "psgd-123-h0"
  SpawnSpec spec;
  std::string stdin_data;  // written to stdin first (spec.stdin_pipe); stdin then stays open until exit
};

struct SupervisorOptions {
  std::chrono::milliseconds grace{5000};
  std::chrono::milliseconds timeout{0};  // 0: none
  std::string log_dir;                   // empty: no log files
  size_t last_lines = 10;                // per rank, shown when it fails
};

class Supervisor {
 public:
  // signal_fd: a signalfd for SIGCHLD, SIGINT, SIGTERM and SIGHUP (blocked by the caller).
  Supervisor(SupervisorOptions options, int signal_fd);
  // Kills (SIGKILL) and reaps workers still running: nothing outlives the launcher.
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // spawned: each worker's pid (= process group) right after it starts; reaped: each worker's pid once it is
  // reaped and its group signalled for the last time (the pid may belong to an unrelated process from then on).
  GroupHooks group_hooks;
  // Called after every wake-up while the job runs: a non-empty message (a
  // helper process of the job died, e.g. a link delayer) stops the job as a
  // failure, exit code 1.
  std::function<std::string()> check_helpers;

  // Starts every worker, in rank order. Throws IoError when one cannot start
  // (the ones already started are killed by the destructor).
  void start(std::vector<WorkerLaunch> launches);

  // Runs until every worker has exited; returns the launcher's exit code
  // (0, the failed worker's code, 124 on timeout, 128+signal on a signal,
  // 1 when check_helpers reported a failure).
  int run();

 private:
  struct Stream {
    Fd fd;
    int out_fd = 1;  // the launcher's stdout or stderr
    Fd log;
    std::string partial;
  };
  struct Worker {
    int rank = 0;
    std::string where;
    pid_t pid = -1;
    bool running = false;  // false once exited; it stays a zombie (see reap()) until run() ends
    bool reaped = false;
    Fd stdin_w;                 // non-blocking
    std::string stdin_pending;  // what is still to be written to stdin_w, by the poll loop
    Stream out, err;
    std::deque<std::string> last;  // ring of the last lines, both streams
  };
  using Clock = std::chrono::steady_clock;

  // One chunk (the poll loop's turn), or, once the worker exited, what its pipe holds now: not what a child it
  // left behind writes meanwhile, which could keep the launcher reading forever.
  enum class Read { Chunk, Held };
  void read_stream(Worker& w, Stream& s, Read amount);
  // Writes to the launcher's own stdout or stderr (`fd`) in pieces a pipe that polls writable takes whole, each
  // waiting for room beside the signal descriptor: a reader that stops (a pager, a stuck log shipper) slows
  // the job, as any pipe does, but keeps the launcher neither from a signal (the rest is dropped and the
  // signal handled), nor from a worker's failure (the same), nor from its next deadline (--timeout, SIGKILL
  // after --grace; once SIGKILL was sent it waits no more). Dropped bytes are counted and reported when the
  // job ends.
  void write_output(int fd, const char* data, size_t size);
  // Whether a running worker has exited with a failure that reap() has not taken yet (it stays a zombie).
  bool failure_waiting() const;
  void say(const std::string& message);
  // When write_output stops waiting for room.
  Clock::time_point output_deadline() const;
  // Reads the signal descriptor into pending_signals_ (a SIGCHLD sets child_signalled_, and failed_child_ where
  // a worker failed: reap() runs after every wake-up).
  void collect_signals();
  // Writes what stdin_w takes now of stdin_pending, never blocking.
  void write_stdin(Worker& w);
  void emit_line(Worker& w, Stream& s, const std::string& line);
  void close_stream(Worker& w, Stream& s);
  void handle_signals();
  void reap();
  // same_wake_up: the job started stopping because of another exit found in this same wake-up.
  void worker_exited(Worker& w, int wait_status, bool same_wake_up);
  void stop(int signal);
  void signal_all(int signal);
  int running_count() const;

  SupervisorOptions options_;
  int signal_fd_;
  std::vector<Worker> workers_;
  bool stopping_ = false;
  bool killed_ = false;
  int sent_signal_ = 0;  // the signal stop() sent to every worker
  int exit_code_ = 0;  // set by the first reason to stop
  Clock::time_point kill_at_{};
  Clock::time_point deadline_ = Clock::time_point::max();  // --timeout's, set by run()
  std::vector<int> pending_signals_;                        // collected, not handled yet
  uint64_t dropped_bytes_ = 0;                              // of output write_output dropped
  bool child_signalled_ = false;  // a SIGCHLD collect_signals took: reap() is due without waiting
  bool failed_child_ = false;     // and a worker had failed then (failure_waiting): write_output waits no more
  size_t out_piece_, err_piece_;  // the most write_output writes at once to stdout, stderr (a terminal: less)
};

}  // namespace powersgd::run
