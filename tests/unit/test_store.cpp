// Rendezvous stores: TCP store semantics and robustness (raw sockets speak the
// wire protocol of docs/store-protocol.md by hand), file store, prefix store,
// and Gloo's connectFullMesh over the TCP store.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gloo/allreduce_ring.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <latch>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "powersgd/error.hpp"
#include "comm/communicator.hpp"
#include "store/store.hpp"

using namespace std::chrono_literals;
using powersgd::transport::connect_tcp_store;
using powersgd::transport::kMaxKeyBytes;
using powersgd::transport::kMaxValueBytes;
using powersgd::transport::Store;
using powersgd::transport::TcpStoreServer;
using powersgd::transport::TcpStoreServerOptions;
using Clock = std::chrono::steady_clock;

// Under ThreadSanitizer: Gloo (not instrumented) moves data between the rank
// threads of the connectFullMesh test through its sockets, which TSan reports
// as a race between writev() and recv() inside gloo::transport::tcp::Pair.
// Only reports with a Gloo pair frame are suppressed; the stores are checked.
extern "C" const char* __tsan_default_suppressions() { return "race:gloo::transport::tcp::Pair\n"; }

namespace {

const std::string kToken = "s3cret-job-token";

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<char>& v) { return {v.begin(), v.end()}; }

long long ms_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

TcpStoreServerOptions server_options(std::chrono::milliseconds frame_timeout = 10s) {
  TcpStoreServerOptions o;
  o.token = kToken;
  o.frame_timeout = frame_timeout;
  return o;
}

std::unique_ptr<Store> client(const TcpStoreServer& server, std::chrono::milliseconds timeout = 5s) {
  return connect_tcp_store("127.0.0.1", server.port(), kToken, timeout);
}

// ---- hand-written wire frames ----
void put_le(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
// The little-endian u32 at `at` of `bytes` (which holds at least at + 4).
uint32_t u32_at(const std::string& bytes, size_t at = 0) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  return v;
}
// Reads exactly n bytes from fd within the timeout; nullopt on EOF/reset/timeout.
std::optional<std::string> read_exactly(int fd, size_t n, std::chrono::milliseconds timeout) {
  std::string out;
  auto deadline = Clock::now() + timeout;
  while (out.size() < n) {
    pollfd p{fd, POLLIN, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return std::nullopt;
    char buf[4096];
    ssize_t got = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), 0);
    if (got <= 0) return std::nullopt;
    out.append(buf, static_cast<size_t>(got));
  }
  return out;
}
std::string field(const std::string& s) {
  std::string out;
  put_le(out, s.size(), 4);
  return out + s;
}
// u32 length + u8 type + body
std::string frame(uint8_t type, const std::string& body) {
  std::string out;
  put_le(out, body.size() + 1, 4);
  out += static_cast<char>(type);
  return out + body;
}
std::string hello_frame(const std::string& token, uint32_t version = 1) {
  std::string body;
  put_le(body, version, 4);
  return frame(1, body + field(token));
}

// A client that speaks the protocol by hand over a plain socket.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  }
  ~RawClient() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  void send(const std::string& data) {
    REQUIRE(::send(fd_, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size()));
  }
  // Reads exactly n bytes; nullopt on EOF/reset/timeout.
  std::optional<std::string> read(size_t n, std::chrono::milliseconds timeout) { return read_exactly(fd_, n, timeout); }
  // One reply frame: type and the rest.
  std::optional<std::pair<uint8_t, std::string>> reply(std::chrono::milliseconds timeout = 2s) {
    auto header = read(4, timeout);
    if (!header) return std::nullopt;
    const uint32_t length = u32_at(*header);
    if (length == 0 || length > 1u << 20) return std::nullopt;
    auto body = read(length, timeout);
    if (!body) return std::nullopt;
    return std::make_pair(static_cast<uint8_t>((*body)[0]), body->substr(1));
  }
  // True when the server resets the connection within the timeout; reads nothing.
  bool reset_by_server(std::chrono::milliseconds timeout) {
    pollfd p{fd_, POLLRDHUP, 0};
    return ::poll(&p, 1, static_cast<int>(timeout.count())) == 1 && (p.revents & (POLLERR | POLLHUP | POLLRDHUP));
  }
  // True when the server closes the connection within the timeout.
  bool closed_by_server(std::chrono::milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
      char buf[256];
      ssize_t got = ::recv(fd_, buf, sizeof buf, 0);
      if (got <= 0) return true;  // EOF or reset
    }
  }

 private:
  int fd_ = -1;
};

constexpr uint8_t kOk = 0x80, kError = 0x81, kRefused = 0x83, kBusy = 0x84;

// A socket listening on 127.0.0.1 at a port of the kernel's choice (written to `port`), for stand-in servers.
int loopback_listener(uint16_t& port) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  socklen_t length = sizeof address;
  REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  port = ntohs(address.sin_port);
  return listener;
}

// Proves the server still serves a well-behaved client, promptly.
void check_server_serves(const TcpStoreServer& server) {
  auto start = Clock::now();
  auto store = client(server);
  store->set("alive", bytes("yes"));
  CHECK(text(store->get("alive")) == "yes");
  CHECK(ms_since(start) < 1000);
}

// Redirects stderr (where PSGD_LOG writes) to a file while alive.
class StderrCapture {
 public:
  StderrCapture() : path_(std::filesystem::temp_directory_path() / ("psgd_store_log_" + std::to_string(::getpid()))) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::dup2(fd, 2) == 2);
    ::close(fd);
  }
  std::string finish() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    std::ifstream in(path_);
    std::stringstream s;
    s << in.rdbuf();
    std::filesystem::remove(path_);
    return s.str();
  }

 private:
  std::filesystem::path path_;
  int saved_;
};

std::filesystem::path fresh_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("psgd_store_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace

TEST_CASE("tcp store: set, get, wait, add, check, remove") {
  TcpStoreServer server(server_options());
  CHECK(server.port() != 0);
  auto a = client(server);
  auto b = client(server);
  a->set("k", bytes("v1"));
  CHECK(text(b->get("k")) == "v1");
  b->set("k", bytes("v2"));  // overwrite
  CHECK(text(a->get("k")) == "v2");
  a->set("empty", {});
  CHECK(b->get("empty").empty());
  CHECK(a->check({"k", "empty"}));
  CHECK_FALSE(a->check({"k", "absent"}));
  CHECK(a->check({}));
  b->wait({"k", "empty"});
  CHECK(a->add("counter", 5) == 5);
  CHECK(b->add("counter", -2) == 3);
  CHECK(text(a->get("counter")) == "3");
  CHECK_THROWS_AS(a->add("k", 1), powersgd::InvalidArgumentError);  // not an integer
  a->set("big", bytes(std::to_string(INT64_MAX)));
  CHECK_THROWS_AS(a->add("big", 1), powersgd::InvalidArgumentError);  // overflow
  CHECK(text(a->get("k")) == "v2");                                    // connection still usable
  CHECK(a->remove("k"));
  CHECK_FALSE(a->remove("k"));
  CHECK_FALSE(b->check({"k"}));
  std::vector<char> large(1 << 20);
  for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<char>(i * 7);
  a->set("large", large);
  CHECK(b->get("large") == large);
}

TEST_CASE("tcp store: get and wait block until another client sets") {
  TcpStoreServer server(server_options());
  auto waiter = client(server);
  auto setter = client(server);
  std::thread t([&] {
    std::this_thread::sleep_for(150ms);
    setter->set("late", bytes("here"));
    std::this_thread::sleep_for(100ms);
    setter->add("late-counter", 1);
  });
  auto start = Clock::now();
  CHECK(text(waiter->get("late")) == "here");
  CHECK(ms_since(start) >= 100);
  waiter->wait({"late", "late-counter"});
  CHECK(ms_since(start) >= 200);
  t.join();
}

TEST_CASE("tcp store: get and wait time out with TimeoutError naming key and timeout") {
  TcpStoreServer server(server_options());
  auto store = client(server, 200ms);
  auto start = Clock::now();
  try {
    store->get("never-set");
    FAIL("get returned");
  } catch (const powersgd::TimeoutError& e) {
    std::string what = e.what();
    CHECK(what.find("never-set") != std::string::npos);
    CHECK(what.find("200 ms") != std::string::npos);
  }
  auto elapsed = ms_since(start);
  CHECK(elapsed >= 190);
  CHECK(elapsed < 1500);
  try {
    store->wait({"a", "b"}, 100ms);
    FAIL("wait returned");
  } catch (const powersgd::TimeoutError& e) {
    CHECK(std::string(e.what()).find("'a', 'b'") != std::string::npos);
  }
  // The connection stays usable after a timeout.
  store->set("a", bytes("x"));
  CHECK(text(store->get("a")) == "x");
}

// A wait the server timed out must leave no registration behind: the timeout's handler moved the keys out
// before unregistering them, so a later set of such a key counted against the session's next request (its GET
// answered with the key absent: the handler failed, the client got no reply) or, the session closed, called
// the freed session (AddressSanitizer: heap-use-after-free).
TEST_CASE("tcp store: a timed-out wait leaves nothing behind: a later set of its key touches no session") {
  TcpStoreServer server(server_options());
  auto waiter = client(server, 5s);
  auto setter = client(server);
  CHECK_THROWS_AS(waiter->wait({"x"}, 100ms), powersgd::TimeoutError);
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    setter->set("x", bytes("1"));  // counted against the waiter's get of "y" before the fix
    std::this_thread::sleep_for(200ms);
    setter->set("y", bytes("why"));
  });
  auto start = Clock::now();
  CHECK(text(waiter->get("y")) == "why");
  CHECK(ms_since(start) >= 350);
  late.join();
  {
    auto gone = client(server);
    CHECK_THROWS_AS(gone->get_many({"w", "x"}, 100ms), powersgd::TimeoutError);
  }  // closed: the server forgets the session once it reads the end of the stream
  std::this_thread::sleep_for(200ms);
  setter->set("w", bytes("2"));  // called the closed session before the fix
  CHECK(text(setter->get("w")) == "2");
  CHECK(text(waiter->get("x")) == "1");
}

