// powersgd-delay: the emulated cluster's link delay where the kernel has no
// netem. It takes every packet of one NFQUEUE queue of its network namespace,
// holds it for a fixed time and accepts it, in arrival order. powersgd-run
// starts one per emulated host, inside the host's namespace, feeding it with
//   iptables -t raw -A PREROUTING -i eth0 -j NFQUEUE --queue-num 0 --queue-bypass
// so the traffic into the host is delayed (docs/launcher.md, "Link delay").
//
// Usage: powersgd-delay --delay D [--queue N] [--name TEXT]
// Prints "ready" on stdout once bound to the queue; runs until SIGTERM or
// SIGINT, then accepts what it still holds and exits 0. Exit 2: a bad command
// line; 1: any other failure (message on stderr).
#include <arpa/inet.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iostream>
#include <string>

#include "common/check.hpp"
#include "run/options.hpp"

namespace {

using namespace powersgd;

// The kernel holds the delayed packets; this many may wait at once (NFQUEUE's
// default, 1024, is about 12 ms of MTU-sized packets at 1 Gbit/s).
constexpr uint32_t kQueueLength = 1 << 17;
// Large enough that a burst of queued packets' messages never overflows the
// socket while the delayer is not running (cluster-emulation.md).
constexpr unsigned kReceiveBuffer = 16u << 20;

int64_t now_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

volatile sig_atomic_t g_stop = 0;

struct Held {
  uint32_t id;
  int64_t due_ns;
};

struct State {
  std::deque<Held> held;
  int64_t arrived_ns = 0;  // when the current batch of messages was read
  int64_t delay_ns = 0;
};

int on_packet(nfq_q_handle*, nfgenmsg*, nfq_data* packet, void* data) {
  auto* state = static_cast<State*>(data);
  if (const nfqnl_msg_packet_hdr* header = nfq_get_msg_packet_hdr(packet))
    state->held.push_back({ntohl(header->packet_id), state->arrived_ns + state->delay_ns});
  return 0;
}

struct Queue {
  nfq_handle* handle = nullptr;
  nfq_q_handle* queue = nullptr;
  ~Queue() {
    if (queue != nullptr) nfq_destroy_queue(queue);
    if (handle != nullptr) nfq_close(handle);
  }
};

// Accepts every held packet up to `last` at once: the kernel's batch verdict
// takes every queued id up to it. (A packet whose message could not be
// delivered, the socket's buffer full, was never queued: the kernel dropped
// it and counts it, as it counts a packet beyond the queue's length; see
// report_drops.)
void accept_up_to(const Queue& q, uint32_t last) {
  if (nfq_set_verdict_batch(q.queue, last, NF_ACCEPT) < 0)
    PSGD_THROW_ERRNO(IoError, errno, "cannot accept the delayed packets (nfq_set_verdict_batch)");
}

// The kernel's drop counters of `queue_number` in this network namespace (/proc/net/netfilter/nfnetlink_queue:
// queue, peer port id, queued, copy mode, copy range, queue_dropped, user_dropped, ...): said on stderr when
// packets were dropped, since a drop costs TCP a retransmission the emulated link would not have.
void report_drops(uint16_t queue_number, const std::string& name) {
  std::FILE* table = std::fopen("/proc/net/netfilter/nfnetlink_queue", "re");
  if (table == nullptr) return;  // counters not available: nothing to say
  unsigned queue = 0, port = 0, queued = 0, mode = 0, range = 0;
  unsigned long long queue_dropped = 0, user_dropped = 0;
  while (std::fscanf(table, "%u %u %u %u %u %llu %llu %*[^\n]", &queue, &port, &queued, &mode, &range,
                     &queue_dropped, &user_dropped) == 7) {
    if (queue != queue_number) continue;
    if (queue_dropped + user_dropped > 0)
      std::fprintf(stderr,
                   "powersgd-delay (%s): warning: the kernel dropped %llu packet(s) of the delayed link (%llu "
                   "beyond the queue's %u, %llu whose message the delayer's socket could not take): TCP "
                   "retransmitted them, so the job's figures include losses the link would not have\n",
                   name.c_str(), queue_dropped + user_dropped, queue_dropped, kQueueLength, user_dropped);
    break;
  }
  std::fclose(table);
}

void delay_packets(int64_t delay_ns, uint16_t queue_number, const std::string& name) {
  State state;
  state.delay_ns = delay_ns;
  Queue q;
  q.handle = nfq_open();
  if (q.handle == nullptr) PSGD_THROW_ERRNO(IoError, errno, "cannot open a netfilter queue socket (nfq_open)");
  q.queue = nfq_create_queue(q.handle, queue_number, &on_packet, &state);
  if (q.queue == nullptr)
    PSGD_THROW_ERRNO(IoError, errno, "cannot bind NFQUEUE queue ", queue_number,
                     " (does the kernel have nfnetlink_queue? is another program bound to it?)");
  // The packet id is all it needs: no payload is copied.
  if (nfq_set_mode(q.queue, NFQNL_COPY_META, 0) < 0) PSGD_THROW_ERRNO(IoError, errno, "nfq_set_mode");
  // GSO packets (up to 64 KiB) stay whole instead of being segmented for the queue.
  if (nfq_set_queue_flags(q.queue, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO) < 0)
    PSGD_THROW_ERRNO(IoError, errno, "nfq_set_queue_flags(NFQA_CFG_F_GSO)");
  if (nfq_set_queue_maxlen(q.queue, kQueueLength) < 0) PSGD_THROW_ERRNO(IoError, errno, "nfq_set_queue_maxlen");
  const int fd = nfq_fd(q.handle);
  nfnl_rcvbufsiz(nfq_nfnlh(q.handle), kReceiveBuffer);  // SO_RCVBUFFORCE, else SO_RCVBUF
  const int on = 1;
  PSGD_CHECK_SYS(::setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &on, sizeof on));

