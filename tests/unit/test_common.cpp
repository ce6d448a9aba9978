// src/common: the serial worker (order, errors, shutdown with pending work,
// peek), a communicator's turns (comm_turns.hpp), file descriptors (Fd, write_all, close_descriptors_from) and the
// system-call checking family. Also runs under ThreadSanitizer (suite tsan).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/check.hpp"
#include "common/comm_turns.hpp"
#include "common/fd.hpp"
#include "common/log.hpp"
#include "common/serial_worker.hpp"

using namespace std::chrono_literals;
using powersgd::Completion;
using powersgd::Fd;
using powersgd::IoError;
using powersgd::SerialWorker;

namespace {

// A latch the test opens to let the worker's current item finish.
struct Gate {
  std::promise<void> open_promise;
  std::shared_future<void> opened = open_promise.get_future().share();
  void open() { open_promise.set_value(); }
  void wait() const { opened.wait(); }
};

std::string message_of(const std::shared_ptr<Completion>& done) {
  try {
    done->wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("serial worker: items run one at a time in submission order, on one thread") {
  std::vector<int> order;  // touched by the worker thread only until stop()
  std::atomic<int> running{0};
  std::atomic<bool> overlapped{false};
  std::thread::id worker_thread;
  bool one_thread = true;
  SerialWorker<int> worker("test worker", [&](int& item) {
    if (running.fetch_add(1) != 0) overlapped = true;
    if (order.empty()) worker_thread = std::this_thread::get_id();
    if (std::this_thread::get_id() != worker_thread) one_thread = false;
    order.push_back(item);
    running.fetch_sub(1);
  });
  std::vector<std::shared_ptr<Completion>> done;
  for (int i = 0; i < 200; ++i) done.push_back(worker.submit(i));
  for (auto& d : done) d->wait();
  worker.stop(nullptr);
  CHECK_FALSE(overlapped.load());
  CHECK(one_thread);
  CHECK(worker_thread != std::this_thread::get_id());
  REQUIRE(order.size() == 200);
  for (int i = 0; i < 200; ++i) CHECK(order[static_cast<size_t>(i)] == i);
}

TEST_CASE("serial worker: an item's exception finishes that item only") {
  SerialWorker<int> worker("test worker", [](int& item) {
    if (item == 1) throw IoError("item 1 failed");
  });
  auto first = worker.submit(0);
  auto failing = worker.submit(1);
  auto after = worker.submit(2);
  CHECK_NOTHROW(first->wait());
  CHECK_THROWS_WITH_AS(failing->wait(), "item 1 failed", IoError);
  CHECK_THROWS_WITH_AS(failing->wait(), "item 1 failed", IoError);  // every wait rethrows it
  CHECK_NOTHROW(after->wait());
  CHECK(after->done());
}

TEST_CASE("serial worker: stop with an error cancels the queued items; the running one completes") {
  Gate gate;
  std::atomic<bool> started{false};
  std::vector<int> ran;
  SerialWorker<int> worker("test worker", [&](int& item) {
    started = true;
    gate.wait();
    ran.push_back(item);
  });
  auto running = worker.submit(0);
  while (!started) std::this_thread::sleep_for(1ms);
  std::vector<std::shared_ptr<Completion>> queued;
  for (int i = 1; i <= 5; ++i) queued.push_back(worker.submit(i));
  std::thread stopper([&] { worker.stop(std::make_exception_ptr(IoError("shutting down: cancelled"))); });
  for (auto& q : queued) CHECK(message_of(q) == "shutting down: cancelled");  // before the running one ends
  CHECK_FALSE(running->done());
  gate.open();
  stopper.join();
  CHECK_NOTHROW(running->wait());
  CHECK(ran == std::vector<int>{0});
  // Later submissions are refused with the same error, at once.
  auto late = worker.submit(9);
  CHECK(late->done());
  CHECK(message_of(late) == "shutting down: cancelled");
}

TEST_CASE("serial worker: stop without an error drains the queue; later items are refused by name") {
  Gate gate;
  std::atomic<int> count{0};
  SerialWorker<int> worker("drain worker", [&](int&) {
    gate.wait();
    ++count;
  });
  std::vector<std::shared_ptr<Completion>> done;
  for (int i = 0; i < 10; ++i) done.push_back(worker.submit(i));
  std::thread stopper([&] { worker.stop(nullptr); });
  gate.open();
  stopper.join();
  CHECK(count.load() == 10);
  for (auto& d : done) CHECK_NOTHROW(d->wait());
  worker.stop(nullptr);  // idempotent
  std::string refused = message_of(worker.submit(10));
  CHECK(refused.find("drain worker has stopped") != std::string::npos);
}

TEST_CASE("serial worker: destruction cancels pending work with an error naming the worker") {
  Gate gate;
  std::atomic<bool> started{false};
  std::shared_ptr<Completion> running, pending;
  std::thread opener;
  {
    SerialWorker<int> worker("named worker", [&](int&) {
      started = true;
      gate.wait();
    });
    running = worker.submit(0);
    pending = worker.submit(1);
    while (!started) std::this_thread::sleep_for(1ms);
    // Lets `running` finish only once the destructor has cancelled `pending`.
    opener = std::thread([&] {
      while (!pending->done()) std::this_thread::sleep_for(1ms);
      gate.open();
    });
  }  // ~SerialWorker: cancels `pending`, then waits for `running`
  opener.join();
  CHECK_NOTHROW(running->wait());
  CHECK(message_of(pending) == "named worker destroyed before the operation ran");
}

TEST_CASE("serial worker: peek_next and peek_front show the queued items without taking them") {
  Gate gate;
  std::atomic<bool> started{false};
  std::vector<int> ran;
  SerialWorker<int> worker("peek worker", [&](int& item) {
    started = true;
    gate.wait();
    ran.push_back(item);
  });
  CHECK_FALSE(worker.peek_next().has_value());
  auto first = worker.submit(1);
  while (!started) std::this_thread::sleep_for(1ms);
  CHECK_FALSE(worker.peek_next().has_value());  // the running item is not "next"
  auto second = worker.submit(2);
  auto third = worker.submit(3);
  REQUIRE(worker.peek_next().has_value());
  CHECK(*worker.peek_next() == 2);
  CHECK(*worker.peek_next() == 2);  // still queued
  const auto doubled = [](const int& item) { return 2 * item; };
  CHECK(worker.peek_front(8, doubled) == std::vector<int>{4, 6});  // in queue order, the running one not
  CHECK(worker.peek_front(1, doubled) == std::vector<int>{4});
  CHECK(worker.peek_front(0, doubled).empty());
  gate.open();
  third->wait();
  CHECK(ran == std::vector<int>{1, 2, 3});
  CHECK_FALSE(worker.peek_next().has_value());
  CHECK(worker.peek_front(8, doubled).empty());
}

TEST_CASE("serial worker: items claimed and dropped by a failing run finish with an error, never wait for good") {
  std::atomic<bool> started{false};
  Gate gate;
  SerialWorker<int>* self = nullptr;
  SerialWorker<int> worker("claiming worker", [&](int& item) {
    if (item != 1) return;
    started = true;
    gate.wait();
    auto claimed = self->claim_front(8, [](const int*, const int&) { return true; });
    REQUIRE(claimed.size() == 2);
    auto moved = std::move(claimed[1]);  // a move hands the Done on: finished once, by the last holder
    throw std::bad_alloc();              // as out of memory between claiming and running them
  });
  self = &worker;
  auto first = worker.submit(1);
  while (!started) std::this_thread::sleep_for(1ms);
  auto second = worker.submit(2);
  auto third = worker.submit(3);
  gate.open();
  CHECK_THROWS_AS(first->wait(), std::bad_alloc);
  for (auto* dropped : {&second, &third}) {
    CHECK_THROWS_AS((*dropped)->wait(), powersgd::InternalError);
    CHECK((*dropped)->done());
  }
}

TEST_CASE("serial worker: submissions from many threads each run exactly once") {
  std::atomic<int> sum{0};
  SerialWorker<int> worker("busy worker", [&](int& item) { sum += item; });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      std::vector<std::shared_ptr<Completion>> done;
      for (int i = 1; i <= 100; ++i) done.push_back(worker.submit(i));
      for (auto& d : done) d->wait();
    });
  for (auto& t : threads) t.join();
  CHECK(sum.load() == 4 * 5050);
}

TEST_CASE("comm turns: two workers issue in the order the turns were taken, whatever their timing") {
  // Two reducers' workers on one communicator: turns taken in program order (a, b, a, b, ...) on this thread,
  // each item waiting for its turn on its worker; worker b is fast, worker a slow, yet the log is in turn order.
  const int dummy_comm = 0;
  std::shared_ptr<powersgd::detail::CommTurns> turns = powersgd::detail::comm_turns(&dummy_comm);
  CHECK(powersgd::detail::comm_turns(&dummy_comm) == turns);  // shared by the communicator's users
  std::mutex log_mutex;
  std::vector<int> log;
  using Turn = powersgd::detail::CommTurns::Turn;
  struct Item {
    int id;
    Turn turn;
  };
  const auto make_worker = [&](const char* name, std::chrono::microseconds delay) {
    return std::make_unique<SerialWorker<Item>>(name, [&, delay](Item& item) {
      std::this_thread::sleep_for(delay);
      item.turn.wait();
      {
        std::lock_guard lock(log_mutex);
        log.push_back(item.id);
      }
      item.turn.release();
    });
  };
  auto a = make_worker("a", 300us);
  auto b = make_worker("b", 0us);
  std::vector<std::shared_ptr<Completion>> done;
  for (int i = 0; i < 40; ++i) {
    auto& worker = i % 2 == 0 ? *a : *b;
    done.push_back(worker.submit(Item{i, turns->take()}));
  }
  for (auto& d : done) d->wait();
  std::vector<int> expected(40);
  for (int i = 0; i < 40; ++i) expected[static_cast<size_t>(i)] = i;
  CHECK(log == expected);

  // A turn given up before it came (work refused or cancelled) is skipped; a default Turn never waits.
  Turn first = turns->take(), skipped = turns->take(), third = turns->take();
  skipped.release();
  first.release();
  third.wait();  // would block forever if the skipped turn were still owed
  third.release();
  Turn none;
  none.wait();
}

TEST_CASE("Fd: owns, moves and closes its descriptor") {
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  int raw = fds[0];
  {
    Fd a(raw);
    Fd writer(fds[1]);
    CHECK(static_cast<bool>(a));
    Fd b(std::move(a));
    CHECK_FALSE(static_cast<bool>(a));
    CHECK(b.get() == raw);
    Fd c;
    c = std::move(b);
    CHECK(c.get() == raw);
    CHECK(::fcntl(raw, F_GETFD) >= 0);
    writer.close();
    CHECK_FALSE(static_cast<bool>(writer));
    writer.close();  // idempotent
  }
  errno = 0;
  CHECK(::fcntl(raw, F_GETFD) == -1);
  CHECK(errno == EBADF);
}

TEST_CASE("write_all: writes everything across short writes; returns the errno of a failed write") {
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  Fd reader(fds[0]), writer(fds[1]);
  // More than the pipe's buffer: the writer blocks and resumes (short writes) while a reader drains it.
  std::string data(1 << 20, 'x');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>('a' + i % 26);
  std::string received;
  std::thread drain([&] {
    char buffer[4096];
    for (ssize_t n; (n = ::read(reader.get(), buffer, sizeof buffer)) > 0;) received.append(buffer, static_cast<size_t>(n));
  });
  CHECK(powersgd::write_all(writer.get(), data.data(), data.size()) == 0);
  writer.reset();
  drain.join();
  CHECK(received == data);

  int fds2[2];
  REQUIRE(::pipe2(fds2, O_CLOEXEC) == 0);
  ::close(fds2[0]);
  Fd orphan(fds2[1]);
  auto previous = std::signal(SIGPIPE, SIG_IGN);
  CHECK(powersgd::write_all(orphan.get(), "x", 1) == EPIPE);
  std::signal(SIGPIPE, previous);
  CHECK(powersgd::write_all(-1, "x", 1) == EBADF);
}

namespace {

// Runs `close` in a forked child holding three extra descriptors (4 to 6 after
// dup2) and returns what it saw, as a wait status: exit 0 = all closed (or all
// close-on-exec) and descriptor 3 untouched.
int close_in_child(int (*close)(int, bool), bool cloexec_only) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int fd = ::open("/dev/null", O_RDONLY);  // no O_CLOEXEC
    if (fd < 0 || ::dup2(fd, 3) < 0 || ::dup2(fd, 4) < 0 || ::dup2(fd, 5) < 0 || ::dup2(fd, 6) < 0) ::_exit(10);
    if (fd > 6) ::close(fd);
    if (close(4, cloexec_only) != 0) ::_exit(11);
    if (::fcntl(3, F_GETFD) != 0) ::_exit(12);  // below `first`: open and inheritable
    for (int d = 4; d <= 6; ++d) {
      int flags = ::fcntl(d, F_GETFD);
      if (cloexec_only ? flags != FD_CLOEXEC : !(flags == -1 && errno == EBADF)) ::_exit(13);
    }
    ::_exit(0);
  }
  int status = -1;
  ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace

TEST_CASE("close_descriptors_from: close_range and the /proc/self/fd fallback close or mark exactly >= first") {
  for (bool cloexec_only : {false, true}) {
    CAPTURE(cloexec_only);
    int status = close_in_child(&powersgd::close_descriptors_from, cloexec_only);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    status = close_in_child(&powersgd::close_listed_descriptors_from, cloexec_only);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}

namespace {

// In a forked child (the level is read once per process): PSGD_LOG_LEVEL=`value`, then whether info and warn
// lines are enabled, and what the child wrote to stderr.
struct LogLevelSeen {
  bool info = false, warn = false;
  std::string err;
};
LogLevelSeen log_level_in_child(const char* value) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(fds[1], 2);
    ::setenv("PSGD_LOG_LEVEL", value, 1);
    const bool info = powersgd::log::enabled(powersgd::log::Level::Info);
    const bool warn = powersgd::log::enabled(powersgd::log::Level::Warn);
    ::_exit((info ? 1 : 0) | (warn ? 2 : 0));
  }
  ::close(fds[1]);
  LogLevelSeen seen;
  char buffer[512];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;) seen.err.append(buffer, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = -1;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  seen.info = (WEXITSTATUS(status) & 1) != 0;
  seen.warn = (WEXITSTATUS(status) & 2) != 0;
  return seen;
}

}  // namespace