TEST_CASE("tcp store: many concurrent clients, shared clients and counters") {
  TcpStoreServer server(server_options());
  constexpr int kClients = 12, kAdds = 100;
  auto shared = client(server);  // one client used by every thread at once
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      try {
        auto own = client(server);
        own->set("rank" + std::to_string(i), bytes(std::to_string(i)));
        for (int j = 0; j < kAdds; ++j) {
          own->add("counter", 1);
          shared->add("shared-counter", 2);
        }
        std::vector<std::string> all;
        for (int r = 0; r < kClients; ++r) all.push_back("rank" + std::to_string(r));
        own->wait(all);
        for (int r = 0; r < kClients; ++r)
          if (text(own->get("rank" + std::to_string(r))) != std::to_string(r)) failures++;
      } catch (const std::exception& e) {
        MESSAGE(std::string(e.what()));
        failures++;
      }
    });
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  CHECK(shared->add("counter", 0) == kClients * kAdds);
  CHECK(shared->add("shared-counter", 0) == 2 * kClients * kAdds);
}

TEST_CASE("tcp store: wrong token is refused, logged with the address and counted; others are served") {
  TcpStoreServer server(server_options());
  StderrCapture capture;
  std::string error;
  try {
    connect_tcp_store("127.0.0.1", server.port(), "wrong-token", 2s);
  } catch (const powersgd::IoError& e) {
    error = e.what();
  }
  std::string log = capture.finish();
  CHECK(error.find("wrong job token") != std::string::npos);
  CHECK(error.find("127.0.0.1:" + std::to_string(server.port())) != std::string::npos);
  CHECK(log.find("refused client 127.0.0.1:") != std::string::npos);
  CHECK(log.find("wrong job token") != std::string::npos);
  CHECK(server.refused_clients() == 1);
  CHECK_THROWS_AS(connect_tcp_store("127.0.0.1", server.port(), "", 2s), powersgd::IoError);  // missing token
  CHECK(server.refused_clients() == 2);
  check_server_serves(server);
}

TEST_CASE("tcp store: raw clients that break the protocol are closed, the server keeps serving") {
  TcpStoreServer server(server_options());
  auto good = client(server);
  good->set("x", bytes("1"));

  SUBCASE("missing HELLO: a SET as first frame is refused") {
    RawClient raw(server.port());
    raw.send(frame(2, field("x") + field("evil")));
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kRefused);
    CHECK(raw.closed_by_server(2s));
    CHECK(server.refused_clients() == 1);
    CHECK(text(good->get("x")) == "1");
  }
  SUBCASE("wrong protocol version") {
    RawClient raw(server.port());
    raw.send(hello_frame(kToken, 99));
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kRefused);
    CHECK(r->second.find("version 99") != std::string::npos);
    CHECK(raw.closed_by_server(2s));
  }
  SUBCASE("malformed frame: string length beyond the frame") {
    RawClient raw(server.port());
    raw.send(hello_frame(kToken));
    REQUIRE(raw.reply()->first == kOk);
    std::string body;
    put_le(body, 1000, 4);  // key claims 1000 bytes, 3 follow
    raw.send(frame(2, body + "abc"));
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kError);
    CHECK(r->second.find("malformed") != std::string::npos);
    CHECK(raw.closed_by_server(2s));
  }
  SUBCASE("unknown command") {
    RawClient raw(server.port());
    raw.send(hello_frame(kToken));
    REQUIRE(raw.reply()->first == kOk);
    raw.send(frame(42, "whatever"));
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kError);
    CHECK(r->second.find("unknown request type 42") != std::string::npos);
    CHECK(raw.closed_by_server(2s));
  }
  SUBCASE("oversized length prefix (4 GiB) after HELLO: rejected before allocating") {
    RawClient raw(server.port());
    raw.send(hello_frame(kToken));
    REQUIRE(raw.reply()->first == kOk);
    raw.send(std::string("\xff\xff\xff\xff", 4));
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kError);
    CHECK(r->second.find("4294967295") != std::string::npos);
    CHECK(raw.closed_by_server(2s));
  }
  SUBCASE("oversized length before HELLO (pre-authentication limit)") {
    RawClient raw(server.port());
    std::string header;
    put_le(header, 1u << 20, 4);  // 1 MiB: allowed for SET, not for an unauthenticated HELLO
    raw.send(header);
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kError);
    CHECK(raw.closed_by_server(2s));
  }
  SUBCASE("key over the limit on the wire") {
    RawClient raw(server.port());
    raw.send(hello_frame(kToken));
    REQUIRE(raw.reply()->first == kOk);
    raw.send(frame(2, field(std::string(kMaxKeyBytes + 1, 'k')) + field("v")));
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kError);
    CHECK(raw.closed_by_server(2s));
  }
  SUBCASE("half a frame, then the client vanishes") {
    {
      RawClient raw(server.port());
      raw.send(hello_frame(kToken));
      REQUIRE(raw.reply()->first == kOk);
      std::string header;
      put_le(header, 100, 4);
      raw.send(header + std::string(10, 'x'));
    }
    {
      RawClient raw(server.port());
      raw.send(std::string("\x10\x00", 2));  // half a length prefix, before HELLO
    }
  }
  SUBCASE("client vanishes while its get is pending") {
    RawClient raw(server.port());
    raw.send(hello_frame(kToken));
    REQUIRE(raw.reply()->first == kOk);
    std::string body = field("pending-key");
    put_le(body, 60000, 8);
    raw.send(frame(3, body));
    std::this_thread::sleep_for(50ms);
    raw.close();
    std::this_thread::sleep_for(50ms);
    good->set("pending-key", bytes("v"));  // the server must not write to the vanished waiter's socket
  }
  SUBCASE("a request while a get is pending is a protocol error") {
    RawClient raw(server.port());
    raw.send(hello_frame(kToken));
    REQUIRE(raw.reply()->first == kOk);
    std::string body = field("pending-key");
    put_le(body, 60000, 8);
    raw.send(frame(3, body));
    raw.send(frame(6, std::string("\0\0\0\0", 4)));
    auto r = raw.reply();
    REQUIRE(r);
    CHECK(r->first == kError);
    CHECK(raw.closed_by_server(2s));
  }
  check_server_serves(server);
  CHECK(text(good->get("x")) == "1");
}

TEST_CASE("tcp store: slow clients are closed after the frame deadline, others unaffected") {
  TcpStoreServer server(server_options(300ms));
  RawClient silent(server.port());  // connects, never sends HELLO
  RawClient stalled(server.port());  // authenticates, then stops mid-frame
  stalled.send(hello_frame(kToken));
  REQUIRE(stalled.reply()->first == kOk);
  stalled.send(std::string("\x20\x00\x00\x00\x02", 5));
  auto start = Clock::now();
  check_server_serves(server);  // while both are stuck
  CHECK(silent.closed_by_server(3s));
  CHECK(stalled.closed_by_server(3s));
  auto elapsed = ms_since(start);
  CHECK(elapsed >= 200);
  CHECK(elapsed < 3000);
  // An authenticated idle client is not a slow one: it stays connected.
  auto idle = client(server);
  std::this_thread::sleep_for(500ms);
  idle->set("after-idle", bytes("ok"));
  CHECK(text(idle->get("after-idle")) == "ok");
}

TEST_CASE("tcp store: random garbage from many connections neither crashes nor blocks the server") {
  TcpStoreServer server(server_options(200ms));
  auto good = client(server);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int c = 0; c < 40; ++c) {
        RawClient raw(server.port());
        if (c % 2) {
          raw.send(hello_frame(kToken));
          raw.reply();
        }
        std::string junk(rng() % 64, '\0');
        for (auto& ch : junk) ch = static_cast<char>(rng());
        if (c % 4 != 3 && junk.size() >= 5) {
          junk[0] = static_cast<char>(junk.size() - 4);  // a plausible length, random type and fields
          junk[1] = junk[2] = junk[3] = 0;
        }
        if (!junk.empty()) raw.send(junk);
      }
    });
  for (int i = 0; i < 20; ++i) {
    good->set("k" + std::to_string(i), bytes("v"));
    CHECK(good->add("n", 1) == i + 1);
  }
  for (auto& th : threads) th.join();
  check_server_serves(server);
  CHECK(server.refused_clients() > 0);
}

