// A worker program for test_launcher: each mode exercises one behaviour of
// powersgd-run from the worker's side. Usage: launcher_worker MODE ARGS...
//   env [NAME...]         print the launcher's variables (and NAMEs), then rendezvous through its store;
//                         rank 0 also prints torch_port=free when it can bind MASTER_ADDR:MASTER_PORT (where
//                         torch.distributed's rank 0 hosts its TCPStore), else torch_port=busy
//   output                lines on stdout and stderr, then a last line without '\n'
//   exit RANK CODE        rank RANK exits with CODE after 200 ms; the others sleep 60 s
//   stubborn RANK CODE    like exit, but the others ignore SIGTERM
//   aborting RANK CODE    like exit, but the others die by SIGABRT at SIGTERM
//   sigkill RANK          rank RANK kills itself with SIGKILL after 200 ms; the others sleep 60 s
//   aftermath             rank 1 kills itself with SIGKILL; rank 0 notices the broken connection and exits 1
//                         at once. Meanwhile the launcher is stopped (SIGSTOP from rank 1 just before it dies)
//                         and continued (SIGCONT from rank 0's helper) once both are gone, so that it finds both
//                         exits in one wake-up, as a launcher descheduled on a loaded machine does
//   pids DIR              start a child, write "PID CHILDPID" to DIR/rank-R.pids, sleep 60 s
//   term DIR              write DIR/rank-R.pid, wait for SIGTERM, then write DIR/rank-R.term and exit 0
//   throughput SECONDS    rank 0 receives, rank 1 sends over TCP between their PSGD_ADDRs for SECONDS;
//                         rank 0 prints throughput_mbit=X measured after a 0.5 s warm-up
//   pingpong COUNT        rank 1 sends 64 bytes over TCP (TCP_NODELAY) to rank 0, which sends them back,
//                         3 + COUNT times; rank 1 prints pingpong_ms median=X p90=Y min=Z max=W of the last COUNT
//   allreduce DIR         join a Communicator, write DIR/rank-R.running after the first allreduce, then
//                         allreduce 1 MiB in a loop for up to 120 s; on failure print "allreduce failed:
//                         CODE: MESSAGE" and exit 3 (PSGD_TIMEOUT_MS bounds each collective)
//   lost-in-create MS     the last rank exits MS ms after it starts, inside Communicator::create or after it;
//                         every rank prints "started at_ms=T" first (T: ms on the monotonic clock, shared by
//                         the emulated hosts), every other rank then "lost where=create|barrier code=C at_ms=T
//                         mesh=0|1"
//   stalled-in-create MS  like lost-in-create, but the last rank stops (SIGSTOP) for 8 s, then exits 0
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/options.hpp"
#include "powersgd/comm.hpp"
#include "powersgd/error.hpp"
#include "store/store.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::string var(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

int rank() { return std::atoi(var("RANK").c_str()); }

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "launcher_worker: %s\n", message.c_str());
  std::exit(99);
}

void sleep_for(std::chrono::milliseconds d) { std::this_thread::sleep_for(d); }

std::unique_ptr<powersgd::transport::Store> connect_store() {
  return powersgd::transport::connect_tcp_store(var("PSGD_STORE_ADDR"),
                                                static_cast<uint16_t>(std::atoi(var("PSGD_STORE_PORT").c_str())),
                                                var("PSGD_TOKEN"), 30000ms);
}

int mode_env(int argc, char** argv) {
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                           "PSGD_STORE_ADDR", "PSGD_STORE_PORT", "PSGD_STORE_HOSTED", "PSGD_RUN_ID", "PSGD_ADDR"})
    std::printf("%s=%s\n", name, var(name).c_str());
  if (rank() == 0) {
    // As torch's TCPStore server binds (SO_REUSEADDR), on the address the other ranks are given.
    int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int on = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(std::atoi(var("MASTER_PORT").c_str())));
    const bool parsed = ::inet_pton(AF_INET, var("MASTER_ADDR").c_str(), &a.sin_addr) == 1;
    const bool free = parsed && s >= 0 && ::bind(s, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0 &&
                      ::listen(s, 1) == 0;
    std::printf("torch_port=%s\n", free ? "free" : "busy");
    if (s >= 0) ::close(s);
  }
  std::printf("PSGD_TOKEN length=%zu\n", var("PSGD_TOKEN").size());
  for (int i = 2; i < argc; ++i) std::printf("%s=%s\n", argv[i], var(argv[i]).c_str());
  std::fflush(stdout);
  // The store is the launcher's: every rank publishes its run id, and reads all the others'.
  auto store = connect_store();
  std::string id = var("PSGD_RUN_ID");
  store->set("id" + var("RANK"), std::vector<char>(id.begin(), id.end()));
  int world = std::atoi(var("WORLD_SIZE").c_str());
  bool same = true;
  for (int r = 0; r < world; ++r) {
    auto value = store->get("id" + std::to_string(r));
    same = same && std::string(value.begin(), value.end()) == id;
  }
  int64_t count = store->add("arrived", 1);
  std::printf("store=ok same_run_id=%d arrived<=%lld\n", same ? 1 : 0, static_cast<long long>(count));
  return 0;
}

