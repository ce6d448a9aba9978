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
#include <sys/socket.h>
#include <unistd.h>

#include <gloo/allreduce_ring.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <latch>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "powersgd/error.hpp"
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
  std::optional<std::string> read(size_t n, std::chrono::milliseconds timeout) {
    std::string out;
    auto deadline = Clock::now() + timeout;
    while (out.size() < n) {
      pollfd p{fd_, POLLIN, 0};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return std::nullopt;
      char buf[4096];
      ssize_t got = ::recv(fd_, buf, std::min(sizeof buf, n - out.size()), 0);
      if (got <= 0) return std::nullopt;
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }
  // One reply frame: type and the rest.
  std::optional<std::pair<uint8_t, std::string>> reply(std::chrono::milliseconds timeout = 2s) {
    auto header = read(4, timeout);
    if (!header) return std::nullopt;
    uint32_t length = 0;
    for (int i = 0; i < 4; ++i) length |= static_cast<uint32_t>(static_cast<unsigned char>((*header)[i])) << (8 * i);
    if (length == 0 || length > 1u << 20) return std::nullopt;
    auto body = read(length, timeout);
    if (!body) return std::nullopt;
    return std::make_pair(static_cast<uint8_t>((*body)[0]), body->substr(1));
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

constexpr uint8_t kOk = 0x80, kError = 0x81, kRefused = 0x83;

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
  CHECK_THROWS_AS(a->add("k", 1), powersgd::InvalidArgumentError);
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
  CHECK(one->add("c", 3) == 3);
  CHECK_FALSE(two->check({"c"}));
  two->set_timeout(100ms);
  auto start = Clock::now();
  CHECK_THROWS_AS(two->get("c"), powersgd::TimeoutError);
  CHECK(ms_since(start) < 1500);
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

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