TEST_CASE("tcp store: key and value limits are checked by the client") {
  TcpStoreServer server(server_options());
  auto store = client(server);
  CHECK_THROWS_AS(store->set(std::string(kMaxKeyBytes + 1, 'k'), bytes("v")), powersgd::InvalidArgumentError);
  CHECK_THROWS_AS(store->get(std::string(kMaxKeyBytes + 1, 'k')), powersgd::InvalidArgumentError);
  CHECK_THROWS_AS(store->set("k", std::vector<char>(kMaxValueBytes + 1)), powersgd::InvalidArgumentError);
  std::string max_key(kMaxKeyBytes, 'k');
  store->set(max_key, bytes("v"));
  CHECK(text(store->get(max_key)) == "v");
}

TEST_CASE("tcp store: stopping the server fails a waiting client with IoError, no hang") {
  auto server = std::make_unique<TcpStoreServer>(server_options());
  auto store = client(*server, 60s);
  std::string error;
  auto start = Clock::now();
  std::thread t([&] {
    try {
      store->get("never");
    } catch (const powersgd::IoError& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("wrong type: ") + e.what();
    }
  });
  std::this_thread::sleep_for(100ms);
  std::string where = "127.0.0.1:" + std::to_string(server->port());
  server->stop();
  t.join();
  CHECK(ms_since(start) < 3000);
  CHECK(error.find("lost the connection") != std::string::npos);
  CHECK(error.find(where) != std::string::npos);
  CHECK_THROWS_AS(store->set("k", bytes("v")), powersgd::IoError);
  server.reset();
}

TEST_CASE("tcp store: the client retries until the server starts, and times out naming host:port") {
  uint16_t port = 0;
  {
    TcpStoreServer probe(server_options());
    port = probe.port();
  }
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    auto o = server_options();
    o.port = port;
    server = std::make_unique<TcpStoreServer>(o);
  });
  auto store = connect_tcp_store("127.0.0.1", port, kToken, 5s);
  starter.join();
  store->set("k", bytes("v"));
  CHECK(text(store->get("k")) == "v");
  store.reset();
  server.reset();

  auto start = Clock::now();
  try {
    connect_tcp_store("127.0.0.1", port, kToken, 300ms);
    FAIL("connected to a stopped server");
  } catch (const powersgd::TimeoutError& e) {
    CHECK(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
  }
  CHECK(ms_since(start) < 2000);
}

TEST_CASE("tcp store: a deadline that ends the reconnect after a Busy reply reports the Busy reason") {
  // A stand-in server: answers the first HELLO with Busy and stops listening first, so every reconnect is
  // refused until the client's deadline. The client must say why (the Busy reason), as when the deadline ends
  // a HELLO after a Busy; it once threw "could not connect" (seen under load in the per-address cap case).
  uint16_t port = 0;
  const int listener = loopback_listener(port);
  std::atomic<bool> answered{false};
  std::thread server([&] {
    int connection = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(listener);
    if (connection < 0) return;
    char header[4];
    if (::recv(connection, header, sizeof header, MSG_WAITALL) == 4) {
      uint32_t body = 0;
      for (int i = 0; i < 4; ++i) body |= static_cast<uint32_t>(static_cast<unsigned char>(header[i])) << (8 * i);
      std::vector<char> hello(std::min<uint32_t>(body, 4096));
      if (::recv(connection, hello.data(), hello.size(), MSG_WAITALL) == static_cast<ssize_t>(hello.size())) {
        std::string busy = frame(kBusy, field("full for this test"));
        answered = ::send(connection, busy.data(), busy.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(busy.size());
      }
    }
    ::close(connection);
  });
  auto start = Clock::now();
  try {
    connect_tcp_store("127.0.0.1", port, kToken, 500ms);
    FAIL("connected to a server that stopped listening");
  } catch (const powersgd::IoError& e) {
    CHECK(std::string(e.what()).find("had no room for this client within 500 ms: full for this test") !=
          std::string::npos);
  }
  server.join();
  CHECK(answered);
  CHECK(ms_since(start) < 3000);
}

TEST_CASE("file store: semantics, prefixes, timeout") {
  auto dir = fresh_dir("file");
  auto a = powersgd::transport::make_file_store(dir.string(), "run1", 2s);
  auto b = powersgd::transport::make_file_store(dir.string(), "run1", 2s);
  auto other = powersgd::transport::make_file_store(dir.string(), "run2", 200ms);
  a->set("k", bytes("v1"));
  CHECK(text(b->get("k")) == "v1");
  a->set("k", bytes("v2"));
  CHECK(text(b->get("k")) == "v2");
  CHECK(b->check({"k"}));
  CHECK_FALSE(other->check({"k"}));  // another run's keys are invisible
  auto start = Clock::now();
  try {
    other->get("k");
    FAIL("get returned");
  } catch (const powersgd::TimeoutError& e) {
    CHECK(std::string(e.what()).find("'k'") != std::string::npos);
    CHECK(std::string(e.what()).find("200 ms") != std::string::npos);
  }
  CHECK(ms_since(start) >= 190);
  CHECK_THROWS_AS(other->wait({"k"}, 50ms), powersgd::TimeoutError);
  CHECK_THROWS_AS(other->get_many({"k"}, 50ms), powersgd::TimeoutError);
  a->set("k2", bytes("w"));
  auto many = b->get_many({"k2", "k"}, 1s);  // the store's own get_many: a wait, then a get each
  REQUIRE(many.size() == 2);
  CHECK(text(many[0]) == "w");
  CHECK(text(many[1]) == "v2");
  // Keys with separators, dots and long keys map to distinct files.
  std::vector<std::string> keys = {"a/b", "a%2fb", "..", ".", "", std::string(300, 'x'), std::string(300, 'x') + "y",
                                   std::string(kMaxKeyBytes, '/')};
  for (size_t i = 0; i < keys.size(); ++i) a->set(keys[i], bytes(std::to_string(i)));
  for (size_t i = 0; i < keys.size(); ++i) CHECK(text(b->get(keys[i])) == std::to_string(i));
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    a->set("late", bytes("x"));
  });
  b->wait({"late", "k"});
  t.join();
  CHECK(a->remove("late"));
  CHECK_FALSE(a->remove("late"));
  std::vector<std::thread> adders;
  for (int i = 0; i < 4; ++i)
    adders.emplace_back([&] {
      auto s = powersgd::transport::make_file_store(dir.string(), "run1", 2s);
      for (int j = 0; j < 50; ++j) s->add("counter", 1);
    });
  for (auto& th : adders) th.join();
  CHECK(a->add("counter", 0) == 200);
  CHECK(text(a->get("counter")) == "200");
  {
    // A process that holds the counter's lock and stalls (stopped, in a debugger): an add waits the store's
    // timeout, not for good.
    std::vector<std::filesystem::path> locks;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir))
      if (entry.path().extension() == ".lock") locks.push_back(entry.path());
    REQUIRE(locks.size() == 1);  // the counter's
    const int held = ::open(locks[0].c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(held >= 0);
    REQUIRE(::flock(held, LOCK_EX) == 0);  // another open file description: a conflict, as another process's
    auto quick = powersgd::transport::make_file_store(dir.string(), "run1", 200ms);
    start = Clock::now();
    try {
      quick->add("counter", 1);
      FAIL("add returned while another held the lock");
    } catch (const powersgd::TimeoutError& e) {
      CHECK(std::string(e.what()).find("waiting for the lock " + locks[0].string()) != std::string::npos);
    }
    CHECK(ms_since(start) >= 190);
    CHECK(ms_since(start) < 1500);
    ::close(held);
    CHECK(quick->add("counter", 1) == 201);
  }
  CHECK_THROWS_AS(a->add("k", 1), powersgd::InvalidArgumentError);
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir))
    CHECK(entry.path().filename().string().rfind(".tmp.", 0) == std::string::npos);  // none left behind
  std::filesystem::remove_all(dir);
}

// Passes every call on to `inner`; once a wait returns, removes `victim`, as another client could between the
// wait and the gets of get_many's fallback (stores without a request of their own, servers before GET_MANY).
class RemovesAfterWait final : public powersgd::transport::Store {
 public:
  RemovesAfterWait(Store& inner, std::string victim) : inner_(inner), victim_(std::move(victim)) {}
  void set(const std::string& key, const std::vector<char>& value) override { inner_.set(key, value); }
  using Store::get;
  std::vector<char> get(const std::string& key, std::chrono::milliseconds limit) override {
    return inner_.get(key, limit);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& limit) override {
    inner_.wait(keys, limit);
    inner_.remove(victim_);
  }
  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
  bool check(const std::vector<std::string>& keys) override { return inner_.check(keys); }
  bool remove(const std::string& key) override { return inner_.remove(key); }

 private:
  Store& inner_;
  std::string victim_;
};