TEST_CASE("PSGD_LOG_LEVEL: the four levels as named; another value is warn, and said once naming it") {
  LogLevelSeen info = log_level_in_child("info");
  CHECK(info.info);
  CHECK(info.warn);
  CHECK(info.err.empty());
  LogLevelSeen error = log_level_in_child("error");
  CHECK_FALSE(error.warn);
  CHECK(error.err.empty());
  LogLevelSeen typo = log_level_in_child("verbose");
  CHECK_FALSE(typo.info);
  CHECK(typo.warn);
  CHECK(typo.err == "powersgd warn: PSGD_LOG_LEVEL='verbose' is not error, warn, info or debug; logging at warn\n");
}

TEST_CASE("system-call checks: messages name the call or the context, and the errno text") {
  int copy = PSGD_CHECK_SYS(::dup(0));
  CHECK(copy >= 0);
  ::close(copy);
  try {
    PSGD_CHECK_SYS(::close(-1));
    FAIL("expected IoError");
  } catch (const IoError& e) {
    std::string what = e.what();
    CHECK(what.find("::close(-1) failed at") != std::string::npos);
    CHECK(what.find("Bad file descriptor") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS(PSGD_CHECK_SYS_MSG(::open("/nonexistent/psgd", O_RDONLY), InvalidArgumentError,
                                          "cannot open '", "/nonexistent/psgd", "'"),
                       "cannot open '/nonexistent/psgd': No such file or directory", powersgd::InvalidArgumentError);
  CHECK_THROWS_WITH_AS(PSGD_THROW_ERRNO(IoError, ENOENT, "reading x"), "reading x: No such file or directory",
                       IoError);
  // EINTR is retried: a read interrupted by a signal (no SA_RESTART) still returns the data.
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  Fd reader(fds[0]), writer(fds[1]);
  struct sigaction action {}, previous {};
  action.sa_handler = [](int) {};
  sigemptyset(&action.sa_mask);
  REQUIRE(::sigaction(SIGUSR1, &action, &previous) == 0);
  pthread_t reader_thread = ::pthread_self();
  std::atomic<bool> stop{false};
  std::thread poker([&] {
    for (int i = 0; i < 20 && !stop; ++i) {
      ::pthread_kill(reader_thread, SIGUSR1);
      std::this_thread::sleep_for(2ms);
    }
    CHECK(::write(writer.get(), "y", 1) == 1);
  });
  char c = 0;
  CHECK(PSGD_CHECK_SYS_RETRY(::read(reader.get(), &c, 1)) == 1);
  stop = true;
  poker.join();
  ::sigaction(SIGUSR1, &previous, nullptr);
  CHECK(c == 'y');
  CHECK(powersgd::detail::errno_text(EPIPE) == "Broken pipe");
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
