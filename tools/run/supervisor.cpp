#include "supervisor.hpp"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/check.hpp"
#include "inputs.hpp"

namespace powersgd::run {
namespace {

// A line longer than this is passed on in pieces so memory stays bounded.
constexpr size_t kMaxLine = 64 * 1024;

std::string seconds_text(std::chrono::milliseconds d) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g", static_cast<double>(d.count()) / 1000.0);
  return buffer;
}

std::string describe_exit(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    int sig = WTERMSIG(wait_status);
    const char* abbrev = sigabbrev_np(sig);
    return detail::concat("was killed by signal ", sig, " (", abbrev != nullptr ? "SIG" : "", abbrev != nullptr ? abbrev : "",
                          abbrev != nullptr ? "; " : "", "exit code ", 128 + sig, ")");
  }
  return detail::concat("exited with code ", exit_code_of(wait_status));
}

// Which of the failures found in one wake-up caused the others (lower first). A worker killed by a
// signal (SIGKILL, SIGSEGV, the OOM killer...) did not react to a peer; one that exited non-zero, or died
// of SIGPIPE, typically did, from the broken connection to the one that died. Among equals, rank order.
int cause_order(int wait_status) { return WIFSIGNALED(wait_status) && WTERMSIG(wait_status) != SIGPIPE ? 0 : 1; }

}  // namespace

Supervisor::Supervisor(SupervisorOptions options, int signal_fd)
    : options_(std::move(options)),
      signal_fd_(signal_fd),
      out_piece_(::isatty(1) ? 256 : PIPE_BUF),
      err_piece_(::isatty(2) ? 256 : PIPE_BUF) {}