TEST_CASE("get_many's fallback: a key removed after its wait fails within get_many's timeout, not the store's") {
  auto dir = fresh_dir("removed");
  auto files = powersgd::transport::make_file_store(dir.string(), "run1", 10s);
  files->set("a", bytes("1"));
  files->set("b", bytes("2"));
  RemovesAfterWait store(*files, "b");
  store.set_timeout(10s);
  auto start = Clock::now();
  try {
    store.get_many({"a", "b"}, 500ms);
    FAIL("get_many returned");
  } catch (const powersgd::TimeoutError& e) {
    CHECK(std::string(e.what()).find("'b'") != std::string::npos);
  }
  CHECK(ms_since(start) < 3000);  // what was left of the 500 ms; the store's own 10 s before
  std::filesystem::remove_all(dir);
}

TEST_CASE("prefix store: namespaces keys and keeps its own timeout") {
  TcpStoreServer server(server_options());
  auto inner = client(server);
  auto one = powersgd::transport::make_prefix_store(*inner, "one");
  auto two = powersgd::transport::make_prefix_store(*inner, "two");
  one->set("k", bytes("1"));
  two->set("k", bytes("2"));
  CHECK(text(one->get("k")) == "1");
  CHECK(text(two->get("k")) == "2");
  CHECK(text(inner->get("one/k")) == "1");
  auto both = one->get_many({"k", "k"}, 1s);
  REQUIRE(both.size() == 2);
  CHECK(text(both[1]) == "1");
  CHECK(one->add("c", 3) == 3);
  CHECK_FALSE(two->check({"c"}));
  two->set_timeout(100ms);
  auto start = Clock::now();
  CHECK_THROWS_AS(two->get("c"), powersgd::TimeoutError);
  CHECK(ms_since(start) < 1500);
}

std::string get_many_frame(const std::vector<std::string>& keys, uint64_t timeout_ms) {
  std::string body;
  put_le(body, keys.size(), 4);
  for (const auto& key : keys) body += field(key);
  put_le(body, timeout_ms, 8);
  return frame(8, body);
}

// GET_MANY's reply read by hand: the values, nullopt where the reply is not Ok(u32 n, n x str).
std::optional<std::vector<std::string>> values_of(const std::optional<std::pair<uint8_t, std::string>>& reply) {
  if (!reply || reply->first != kOk || reply->second.size() < 4) return std::nullopt;
  const std::string& body = reply->second;
  std::vector<std::string> values(u32_at(body));
  size_t at = 4;
  for (auto& value : values) {
    if (body.size() < at + 4 || body.size() < at + 4 + u32_at(body, at)) return std::nullopt;
    value = body.substr(at + 4, u32_at(body, at));
    at += 4 + value.size();
  }
  if (at != body.size()) return std::nullopt;
  return values;
}

TEST_CASE("tcp store: get_many waits for every key and returns the values in the order asked, in one reply") {
  TcpStoreServer server(server_options());
  auto a = client(server);
  auto b = client(server);
  a->set("one", bytes("1"));
  a->set("empty", {});
  std::thread late([&] {
    std::this_thread::sleep_for(100ms);
    b->set("late", bytes("value set later"));
  });
  auto start = Clock::now();
  auto values = a->get_many({"late", "one", "empty", "one"}, 5s);
  late.join();
  CHECK(ms_since(start) >= 90);
  REQUIRE(values.size() == 4);
  CHECK(text(values[0]) == "value set later");
  CHECK(text(values[1]) == "1");
  CHECK(values[2].empty());
  CHECK(text(values[3]) == "1");
  CHECK(a->get_many({}, 1s).empty());

  // On the wire: the server offers GET_MANY in its HELLO's Ok, and answers one request with every value.
  RawClient raw(server.port());
  raw.send(hello_frame(kToken));
  auto hello = raw.reply();
  REQUIRE(hello);
  CHECK(hello->first == kOk);
  REQUIRE(hello->second.size() == 4);
  CHECK((static_cast<unsigned char>(hello->second[0]) & 1) == 1);
  raw.send(get_many_frame({"one", "late", "empty"}, 1000));
  auto got = values_of(raw.reply());
  REQUIRE(got);
  CHECK(*got == std::vector<std::string>{"1", "value set later", ""});
  // A large value among small ones comes whole, and the connection goes on.
  std::vector<char> large(300000);
  for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<char>(i * 13);
  a->set("large", large);
  values = b->get_many({"one", "large", "one"}, 1s);
  REQUIRE(values.size() == 3);
  CHECK(values[1] == large);
  CHECK(text(values[2]) == "1");
}

// A rendezvous's reads: every rank asks for every other rank's addresses at once, and the last rank's set answers
// them all in one go. Each reply carried its own copy of every value under 64 KiB, counted against the server's
// budget once per reply: 400 ranks of 54 KB values passed the default 1 GiB, and the server reset the ranks'
// connections. Shared, each value counts once.
TEST_CASE("tcp store: get_many replies share the values: many readers of the same values fit the server's budget") {
  constexpr int kReaders = 12;
  constexpr int kKeys = 24;
  constexpr size_t kValueBytes = 40000;  // under the 64 KiB that were copied: 0.96 MB a reply, 11.5 MB for all
  auto o = server_options();
  o.max_queued_bytes = 2u << 20;
  TcpStoreServer server(o);
  auto store = client(server);
  std::vector<std::string> keys;
  std::vector<std::string> expected;
  for (int k = 0; k < kKeys; ++k) {
    keys.push_back("rank" + std::to_string(k));
    expected.emplace_back(kValueBytes, static_cast<char>('a' + k % 26));
    if (k + 1 < kKeys) store->set(keys.back(), bytes(expected.back()));
  }
  std::vector<std::unique_ptr<RawClient>> readers;
  for (int i = 0; i < kReaders; ++i) {
    readers.push_back(std::make_unique<RawClient>(server.port()));
    readers.back()->send(hello_frame(kToken));
    auto hello = readers.back()->reply();
    REQUIRE(hello);
    REQUIRE(hello->first == kOk);
    readers.back()->send(get_many_frame(keys, 10000));
  }
  // Every reader waits for the last key (the reply to a check after them comes once the server has read theirs).
  CHECK_FALSE(store->check({"nothing"}));
  std::this_thread::sleep_for(100ms);
  store->set(keys.back(), bytes(expected.back()));  // answers every reader at once
  for (auto& reader : readers) {
    auto got = values_of(reader->reply(10s));
    REQUIRE(got);  // not reset for the budget
    CHECK(*got == expected);
  }
  for (auto deadline = Clock::now() + 2s; server.queued_reply_bytes() != 0 && Clock::now() < deadline;)
    std::this_thread::sleep_for(10ms);
  CHECK(server.queued_reply_bytes() == 0);
}

TEST_CASE("tcp store: get_many times out naming the keys and the missing ones; values over a frame are refused") {
  TcpStoreServer server(server_options());
  auto store = client(server, 60s);
  store->set("here", bytes("x"));
  auto start = Clock::now();
  try {
    store->get_many({"here", "never-set", "nor-this"}, 200ms);
    FAIL("get_many returned");
  } catch (const powersgd::TimeoutError& e) {
    const std::string what = e.what();
    MESSAGE(what);
    CHECK(what.find("'here', 'never-set', 'nor-this'") != std::string::npos);
    CHECK(what.find("200 ms") != std::string::npos);
    CHECK(what.find("missing 'never-set', 'nor-this'") != std::string::npos);
  }
  CHECK(ms_since(start) >= 190);
  CHECK(ms_since(start) < 1500);
  CHECK(text(store->get_many({"here"}, 100ms)[0]) == "x");  // the connection stays usable

  // Two values of 40 MiB make a reply over the largest frame: an error naming the limit, nothing queued, and the
  // connection stays usable.
  store->set("half-a", std::vector<char>(40u << 20, 'a'));
  store->set("half-b", std::vector<char>(40u << 20, 'b'));
  try {
    store->get_many({"half-a", "half-b"}, 1s);
    FAIL("get_many returned");
  } catch (const powersgd::InvalidArgumentError& e) {
    const std::string what = e.what();
    MESSAGE(what);
    CHECK(what.find("'half-a', 'half-b'") != std::string::npos);
    CHECK(what.find("the limit is") != std::string::npos);
  }
  for (auto deadline = Clock::now() + 2s; server.queued_reply_bytes() != 0 && Clock::now() < deadline;)
    std::this_thread::sleep_for(10ms);  // the Error's own bytes, until the server saw them written
  CHECK(server.queued_reply_bytes() == 0);
  auto halves = store->get_many({"half-a", "here"}, 30s);  // present: the limit bounds 40 MiB's transfer
  CHECK(halves[0] == std::vector<char>(40u << 20, 'a'));
  CHECK(text(halves[1]) == "x");
  check_server_serves(server);
}

// A server of a build before GET_MANY, played by hand: its HELLO's Ok carries nothing, it answers WAIT with Ok
// and GET with the key's value, and any other request with an Error (as that build closes the connection on a
// request type it does not know). It serves one connection and records the request types it got.
class ServerBeforeGetMany {
 public:
  explicit ServerBeforeGetMany(std::map<std::string, std::string> values)
      : values_(std::move(values)), listener_(loopback_listener(port)) {
    thread_ = std::thread([this] { serve(); });
  }
  ~ServerBeforeGetMany() {
    thread_.join();  // ends when its client closes, or after 5 s without a request
    ::close(listener_);
  }
  std::vector<uint8_t> requests() {
    std::lock_guard lock(mutex_);
    return requests_;
  }