int mode_output() {
  std::printf("line one\nline two\n");
  std::fflush(stdout);
  std::fprintf(stderr, "error one\n");
  std::fflush(stderr);
  std::printf("tail-%d", rank());
  return 0;
}

int mode_exit(char** argv, bool stubborn, bool aborting = false) {
  if (rank() == std::atoi(argv[2])) {
    sleep_for(200ms);
    std::printf("rank %d exits with %s\n", rank(), argv[3]);
    return std::atoi(argv[3]);
  }
  if (stubborn) ::signal(SIGTERM, SIG_IGN);
  if (aborting) ::signal(SIGTERM, [](int) { ::abort(); });
  sleep_for(60s);
  return 0;
}

int mode_sigkill(char** argv) {
  if (rank() == std::atoi(argv[2])) {
    sleep_for(200ms);
    std::printf("about to die\n");
    std::fflush(stdout);
    ::raise(SIGKILL);
  }
  sleep_for(60s);
  return 0;
}

void write_file(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text;
  if (std::rename(tmp.c_str(), path.c_str()) != 0) die("cannot write " + path);
}

int mode_pids(char** argv) {
  pid_t child = ::fork();
  if (child < 0) die("fork failed");
  if (child == 0) {
    ::execl("/bin/sleep", "sleep", "60", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  write_file(std::string(argv[2]) + "/rank-" + var("RANK") + ".pids", std::to_string(::getpid()) + " " +
                                                                          std::to_string(child) + "\n");
  sleep_for(60s);
  return 0;
}

volatile sig_atomic_t g_terminated = 0;

int mode_term(char** argv) {
  struct sigaction action {};
  action.sa_handler = [](int) { g_terminated = 1; };
  ::sigaction(SIGTERM, &action, nullptr);
  std::string base = std::string(argv[2]) + "/rank-" + var("RANK");
  write_file(base + ".pid", std::to_string(::getpid()) + "\n");
  auto end = Clock::now() + 60s;
  while (g_terminated == 0 && Clock::now() < end) sleep_for(10ms);
  if (g_terminated == 0) return 1;
  write_file(base + ".term", "SIGTERM\n");
  return 0;
}

// Rank 0 listens on PSGD_ADDR (127.0.0.1 where the launcher sets none: local jobs), publishes the endpoint in the store and returns the one connection it accepts.
int accept_published(powersgd::transport::Store& store) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  const std::string host = var("PSGD_ADDR").empty() ? "127.0.0.1" : var("PSGD_ADDR");
  if (::inet_pton(AF_INET, host.c_str(), &address.sin_addr) != 1) die("PSGD_ADDR is not an IPv4 address");
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) die("socket failed");
  socklen_t length = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || ::listen(fd, 1) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0)
    die(std::string("cannot listen: ") + std::strerror(errno));
  std::string endpoint = host + ":" + std::to_string(ntohs(address.sin_port));
  store.set("receiver", std::vector<char>(endpoint.begin(), endpoint.end()));
  int conn = ::accept(fd, nullptr, nullptr);
  if (conn < 0) die("accept failed");
  ::close(fd);
  return conn;
}

// Rank 1 connects to the endpoint rank 0 published.
int connect_published(powersgd::transport::Store& store) {
  auto endpoint_bytes = store.get("receiver");
  std::string endpoint(endpoint_bytes.begin(), endpoint_bytes.end());
  auto colon = endpoint.rfind(':');
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_port = htons(static_cast<uint16_t>(std::atoi(endpoint.substr(colon + 1).c_str())));
  ::inet_pton(AF_INET, endpoint.substr(0, colon).c_str(), &peer.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) die("socket failed");
  if (::connect(fd, reinterpret_cast<sockaddr*>(&peer), sizeof peer) != 0)
    die("cannot connect to " + endpoint + ": " + std::strerror(errno));
  return fd;
}

