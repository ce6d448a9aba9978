// TCP store server: one io_context thread serves every connection; the store's
// state is touched only on that thread, so it needs no lock.

#include <algorithm>
#include <atomic>
#include <charconv>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "asio.hpp"
#include "common/check.hpp"
#include "common/log.hpp"
#include "protocol.hpp"
#include "store.hpp"

namespace powersgd::transport {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using protocol::Reply;
using protocol::Request;

class Session;

// Compares in time that depends only on the expected token's length, so a
// client cannot find the token byte by byte from reply latency.
bool token_matches(const std::string& expected, const std::string& given) {
  unsigned char diff = expected.size() != given.size() ? 1 : 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= static_cast<unsigned char>(static_cast<unsigned char>(expected[i]) ^ g);
  }
  volatile unsigned char result = diff;
  return result == 0;
}

std::vector<char> reply(Reply type, const std::string& message) {
  return protocol::Writer(static_cast<uint8_t>(type)).str(message).finish();
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 8) out += detail::concat(", ... (", keys.size(), " keys)");
  return out;
}

// Counters are stored as decimal text so that get() of a counter is readable.
std::optional<int64_t> parse_counter(const std::vector<char>& value) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size()) return std::nullopt;
  return v;
}

}  // namespace

struct TcpStoreServer::Impl {
  explicit Impl(const TcpStoreServerOptions& o) : options(o) {}

  TcpStoreServerOptions options;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_retry{io};
  std::thread thread;
  std::atomic<uint64_t> refused{0};
  uint16_t bound_port = 0;
  std::mutex stop_mutex;
  bool stopped = false;

  // io thread only.
  std::unordered_map<std::string, std::vector<char>> data;
  std::set<std::shared_ptr<Session>> sessions;
  std::unordered_map<std::string, std::unordered_set<Session*>> waiting;  // key -> sessions waiting for it