  uint16_t port = 0;

 private:
  void serve() {
    pollfd ready{listener_, POLLIN, 0};
    if (::poll(&ready, 1, 5000) != 1) return;
    const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    for (;;) {
      const auto header = read_exactly(fd, 4, 5s);
      if (!header || u32_at(*header) == 0 || u32_at(*header) > (1u << 20)) break;
      const auto received = read_exactly(fd, u32_at(*header), 5s);
      if (!received) break;
      const std::string& body = *received;
      const auto type = static_cast<uint8_t>(body[0]);
      {
        std::lock_guard lock(mutex_);
        requests_.push_back(type);
      }
      std::string reply = frame(kError, field("unknown request type"));
      if (type == 1 || type == 4) reply = frame(kOk, "");
      if (type == 3 && body.size() >= 5) {
        const std::string key = body.substr(5, u32_at(body, 1));
        reply = values_.count(key) ? frame(kOk, field(values_.at(key))) : frame(kError, field("no such key"));
      }
      if (::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(reply.size())) break;
    }
    ::close(fd);
  }

  std::map<std::string, std::string> values_;
  int listener_ = -1;
  std::mutex mutex_;
  std::vector<uint8_t> requests_;
  std::thread thread_;  // last: started once the members it reads are
};

TEST_CASE("tcp store: get_many with a server that does not offer it waits, then gets each key") {
  ServerBeforeGetMany older({{"a", "1"}, {"b", "two"}});
  {
    auto store = connect_tcp_store("127.0.0.1", older.port, kToken, 5s);
    auto values = store->get_many({"b", "a"}, 1s);
    REQUIRE(values.size() == 2);
    CHECK(text(values[0]) == "two");
    CHECK(text(values[1]) == "1");
  }
  // HELLO, WAIT, GET, GET: no request that server would not know.
  CHECK(older.requests() == std::vector<uint8_t>{1, 4, 3, 3});
}

TEST_CASE("gloo connectFullMesh and allreduce over the TCP store") {
  TcpStoreServer server(server_options());
  for (int world : {2, 3}) {
    CAPTURE(world);
    std::vector<std::thread> ranks;
    std::mutex errors_mutex;
    std::vector<std::string> errors;  // one line per failed rank, reported from the test thread
    std::latch all_done(world);
    for (int rank = 0; rank < world; ++rank)
      ranks.emplace_back([&, rank] {
        std::string error;
        const char* stage = "rendezvous";
        std::shared_ptr<gloo::rendezvous::Context> context;  // outlives the try: see all_done below
        try {
          auto store = client(server, 10s);
          auto prefixed = powersgd::transport::make_prefix_store(*store, "mesh" + std::to_string(world));
          gloo::transport::tcp::attr attr;
          attr.hostname = "127.0.0.1";
          auto device = gloo::transport::tcp::CreateDevice(attr);
          context = std::make_shared<gloo::rendezvous::Context>(rank, world);
          context->setTimeout(10s);
          context->connectFullMesh(*prefixed, device);
          stage = "allreduce";
          std::vector<float> data(1000);
          for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(rank + 1) * static_cast<float>(i);
          gloo::AllreduceRing<float>(context, {data.data()}, static_cast<int>(data.size())).run();
          float sum_ranks = static_cast<float>(world * (world + 1) / 2);
          for (size_t i = 0; i < data.size() && error.empty(); ++i)
            if (data[i] != sum_ranks * static_cast<float>(i))
              error = "wrong sum at " + std::to_string(i) + ": " + std::to_string(data[i]);
        } catch (const std::exception& e) {
          error = std::string(stage) + ": " + e.what();
        }
        // A rank that returns destroys its context and closes its pairs. Gloo
        // fails a pair that reads EOF with "Connection closed by peer" even when
        // the peer's last bytes were already delivered, so a rank that finished
        // the ring early would fail a peer still inside run(): every rank keeps
        // its context until all are done (as a real job's last barrier does).
        all_done.arrive_and_wait();
        if (!error.empty()) {
          std::lock_guard lock(errors_mutex);
          errors.push_back("rank " + std::to_string(rank) + ": " + error);
        }
      });
    for (auto& t : ranks) t.join();
    for (const auto& e : errors) MESSAGE(e);
    CHECK(errors.empty());
  }
}

// ---- defences against hostile clients (docs/reliability.md, "Rendezvous store: threat model") ----

namespace {

// A raw connection from a chosen loopback source address (127.0.0.x), so that
// tests can play clients from several peer addresses.
int connect_from(const char* source, uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  REQUIRE(::inet_pton(AF_INET, source, &local.sin_addr) == 1);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) == 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  return fd;
}

// True when the peer closed fd within the timeout.
bool fd_closed_by_peer(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
  char buf[64];
  return ::recv(fd, buf, sizeof buf, MSG_DONTWAIT) <= 0;
}

size_t count_lines_with(const std::string& log, const std::string& what) {
  size_t n = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);)
    if (line.find(what) != std::string::npos) ++n;
  return n;
}

}  // namespace

TEST_CASE("tcp store: unauthenticated connections are capped per source and overall; the oldest is closed") {
  auto o = server_options();
  o.auth_timeout = 10s;  // only the caps close connections here
  // Every loopback address is one source: the per-source cap is reached from
  // two of them; the overall cap, set below it, from three.
  bool per_source = false;
  SUBCASE("per source") {
    per_source = true;
    o.max_unauthenticated_per_address = 3;
    o.max_unauthenticated = 5;
  }
  SUBCASE("overall") {
    o.max_unauthenticated_per_address = 10;
    o.max_unauthenticated = 3;
  }
  TcpStoreServer server(o);
  std::vector<int> a;
  for (const char* from : {"127.0.0.1", "127.0.0.2", "127.0.0.1"}) a.push_back(connect_from(from, server.port()));
  for (int fd : a) CHECK_FALSE(fd_closed_by_peer(fd, 100ms));
  // A fourth pushes out the oldest.
  a.push_back(connect_from(per_source ? "127.0.0.2" : "127.0.0.3", server.port()));
  CHECK(fd_closed_by_peer(a[0], 2s));
  for (size_t i = 1; i < a.size(); ++i) CHECK_FALSE(fd_closed_by_peer(a[i], 100ms));
  CHECK(server.shed_connections() == 1);
  // Authenticated clients do not count against the caps.
  std::vector<std::unique_ptr<Store>> clients;
  for (int i = 0; i < 6; ++i) clients.push_back(client(server));
  for (auto& c : clients) c->set("k", bytes("v"));
  for (int fd : a) ::close(fd);
  check_server_serves(server);
}

