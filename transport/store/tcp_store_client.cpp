// TCP store client: synchronous request/response over one connection. Each
// operation runs the client's private io_context until the reply or the
// deadline, the Asio idiom for blocking I/O with a timeout.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

#include "asio.hpp"
#include "common/check.hpp"
#include "protocol.hpp"
#include "store.hpp"

namespace powersgd::transport {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using protocol::Reply;
using protocol::Request;

// Time a get/wait reply may lag behind the server's own timeout before the
// client stops waiting for it (server stalled or network lost).
constexpr std::chrono::milliseconds kReplyGrace{1000};
// Pause before connecting again after a failed connect or a connection the
// server closed before authentication.
constexpr std::chrono::milliseconds kReconnectDelay{20};

std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 8) out += detail::concat(", ... (", keys.size(), " keys)");
  return out;
}

class TcpStore final : public Store {
 public:
  TcpStore(const std::string& host, uint16_t port, const std::string& token, std::chrono::milliseconds timeout)
      : where_(detail::concat(host, ":", port)) {
    PSGD_REQUIRE(token.size() <= kMaxKeyBytes, InvalidArgumentError, "store job token is ", token.size(),
                 " bytes, the limit is ", kMaxKeyBytes);
    set_timeout(timeout);
    auto deadline = Clock::now() + timeout;
    auto hello = protocol::Writer(static_cast<uint8_t>(Request::Hello)).u32(protocol::kVersion).str(token).finish();
    // A server under a flood of unauthenticated connections may close this one
    // before reading its HELLO (it keeps the newest), and one at its connection
    // caps answers Busy: connect again until the deadline. A refusal is final.
    std::optional<std::string> busy;  // the server's last Busy reason: why, if the deadline ends a later attempt
    const auto no_room = [&] {
      PSGD_THROW(IoError, "store at ", where_, " had no room for this client within ", timeout.count(), " ms: ",
                 *busy);
    };
    for (;;) {
      try {
        connect(host, port, deadline);
        auto [type, payload] = exchange(hello, deadline, "HELLO");
        if (type == Reply::Busy) {
          busy = message(payload);
          if (Clock::now() + kReconnectDelay >= deadline) no_room();
        } else {
          if (type == Reply::Refused || type == Reply::Error) {
            broken_ = true;
            PSGD_THROW(IoError, "store at ", where_, " refused this client: ", message(payload));
          }
          expect_ok(type, payload, "HELLO");
          // What the server offers: absent from servers that offer nothing beyond version 1.
          protocol::Reader offered(payload.data(), payload.size());
          features_ = offered.u32().value_or(0);
          return;
        }
      } catch (const TimeoutError&) {
        // The deadline ended an attempt (its connect or its HELLO) after a Busy reply: the Busy is the reason.
        if (busy) no_room();
        throw;
      } catch (const IoError&) {
        if (!connection_lost_ || Clock::now() + kReconnectDelay >= deadline) throw;
      }
      boost::system::error_code ignored;
      socket_.close(ignored);
      broken_ = connection_lost_ = false;
      std::this_thread::sleep_for(kReconnectDelay);
    }
  }

  void set(const std::string& key, const std::vector<char>& value) override {
    check_key(key);
    PSGD_REQUIRE(value.size() <= kMaxValueBytes, InvalidArgumentError, "store value for key '", key, "' is ",
                 value.size(), " bytes, the limit is ", kMaxValueBytes);
    std::lock_guard lock(mutex_);
    auto [type, payload] = exchange(protocol::Writer(static_cast<uint8_t>(Request::Set)).str(key).str(value).finish(),
                                    Clock::now() + timeout(), "set of key '" + key + "'");
    expect_ok(type, payload, "set");
  }