  void accept();
  void on_set(const std::string& key);
  void run();
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer::Impl& server, tcp::socket socket, std::string peer)
      : server_(server), socket_(std::move(socket)), deadline_(server.io), wait_timer_(server.io),
        peer_(std::move(peer)) {}

  void start() {
    arm_deadline(server_.options.frame_timeout, "authenticate");  // HELLO must come within it
    read_header();
  }

  // Closes the connection and forgets every trace of it in the server.
  void close() {
    if (closed_) return;
    closed_ = true;
    drop_pending();
    boost::system::error_code ignored;
    deadline_.cancel();
    wait_timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    server_.sessions.erase(shared_from_this());
  }

  // A key this session waits for was set: answer when all are present.
  void key_arrived() {
    if (closed_ || !pending_) return;
    for (const auto& k : pending_->keys)
      if (!server_.data.count(k)) return;
    Pending done = std::move(*pending_);
    drop_pending();
    wait_timer_.cancel();
    if (done.is_get)
      send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).str(server_.data.at(done.keys[0])).finish());
    else
      send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).finish());
  }

 private:
  struct Pending {
    bool is_get;
    std::vector<std::string> keys;
    uint64_t timeout_ms;
  };

  void arm_deadline(std::chrono::milliseconds after, const char* what) {
    deadline_.expires_after(after);
    deadline_.async_wait([self = shared_from_this(), gen = ++deadline_gen_, what](boost::system::error_code ec) {
      if (ec || gen != self->deadline_gen_ || self->closed_) return;
      PSGD_LOG(Warn, "store server: closing connection from ", self->peer_, ": it did not ", what, " within ",
               self->server_.options.frame_timeout.count(), " ms");
      self->close();
    });
  }
  void disarm_deadline() {
    ++deadline_gen_;
    deadline_.cancel();
  }

  void read_header() {
    if (closed_) return;
    header_got_ = 0;
    reading_ = true;
    if (authenticated_) {
      if (server_.options.client_idle_timeout.count() > 0)
        arm_deadline(server_.options.client_idle_timeout, "send a request (idle timeout)");
      else
        disarm_deadline();
    }
    read_header_part();
  }

  // Reads the length prefix piecewise so that the frame deadline starts at its first byte.
  void read_header_part() {
    socket_.async_read_some(
        asio::buffer(header_ + header_got_, 4 - header_got_),
        [self = shared_from_this()](boost::system::error_code ec, size_t n) { self->on_header(ec, n); });
  }

  void on_header(boost::system::error_code ec, size_t n) {
    if (closed_) return;
    if (ec) {
      if (ec != asio::error::eof || header_got_ != 0 || pending_)
        PSGD_LOG(Debug, "store server: connection from ", peer_, " ended: ", ec.message());
      close();
      return;
    }
    if (header_got_ == 0 && authenticated_) arm_deadline(server_.options.frame_timeout, "complete a frame");
    header_got_ += n;
    if (header_got_ < 4) {
      read_header_part();
      return;
    }
    uint32_t length = protocol::decode_u32(header_);
    size_t limit = authenticated_ ? protocol::kMaxFrameBytes : protocol::kMaxHelloBytes;
    if (length == 0 || length > limit) {
      // Refused before allocating anything for the body.
      fail(detail::concat("frame length ", length, " is outside [1, ", limit, "]"));
      return;
    }
    body_.resize(length);
    asio::async_read(socket_, asio::buffer(body_),
                     [self = shared_from_this()](boost::system::error_code ec2, size_t) { self->on_body(ec2); });
  }

  void on_body(boost::system::error_code ec) {
    if (closed_) return;
    reading_ = false;
    if (ec) {
      PSGD_LOG(Warn, "store server: connection from ", peer_, " lost in the middle of a frame: ", ec.message());
      close();
      return;
    }
    if (authenticated_) disarm_deadline();
    if (writing_) {
      deferred_ = true;  // answered once the reply in flight is written: one write at a time
      return;
    }
    process();
  }

  void process() {
    handle_frame();
    body_.clear();
    body_.shrink_to_fit();
    if (!closed_ && !writing_ && !reading_) read_header();
  }

  void handle_frame() {
    auto type = static_cast<uint8_t>(body_[0]);
    protocol::Reader in(body_.data() + 1, body_.size() - 1);
    if (!authenticated_) {
      hello(type, in);
      return;
    }
    if (pending_) {
      fail("a request arrived while a get/wait was pending");
      return;
    }
    auto malformed = [&] { fail(detail::concat("malformed frame of type ", int{type})); };
    switch (static_cast<Request>(type)) {
      case Request::Set: {
        auto key = in.str(kMaxKeyBytes);
        auto value = in.str(kMaxValueBytes);
        if (!key || !value || !in.done()) return malformed();
        server_.data[*key] = std::vector<char>(value->begin(), value->end());
        send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).finish());
        server_.on_set(*key);
        return;
      }
      case Request::Get: {
        auto key = in.str(kMaxKeyBytes);
        auto timeout = in.u64();
        if (!key || !timeout || !in.done()) return malformed();
        return wait_for(true, {*key}, *timeout);
      }
      case Request::Wait: {
        auto keys = read_keys(in);
        auto timeout = in.u64();
        if (!keys || !timeout || !in.done()) return malformed();
        return wait_for(false, std::move(*keys), *timeout);
      }
      case Request::Add: {
        auto key = in.str(kMaxKeyBytes);
        auto delta = in.i64();
        if (!key || !delta || !in.done()) return malformed();
        int64_t current = 0;
        if (auto it = server_.data.find(*key); it != server_.data.end()) {
          auto parsed = parse_counter(it->second);
          if (!parsed) {
            send(reply(Reply::Error, "add on key '" + *key + "', whose value is not a decimal 64-bit integer"));
            return;
          }
          current = *parsed;
        }
        int64_t result = 0;
        if (__builtin_add_overflow(current, *delta, &result)) {
          send(reply(Reply::Error, detail::concat("add of ", *delta, " to key '", *key, "' (value ", current,
                                                  ") overflows a 64-bit integer")));
          return;
        }
        std::string text = std::to_string(result);
        server_.data[*key] = std::vector<char>(text.begin(), text.end());
        send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).i64(result).finish());
        server_.on_set(*key);
        return;
      }
      case Request::Check: {
        auto keys = read_keys(in);
        if (!keys || !in.done()) return malformed();
        bool all = std::all_of(keys->begin(), keys->end(), [&](const auto& k) { return server_.data.count(k) > 0; });
        send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).u8(all ? 1 : 0).finish());
        return;
      }
      case Request::Remove: {
        auto key = in.str(kMaxKeyBytes);
        if (!key || !in.done()) return malformed();
        bool existed = server_.data.erase(*key) > 0;
        send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).u8(existed ? 1 : 0).finish());
        return;
      }
      case Request::Hello:
        return fail("HELLO sent twice");
    }
    fail(detail::concat("unknown request type ", int{type}));
  }

  void hello(uint8_t type, protocol::Reader& in) {
    auto refuse = [&](const std::string& why) {
      server_.refused.fetch_add(1);
      PSGD_LOG(Warn, "store server: refused client ", peer_, ": ", why);
      send(reply(Reply::Refused, why), true);
    };
    if (type != static_cast<uint8_t>(Request::Hello))
      return refuse(detail::concat("first frame must be HELLO (type 1), got type ", int{type}));
    auto version = in.u32();
    auto token = in.str(kMaxKeyBytes);
    if (!version || !token || !in.done()) return refuse("malformed HELLO frame");
    if (*version != protocol::kVersion)
      return refuse(detail::concat("protocol version ", *version, " not supported, the server speaks version ",
                                   protocol::kVersion));
    if (!token_matches(server_.options.token, *token)) return refuse("wrong job token");
    authenticated_ = true;
    disarm_deadline();
    send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).finish());
  }

  static std::optional<std::vector<std::string>> read_keys(protocol::Reader& in) {
    auto n = in.u32();
    if (!n || *n > protocol::kMaxKeysPerRequest) return std::nullopt;
    std::vector<std::string> keys;
    for (uint32_t i = 0; i < *n; ++i) {
      auto key = in.str(kMaxKeyBytes);
      if (!key) return std::nullopt;
      keys.push_back(std::move(*key));
    }
    return keys;
  }

  void wait_for(bool is_get, std::vector<std::string> keys, uint64_t timeout_ms) {
    pending_ = Pending{is_get, std::move(keys), timeout_ms};
    bool missing = false;
    for (const auto& k : pending_->keys)
      if (!server_.data.count(k)) {
        server_.waiting[k].insert(this);
        missing = true;
      }
    if (!missing) {
      key_arrived();
      return;
    }
    // The server enforces the timeout too, so an abandoned waiter never stays.
    // Clamped so the timer arithmetic cannot overflow.
    wait_timer_.expires_after(std::chrono::milliseconds(std::min<uint64_t>(timeout_ms, uint64_t{1} << 40)));
    wait_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed_ || !self->pending_) return;
      Pending expired = std::move(*self->pending_);
      self->drop_pending();
      self->send(reply(Reply::Timeout, detail::concat("timed out after ", expired.timeout_ms,
                                                      " ms waiting for key(s) ", key_list(expired.keys))));
    });
  }

  void drop_pending() {
    if (!pending_) return;
    for (const auto& k : pending_->keys) {
      auto it = server_.waiting.find(k);
      if (it == server_.waiting.end()) continue;
      it->second.erase(this);
      if (it->second.empty()) server_.waiting.erase(it);
    }
    pending_.reset();
  }

  // Protocol violation: tell the client why, then close.
  void fail(const std::string& why) {
    PSGD_LOG(Warn, "store server: closing connection from ", peer_, ": ", why);
    drop_pending();
    wait_timer_.cancel();
    send(reply(Reply::Error, why), true);
  }

  void send(std::vector<char> frame, bool close_after = false) {
    if (closed_) return;
    PSGD_ASSERT(!writing_, "one reply at a time per connection");
    out_ = std::move(frame);
    writing_ = true;
    close_after_ = close_after;
    if (close_after) reading_ = true;  // no further reads on this connection
    asio::async_write(socket_, asio::buffer(out_), [self = shared_from_this()](boost::system::error_code ec, size_t) {
      self->writing_ = false;
      self->out_ = {};
      if (self->closed_) return;
      if (ec || self->close_after_) {
        self->close();
        return;
      }
      if (self->deferred_) {
        self->deferred_ = false;
        self->process();
      } else if (!self->reading_) {
        self->read_header();
      }
    });
  }

  TcpStoreServer::Impl& server_;
  tcp::socket socket_;
  asio::steady_timer deadline_;    // authentication, frame in progress, idle
  asio::steady_timer wait_timer_;  // pending get/wait
  uint64_t deadline_gen_ = 0;
  std::string peer_;
  bool authenticated_ = false;
  bool closed_ = false;
  bool reading_ = false;
  bool writing_ = false;
  bool deferred_ = false;
  bool close_after_ = false;
  unsigned char header_[4] = {};
  size_t header_got_ = 0;
  std::vector<char> body_;
  std::vector<char> out_;
  std::optional<Pending> pending_;
};

}  // namespace