TEST_CASE("tcp store: authenticated connections are capped per address; the excess is refused, others served") {
  auto o = server_options();
  o.max_authenticated_per_address = 3;
  TcpStoreServer server(o);
  std::vector<std::unique_ptr<Store>> clients;
  for (int i = 0; i < 3; ++i) {
    clients.push_back(client(server));
    clients.back()->check({"in use"});  // a request: no newcomer may push it out
  }
  // A fourth authenticated client from the same address is refused with the
  // reason (Busy: it retries until its timeout); the three already in keep working.
  try {
    client(server, 2000ms);  // long enough for a loaded sanitizer build to answer HELLO at all
    FAIL("a fourth authenticated connection from 127.0.0.1 was admitted");
  } catch (const powersgd::IoError& e) {
    std::string what = e.what();
    CHECK(what.find("had no room for this client within 2000 ms") != std::string::npos);
    CHECK(what.find("3 authenticated connections from loopback") != std::string::npos);
    CHECK(what.find("max_authenticated_per_address") != std::string::npos);
  }
  CHECK(server.refused_clients() >= 1);
  uint64_t refused_before_flood = server.refused_clients();
  // A raw flood from the same address: each HELLO is refused and the
  // connection closed, so the server holds no more than the cap.
  std::vector<std::unique_ptr<RawClient>> flood;
  for (int i = 0; i < 20; ++i) {
    flood.push_back(std::make_unique<RawClient>(server.port()));
    flood.back()->send(hello_frame(kToken));
  }
  for (auto& f : flood) {
    auto r = f->reply();
    REQUIRE(r.has_value());
    CHECK(r->first == kBusy);
    CHECK(f->closed_by_server(2s));
  }
  // The refused fourth client's last HELLO may have been answered after its deadline cut the wait (it retries
  // on Busy until then), so the count may hold it too.
  const uint64_t refused_in_flood = server.refused_clients() - refused_before_flood;
  CHECK((refused_in_flood == 20 || refused_in_flood == 21));
  for (size_t i = 0; i < clients.size(); ++i) {
    clients[i]->set("k" + std::to_string(i), bytes("v"));
    CHECK(text(clients[i]->get("k" + std::to_string(i))) == "v");
  }
  // Another loopback address is the same source (any local process may use
  // any of them).
  int other = connect_from("127.0.0.2", server.port());
  std::string hello = hello_frame(kToken);
  REQUIRE(::send(other, hello.data(), hello.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(hello.size()));
  pollfd p{other, POLLIN, 0};
  REQUIRE(::poll(&p, 1, 2000) == 1);
  char reply[5];
  REQUIRE(::recv(other, reply, sizeof reply, MSG_WAITALL) == 5);
  CHECK(static_cast<uint8_t>(reply[4]) == kBusy);
  ::close(other);
  // A closed connection frees its place (the server notices the close
  // asynchronously: retry briefly).
  clients.pop_back();
  std::unique_ptr<Store> again;
  for (auto start = Clock::now(); again == nullptr && ms_since(start) < 2000;) {
    try {
      again = client(server);
    } catch (const powersgd::IoError&) {
      std::this_thread::sleep_for(10ms);
    }
  }
  REQUIRE(again != nullptr);
  again->set("again", bytes("yes"));
  CHECK(text(clients[0]->get("again")) == "yes");
}

TEST_CASE("tcp store: silent connections are closed after auth_timeout, logged once per cause") {
  auto o = server_options();
  o.auth_timeout = 200ms;
  auto server = std::make_unique<TcpStoreServer>(o);
  StderrCapture capture;
  auto start = Clock::now();
  std::vector<std::unique_ptr<RawClient>> silent;
  for (int i = 0; i < 40; ++i) silent.push_back(std::make_unique<RawClient>(server->port()));
  for (auto& s : silent) CHECK(s->closed_by_server(2s));
  auto elapsed = ms_since(start);
  check_server_serves(*server);
  server.reset();  // the summary of suppressed lines is written at stop
  std::string log = capture.finish();
  CHECK(elapsed >= 150);
  CHECK(elapsed < 1500);
  CHECK(count_lines_with(log, "did not authenticate within 200 ms") == 1);
  CHECK(count_lines_with(log, "39 more event(s) of kind 'authentication deadline'") == 1);
}

TEST_CASE("tcp store: out of file descriptors, accept backs off without spinning and clients are served") {
  // The server runs in a child process with a low descriptor limit; this
  // process plays the clients. The parent has no other threads at fork.
  int ready[2], quit[2];
  REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(quit, O_CLOEXEC) == 0);
  auto log_path = std::filesystem::temp_directory_path() / ("psgd_store_emfile_" + std::to_string(::getpid()));
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    ::close(quit[1]);
    int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (log_fd < 0 || ::dup2(log_fd, 2) != 2) ::_exit(2);
    uint16_t port = 0;
    try {
      TcpStoreServer server(server_options());
      // New descriptors take the lowest free numbers below the limit: leave 12 free.
      std::set<int> open;
      for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd"))
        open.insert(std::atoi(entry.path().filename().c_str()));
      int limit_fd = 0;
      for (int free_below = 0; free_below < 12; ++limit_fd)
        if (!open.count(limit_fd)) ++free_below;
      rlimit limit{};
      ::getrlimit(RLIMIT_NOFILE, &limit);
      limit.rlim_cur = static_cast<rlim_t>(limit_fd);
      if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(3);
      port = server.port();
      if (::write(ready[1], &port, sizeof port) != sizeof port) ::_exit(4);
      char c;
      [[maybe_unused]] auto ignored = ::read(quit[0], &c, 1);  // until the parent closes its end
    } catch (...) {
      ::_exit(5);
    }
    std::fflush(stderr);
    ::_exit(0);
  }
  struct KillOnFailure {
    pid_t pid;
    ~KillOnFailure() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  } guard{child};
  ::close(ready[1]);
  ::close(quit[0]);
  uint16_t port = 0;
  REQUIRE(::read(ready[0], &port, sizeof port) == sizeof port);
  ::close(ready[0]);
  auto good = connect_tcp_store("127.0.0.1", port, kToken, 5s);
  // Authenticated connections until the server has no descriptor left for the
  // next one: that one sits in the backlog without a reply.
  std::vector<std::unique_ptr<RawClient>> held;
  std::unique_ptr<RawClient> stuck;
  for (int i = 0; i < 40 && !stuck; ++i) {
    auto raw = std::make_unique<RawClient>(port);
    raw->send(hello_frame(kToken));
    auto r = raw->reply(300ms);
    if (r) {
      REQUIRE(r->first == kOk);
      held.push_back(std::move(raw));
    } else {
      stuck = std::move(raw);
    }
  }
  REQUIRE(stuck);
  CHECK(held.size() >= 8);
  // For a second the server keeps failing accept: it must not spin, must
  // serve the connected client, and must log that once.
  auto cpu_ticks = [&] {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    std::istringstream fields(all.substr(all.rfind(')') + 2));
    std::string skip;
    for (int i = 0; i < 11; ++i) fields >> skip;  // state .. cmajflt
    long utime = 0, stime = 0;
    fields >> utime >> stime;
    return utime + stime;
  };
  long before = cpu_ticks();
  auto start = Clock::now();
  while (ms_since(start) < 1000) {
    good->set("k", bytes("v"));
    CHECK(text(good->get("k")) == "v");
    std::this_thread::sleep_for(50ms);
  }
  long used = cpu_ticks() - before;  // clock ticks (1/100 s)
  CHECK(used < 30);                  // well under the 100 a spinning thread would use
  // Descriptors freed: the stuck client is accepted after the back-off.
  held.resize(held.size() - 4);
  auto r = stuck->reply(3s);
  REQUIRE(r);
  CHECK(r->first == kOk);
  ::close(quit[1]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  guard.pid = 0;
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  std::ifstream in(log_path);
  std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(log_path);
  CHECK(count_lines_with(log, "accept failed: Too many open files") == 1);
}

TEST_CASE("tcp store: a frame header declaring 64 MiB allocates as the body arrives") {
  TcpStoreServer server(server_options());
  auto rss_bytes = [] {
    std::ifstream statm("/proc/self/statm");
    long size = 0, resident = 0;
    statm >> size >> resident;
    return resident * ::sysconf(_SC_PAGESIZE);
  };
  long before = rss_bytes();
  std::vector<std::unique_ptr<RawClient>> raws;
  for (int i = 0; i < 6; ++i) {
    auto raw = std::make_unique<RawClient>(server.port());
    raw->send(hello_frame(kToken));
    REQUIRE(raw->reply()->first == kOk);
    std::string header;
    put_le(header, kMaxValueBytes, 4);  // a SET of 64 MiB is announced; 5 bytes follow
    raw->send(header + std::string("\x02\x01\x00\x00\x00", 5));
    raws.push_back(std::move(raw));
  }
  check_server_serves(server);
  std::this_thread::sleep_for(200ms);
  long grown = rss_bytes() - before;
  CAPTURE(grown);
  CHECK(grown < (64l << 20));  // not 6 x 64 MiB
  // A large frame that does arrive is still read whole.
  auto store = client(server, 20s);
  std::vector<char> big(20 << 20, 'b');
  store->set("big", big);
  CHECK(store->get("big") == big);
}

TEST_CASE("tcp store: quotas on keys and bytes fail with an error naming the quota; the connection stays usable") {
  auto o = server_options();
  o.max_keys = 3;
  o.max_bytes = 100;
  TcpStoreServer server(o);
  auto store = client(server);
  store->set("a", bytes("1"));
  store->set("b", bytes("2"));
  CHECK(store->add("c", 1) == 1);
  auto expect_quota = [&](auto&& call, const char* quota) {
    try {
      call();
      FAIL("no quota error");
    } catch (const powersgd::InvalidArgumentError& e) {
      std::string what = e.what();
      CHECK(what.find("store quota exceeded") != std::string::npos);
      CHECK(what.find(quota) != std::string::npos);
    }
  };
  expect_quota([&] { store->set("d", bytes("4")); }, "max_keys");
  expect_quota([&] { store->add("d", 1); }, "max_keys");
  CHECK_FALSE(store->check({"d"}));
  store->set("a", bytes("overwrite"));  // overwriting adds no key
  expect_quota([&] { store->set("a", std::vector<char>(100, 'x')); }, "max_bytes");
  CHECK(text(store->get("a")) == "overwrite");  // the refused set changed nothing
  CHECK(store->remove("b"));
  store->set("d", std::vector<char>(80, 'y'));  // the removed key's room is free again
  CHECK(store->get("d").size() == 80);
  CHECK(store->add("c", 1) == 2);
}

TEST_CASE("tcp store: a protocol error while a reply is being written still reaches the client, in order") {
  TcpStoreServer server(server_options());
  auto setter = client(server, 20s);
  RawClient raw(server.port());
  raw.send(hello_frame(kToken));
  REQUIRE(raw.reply()->first == kOk);
  std::string get = field("big");
  put_le(get, 60000, 8);
  raw.send(frame(3, get));
  std::this_thread::sleep_for(50ms);
  // The answer (16 MiB) cannot be written at once while raw does not read.
  const size_t kBig = 16u << 20;
  setter->set("big", std::vector<char>(kBig, 'z'));
  raw.send(std::string("\0\0\0\0", 4));  // an invalid header while the reply is in flight
  std::this_thread::sleep_for(50ms);
  auto header = raw.read(5, 5s);
  REQUIRE(header);
  const uint32_t length = u32_at(*header);
  CHECK(static_cast<uint8_t>((*header)[4]) == kOk);
  CHECK(length == 1 + 4 + kBig);
  REQUIRE(raw.read(length - 1, 10s));
  auto error = raw.reply(5s);
  REQUIRE(error);
  CHECK(error->first == kError);
  CHECK(error->second.find("frame length 0") != std::string::npos);
  CHECK(raw.closed_by_server(2s));
  check_server_serves(server);
}