// Reads or writes exactly size bytes; false on EOF or error.
bool transfer_exactly(int fd, void* data, size_t size, bool sending) {
  auto* bytes = static_cast<char*>(data);
  for (size_t done = 0; done < size;) {
    ssize_t n = sending ? ::write(fd, bytes + done, size - done) : ::read(fd, bytes + done, size - done);
    if (n == 0) errno = 0;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

int mode_aftermath() {
  auto store = connect_store();
  pid_t launcher = ::getppid();
  if (rank() == 1) {
    int fd = connect_published(*store);
    pid_t me = ::getpid();
    char ready = 0;
    if (!transfer_exactly(fd, &me, sizeof me, true) || !transfer_exactly(fd, &ready, 1, false))
      die("aftermath: no handshake with rank 0");
    std::printf("rank 1 dies\n");
    std::fflush(stdout);
    ::kill(launcher, SIGSTOP);
    ::raise(SIGKILL);
  }
  if (rank() != 0) {
    sleep_for(60s);
    return 0;
  }
  int fd = accept_published(*store);
  pid_t peer = 0;
  if (!transfer_exactly(fd, &peer, sizeof peer, false)) die("aftermath: no pid from rank 1");
  // glibc 2.36's <sys/pidfd.h> lacks extern "C" for C++: the system call directly.
  auto pidfd_open = [](pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); };
  int watched[2] = {pidfd_open(::getpid()), pidfd_open(peer)};
  if (watched[0] < 0 || watched[1] < 0) die(std::string("pidfd_open failed: ") + std::strerror(errno));
  pid_t helper = ::fork();
  if (helper < 0) die("fork failed");
  if (helper == 0) {  // continues the launcher once rank 0 and rank 1 have both exited (10 s at most)
    pollfd fds[2] = {{watched[0], POLLIN, 0}, {watched[1], POLLIN, 0}};
    const auto end = Clock::now() + 10s;
    while (Clock::now() < end && (fds[0].fd >= 0 || fds[1].fd >= 0)) {
      if (::poll(fds, 2, 100) > 0)
        for (auto& f : fds)
          if (f.revents != 0) f.fd = -1;
    }
    ::kill(launcher, SIGCONT);
    ::_exit(0);
  }
  char ready = 1;
  if (!transfer_exactly(fd, &ready, 1, true)) die("aftermath: rank 1 went away before the handshake");
  char byte = 0;
  transfer_exactly(fd, &byte, 1, false);  // returns at rank 1's death
  std::printf("rank 0: connection to rank 1 lost\n");
  std::fflush(stdout);
  return 1;
}

int mode_throughput(char** argv) {
  const auto duration = std::chrono::duration<double>(std::atof(argv[2]));
  auto store = connect_store();
  std::vector<char> buffer(1 << 16);
  if (rank() == 0) {
    int conn = accept_published(*store);
    auto start = Clock::now();
    auto warm = start + 500ms;
    uint64_t counted = 0;
    Clock::time_point first{}, last{};
    for (;;) {
      ssize_t n = ::read(conn, buffer.data(), buffer.size());
      if (n <= 0) break;
      auto now = Clock::now();
      if (now >= warm) {
        if (first == Clock::time_point{}) first = now;
        else counted += static_cast<uint64_t>(n);
        last = now;
      }
    }
    double seconds = std::chrono::duration<double>(last - first).count();
    if (seconds <= 0) die("no data after the warm-up");
    std::printf("throughput_mbit=%.1f bytes=%llu seconds=%.2f\n", static_cast<double>(counted) * 8 / seconds / 1e6,
                static_cast<unsigned long long>(counted), seconds);
    ::close(conn);
  } else if (rank() == 1) {
    int fd = connect_published(*store);
    auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(duration);
    while (Clock::now() < end)
      if (::write(fd, buffer.data(), buffer.size()) < 0) die(std::string("send failed: ") + std::strerror(errno));
    ::close(fd);
  }
  return 0;
}

void exchange(int fd, bool send_first, std::vector<char>& message) {
  for (bool sending : {send_first, !send_first})
    if (!transfer_exactly(fd, message.data(), message.size(), sending))
      die(std::string("ping-pong ") + (sending ? "send" : "receive") + " failed: " +
          (errno == 0 ? "connection closed" : std::strerror(errno)));
}

int mode_pingpong(char** argv) {
  constexpr int kWarmUp = 3;
  const int count = std::atoi(argv[2]);
  if (count < 1) die("pingpong COUNT: expected a positive count");
  auto store = connect_store();
  std::vector<char> message(64, 'p');
  if (rank() > 1) return 0;
  int fd = rank() == 0 ? accept_published(*store) : connect_published(*store);
  int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
  std::vector<double> ms;
  for (int i = 0; i < kWarmUp + count; ++i) {
    auto start = Clock::now();
    exchange(fd, rank() == 1, message);  // rank 1 sends, rank 0 echoes
    if (i >= kWarmUp) ms.push_back(ms_since(start));
  }
  ::close(fd);
  if (rank() == 1) {
    std::sort(ms.begin(), ms.end());
    auto at = [&](double q) { return ms[static_cast<size_t>(q * static_cast<double>(ms.size() - 1) + 0.5)]; };
    std::printf("pingpong_ms median=%.3f p90=%.3f min=%.3f max=%.3f count=%zu\n", at(0.5), at(0.9), ms.front(),
                ms.back(), ms.size());
  }
  return 0;
}

int mode_allreduce(char** argv) {
  auto comm = powersgd::Communicator::from_env();
  std::vector<float> data(size_t{1} << 18, 1.0f);
  const auto end = Clock::now() + 120s;
  bool announced = false;
  try {
    while (Clock::now() < end) {
      comm->allreduce(data.data(), data.size(), powersgd::DataType::Float32);
      std::fill(data.begin(), data.end(), 1.0f);
      if (!announced) {
        std::ofstream(std::string(argv[2]) + "/rank-" + std::to_string(rank()) + ".running") << "1\n";
        announced = true;
      }
    }
  } catch (const powersgd::Error& e) {
    std::printf("allreduce failed: %s: %s\n", powersgd::to_string(e.code()), e.what());
    std::fflush(stdout);
    return 3;
  }
  std::printf("allreduce loop ended without a failure\n");
  return 0;
}

// A communicator with PSGD_DIRECT_MAX_BYTES=auto: prints the bound it chose, then checks one allreduce of a
// message direct takes and one scatter-gather takes (wrong: elements not the exact sum, or the other algorithm).
// With `channels`, then times two more groups of the same ranks (below).
int mode_direct_bound(bool channels) {
  using powersgd::transport::Algorithm;
  using powersgd::transport::GlooCommunicator;
  const auto start = Clock::now();
  auto comm = GlooCommunicator::create(powersgd::CommOptions::from_env(), powersgd::transport::GlooApi::New);
  const double create_ms = ms_since(start);
  const size_t bound = comm->direct_max_bytes();
  const auto others = static_cast<size_t>((comm->staged_hosts() > 0 ? comm->staged_hosts() : comm->size()) - 1);
  const size_t largest_direct = bound / others / sizeof(float);  // floats per rank
  int wrong = 0;
  for (size_t count : {largest_direct, 2 * largest_direct}) {
    const Algorithm expected = count == largest_direct ? Algorithm::Direct : Algorithm::ScatterGather;
    wrong += comm->choose(count * sizeof(float)) != expected ? 1 : 0;
    std::vector<float> data(count, static_cast<float>(comm->rank() + 1));
    comm->allreduce(data.data(), data.size(), powersgd::DataType::Float32);
    const auto n = static_cast<float>(comm->size());
    wrong += static_cast<int>(std::count_if(data.begin(), data.end(), [&](float v) { return v != n * (n + 1) / 2; }));
  }
  // A second group of the same ranks made as before create_channel (the first's options, a run id of its own:
  // it measures its own bound), then a channel (create_channel: the first's bound); each timed.
  std::string channel_times;
  if (channels) {
    powersgd::CommOptions options = comm->options();
    options.host_store = false;
    options.run_id += "/remeasured";
    const auto remeasuring = Clock::now();
    const auto remeasured = GlooCommunicator::create(options);
    const double remeasured_ms = ms_since(remeasuring);
    const auto channeling = Clock::now();
    const auto channel = comm->create_channel(1);
    const double channel_ms = ms_since(channeling);
    wrong += channel->direct_max_bytes() != bound ? 1 : 0;
    char text[96];
    std::snprintf(text, sizeof(text), " remeasured_ms=%.0f channel_ms=%.0f", remeasured_ms, channel_ms);
    channel_times = text;
  }
  const auto destroying = Clock::now();
  comm.reset();
  const double destroy_ms = ms_since(destroying);
  // The launcher prefixes the rank; create_ms and destroy_ms: how long Communicator::create and the
  // communicator's destruction took on this rank; remeasured_ms and channel_ms: the two groups' creation.
  std::printf("direct_bound=%zu wrong=%d create_ms=%.0f destroy_ms=%.1f%s\n", bound, wrong, create_ms, destroy_ms,
              channel_times.c_str());
  std::fflush(stdout);
  return wrong == 0 ? 0 : 4;
}

// The seconds a stalled-in-create victim stays stopped: beyond every survivor's bound in the test.
constexpr int kStalledSeconds = 8;

// The last rank exits (_exit(0): its sockets close as under SIGKILL, and the launcher goes on) MS ms after
// it starts, wherever it is then: in the rendezvous, the mesh, the fingerprint check, host staging's setup or
// the direct bound's probe of Communicator::create, or after it. Every other rank must then fail, in create or
// in the barrier after it, within the timeout: it prints where, the error's code and when.
// With `stall`, the last rank stops instead (SIGSTOP: its connections stay open and silent) for
// kStalledSeconds, continued by a child of its own, then exits 0.
int mode_lost_in_create(char** argv, bool stall) {
  const int ms = std::atoi(argv[2]);
  if (ms < 0) die("lost-in-create / stalled-in-create MS: expected a delay in milliseconds");
  const powersgd::CommOptions options = powersgd::CommOptions::from_env();
  const bool victim = options.rank == options.world_size - 1;
  // steady_clock (CLOCK_MONOTONIC) is one clock for every process of the machine: powersgd-run's emulated hosts
  // are network namespaces, not time namespaces. The test compares these times across ranks.
  auto now_ms = [] {
    return std::chrono::duration<double, std::milli>(Clock::now().time_since_epoch()).count();
  };
  std::printf("started at_ms=%.1f\n", now_ms());
  std::fflush(stdout);
  if (victim)
    std::thread([ms, stall] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      if (stall) {
        // A child stops it and continues it (on this machine a process's SIGSTOP to itself, sent after a
        // fork, did not stop it); this thread then waits for the child and exits.
        const pid_t self = ::getpid();
        const pid_t stopper = ::fork();
        if (stopper == 0) {  // async-signal-safe calls only: the parent has threads
          ::kill(self, SIGSTOP);
          ::sleep(kStalledSeconds);
          ::kill(self, SIGCONT);
          ::_exit(0);
        }
        if (stopper > 0) ::waitpid(stopper, nullptr, 0);
      }
      ::_exit(0);
    }).detach();
  const char* where = "create";
  try {
    auto comm = powersgd::Communicator::create(options);
    where = "barrier";
    if (victim) std::this_thread::sleep_for(std::chrono::hours(1));  // until its thread exits it
    comm->barrier();
  } catch (const powersgd::Error& e) {
    // mesh=1: it failed in the rendezvous, the mesh's connect included (connect_mesh's "rendezvous of N ranks").
    const bool mesh = std::string(e.what()).find("rendezvous of ") != std::string::npos;
    std::printf("lost where=%s code=%d at_ms=%.1f mesh=%d\n", where, static_cast<int>(e.code()), now_ms(),
                mesh ? 1 : 0);
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    return 0;
  }
  die("lost-in-create / stalled-in-create: the barrier succeeded without the last rank");
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "env") return mode_env(argc, argv);
    if (mode == "output") return mode_output();
    if ((mode == "exit" || mode == "stubborn") && argc == 4) return mode_exit(argv, mode == "stubborn");
    if (mode == "aborting" && argc == 4) return mode_exit(argv, false, true);
    if (mode == "sigkill" && argc == 3) return mode_sigkill(argv);
    if (mode == "aftermath" && argc == 2) return mode_aftermath();
    if (mode == "pids" && argc == 3) return mode_pids(argv);
    if (mode == "term" && argc == 3) return mode_term(argv);
    if (mode == "throughput" && argc == 3) return mode_throughput(argv);
    if (mode == "pingpong" && argc == 3) return mode_pingpong(argv);
    if (mode == "allreduce" && argc == 3) return mode_allreduce(argv);
    if (mode == "direct-bound" && argc == 2) return mode_direct_bound(false);
    if (mode == "direct-bound" && argc == 3 && std::string(argv[2]) == "channels") return mode_direct_bound(true);
    if (mode == "lost-in-create" && argc == 3) return mode_lost_in_create(argv, false);
    if (mode == "stalled-in-create" && argc == 3) return mode_lost_in_create(argv, true);
  } catch (const std::exception& e) {
    die(e.what());
  }
  die("unknown mode or wrong arguments: '" + mode + "'");
}