void TcpStoreServer::Impl::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (!acceptor.is_open()) return;
    if (ec) {
      // EMFILE and the like: retry later instead of spinning.
      PSGD_LOG(Warn, "store server: accept failed: ", ec.message());
      accept_retry.expires_after(std::chrono::milliseconds(100));
      accept_retry.async_wait([this](boost::system::error_code ec2) {
        if (!ec2) accept();
      });
      return;
    }
    boost::system::error_code ignored;
    auto remote = socket.remote_endpoint(ignored);
    std::string peer = detail::concat(remote.address().to_string(ignored), ":", remote.port());
    socket.set_option(tcp::no_delay(true), ignored);
    // Detects peers that vanished without a FIN while idle.
    socket.set_option(asio::socket_base::keep_alive(true), ignored);
    auto session = std::make_shared<Session>(*this, std::move(socket), std::move(peer));
    sessions.insert(session);
    session->start();
    accept();
  });
}

void TcpStoreServer::Impl::on_set(const std::string& key) {
  auto it = waiting.find(key);
  if (it == waiting.end()) return;
  // key_arrived() edits `waiting`: work on a copy.
  std::vector<Session*> waiters(it->second.begin(), it->second.end());
  for (Session* s : waiters) s->key_arrived();
}

void TcpStoreServer::Impl::run() {
  for (;;) {
    try {
      io.run();
      return;
    } catch (const std::exception& e) {
      // A handler failed (e.g. out of memory): log it and keep serving.
      PSGD_LOG(Error, "store server: ", e.what());
    }
  }
}