Supervisor::~Supervisor() {
  for (auto& w : workers_) {
    if (w.reaped) continue;
    // Until it is reaped the leader (running, or a zombie) holds its pid: the group is still this worker's.
    ::kill(-w.pid, SIGKILL);
    if (w.running) ::kill(w.pid, SIGKILL);
    int status = 0;
    while (::waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

void Supervisor::start(std::vector<WorkerLaunch> launches) {
  workers_.reserve(launches.size());  // Worker addresses stay stable
  for (auto& launch : launches) {
    std::string out_path, err_path;
    Worker w;
    w.rank = launch.rank;
    w.where = launch.where;
    w.out.out_fd = 1;
    w.err.out_fd = 2;
    if (!options_.log_dir.empty()) {
      for (auto [stream, suffix] : {std::pair{&w.out, ".out"}, std::pair{&w.err, ".err"}}) {
        std::string path = detail::concat(options_.log_dir, "/rank-", w.rank, suffix);
        stream->log = Fd(open_log_file(path));
      }
    }
    Child child = spawn(launch.spec);
    w.pid = child.pid;
    w.running = true;
    w.out.fd = std::move(child.stdout_r);
    w.err.fd = std::move(child.stderr_r);
    w.stdin_w = std::move(child.stdin_w);
    workers_.push_back(std::move(w));
    if (group_hooks.spawned) group_hooks.spawned(child.pid);
    // Written by the poll loop as the worker takes it: an ssh that does not
    // read its stdin must not keep the launcher from signals and --timeout.
    Worker& added = workers_.back();
    if (added.stdin_w && !launch.stdin_data.empty()) {
      PSGD_CHECK_SYS(::fcntl(added.stdin_w.get(), F_SETFL, ::fcntl(added.stdin_w.get(), F_GETFL) | O_NONBLOCK));
      added.stdin_pending = std::move(launch.stdin_data);
      write_stdin(added);
    }
  }
}

void Supervisor::write_stdin(Worker& w) {
  while (w.stdin_w && !w.stdin_pending.empty()) {
    ssize_t n = ::write(w.stdin_w.get(), w.stdin_pending.data(), w.stdin_pending.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n < 0) {  // EPIPE: the ssh died; the loop reports its exit as the worker's failure
      w.stdin_pending.clear();
      return;
    }
    w.stdin_pending.erase(0, static_cast<size_t>(n));
  }
}

int Supervisor::running_count() const {
  return static_cast<int>(std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; }));
}

void Supervisor::say(const std::string& message) {
  std::string line = "powersgd-run: " + message + "\n";
  write_output(2, line.data(), line.size());
}

Supervisor::Clock::time_point Supervisor::output_deadline() const {
  if (killed_) return Clock::time_point::min();
  if (stopping_) return kill_at_;
  return deadline_;
}

void Supervisor::collect_signals() {
  signalfd_siginfo info{};
  while (::read(signal_fd_, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
    if (info.ssi_signo == SIGCHLD) {
      child_signalled_ = true;
      failed_child_ = failed_child_ || (!stopping_ && failure_waiting());
    } else {
      pending_signals_.push_back(static_cast<int>(info.ssi_signo));
    }
  }
}

void Supervisor::write_output(int fd, const char* data, size_t size) {
  while (size > 0) {
    if (!pending_signals_.empty()) break;
    pollfd fds[2] = {{fd, POLLOUT, 0}, {signal_fd_, POLLIN, 0}};
    const auto limit = output_deadline();
    // A worker failed: what the output takes now, no waiting (reap() stops the job, then writes wait to --grace).
    const int wait_ms = failed_child_ && !stopping_        ? 0
                        : limit == Clock::time_point::max() ? -1
                        : limit <= Clock::now()            ? 0
                                                           : poll_timeout_ms(limit - Clock::now());
    const int ready = ::poll(fds, 2, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || (fds[0].revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return;  // closed: output lost
    if ((fds[1].revents & POLLIN) != 0) collect_signals();
    if ((fds[0].revents & POLLOUT) == 0) {
      if (ready == 0) break;  // the deadline passed, or a worker failed
      continue;               // a SIGCHLD, or a signal (the loop's first test)
    }
    // A terminal polls writable with room for less than PIPE_BUF (and none once stopped, ^S, with a full buffer):
    // a piece of 256 bytes fits what it reported.
    const size_t piece = fd == 1 ? out_piece_ : fd == 2 ? err_piece_ : 256;
    const ssize_t n = ::write(fd, data, std::min(size, piece));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return;  // EPIPE (a closed launcher stdout) only loses output
    data += n;
    size -= static_cast<size_t>(n);
  }
  dropped_bytes_ += size;
}

bool Supervisor::failure_waiting() const {
  for (const auto& w : workers_) {
    if (!w.running) continue;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == w.pid &&
        !(info.si_code == CLD_EXITED && info.si_status == 0))
      return true;
  }
  return false;
}

void Supervisor::emit_line(Worker& w, Stream& s, const std::string& line) {
  std::string text = detail::concat("[", w.rank, "] ", line, "\n");
  write_output(s.out_fd, text.data(), text.size());
  w.last.push_back((s.out_fd == 1 ? "  stdout| " : "  stderr| ") + line);
  if (w.last.size() > options_.last_lines) w.last.pop_front();
}

void Supervisor::read_stream(Worker& w, Stream& s, Read amount) {
  char buffer[65536];
  size_t left = sizeof buffer;
  if (amount == Read::Held) {
    int held = 0;
    if (!s.fd || ::ioctl(s.fd.get(), FIONREAD, &held) != 0) return;
    left = static_cast<size_t>(std::max(held, 0));
  }
  while (s.fd && left > 0) {
    ssize_t n = ::read(s.fd.get(), buffer, std::min(left, sizeof buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {  // EOF, or an error that ends the stream just the same
      close_stream(w, s);
      return;
    }
    left -= static_cast<size_t>(n);
    if (s.log) write_all(s.log.get(), buffer, static_cast<size_t>(n));
    s.partial.append(buffer, static_cast<size_t>(n));
    size_t begin = 0;
    for (size_t nl; (nl = s.partial.find('\n', begin)) != std::string::npos; begin = nl + 1)
      emit_line(w, s, s.partial.substr(begin, nl - begin));
    s.partial.erase(0, begin);
    while (s.partial.size() >= kMaxLine) {
      emit_line(w, s, s.partial.substr(0, kMaxLine));
      s.partial.erase(0, kMaxLine);
    }
    if (amount == Read::Chunk) return;  // one chunk per poll round keeps the ranks fair
  }
}

void Supervisor::close_stream(Worker& w, Stream& s) {
  if (!s.partial.empty()) emit_line(w, s, s.partial);  // a last line without '\n'
  s.partial.clear();
  s.fd.reset();
}

void Supervisor::signal_all(int signal) {
  for (auto& w : workers_) {
    if (!w.running) continue;
    // The whole process group, so that a worker's own children get it too.
    if (::kill(-w.pid, signal) != 0) ::kill(w.pid, signal);
  }
}

void Supervisor::stop(int signal) {
  stopping_ = true;
  sent_signal_ = signal;
  kill_at_ = Clock::now() + options_.grace;
  signal_all(signal);
}

void Supervisor::worker_exited(Worker& w, int wait_status, bool same_wake_up) {
  w.running = false;
  w.stdin_w.reset();  // ssh workers: closes the remote side's liveness channel
  w.stdin_pending.clear();
  const int code = exit_code_of(wait_status);
  // The job's failure is acted on before anything is written: a reader of the launcher's output that stopped
  // holds the writes back up to --grace once the others are stopping, never the stop itself.
  const bool cause = code != 0 && !stopping_;
  const int others = running_count();
  if (cause) {
    exit_code_ = code;
    stop(SIGTERM);
  }
  // Everything the worker wrote before exiting is in the pipes now; a child it
  // left behind may keep them open, so do not wait for EOF.
  read_stream(w, w.out, Read::Held);
  read_stream(w, w.err, Read::Held);
  close_stream(w, w.out);
  close_stream(w, w.err);
  if (code == 0) return;
  const std::string who = detail::concat("rank ", w.rank, " (pid ", w.pid, " on ", w.where, ") ");
  if (!cause) {
    // Not the cause, but not silent either when found with the cause, or when killed by a signal that the
    // launcher did not send (a failure of its own, come while the job was stopping).
    const int sig = WIFSIGNALED(wait_status) ? WTERMSIG(wait_status) : 0;
    const bool foreign_signal = sig != 0 && sig != SIGPIPE && sig != sent_signal_ && !(killed_ && sig == SIGKILL);
    if (same_wake_up) say(who + describe_exit(wait_status) + " in the same wake-up (not counted as the cause)");
    else if (foreign_signal) say(who + describe_exit(wait_status) + " while the job was stopping");
    return;
  }
  say(detail::concat(who, describe_exit(wait_status),
                     others > 0 ? detail::concat("; stopping the other ", others, " worker", others == 1 ? "" : "s",
                                                 " (SIGTERM, SIGKILL after --grace ", seconds_text(options_.grace),
                                                 " s)")
                                : std::string()));
  if (w.last.empty()) {
    say(detail::concat("rank ", w.rank, " printed nothing"));
  } else {
    say(detail::concat("last ", w.last.size(), " lines of rank ", w.rank, ":"));
    for (const auto& line : w.last) write_output(2, (line + "\n").data(), line.size() + 1);
  }
}

void Supervisor::reap() {
  // The scan below takes every failure there is now; one after it sets the flag again (its SIGCHLD is later).
  failed_child_ = false;
  // Every exit this wake-up finds is collected before any is handled: when several are ready, rank order
  // is not the order in which they happened (docs/launcher.md, "Failure, timeout and signals").
  std::vector<std::pair<Worker*, int>> exited;
  for (auto& w : workers_) {
    if (!w.running) continue;
    // WNOWAIT: the worker stays a zombie until run() ends, so its pid (= process group id) cannot be
    // given to an unrelated process while the launcher may still signal the group.
    siginfo_t info{};
    PSGD_CHECK_SYS_RETRY(::waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT));
    if (info.si_pid == w.pid) {
      w.running = false;  // neither counted among the others to stop nor signalled again
      exited.emplace_back(&w, info.si_code == CLD_EXITED ? W_EXITCODE(info.si_status, 0) : W_EXITCODE(0, info.si_status));
    }
  }
  std::stable_sort(exited.begin(), exited.end(),
                   [](const auto& a, const auto& b) { return cause_order(a.second) < cause_order(b.second); });
  const bool was_stopping = stopping_;
  for (auto& [w, status] : exited) worker_exited(*w, status, !was_stopping && stopping_);
}

void Supervisor::handle_signals() {
  collect_signals();
  while (!pending_signals_.empty()) {
    const int sig = pending_signals_.front();
    pending_signals_.erase(pending_signals_.begin());
    // Acted on first, said after (as everywhere here): a stopped reader of the output cannot hold the signal.
    if (!stopping_) {
      exit_code_ = 128 + sig;
      const int running = running_count();
      stop(sig);
      say(detail::concat("got SIG", sigabbrev_np(sig), "; forwarding it to ", running,
                         " workers (SIGKILL after --grace ", seconds_text(options_.grace), " s)"));
    } else if (!killed_) {
      killed_ = true;
      signal_all(SIGKILL);
      say(detail::concat("got SIG", sigabbrev_np(sig), " again; sending SIGKILL to every worker"));
    }
  }
}

int Supervisor::run() {
  if (options_.timeout.count() > 0) deadline_ = Clock::now() + options_.timeout;
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> owners;
  reap();  // a worker may have exited before the loop started
  // And a helper (a link delayer): its SIGCHLD was taken during setup, so none would wake the first poll, which
  // waits for ever without --timeout (a delayer that died then went unnoticed while the workers were silent).
  child_signalled_ = true;
  while (running_count() > 0) {
    fds.assign(1, pollfd{signal_fd_, POLLIN, 0});
    owners.assign(1, {nullptr, nullptr});
    for (auto& w : workers_) {
      for (Stream* s : {&w.out, &w.err})
        if (s->fd) {
          fds.push_back({s->fd.get(), POLLIN, 0});
          owners.emplace_back(&w, s);
        }
      if (w.stdin_w && !w.stdin_pending.empty()) {
        fds.push_back({w.stdin_w.get(), POLLOUT, 0});
        owners.emplace_back(&w, nullptr);  // stdin
      }
    }
    auto now = Clock::now();
    auto wake = Clock::time_point::max();
    if (!stopping_) wake = deadline_;
    if (stopping_ && !killed_) wake = std::min(wake, kill_at_);
    int wait_ms = -1;
    if (wake != Clock::time_point::max()) wait_ms = poll_timeout_ms(wake - now);
    // Signals or a child's exit that write_output took from the signalfd while relaying: handled now, not
    // after the next event (which may never come).
    if (!pending_signals_.empty() || child_signalled_) wait_ms = 0;
    child_signalled_ = false;
    // EINTR counts as a wake-up with nothing ready: the loop re-checks signals and deadlines.
    int ready = ::poll(fds.data(), fds.size(), wait_ms);
    if (ready < 0 && errno != EINTR) PSGD_CHECK_SYS(ready);
    for (size_t i = 1; ready > 0 && i < fds.size(); ++i)
      if (fds[i].revents != 0) {
        if (owners[i].second != nullptr) read_stream(*owners[i].first, *owners[i].second, Read::Chunk);
        else write_stdin(*owners[i].first);
      }
    if ((ready > 0 && fds[0].revents != 0) || !pending_signals_.empty()) handle_signals();
    reap();
    if (check_helpers && !stopping_ && running_count() > 0) {
      if (std::string failure = check_helpers(); !failure.empty()) {
        exit_code_ = 1;
        const int running = running_count();
        stop(SIGTERM);
        say(detail::concat(failure, "; stopping ", running, " workers (SIGTERM, SIGKILL after --grace ",
                           seconds_text(options_.grace), " s)"));
      }
    }

    now = Clock::now();
    if (!stopping_ && now >= deadline_ && running_count() > 0) {
      exit_code_ = 124;
      const int running = running_count();
      stop(SIGTERM);
      say(detail::concat("job timed out: --timeout ", seconds_text(options_.timeout), " s passed; stopping ",
                         running, " workers (SIGTERM, SIGKILL after --grace ", seconds_text(options_.grace),
                         " s)"));
    }
    if (stopping_ && !killed_ && now >= kill_at_ && running_count() > 0) {
      std::string ranks;
      for (const auto& w : workers_)
        if (w.running) ranks += (ranks.empty() ? "" : ", ") + std::to_string(w.rank);
      const int running = running_count();
      killed_ = true;
      signal_all(SIGKILL);
      say(detail::concat("rank", running == 1 ? " " : "s ", ranks, " still running after --grace ",
                         seconds_text(options_.grace), " s; sending SIGKILL"));
    }
  }
  // Children that workers left behind in their process groups go with them; each group is signalled while
  // its leader, a zombie, still holds the pid, and only then reaped.
  for (auto& w : workers_) {
    ::kill(-w.pid, SIGKILL);
    PSGD_CHECK_SYS_RETRY(::waitpid(w.pid, nullptr, 0));
    w.reaped = true;
    if (group_hooks.reaped) group_hooks.reaped(w.pid);
  }
  if (dropped_bytes_ > 0)
    say(detail::concat("dropped ", dropped_bytes_, " bytes of the workers' output that the launcher's stdout or "
                       "stderr did not take in time (--log-dir keeps every byte)"));
  return exit_code_;
}

}  // namespace powersgd::run