  // Latency spikes of a loaded machine would become delay: run ahead of the workers where permitted.
  ::prctl(PR_SET_TIMERSLACK, 1UL);
  sched_param priority{};
  priority.sched_priority = 50;
  if (::sched_setscheduler(0, SCHED_FIFO, &priority) != 0)
    std::fprintf(stderr, "powersgd-delay (%s): warning: no real-time priority (%s): delays may run late under load\n",
                 name.c_str(), powersgd::detail::errno_text(errno).c_str());

  // SIGTERM and SIGINT are blocked except inside ppoll, so the loop sees them there and only there.
  sigset_t stop_signals, during_wait;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  PSGD_CHECK_SYS(::sigprocmask(SIG_BLOCK, &stop_signals, &during_wait));
  sigdelset(&during_wait, SIGTERM);
  sigdelset(&during_wait, SIGINT);
  struct sigaction action {};
  action.sa_handler = [](int) { g_stop = 1; };
  for (int sig : {SIGTERM, SIGINT}) PSGD_CHECK_SYS(::sigaction(sig, &action, nullptr));

  std::printf("ready\n");
  std::fflush(stdout);

  alignas(nlmsghdr) static char buffer[1 << 16];
  while (g_stop == 0) {
    const int64_t now = now_ns();
    bool due = false;
    uint32_t last = 0;
    while (!state.held.empty() && state.held.front().due_ns <= now) {
      last = state.held.front().id;
      due = true;
      state.held.pop_front();
    }
    if (due) accept_up_to(q, last);

    timespec wait{};
    timespec* timeout = nullptr;
    if (!state.held.empty()) {
      const int64_t left = state.held.front().due_ns - now_ns();
      wait.tv_sec = left > 0 ? left / 1'000'000'000 : 0;
      wait.tv_nsec = left > 0 ? left % 1'000'000'000 : 0;
      timeout = &wait;
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = ::ppoll(&p, 1, timeout, &during_wait);
    if (ready < 0 && errno != EINTR) PSGD_CHECK_SYS(ready);
    if (ready <= 0) continue;
    // Bounded, so that a flood of arrivals never holds back the packets already due.
    for (int i = 0; i < 256; ++i) {
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
      if (n < 0 && errno == ENOBUFS) continue;  // messages lost (their packets dropped: report_drops)
      if (n < 0) PSGD_THROW_ERRNO(IoError, errno, "recv on the netfilter queue socket");
      state.arrived_ns = now_ns();
      nfq_handle_packet(q.handle, buffer, static_cast<int>(n));
    }
  }
  if (!state.held.empty()) accept_up_to(q, state.held.back().id);
  report_drops(queue_number, name);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("powersgd-delay: hold every packet of an NFQUEUE queue for DELAY, then accept it, in order "
               "(the emulated cluster's link delay; started by powersgd-run --link-delay).",
               "powersgd-delay");
  std::string delay_text, name = "powersgd-delay";
  uint16_t queue_number = 0;
  app.add_option("--delay", delay_text, "How long each packet is held, e.g. 5ms, 250us")->required()->type_name("DELAY");
  app.add_option("--queue", queue_number, "NFQUEUE queue number (default 0)")->type_name("N");
  app.add_option("--name", name, "Name used in messages (powersgd-run gives the host's namespace)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  std::chrono::nanoseconds delay{};
  try {
    delay = powersgd::run::parse_delay(delay_text, "--delay");
    if (delay.count() == 0) PSGD_THROW(InvalidArgumentError, "--delay 0: nothing to delay; run no delayer");
  } catch (const powersgd::Error& e) {
    std::fprintf(stderr, "powersgd-delay: error: %s\n", e.what());
    return 2;
  }
  try {
    delay_packets(delay.count(), queue_number, name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "powersgd-delay (%s): error: %s\n", name.c_str(), e.what());
    return 1;
  }
  return 0;
}