TcpStoreServer::TcpStoreServer(const TcpStoreServerOptions& options) : impl_(std::make_unique<Impl>(options)) {
  PSGD_REQUIRE(options.frame_timeout.count() > 0, InvalidArgumentError,
               "store server frame_timeout must be > 0 ms, got ", options.frame_timeout.count());
  PSGD_REQUIRE(options.token.size() <= kMaxKeyBytes, InvalidArgumentError, "store job token is ",
               options.token.size(), " bytes, the limit is ", kMaxKeyBytes);
  std::string where = detail::concat(options.bind_address, ":", options.port);
  boost::system::error_code ec;
  tcp::resolver resolver(impl_->io);
  auto results = resolver.resolve(options.bind_address, std::to_string(options.port),
                                  tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || results.empty())
    PSGD_THROW(InvalidArgumentError, "store server bind address '", options.bind_address,
               "' does not resolve: ", ec.message());
  tcp::endpoint endpoint = results.begin()->endpoint();
  auto& acceptor = impl_->acceptor;
  if (acceptor.open(endpoint.protocol(), ec) || acceptor.set_option(tcp::acceptor::reuse_address(true), ec) ||
      acceptor.bind(endpoint, ec) || acceptor.listen(asio::socket_base::max_listen_connections, ec))
    PSGD_THROW(IoError, "store server cannot listen on ", where, ": ", ec.message());
  impl_->bound_port = acceptor.local_endpoint().port();
  impl_->accept();
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
  PSGD_LOG(Info, "store server listening on ", options.bind_address, ":", impl_->bound_port);
}

TcpStoreServer::~TcpStoreServer() { stop(); }

uint16_t TcpStoreServer::port() const { return impl_->bound_port; }

uint64_t TcpStoreServer::refused_clients() const { return impl_->refused.load(); }

void TcpStoreServer::stop() {
  std::lock_guard lock(impl_->stop_mutex);
  if (impl_->stopped) return;
  impl_->stopped = true;
  // Closing the acceptor, timers and every connection leaves the io_context
  // without work, so run() returns once the aborted handlers have run.
  asio::post(impl_->io, [impl = impl_.get()] {
    boost::system::error_code ignored;
    impl->acceptor.close(ignored);
    impl->accept_retry.cancel();
    auto sessions = impl->sessions;
    for (const auto& s : sessions) s->close();
    impl->waiting.clear();
  });
  impl_->thread.join();
}

}  // namespace powersgd::transport