  using Store::get;
  std::vector<char> get(const std::string& key, std::chrono::milliseconds requested) override {
    check_key(key);
    auto limit = std::max(requested, std::chrono::milliseconds(0));
    std::lock_guard lock(mutex_);
    auto [type, payload] = exchange(
        protocol::Writer(static_cast<uint8_t>(Request::Get)).str(key).u64(static_cast<uint64_t>(limit.count())).finish(),
        Clock::now() + limit + kReplyGrace, "get of key '" + key + "'", limit);
    if (type == Reply::Timeout)
      PSGD_THROW(TimeoutError, "store get of key '", key, "' timed out after ", limit.count(), " ms (store at ",
                 where_, ")");
    expect_ok(type, payload, "get");
    protocol::Reader in(payload.data(), payload.size());
    auto value = in.str(kMaxValueBytes);
    if (!value || !in.done()) bad_reply("get");
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& requested) override {
    if (keys.empty()) return;
    auto limit = std::max(requested, std::chrono::milliseconds(0));
    auto frame = keys_frame(Request::Wait, keys).u64(static_cast<uint64_t>(limit.count())).finish();
    std::lock_guard lock(mutex_);
    auto [type, payload] =
        exchange(frame, Clock::now() + limit + kReplyGrace, "wait for key(s) " + key_list(keys), limit);
    if (type == Reply::Timeout)
      PSGD_THROW(TimeoutError, "store wait for key(s) ", key_list(keys), " timed out after ", limit.count(),
                 " ms (store at ", where_, ")");
    expect_ok(type, payload, "wait");
  }

  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys,
                                          std::chrono::milliseconds requested) override {
    if (!(features_ & protocol::kFeatureGetMany)) return Store::get_many(keys, requested);  // an older server
    if (keys.empty()) return {};
    auto limit = std::max(requested, std::chrono::milliseconds(0));
    auto frame = keys_frame(Request::GetMany, keys).u64(static_cast<uint64_t>(limit.count())).finish();
    std::lock_guard lock(mutex_);
    auto [type, payload] =
        exchange(frame, Clock::now() + limit + kReplyGrace, "get of key(s) " + key_list(keys), limit);
    if (type == Reply::Timeout)
      PSGD_THROW(TimeoutError, "store get of key(s) ", key_list(keys), " timed out after ", limit.count(),
                 " ms (store at ", where_, ")", missing_keys(payload, keys));
    const std::string what = "get of key(s) " + key_list(keys);
    expect_ok(type, payload, what);
    protocol::Reader in(payload.data(), payload.size());
    auto count = in.u32();
    if (!count || *count != keys.size()) bad_reply(what);
    std::vector<std::vector<char>> values;
    values.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      auto value = in.str(kMaxValueBytes);
      if (!value) bad_reply(what);
      values.emplace_back(value->begin(), value->end());
    }
    if (!in.done()) bad_reply(what);
    return values;
  }

  int64_t add(const std::string& key, int64_t delta) override {
    check_key(key);
    std::lock_guard lock(mutex_);
    auto [type, payload] = exchange(protocol::Writer(static_cast<uint8_t>(Request::Add)).str(key).i64(delta).finish(),
                                    Clock::now() + timeout(), "add to key '" + key + "'");
    expect_ok(type, payload, "add");
    protocol::Reader in(payload.data(), payload.size());
    auto value = in.i64();
    if (!value || !in.done()) bad_reply("add");
    return *value;
  }

  bool check(const std::vector<std::string>& keys) override {
    if (keys.empty()) return true;
    auto frame = keys_frame(Request::Check, keys).finish();
    std::lock_guard lock(mutex_);
    auto [type, payload] = exchange(frame, Clock::now() + timeout(), "check of key(s) " + key_list(keys));
    expect_ok(type, payload, "check");
    protocol::Reader in(payload.data(), payload.size());
    auto all = in.u8();
    if (!all || !in.done()) bad_reply("check");
    return *all != 0;
  }

  bool remove(const std::string& key) override {
    check_key(key);
    std::lock_guard lock(mutex_);
    auto [type, payload] = exchange(protocol::Writer(static_cast<uint8_t>(Request::Remove)).str(key).finish(),
                                    Clock::now() + timeout(), "remove of key '" + key + "'");
    expect_ok(type, payload, "remove");
    protocol::Reader in(payload.data(), payload.size());
    auto existed = in.u8();
    if (!existed || !in.done()) bad_reply("remove");
    return *existed != 0;
  }

 private:
  struct Response {
    Reply type;
    std::vector<char> payload;
  };

  static void check_key(const std::string& key) {
    PSGD_REQUIRE(key.size() <= kMaxKeyBytes, InvalidArgumentError, "store key of ", key.size(),
                 " bytes is over the limit of ", kMaxKeyBytes, " bytes");
  }

  static protocol::Writer keys_frame(Request type, const std::vector<std::string>& keys) {
    PSGD_REQUIRE(keys.size() <= protocol::kMaxKeysPerRequest, InvalidArgumentError, "store request names ",
                 keys.size(), " keys, the limit is ", protocol::kMaxKeysPerRequest);
    protocol::Writer w(static_cast<uint8_t>(type));
    w.u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) {
      check_key(k);
      w.str(k);
    }
    return w;
  }

  // "; missing 'k', ..." from GET_MANY's Timeout reply (its message, then the indices of the keys missing),
  // or nothing where the reply does not say.
  static std::string missing_keys(const std::vector<char>& payload, const std::vector<std::string>& keys) {
    protocol::Reader in(payload.data(), payload.size());
    auto count = in.str(payload.size()) ? in.u32() : std::nullopt;
    if (!count || *count == 0 || *count > keys.size()) return {};
    std::vector<std::string> missing;
    for (uint32_t i = 0; i < *count; ++i) {
      auto at = in.u32();
      if (!at || *at >= keys.size()) return {};
      missing.push_back(keys[*at]);
    }
    return in.done() ? "; missing " + key_list(missing) : std::string();
  }

  static std::string message(const std::vector<char>& payload) {
    protocol::Reader in(payload.data(), payload.size());
    auto text = in.str(payload.size());
    return text ? *text : std::string("(no message)");
  }

  void expect_ok(Reply type, const std::vector<char>& payload, std::string_view what) {
    if (type == Reply::Ok) return;
    if (type == Reply::Error)
      PSGD_THROW(InvalidArgumentError, "store ", what, " failed at ", where_, ": ", message(payload));
    bad_reply(what);
  }

  [[noreturn]] void bad_reply(std::string_view what) {
    broken_ = true;
    PSGD_THROW(IoError, "store at ", where_, " sent a malformed reply to ", what);
  }

  // Runs the io_context until the started operation completes or the deadline
  // passes; on the deadline the socket is closed (the operation cannot be resumed).
  boost::system::error_code run_until(boost::system::error_code& result, Clock::time_point deadline) {
    io_.restart();
    io_.run_until(deadline);
    if (result == asio::error::would_block) {
      boost::system::error_code ignored;
      socket_.close(ignored);
      io_.restart();
      io_.run();  // lets the aborted handler complete
      return asio::error::timed_out;
    }
    return result;
  }

  void connect(const std::string& host, uint16_t port, Clock::time_point deadline) {
    tcp::resolver resolver(io_);
    boost::system::error_code ec;
    auto endpoints = resolver.resolve(host, std::to_string(port), tcp::resolver::numeric_service, ec);
    if (ec) PSGD_THROW(IoError, "cannot resolve store host ", where_, ": ", ec.message());
    // The server may start after its clients: retry until the deadline.
    for (;;) {
      for (const auto& entry : endpoints) {
        ec = connect_to(entry.endpoint(), deadline);
        if (!ec) break;
      }
      if (!ec) break;
      if (Clock::now() + kReconnectDelay >= deadline)
        PSGD_THROW(TimeoutError, "could not connect to the store at ", where_, " within ", timeout().count(),
                   " ms: ", ec.message());
      std::this_thread::sleep_for(kReconnectDelay);
    }
    socket_.set_option(tcp::no_delay(true), ec);
  }

  // One connection attempt on a socket created close-on-exec in one step (a
  // child the trainer forks and execs must not inherit the store connection).
  boost::system::error_code connect_to(const tcp::endpoint& endpoint, Clock::time_point deadline) {
    boost::system::error_code ignored;
    socket_.close(ignored);
    int fd = ::socket(endpoint.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
    if (fd < 0) return {errno, boost::system::system_category()};
    boost::system::error_code ec;
    if (socket_.assign(endpoint.protocol(), fd, ec)) {
      ::close(fd);
      return ec;
    }
    boost::system::error_code result = asio::error::would_block;
    socket_.async_connect(endpoint, [&](boost::system::error_code e) { result = e; });
    ec = run_until(result, deadline);
    if (ec) socket_.close(ignored);
    return ec;
  }

  // Sends one request and reads its reply. Caller holds mutex_ (or is the constructor).
  Response exchange(const std::vector<char>& frame, Clock::time_point deadline, const std::string& what,
                    std::optional<std::chrono::milliseconds> wait_limit = std::nullopt) {
    if (broken_) PSGD_THROW(IoError, "connection to the store at ", where_, " is closed after an earlier failure");
    auto lost = [&](const boost::system::error_code& ec) -> Response {
      broken_ = true;
      connection_lost_ = true;
      if (ec == asio::error::timed_out) {
        if (wait_limit)
          PSGD_THROW(TimeoutError, "store ", what, " timed out after ", wait_limit->count(), " ms (no reply from ",
                     where_, ")");
        PSGD_THROW(TimeoutError, "store ", what, " got no reply from ", where_, " within ", timeout().count(), " ms");
      }
      PSGD_THROW(IoError, "lost the connection to the store at ", where_, " during ", what, ": ", ec.message());
    };
    boost::system::error_code result = asio::error::would_block;
    asio::async_write(socket_, asio::buffer(frame), [&](boost::system::error_code e, size_t) { result = e; });
    if (auto ec = run_until(result, deadline)) return lost(ec);
    unsigned char header[4];
    result = asio::error::would_block;
    asio::async_read(socket_, asio::buffer(header), [&](boost::system::error_code e, size_t) { result = e; });
    if (auto ec = run_until(result, deadline)) return lost(ec);
    uint32_t length = protocol::decode_u32(header);
    if (length == 0 || length > protocol::kMaxFrameBytes) {
      broken_ = true;
      PSGD_THROW(IoError, "store at ", where_, " sent a reply of ", length, " bytes to ", what);
    }
    std::vector<char> body(length);
    result = asio::error::would_block;
    asio::async_read(socket_, asio::buffer(body), [&](boost::system::error_code e, size_t) { result = e; });
    if (auto ec = run_until(result, deadline)) return lost(ec);
    auto type = static_cast<Reply>(static_cast<uint8_t>(body[0]));
    if (type != Reply::Ok && type != Reply::Error && type != Reply::Timeout && type != Reply::Refused &&
        type != Reply::Busy) {
      broken_ = true;
      PSGD_THROW(IoError, "store at ", where_, " sent unknown reply type ", int{static_cast<uint8_t>(body[0])});
    }
    if (type == Reply::Refused || type == Reply::Busy) broken_ = true;
    return {type, std::vector<char>(body.begin() + 1, body.end())};
  }

  std::string where_;
  asio::io_context io_;
  tcp::socket socket_{io_};
  std::mutex mutex_;
  bool broken_ = false;
  bool connection_lost_ = false;  // the last exchange failed on the connection itself
  uint32_t features_ = 0;         // what the server's HELLO reply offered (protocol::kFeature*)
};

}  // namespace

std::unique_ptr<Store> connect_tcp_store(const std::string& host, uint16_t port, const std::string& token,
                                         std::chrono::milliseconds timeout) {
  PSGD_REQUIRE(timeout.count() > 0, InvalidArgumentError, "store timeout must be > 0 ms, got ", timeout.count());
  return std::make_unique<TcpStore>(host, port, token, timeout);
}

}  // namespace powersgd::transport