TEST_CASE("tcp store: the idle timeout spares clients waiting in get/wait and closes idle ones") {
  auto o = server_options();
  o.client_idle_timeout = 300ms;
  TcpStoreServer server(o);
  auto waiter = client(server);
  std::thread t([&] {
    std::this_thread::sleep_for(700ms);
    client(server)->set("late", bytes("v"));
    std::this_thread::sleep_for(200ms);
    client(server)->set("later", bytes("w"));
  });
  CHECK(text(waiter->get("late")) == "v");
  waiter->wait({"later"});
  t.join();
  std::this_thread::sleep_for(800ms);  // idle past the timeout: closed
  CHECK_THROWS_AS(waiter->get("late"), powersgd::IoError);
}

TEST_CASE("tcp store: no socket of the server or client is inherited by an exec'd child") {
  TcpStoreServer server(server_options());
  auto store = client(server);
  store->set("k", bytes("v"));
  int out[2];
  REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::dup2(out[1], 1);  // dup2 clears close-on-exec on the copy
    ::execl("/bin/ls", "ls", "-l", "/proc/self/fd/", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  std::string listing;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) listing.append(buf, static_cast<size_t>(n));
  ::close(out[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WEXITSTATUS(status) == 0);
  CAPTURE(listing);
  CHECK(listing.find("pipe:") != std::string::npos);  // the listing itself worked
  CHECK(listing.find("socket:") == std::string::npos);
}

namespace {

// Hostile connections: `count` of them kept open from a few loopback source
// addresses, each reopened as soon as the server closes it. A third stay
// silent, a third send half a length prefix, a third a HELLO with a wrong token.
class Flood {
 public:
  Flood(uint16_t port, size_t count) : port_(port), count_(count) {
    thread_ = std::thread([this] { run(); });
  }
  ~Flood() {
    stop_ = true;
    thread_.join();
  }
  uint64_t connections() const { return connections_.load(); }

 private:
  int open_one(size_t i) {
    static const char* kSources[] = {"127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"};
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    sockaddr_in local{};
    local.sin_family = AF_INET;
    ::inet_pton(AF_INET, kSources[i % 4], &local.sin_addr);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port_);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    // The port is picked at connect, per destination: bind() alone would need
    // a port free of every TIME_WAIT left by earlier runs.
    int one = 1;
    ::setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0 ||
        (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS)) {
      ::close(fd);
      return -1;
    }
    connections_++;
    return fd;
  }

  void run() {
    std::vector<pollfd> fds(count_, pollfd{-1, 0, 0});
    std::vector<bool> sent(count_, false);
    std::string half_header("\x10\x00", 2);
    std::string wrong = hello_frame("not-the-token");
    while (!stop_) {
      for (size_t i = 0; i < count_; ++i)
        if (fds[i].fd < 0) {
          fds[i] = pollfd{open_one(i), POLLIN | POLLOUT, 0};
          sent[i] = false;
        }
      if (::poll(fds.data(), fds.size(), 10) < 0) continue;
      for (size_t i = 0; i < count_; ++i) {
        if (fds[i].fd < 0) continue;
        if ((fds[i].revents & POLLOUT) && !sent[i]) {
          sent[i] = true;
          fds[i].events = POLLIN;
          if (i % 3 == 1) ::send(fds[i].fd, half_header.data(), half_header.size(), MSG_NOSIGNAL);
          if (i % 3 == 2) ::send(fds[i].fd, wrong.data(), wrong.size(), MSG_NOSIGNAL);
        }
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
          char buf[256];
          if (::recv(fds[i].fd, buf, sizeof buf, 0) <= 0 || (fds[i].revents & (POLLHUP | POLLERR))) {
            ::close(fds[i].fd);
            fds[i].fd = -1;
          }
        }
      }
    }
    for (auto& p : fds)
      if (p.fd >= 0) ::close(p.fd);
  }

  uint16_t port_;
  size_t count_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> connections_{0};
  std::thread thread_;
};

// What a 4-rank job does at rendezvous (Communicator::connect and Gloo's
// connectFullMesh): each rank connects, joins a counter, publishes an address
// and reads every other rank's. Returns the time until the last rank is done.
long long rendezvous_ms(uint16_t port, const std::string& run, const std::string& token = kToken) {
  constexpr int kRanks = 4;
  std::atomic<int> done{0};
  std::vector<std::thread> ranks;
  auto start = Clock::now();
  for (int r = 0; r < kRanks; ++r)
    ranks.emplace_back([&, r] {
      try {
        auto store = connect_tcp_store("127.0.0.1", port, token, 10s);
        store->add(run + "/joined", 1);
        store->set(run + "/addr/" + std::to_string(r), std::vector<char>(64, static_cast<char>('a' + r)));
        for (int peer = 0; peer < kRanks; ++peer)
          if (store->get(run + "/addr/" + std::to_string(peer)).size() != 64) return;
        done++;
      } catch (const std::exception& e) {
        MESSAGE("rank " << r << ": " << std::string(e.what()));
      }
    });
  for (auto& t : ranks) t.join();
  REQUIRE(done == kRanks);
  return ms_since(start);
}

}  // namespace

// The measured goal of docs/reliability.md: 1,000 hostile connections, open and
// reconnecting, delay a 4-rank rendezvous by less than 1 s (median of 5). bench/store_flood.sh
// runs this case and prints its figures.
TEST_CASE("tcp store: a 4-rank rendezvous under a flood of 1000 hostile connections") {
  size_t hostile = 1000;
  if (const char* n = std::getenv("PSGD_STORE_FLOOD_CONNECTIONS")) hostile = std::strtoul(n, nullptr, 10);
  rlimit limit{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &limit) == 0);
  if (limit.rlim_cur < hostile + 512) {
    limit.rlim_cur = std::min<rlim_t>(limit.rlim_max, hostile + 512);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &limit) == 0);
  }
  TcpStoreServer server(server_options());
  // Medians of 5: on a shared machine a single rendezvous can lose the CPU for
  // a while, with or without the flood.
  constexpr int kRuns = 5;
  auto measure = [&](const std::string& name) {
    std::vector<long long> ms;
    for (int i = 0; i < kRuns; ++i) ms.push_back(rendezvous_ms(server.port(), name + std::to_string(i)));
    std::sort(ms.begin(), ms.end());
    return ms;
  };
  auto undisturbed = measure("quiet");
  std::vector<long long> flooded;
  uint64_t opened = 0;
  {
    Flood flood(server.port(), hostile);
    std::this_thread::sleep_for(500ms);  // the flood is at full strength
    flooded = measure("flood");
    opened = flood.connections();
  }
  std::printf("store flood: 4-rank rendezvous median %lld ms (worst %lld) undisturbed, median %lld ms (worst %lld) "
              "under %zu hostile connections; %llu opened in all, %llu shed by the caps, %llu refused\n",
              undisturbed[kRuns / 2], undisturbed.back(), flooded[kRuns / 2], flooded.back(), hostile,
              static_cast<unsigned long long>(opened), static_cast<unsigned long long>(server.shed_connections()),
              static_cast<unsigned long long>(server.refused_clients()));
  CHECK(opened >= hostile);
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer makes the server's work per hostile connection about ten
  // times dearer (median about 800 ms seen on 2 shared cores): the goal is
  // asserted by the uninstrumented build; this one checks the flood is survived.
  constexpr long long kAllowedDelayMs = 5000;
#else
  constexpr long long kAllowedDelayMs = 1000;
#endif
  CHECK(flooded[kRuns / 2] < undisturbed[kRuns / 2] + kAllowedDelayMs);
}

// Issue 32, item 2: a store without a token, one local process holding every
// authenticated connection it can get from four loopback addresses, and a
// descriptor limit of 256. Before: the flood took every descriptor (accept
// failed with EMFILE) and the ranks timed out connecting.
TEST_CASE("tcp store: a flood of idle authenticated connections from loopback refuses the flood, not the ranks") {
  // The flood runs in a child forked before the server's thread exists; it
  // reports how its HELLOs were answered.
  int go[2], report[2];
  REQUIRE(::pipe2(go, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(report, O_CLOEXEC) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(go[1]);
    ::close(report[0]);
    rlimit mine{};
    ::getrlimit(RLIMIT_NOFILE, &mine);
    mine.rlim_cur = std::min<rlim_t>(mine.rlim_max, 4096);
    ::setrlimit(RLIMIT_NOFILE, &mine);
    uint16_t port = 0;
    if (::read(go[0], &port, sizeof port) != sizeof port) ::_exit(2);
    std::string hello = hello_frame("");
    uint32_t counts[3] = {};  // admitted, refused or closed, no answer within 1 s
    std::vector<int> held;
    const char* sources[] = {"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"};
    for (int i = 0; i < 1000 && counts[1] < 20 && counts[2] < 3; ++i) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in local{}, addr{};
      local.sin_family = addr.sin_family = AF_INET;
      ::inet_pton(AF_INET, sources[i % 4], &local.sin_addr);
      addr.sin_port = htons(port);
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0 ||
          ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
        ::_exit(3);
      if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
        ++counts[1];
        ::close(fd);
        continue;
      }
      pollfd p{fd, POLLIN, 0};
      char reply[5];
      if (::poll(&p, 1, 1000) != 1) {
        ++counts[2];
        held.push_back(fd);
      } else if (::recv(fd, reply, sizeof reply, MSG_WAITALL) == 5 && static_cast<uint8_t>(reply[4]) == kOk) {
        ++counts[0];
        held.push_back(fd);
      } else {
        ++counts[1];
        ::close(fd);
      }
    }
    if (::write(report[1], counts, sizeof counts) != sizeof counts) ::_exit(4);
    char c;
    [[maybe_unused]] auto ignored = ::read(go[0], &c, 1);  // holds its connections until the parent is done
    ::_exit(0);
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{child};
  ::close(go[0]);
  ::close(report[1]);
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  struct Restore {
    rlimit limit;
    ~Restore() { ::setrlimit(RLIMIT_NOFILE, &limit); }
  } restore{saved};
  rlimit low = saved;
  low.rlim_cur = 256;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  TcpStoreServerOptions o;  // no token
  o.auth_timeout = 300ms;
  TcpStoreServer server(o);
  CHECK(server.connection_budget() < 256);
  uint16_t port = server.port();
  REQUIRE(::write(go[1], &port, sizeof port) == sizeof port);
  uint32_t counts[3] = {};
  REQUIRE(::read(report[0], counts, sizeof counts) == sizeof counts);
  MESSAGE("flood: " << counts[0] << " admitted, " << counts[1] << " refused, " << counts[2]
                    << " unanswered; descriptor budget " << server.connection_budget());
  CHECK(counts[1] >= 20);  // the flood was refused,
  CHECK(counts[2] == 0);   // never left hanging
  // The ranks, well after the flood's connections were admitted, each push
  // out one that never sent a request, and rendezvous within their timeout.
  auto start = Clock::now();
  rendezvous_ms(port, "ranks", "");
  CHECK(ms_since(start) < 10000);
  CHECK(server.shed_connections() >= 4);
}

namespace {
// Resident set of this process, in MiB.
long resident_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE) / (1 << 20);
}

std::string get_frame(const std::string& key, uint64_t timeout_ms) {
  std::string body = field(key);
  put_le(body, timeout_ms, 8);
  return frame(3, body);
}
}  // namespace

// Issue 32, item 3: one 64 MiB value and connections that GET it and never
// read. Before: every reply was a copy (8 such connections: about 512 MiB more
// resident) and stayed for as long as the connections did.
TEST_CASE("tcp store: replies share the stored value, are bounded in bytes and closed when not read") {
  // frame_timeout: the write deadline, and the deadline for reading a frame. Both sides are sized for 64 MiB
  // frames under ThreadSanitizer on a loaded 2-core machine (2 s and the client's usual 5 s failed there).
  auto o = server_options(10s);
  o.max_queued_bytes = 100u << 20;
  TcpStoreServer server(o);
  auto store = client(server, 60s);
  store->set("big", std::vector<char>(kMaxValueBytes, 'x'));
  store->set("other", std::vector<char>(kMaxValueBytes, 'y'));
  CHECK(store->get("big").size() == kMaxValueBytes);
  long before = resident_mib();
  std::vector<std::unique_ptr<RawClient>> readers;  // that never read
  for (int i = 0; i < 8; ++i) {
    readers.push_back(std::make_unique<RawClient>(server.port()));
    readers.back()->send(hello_frame(kToken));
    auto r = readers.back()->reply();
    REQUIRE(r);
    REQUIRE(r->first == kOk);
    readers.back()->send(get_frame("big", 1000));
  }
  // Every reply queued (the Ok reply to a CHECK after them comes once the
  // server has handled theirs), sharing one value.
  CHECK_FALSE(store->check({"nothing"}));
  std::this_thread::sleep_for(100ms);
  long grown = resident_mib() - before;
  MESSAGE("8 unread 64 MiB replies: resident +" << grown << " MiB, " << (server.queued_reply_bytes() >> 20)
                                                << " MiB queued");
  CHECK(grown < 128);
  CHECK(server.queued_reply_bytes() >= kMaxValueBytes);
  CHECK(server.queued_reply_bytes() < kMaxValueBytes + (1u << 20));
  // Another value would make 128 MiB queued, over the 100 MiB budget: the
  // connection asking for it is closed.
  RawClient over(server.port());
  over.send(hello_frame(kToken));
  REQUIRE(over.reply()->first == kOk);
  over.send(get_frame("other", 1000));
  CHECK(over.reset_by_server(1s));
  // The readers that never read are closed after frame_timeout, and the
  // bytes they held are freed.
  auto start = Clock::now();
  for (auto& r : readers) CHECK(r->reset_by_server(15s));
  CHECK(ms_since(start) < 15000);
  for (auto deadline = Clock::now() + 2s; server.queued_reply_bytes() != 0 && Clock::now() < deadline;)
    std::this_thread::sleep_for(10ms);
  CHECK(server.queued_reply_bytes() == 0);
  // A reader that reads gets the whole value.
  CHECK(store->get("other") == std::vector<char>(kMaxValueBytes, 'y'));
  check_server_serves(server);
}

TEST_CASE("job key prefix: derived from the token, same on every rank, reveals nothing of it") {
  using powersgd::transport::job_key_prefix;
  CHECK(job_key_prefix("").empty());
  std::string p = job_key_prefix(kToken);
  CHECK(p == job_key_prefix(kToken));
  CHECK(p.size() == 4 + 32);
  CHECK(p.rfind("job-", 0) == 0);
  CHECK(p.find(kToken) == std::string::npos);
  CHECK(p != job_key_prefix(kToken + "x"));
  // First 128 bits of SHA-1("powersgd store key prefix v1:abc") (python3 hashlib):
  // a change of the derivation, which would split mixed-version jobs, shows.
  CHECK(job_key_prefix("abc") == "job-3fd3dff95c1b3fd9428554f5657859bf");
}

TEST_CASE("rank 0's store binds the loopback MASTER_ADDR only, and keys carry the job prefix") {
  uint16_t port = 0;
  {
    TcpStoreServer probe(server_options());
    port = probe.port();
  }
  powersgd::CommOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.store_addr = "127.0.0.2";
  o.store_port = port;
  o.host_store = true;
  o.token = kToken;
  o.timeout = 10s;
  o.address = "127.0.0.2";
  auto comm = powersgd::transport::GlooCommunicator::create(o);
  auto store = connect_tcp_store("127.0.0.2", port, kToken, 5s);
  CHECK(store->check({"powersgd/" + powersgd::transport::job_key_prefix(kToken) + "/default/joined"}));
  CHECK_FALSE(store->check({"powersgd/default/joined"}));
  // Not on another loopback address (and so on no other interface).
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0);
  CHECK(errno == ECONNREFUSED);
  ::close(fd);
}

// Issue 32, item 4: rank 0 of a world that never comes. Before: WORLD_SIZE
// 100000 with a 1 s timeout still waited after 120 s (Gloo opening a socket
// per peer), 2147483647 took 8.9 GB in 20 s.
TEST_CASE("rank 0 of a world that never comes fails with a clear error within the timeout") {
  auto attempt = [](int world_size) {
    powersgd::CommOptions o;
    o.rank = 0;
    o.world_size = world_size;
    o.store_addr = "127.0.0.1";
    {
      TcpStoreServer probe(server_options());
      o.store_port = probe.port();
    }
    o.host_store = true;
    o.timeout = 1s;
    o.address = "127.0.0.1";
    auto start = Clock::now();
    std::string what;
    try {
      powersgd::transport::GlooCommunicator::create(o);
      FAIL("a world of " << world_size << " with one rank formed");
    } catch (const powersgd::Error& e) {
      what = e.what();
    }
    MESSAGE("world size " << world_size << ": " << what << " (" << ms_since(start) << " ms)");
    CHECK(ms_since(start) < 2 * 1000 + 1500);
    return what;
  };
  rlimit limit{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &limit) == 0);
  for (int world : {100000, 2147483647}) {
    std::string what = attempt(world);
    CHECK(what.find("world size " + std::to_string(world)) != std::string::npos);
    if (limit.rlim_cur < 3 * static_cast<rlim_t>(world))
      CHECK(what.find("RLIMIT_NOFILE allows " + std::to_string(limit.rlim_cur)) != std::string::npos);
  }
  // A world the host can hold: the missing ranks are counted.
  std::string what = attempt(500);
  CHECK(what.find("only 1 of 500 ranks joined") != std::string::npos);
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
