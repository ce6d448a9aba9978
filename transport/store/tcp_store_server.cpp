// TCP store server: one io_context thread serves every connection; the store's
// state is touched only on that thread, so it needs no lock.
//
// Defences against hostile or broken clients (docs/reliability.md, "Rendezvous
// store: threat model"): unauthenticated connections are capped overall and per
// peer address (the oldest is closed to admit a new one), must authenticate within
// auth_timeout, and are never given more than a HELLO's worth of buffer;
// authenticated ones are capped per source, loopback counting as one (over the
// cap an authenticated connection that never sent a request makes room, else
// the HELLO is refused); every connection fits in a descriptor budget taken
// from RLIMIT_NOFILE; accept() running out of descriptors anyway sheds an
// unauthenticated connection or backs off instead of spinning; warnings are
// rate-limited per cause; the store's keys and bytes are bounded by quotas;
// replies share stored values instead of copying them, the bytes they hold
// are bounded per connection and in all, and a reply not read within
// frame_timeout closes its connection.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "asio.hpp"
#include "common/check.hpp"
#include "common/fd.hpp"
#include "common/log.hpp"
#include "protocol.hpp"
#include "store.hpp"

namespace powersgd::transport {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
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

// The source a connection is counted against: its address, except that every
// loopback address (127.0.0.0/8, ::1, and their v4-mapped forms) is one
// source, since any local process may connect from any of them.
std::string source_of(const asio::ip::address& address) {
  bool loopback = address.is_loopback();
  if (address.is_v6() && address.to_v6().is_v4_mapped())
    loopback = asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6()).is_loopback();
  boost::system::error_code ignored;
  return loopback ? std::string("loopback (127.0.0.0/8, ::1)") : address.to_string(ignored);
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 8) out += detail::concat(", ... (", keys.size(), " keys)");
  return out;
}

// Counters are stored as decimal text so that get() of a counter is readable.
using Value = std::shared_ptr<const std::vector<char>>;

std::optional<int64_t> parse_counter(const std::vector<char>& value) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size()) return std::nullopt;
  return v;
}

// Warnings about clients, at most one line per cause per interval: the first is
// written at once, later ones in the interval are counted and their number is
// appended to the next line written for that cause (or to the summary at stop).
// A flood of hostile connections thus costs a few lines, not one per connection.
class ThrottledLog {
 public:
  static constexpr std::chrono::seconds kInterval{10};

  void warn(const std::string& cause, const std::string& line) {
    auto now = Clock::now();
    Entry& e = entries_[cause];
    if (e.written && now - e.last < kInterval) {
      ++e.suppressed;
      return;
    }
    if (e.suppressed > 0)
      PSGD_LOG(Warn, "store server: ", line, " (and ", e.suppressed, " more of this kind in the last ",
               kInterval.count(), " s)");
    else
      PSGD_LOG(Warn, "store server: ", line);
    e = Entry{true, now, 0};
  }

  // Reports what was counted but never written.
  void flush() {
    for (auto& [cause, e] : entries_)
      if (e.suppressed > 0) {
        PSGD_LOG(Warn, "store server: ", e.suppressed, " more event(s) of kind '", cause, "' were not logged");
        e.suppressed = 0;
      }
  }

 private:
  struct Entry {
    bool written = false;
    Clock::time_point last;
    uint64_t suppressed = 0;
  };
  std::map<std::string, Entry> entries_;
};

}  // namespace

struct TcpStoreServer::Impl {
  explicit Impl(const TcpStoreServerOptions& o) : options(o) {}

  TcpStoreServerOptions options;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_retry{io};
  std::chrono::milliseconds accept_backoff{kMinAcceptBackoff};
  std::thread thread;
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> shed{0};
  uint16_t bound_port = 0;
  std::mutex stop_mutex;
  bool stopped = false;

  static constexpr std::chrono::milliseconds kMinAcceptBackoff{10};
  static constexpr std::chrono::milliseconds kMaxAcceptBackoff{1000};
  // Connections accepted per wake-up before the sessions' own handlers get a
  // turn, so a burst of connections cannot starve the clients already in.
  static constexpr int kAcceptBatch = 16;

  // io thread only.
  // Values are immutable and shared with the replies that carry them.
  std::unordered_map<std::string, Value> data;
  size_t data_bytes = 0;  // sum of key and value sizes in `data`
  // Bytes held by queued replies: their own bytes, plus each value they share
  // once however many replies carry it (`queued_values` counts the replies).
  size_t queued_bytes = 0;
  std::unordered_map<const std::vector<char>*, size_t> queued_values;
  std::atomic<size_t> queued_bytes_seen{0};  // copy of queued_bytes for other threads
  std::set<std::shared_ptr<Session>> sessions;
  std::unordered_map<std::string, std::unordered_set<Session*>> waiting;  // key -> sessions waiting for it
  std::list<Session*> unauthenticated;                                    // oldest first
  std::unordered_map<std::string, size_t> unauthenticated_per_address;
  std::unordered_map<std::string, size_t> authenticated_per_address;
  size_t authenticated_count = 0;
  std::list<Session*> unused;  // authenticated, no request sent yet; oldest first
  ThrottledLog log;

  // Caps derived from the descriptor budget (constructor; constant after).
  size_t budget = 0;             // connections of every kind
  size_t unauthenticated_cap = 0;
  size_t unauthenticated_per_source_cap = 0;
  size_t authenticated_cap = 0;
  size_t authenticated_per_source_cap = 0;

  void accept();        // waits for the listening socket to become readable
  void accept_ready();  // accepts what is in the backlog (a batch), then waits again
  void admit(int fd);
  bool shed_oldest_unauthenticated(const std::string* address, const std::string& why);
  // Closes the oldest authenticated connection (of `source`, or of any) that
  // sent no request within auth_timeout of its HELLO; false when there is none.
  bool shed_oldest_unused(const std::string* source, const std::string& why);
  void on_set(const std::string& key);
  // Stores key = value if the quotas allow; else the reason it does not.
  std::optional<std::string> store(const std::string& key, std::vector<char> value);
  // Accounts a queued reply's bytes (+1) or a written one's (-1).
  void account_queued(const std::vector<char>& head, const Value& value, int sign);
  void erase(const std::string& key);
  void run();
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer::Impl& server, tcp::socket socket, std::string peer, std::string address)
      : server_(server), socket_(std::move(socket)), deadline_(server.io), wait_timer_(server.io),
        peer_(std::move(peer)), address_(std::move(address)), write_timer_(server.io) {}

  const std::string& peer() const { return peer_; }
  const std::string& address() const { return address_; }
  // Position in Impl::unauthenticated while not authenticated.
  std::optional<std::list<Session*>::iterator> unauthenticated_entry;
  // Position in Impl::unused while authenticated without a request yet.
  std::optional<std::list<Session*>::iterator> unused_entry;
  Clock::time_point authenticated_at;

  void start() {
    arm_deadline(server_.options.auth_timeout, "authenticate", "authentication deadline");
    read_header();
  }

  // Closes the connection and forgets every trace of it in the server.
  void close() {
    if (closed_) return;
    closed_ = true;
    drop_pending();
    leave_unauthenticated();
    leave_authenticated();
    leave_unused();
    boost::system::error_code ignored;
    deadline_.cancel();
    wait_timer_.cancel();
    ++write_gen_;
    write_timer_.cancel();
    for (const Out& out : out_) server_.account_queued(out.head, out.value, -1);
    queued_ = 0;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    server_.sessions.erase(shared_from_this());
  }

  // Closes with a reset, dropping what the kernel still holds to send: for a
  // client that does not read.
  void abort() {
    boost::system::error_code ignored;
    socket_.set_option(asio::socket_base::linger(true, 0), ignored);
    close();
  }

  // `key`, which this session waits for, was set: answer once none is missing. O(1) per key that comes, so a
  // GET_MANY of n keys set one by one costs O(n), not O(n^2).
  void key_arrived(const std::string& key) {
    if (closed_ || !pending_) return;
    auto it = server_.waiting.find(key);
    if (it != server_.waiting.end() && it->second.erase(this) > 0) {
      if (it->second.empty()) server_.waiting.erase(it);
      --pending_->missing;
    }
    if (pending_->missing > 0 || !register_missing()) return;  // a key that came was removed since: wait again
    answer();
  }

 private:
  struct Pending {
    enum class Kind { Wait, Get, GetMany } kind;
    std::vector<std::string> keys;
    uint64_t timeout_ms;
    size_t missing = 0;  // keys (distinct) this session is registered in `waiting` for
  };

  // Registers this session as a waiter on each pending key not stored yet (once per distinct key); true when
  // none is missing.
  bool register_missing() {
    for (const auto& k : pending_->keys)
      if (!server_.data.count(k) && server_.waiting[k].insert(this).second) ++pending_->missing;
    return pending_->missing == 0;
  }

  // Every pending key is present: the reply.
  void answer() {
    Pending done = take_pending();
    wait_timer_.cancel();
    switch (done.kind) {
      case Pending::Kind::Wait:
        return send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).finish());
      case Pending::Kind::Get: {
        const Value& value = server_.data.at(done.keys[0]);
        // Ok + str: the value's length here, its bytes shared, not copied.
        return send(protocol::Writer(static_cast<uint8_t>(Reply::Ok))
                        .u32(static_cast<uint32_t>(value->size()))
                        .finish(value->size()),
                    false, value);
      }
      case Pending::Kind::GetMany:
        return send_values(done.keys);
    }
  }

  struct Out {
    std::vector<char> head;  // the frame, or what precedes `value` of it (GET_MANY: a value's length)
    Value value;             // shared stored value sent after head; may be null
    size_t bytes() const { return head.size() + (value ? value->size() : 0); }
  };

  // Body buffer growth: a frame's buffer starts at this size and doubles as
  // bytes arrive, so a header declaring 64 MiB costs memory only once the
  // client has actually sent that much.
  static constexpr size_t kInitialBodyBytes = 4096;
  // The most buffers one write gathers (parts of queued replies, a head and a value each): well under IOV_MAX.
  static constexpr size_t kMaxWriteBuffers = 128;

  void leave_unauthenticated() {
    if (!unauthenticated_entry) return;
    server_.unauthenticated.erase(*unauthenticated_entry);
    unauthenticated_entry.reset();
    auto it = server_.unauthenticated_per_address.find(address_);
    if (it != server_.unauthenticated_per_address.end() && --it->second == 0)
      server_.unauthenticated_per_address.erase(it);
  }

  void leave_unused() {
    if (!unused_entry) return;
    server_.unused.erase(*unused_entry);
    unused_entry.reset();
  }

  void leave_authenticated() {
    if (!authenticated_) return;
    --server_.authenticated_count;
    auto it = server_.authenticated_per_address.find(address_);
    if (it != server_.authenticated_per_address.end() && --it->second == 0)
      server_.authenticated_per_address.erase(it);
  }

  void arm_deadline(std::chrono::milliseconds after, const char* what, const char* cause) {
    deadline_.expires_after(after);
    deadline_.async_wait(
        [self = shared_from_this(), gen = ++deadline_gen_, what, cause, after](boost::system::error_code ec) {
          if (ec || gen != self->deadline_gen_ || self->closed_) return;
          self->server_.log.warn(cause, detail::concat("closing connection from ", self->peer_, ": it did not ",
                                                       what, " within ", after.count(), " ms"));
          self->close();
        });
  }
  void disarm_deadline() {
    ++deadline_gen_;
    deadline_.cancel();
  }

  // An authenticated connection with nothing in progress (no frame being read,
  // no get/wait pending, no reply queued) is idle: only then does the idle
  // timeout run. A client blocked in a long GET/WAIT/GET_MANY is not idle.
  void rearm_idle() {
    if (!authenticated_ || closed_ || closing_) return;
    if (header_got_ != 0 || pending_ || !out_.empty()) return;
    if (server_.options.client_idle_timeout.count() > 0)
      arm_deadline(server_.options.client_idle_timeout, "send a request (idle timeout)", "idle timeout");
    else
      disarm_deadline();
  }

  void read_header() {
    if (closed_ || closing_ || reading_) return;
    header_got_ = 0;
    reading_ = true;
    rearm_idle();
    read_header_part();
  }

  // Reads the length prefix piecewise so that the frame deadline starts at its first byte.
  void read_header_part() {
    socket_.async_read_some(
        asio::buffer(header_ + header_got_, 4 - header_got_),
        [self = shared_from_this()](boost::system::error_code ec, size_t n) { self->on_header(ec, n); });
  }

  void on_header(boost::system::error_code ec, size_t n) {
    if (closed_ || closing_) return;
    if (ec) {
      reading_ = false;
      if (ec != asio::error::eof || header_got_ != 0 || pending_)
        PSGD_LOG(Debug, "store server: connection from ", peer_, " ended: ", ec.message());
      close();
      return;
    }
    if (header_got_ == 0 && authenticated_)
      arm_deadline(server_.options.frame_timeout, "complete a frame", "frame deadline");
    header_got_ += n;
    if (header_got_ < 4) {
      read_header_part();
      return;
    }
    uint32_t length = protocol::decode_u32(header_);
    size_t limit = authenticated_ ? protocol::kMaxFrameBytes : protocol::kMaxHelloBytes;
    if (length == 0 || length > limit) {
      // Refused before allocating anything for the body.
      reading_ = false;
      fail(detail::concat("frame length ", length, " is outside [1, ", limit, "]"));
      return;
    }
    body_length_ = length;
    body_.assign(std::min<size_t>(length, kInitialBodyBytes), 0);
    body_got_ = 0;
    read_body_part();
  }

  void read_body_part() {
    if (body_got_ == body_.size()) body_.resize(std::min(body_length_, body_.size() * 2));
    socket_.async_read_some(asio::buffer(body_.data() + body_got_, body_.size() - body_got_),
                            [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                              self->on_body(ec, n);
                            });
  }

  void on_body(boost::system::error_code ec, size_t n) {
    if (closed_ || closing_) return;
    if (ec) {
      reading_ = false;
      server_.log.warn("lost mid-frame", detail::concat("connection from ", peer_,
                                                        " lost in the middle of a frame: ", ec.message()));
      close();
      return;
    }
    body_got_ += n;
    if (body_got_ < body_length_) {
      read_body_part();
      return;
    }
    reading_ = false;
    header_got_ = 0;
    if (authenticated_) disarm_deadline();
    handle_frame();
    body_ = {};
    // The next request is read once every reply is written (a client that does
    // not read its replies stalls only itself), or at once while a get/wait is
    // pending (to notice a disconnect).
    if (out_.empty()) read_header();
  }

  void handle_frame() {
    auto type = static_cast<uint8_t>(body_[0]);
    protocol::Reader in(body_.data() + 1, body_.size() - 1);
    if (!authenticated_) {
      hello(type, in);
      return;
    }
    leave_unused();
    if (pending_) {
      fail("a request arrived while a get/wait/get_many was pending");
      return;
    }
    auto malformed = [&] { fail(detail::concat("malformed frame of type ", int{type})); };
    switch (static_cast<Request>(type)) {
      case Request::Set: {
        auto key = in.str(kMaxKeyBytes);
        auto value = in.str(kMaxValueBytes);
        if (!key || !value || !in.done()) return malformed();
        if (auto refused = server_.store(*key, std::vector<char>(value->begin(), value->end())))
          return send(reply(Reply::Error, *refused));
        send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).finish());
        server_.on_set(*key);
        return;
      }
      case Request::Get: {
        auto key = in.str(kMaxKeyBytes);
        auto timeout = in.u64();
        if (!key || !timeout || !in.done()) return malformed();
        return wait_for(Pending::Kind::Get, {*key}, *timeout);
      }
      case Request::Wait: {
        auto keys = read_keys(in);
        auto timeout = in.u64();
        if (!keys || !timeout || !in.done()) return malformed();
        return wait_for(Pending::Kind::Wait, std::move(*keys), *timeout);
      }
      case Request::GetMany: {
        auto keys = read_keys(in);
        auto timeout = in.u64();
        if (!keys || !timeout || !in.done()) return malformed();
        return wait_for(Pending::Kind::GetMany, std::move(*keys), *timeout);
      }
      case Request::Add: {
        auto key = in.str(kMaxKeyBytes);
        auto delta = in.i64();
        if (!key || !delta || !in.done()) return malformed();
        int64_t current = 0;
        if (auto it = server_.data.find(*key); it != server_.data.end()) {
          auto parsed = parse_counter(*it->second);
          if (!parsed)
            return send(reply(Reply::Error, "add on key '" + *key + "', whose value is not a decimal 64-bit integer"));
          current = *parsed;
        }
        int64_t result = 0;
        if (__builtin_add_overflow(current, *delta, &result))
          return send(reply(Reply::Error, detail::concat("add of ", *delta, " to key '", *key, "' (value ", current,
                                                         ") overflows a 64-bit integer")));
        std::string text = std::to_string(result);
        if (auto refused = server_.store(*key, std::vector<char>(text.begin(), text.end())))
          return send(reply(Reply::Error, *refused));
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
        bool existed = server_.data.count(*key) > 0;
        server_.erase(*key);
        send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).u8(existed ? 1 : 0).finish());
        return;
      }
      case Request::Hello:
        return fail("HELLO sent twice");
    }
    fail(detail::concat("unknown request type ", int{type}));
  }

  void hello(uint8_t type, protocol::Reader& in) {
    auto refuse = [&](const std::string& why, Reply as = Reply::Refused) {
      server_.refused.fetch_add(1);
      server_.log.warn("refused client", detail::concat("refused client ", peer_, ": ", why));
      send(reply(as, why), true);
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
    // Over a cap, only a connection that has sent nothing since its HELLO
    // makes room (every other one may be a rank of the job, waiting or idle);
    // with none, the newest is refused.
    auto& caps = server_;
    size_t from_source = caps.authenticated_per_address.count(address_) ? caps.authenticated_per_address[address_] : 0;
    if (from_source >= caps.authenticated_per_source_cap) {
      std::string why = detail::concat(from_source, " authenticated connections from ", address_,
                                       " are open, the limit is ", caps.authenticated_per_source_cap,
                                       " (max_authenticated_per_address, the descriptor budget ", caps.budget,
                                       " and reserved_for_other_sources)");
      if (!caps.shed_oldest_unused(&address_, why)) return refuse(why, Reply::Busy);
    }
    if (caps.authenticated_count >= caps.authenticated_cap) {
      std::string why = detail::concat(caps.authenticated_count, " authenticated connections are open, the limit is ",
                                       caps.authenticated_cap, " (descriptor budget ", caps.budget,
                                       " from RLIMIT_NOFILE, less the unauthenticated connections' share)");
      if (!caps.shed_oldest_unused(nullptr, why)) return refuse(why, Reply::Busy);
    }
    ++caps.authenticated_per_address[address_];
    ++caps.authenticated_count;
    authenticated_ = true;
    authenticated_at = Clock::now();
    unused_entry = caps.unused.insert(caps.unused.end(), this);
    leave_unauthenticated();
    disarm_deadline();
    send(protocol::Writer(static_cast<uint8_t>(Reply::Ok)).u32(protocol::kServerFeatures).finish());
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

  void wait_for(Pending::Kind kind, std::vector<std::string> keys, uint64_t timeout_ms) {
    pending_ = Pending{kind, std::move(keys), timeout_ms};
    disarm_deadline();  // waiting is not idling
    if (register_missing()) {
      answer();
      return;
    }
    // The server enforces the timeout too, so an abandoned waiter never stays.
    // Clamped so the timer arithmetic cannot overflow.
    wait_timer_.expires_after(std::chrono::milliseconds(std::min<uint64_t>(timeout_ms, uint64_t{1} << 40)));
    wait_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed_ || !self->pending_) return;
      Pending expired = self->take_pending();
      std::vector<std::string> absent;
      std::vector<uint32_t> absent_at;
      for (size_t i = 0; i < expired.keys.size(); ++i)
        if (!self->server_.data.count(expired.keys[i])) {
          absent.push_back(expired.keys[i]);
          absent_at.push_back(static_cast<uint32_t>(i));
        }
      protocol::Writer timed_out(static_cast<uint8_t>(Reply::Timeout));
      timed_out.str(detail::concat("timed out after ", expired.timeout_ms, " ms waiting for key(s) ",
                                   key_list(expired.keys), "; missing ", key_list(absent)));
      if (expired.kind == Pending::Kind::GetMany) {  // and which of the keys asked were missing
        timed_out.u32(static_cast<uint32_t>(absent_at.size()));
        for (uint32_t at : absent_at) timed_out.u32(at);
      }
      self->send(timed_out.finish());
    });
  }

  void drop_pending() {
    if (pending_) take_pending();
  }

  // The pending request, this session no longer registered in `waiting` for any of its keys. Unregistered
  // before its keys are moved out: a registration left behind (as when the timeout's handler moved them out
  // first) made a later set of that key count against this session's next request (a GET answered with its
  // key absent failed the handler) or, once the session had closed, call a freed session.
  Pending take_pending() {
    for (const auto& k : pending_->keys) {
      auto it = server_.waiting.find(k);
      if (it == server_.waiting.end()) continue;
      it->second.erase(this);
      if (it->second.empty()) server_.waiting.erase(it);
    }
    Pending taken = std::move(*pending_);
    pending_.reset();
    return taken;
  }

  // GET_MANY's reply, every key present: Ok, u32 n, then each value as a str. Every value is shared, not
  // copied (a part of its own, as a GET's), so the budgets count a value once however many replies carry it:
  // a rendezvous where every rank asks for every other rank's addresses at once queues each value once, not
  // once per rank (copies of 54 KB values in 400 replies of 16 MiB passed max_queued_bytes). A write gathers
  // many parts (write_front), so a reply of many small values is still a few writes. Values that would not fit
  // one frame get an Error instead (the connection stays usable: the request was well formed).
  void send_values(const std::vector<std::string>& keys) {
    size_t body = 1 + 4;
    for (const auto& k : keys) body += 4 + server_.data.at(k)->size();
    if (body > protocol::kMaxFrameBytes)
      return send(reply(Reply::Error, detail::concat("the values of the ", keys.size(), " keys asked (", key_list(keys),
                                                     ") make a reply of ", body, " bytes, the limit is ",
                                                     protocol::kMaxFrameBytes, ": get them in fewer at a time")));
    std::vector<Out> parts;
    parts.reserve(keys.size() + 1);
    std::vector<char> head =
        protocol::Writer(static_cast<uint8_t>(Reply::Ok)).u32(static_cast<uint32_t>(keys.size())).finish(body - 1 - 4);
    for (const auto& k : keys) {
      const Value& value = server_.data.at(k);
      const auto size = static_cast<uint32_t>(value->size());
      for (int b = 0; b < 4; ++b) head.push_back(static_cast<char>((size >> (8 * b)) & 0xff));
      parts.push_back(Out{std::move(head), value});
      head = {};
    }
    if (parts.empty()) parts.push_back(Out{std::move(head), nullptr});
    queue(std::move(parts));
  }

  // Protocol violation: tell the client why (after any reply already queued),
  // then close.
  void fail(const std::string& why) {
    server_.log.warn("protocol violation", detail::concat("closing connection from ", peer_, ": ", why));
    drop_pending();
    wait_timer_.cancel();
    send(reply(Reply::Error, why), true);
  }

  // Queues a reply (frame, then the shared value's bytes when there is one);
  // replies go out in order, one write at a time. With close_after, nothing
  // more is read and the connection closes once the queue is written (or after
  // frame_timeout if the client does not read it). A reply that would take the
  // connection's queued bytes over max_queued_bytes_per_connection, or the
  // server's over max_queued_bytes, closes the connection instead.
  void send(std::vector<char> frame, bool close_after = false, Value value = nullptr) {
    std::vector<Out> parts;
    parts.push_back(Out{std::move(frame), std::move(value)});
    queue(std::move(parts), close_after);
  }

  // Queues one reply made of parts written in order (send's frame and value, or GET_MANY's values), its
  // bytes counted against the budgets as a whole, so a reply is queued whole or not at all.
  void queue(std::vector<Out> parts, bool close_after = false) {
    if (closed_ || closing_) return;
    size_t bytes = 0;
    size_t server_bytes = 0;  // a value already queued, or twice in this reply, counts once in all
    std::unordered_set<const std::vector<char>*> new_values;
    for (const Out& part : parts) {
      bytes += part.bytes();
      server_bytes += part.head.size();
      const std::vector<char>* value = part.value.get();
      if (value && server_.queued_values.count(value) == 0 && new_values.insert(value).second)
        server_bytes += value->size();
    }
    size_t server_after = server_.queued_bytes + server_bytes;
    if (queued_ + bytes > server_.options.max_queued_bytes_per_connection ||
        server_after > server_.options.max_queued_bytes) {
      server_.log.warn("reply budget", detail::concat("closing connection from ", peer_, ": a reply of ", bytes,
                                                      " bytes would make ", queued_ + bytes,
                                                      " bytes queued for it (max_queued_bytes_per_connection ",
                                                      server_.options.max_queued_bytes_per_connection, ") and ",
                                                      server_after, " for all (max_queued_bytes ",
                                                      server_.options.max_queued_bytes, ")"));
      abort();
      return;
    }
    queued_ += bytes;
    const bool idle = out_.empty();
    for (Out& part : parts) {
      server_.account_queued(part.head, part.value, +1);
      out_.push_back(std::move(part));
    }
    if (close_after) {
      closing_ = true;
      arm_deadline(server_.options.frame_timeout, "read its last reply", "frame deadline");
    } else if (header_got_ == 0) {
      disarm_deadline();  // a reply being written is not idling; rearmed once written
    }
    if (idle) write_front();
  }

  // Writes what is left of the queued replies, up to kMaxWriteBuffers parts' buffers in one write (writev),
  // from `written_` bytes into the front part on; each write must go out within frame_timeout, so a client
  // that stops reading is closed.
  void write_front() {
    std::vector<asio::const_buffer> rest;
    rest.reserve(std::min(kMaxWriteBuffers, 2 * out_.size()));
    size_t skip = written_;  // only into the front part
    for (const Out& part : out_) {
      if (rest.size() + 2 > kMaxWriteBuffers) break;
      const size_t head = part.head.size();
      if (skip < head) rest.push_back(asio::buffer(part.head.data() + skip, head - skip));
      if (part.value && !part.value->empty()) {
        const size_t into_value = skip > head ? skip - head : 0;
        rest.push_back(asio::buffer(part.value->data() + into_value, part.value->size() - into_value));
      }
      skip = 0;
    }
    write_timer_.expires_after(server_.options.frame_timeout);
    write_timer_.async_wait([self = shared_from_this(), gen = ++write_gen_](boost::system::error_code ec) {
      if (ec || gen != self->write_gen_ || self->closed_) return;
      self->server_.log.warn("write deadline",
                             detail::concat("closing connection from ", self->peer_, ": it did not read its reply (",
                                            self->queued_, " bytes queued) within ",
                                            self->server_.options.frame_timeout.count(), " ms"));
      self->abort();
    });
    socket_.async_write_some(rest, [self = shared_from_this()](boost::system::error_code ec, size_t n) {
      self->on_written(ec, n);
    });
  }

  void on_written(boost::system::error_code ec, size_t n) {
    if (closed_) return;
    ++write_gen_;
    write_timer_.cancel();
    if (ec) {
      close();
      return;
    }
    written_ += n;
    // The parts written whole leave the queue and the budgets; what was written of the next stays in written_.
    while (!out_.empty()) {
      const Out& front = out_.front();
      const size_t total = front.bytes();
      if (written_ < total) break;
      written_ -= total;
      queued_ -= total;
      server_.account_queued(front.head, front.value, -1);
      out_.pop_front();
    }
    if (!out_.empty()) {
      write_front();
      return;
    }
    if (closing_) {
      close();
      return;
    }
    if (reading_)
      rearm_idle();  // the read armed while a get/wait was pending carries on
    else
      read_header();
  }

  TcpStoreServer::Impl& server_;
  tcp::socket socket_;
  asio::steady_timer deadline_;    // authentication, frame in progress, idle, last reply
  asio::steady_timer wait_timer_;  // pending get/wait/get_many
  uint64_t deadline_gen_ = 0;
  std::string peer_;     // address:port, for logs
  std::string address_;  // source (address, or loopback), for the per-source caps
  bool authenticated_ = false;
  bool closed_ = false;
  bool closing_ = false;  // last reply queued; nothing more is read or sent
  bool reading_ = false;  // a header or body read is outstanding
  unsigned char header_[4] = {};
  size_t header_got_ = 0;
  std::vector<char> body_;
  size_t body_length_ = 0;
  size_t body_got_ = 0;
  std::deque<Out> out_;  // replies not yet written; front is in flight
  size_t written_ = 0;   // bytes of out_.front() written
  size_t queued_ = 0;    // bytes of out_
  asio::steady_timer write_timer_;  // the front reply's progress
  uint64_t write_gen_ = 0;
  std::optional<Pending> pending_;
};

}  // namespace

void TcpStoreServer::Impl::accept() {
  acceptor.async_wait(tcp::acceptor::wait_read, [this](boost::system::error_code ec) {
    if (ec || !acceptor.is_open()) return;
    accept_ready();
  });
}

void TcpStoreServer::Impl::accept_ready() {
  for (int i = 0; i < kAcceptBatch; ++i) {
    int fd = ::accept4(acceptor.native_handle(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      accept_backoff = kMinAcceptBackoff;
      admit(fd);
      continue;
    }
    int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      accept();  // backlog drained: wait for the next connection
      return;
    }
    // The connection died in the backlog, or a signal: take the next one.
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    if (err == EMFILE || err == ENFILE) {
      // Linux reports EMFILE before looking at the backlog: with none waiting,
      // wait for the next connection rather than shed anyone.
      pollfd backlog{acceptor.native_handle(), POLLIN, 0};
      if (::poll(&backlog, 1, 0) == 0) {
        accept();
        return;
      }
      // Out of descriptors with a connection waiting: an unauthenticated
      // connection is the one to give up.
      if (shed_oldest_unauthenticated(nullptr, std::string("out of file descriptors (") + detail::errno_text(err) + ")"))
        continue;
    }
    // Nothing to shed (EMFILE with only authenticated clients, ENOBUFS, ENOMEM):
    // wait before trying again, so the loop does not spin on a full backlog;
    // connected clients are served meanwhile.
    log.warn("accept failed", detail::concat("accept failed: ", detail::errno_text(err), "; retrying in ",
                                             accept_backoff.count(), " ms, connected clients are still served"));
    accept_retry.expires_after(accept_backoff);
    accept_backoff = std::min(accept_backoff * 2, kMaxAcceptBackoff);
    accept_retry.async_wait([this](boost::system::error_code ec) {
      if (!ec && acceptor.is_open()) accept_ready();
    });
    return;
  }
  // Batch done with connections left in the backlog: come back after the
  // handlers already queued. Not through accept(): the reactor is
  // edge-triggered, so waiting for readiness that was already reported would
  // stall until yet another connection arrives.
  asio::post(io, [this] {
    if (acceptor.is_open()) accept_ready();
  });
}

void TcpStoreServer::Impl::admit(int fd) {
  sockaddr_storage remote{};
  socklen_t length = sizeof remote;
  bool v6 = ::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &length) == 0 && remote.ss_family == AF_INET6;
  boost::system::error_code ec;
  tcp::socket socket(io);
  socket.assign(v6 ? tcp::v6() : tcp::v4(), fd, ec);
  if (ec) {
    ::close(fd);
    return;
  }
  boost::system::error_code ignored;
  auto endpoint = socket.remote_endpoint(ignored);
  std::string address = source_of(endpoint.address());
  std::string peer = detail::concat(endpoint.address().to_string(ignored), ":", endpoint.port());
  socket.set_option(tcp::no_delay(true), ignored);
  // Detects peers that vanished without a FIN while idle.
  socket.set_option(asio::socket_base::keep_alive(true), ignored);

  // Admission: the newest connection always gets in; over a cap, the oldest
  // unauthenticated one (from the same address first) makes room. A legitimate
  // client authenticates within a round trip of connecting, so only connections
  // that sit silent are pushed out; an evicted client reconnects.
  auto from_address = unauthenticated_per_address.find(address);
  if (from_address != unauthenticated_per_address.end() && from_address->second >= unauthenticated_per_source_cap)
    shed_oldest_unauthenticated(&address, detail::concat(unauthenticated_per_source_cap,
                                                         " unauthenticated connections from ", address,
                                                         " (max_unauthenticated_per_address)"));
  if (unauthenticated.size() >= unauthenticated_cap)
    shed_oldest_unauthenticated(
        nullptr, detail::concat(unauthenticated_cap, " unauthenticated connections (max_unauthenticated)"));
  if (sessions.size() >= budget) {
    // Every connection counted against the descriptor budget is authenticated
    // and in use: refuse this one rather than run out of descriptors.
    std::string why = detail::concat(sessions.size(), " connections are open, the descriptor budget is ", budget,
                                     " (RLIMIT_NOFILE less reserved_descriptors)");
    if (!shed_oldest_unauthenticated(nullptr, why) && !shed_oldest_unused(nullptr, why)) {
      refused.fetch_add(1);
      log.warn("refused client", detail::concat("refused client ", peer, ": ", why));
      socket.close(ignored);
      return;
    }
  }

  auto session = std::make_shared<Session>(*this, std::move(socket), std::move(peer), address);
  sessions.insert(session);
  session->unauthenticated_entry = unauthenticated.insert(unauthenticated.end(), session.get());
  ++unauthenticated_per_address[address];
  session->start();
}

bool TcpStoreServer::Impl::shed_oldest_unauthenticated(const std::string* address, const std::string& why) {
  auto it = std::find_if(unauthenticated.begin(), unauthenticated.end(),
                         [&](Session* s) { return address == nullptr || s->address() == *address; });
  if (it == unauthenticated.end()) return false;
  Session* victim = *it;
  shed.fetch_add(1);
  log.warn("shed unauthenticated",
           detail::concat("closing unauthenticated connection from ", victim->peer(), " to admit another: ", why));
  victim->close();
  return true;
}

bool TcpStoreServer::Impl::shed_oldest_unused(const std::string* source, const std::string& why) {
  auto now = Clock::now();
  // Oldest first, so the first too young to shed ends the search.
  for (Session* s : unused) {
    if (now - s->authenticated_at < options.auth_timeout) return false;
    if (source != nullptr && s->address() != *source) continue;
    shed.fetch_add(1);
    log.warn("shed unused", detail::concat("closing authenticated connection from ", s->peer(),
                                           ", which sent no request, to admit another: ", why));
    s->close();
    return true;
  }
  return false;
}

std::optional<std::string> TcpStoreServer::Impl::store(const std::string& key, std::vector<char> value) {
  auto it = data.find(key);
  size_t old_bytes = it == data.end() ? 0 : key.size() + it->second->size();
  size_t new_bytes = key.size() + value.size();
  if (it == data.end() && data.size() >= options.max_keys)
    return detail::concat("store quota exceeded: setting key '", key, "' would make ", data.size() + 1,
                          " keys, the limit is ", options.max_keys, " (TcpStoreServerOptions::max_keys)");
  if (data_bytes - old_bytes + new_bytes > options.max_bytes)
    return detail::concat("store quota exceeded: setting key '", key, "' (", new_bytes, " bytes) would make ",
                          data_bytes - old_bytes + new_bytes, " bytes of keys and values, the limit is ",
                          options.max_bytes, " (TcpStoreServerOptions::max_bytes)");
  data_bytes = data_bytes - old_bytes + new_bytes;
  auto shared = std::make_shared<const std::vector<char>>(std::move(value));
  if (it == data.end())
    data.emplace(key, std::move(shared));
  else
    it->second = std::move(shared);
  return std::nullopt;
}

void TcpStoreServer::Impl::account_queued(const std::vector<char>& head, const Value& value, int sign) {
  size_t bytes = head.size();
  if (value) {
    size_t& replies = queued_values[value.get()];
    if (sign > 0 ? replies++ == 0 : --replies == 0) bytes += value->size();
    if (replies == 0) queued_values.erase(value.get());
  }
  queued_bytes = sign > 0 ? queued_bytes + bytes : queued_bytes - bytes;
  queued_bytes_seen.store(queued_bytes, std::memory_order_relaxed);
}

void TcpStoreServer::Impl::erase(const std::string& key) {
  auto it = data.find(key);
  if (it == data.end()) return;
  data_bytes -= key.size() + it->second->size();
  data.erase(it);
}

void TcpStoreServer::Impl::on_set(const std::string& key) {
  auto it = waiting.find(key);
  if (it == waiting.end()) return;
  // key_arrived() edits `waiting`: work on a copy.
  std::vector<Session*> waiters(it->second.begin(), it->second.end());
  for (Session* s : waiters) s->key_arrived(key);
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
  PSGD_REQUIRE(options.auth_timeout.count() > 0, InvalidArgumentError,
               "store server auth_timeout must be > 0 ms, got ", options.auth_timeout.count());
  PSGD_REQUIRE(options.max_unauthenticated >= 1 && options.max_unauthenticated_per_address >= 1,
               InvalidArgumentError, "store server max_unauthenticated (", options.max_unauthenticated,
               ") and max_unauthenticated_per_address (", options.max_unauthenticated_per_address,
               ") must be >= 1");
  PSGD_REQUIRE(options.max_authenticated_per_address >= 1, InvalidArgumentError,
               "store server max_authenticated_per_address (", options.max_authenticated_per_address,
               ") must be >= 1");
  PSGD_REQUIRE(options.token.size() <= kMaxKeyBytes, InvalidArgumentError, "store job token is ",
               options.token.size(), " bytes, the limit is ", kMaxKeyBytes);
  std::string where = detail::concat(options.bind_address, ":", options.port);
  {
    // The descriptor budget and the caps it bounds (store.hpp).
    rlimit limit{};
    size_t soft = ::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY
                      ? static_cast<size_t>(limit.rlim_cur)
                      : size_t{1} << 20;
    size_t used = open_descriptor_count() + 1 + options.reserved_descriptors;  // + the listening socket
    Impl& i = *impl_;
    i.budget = std::max<size_t>(soft > used ? soft - used : 0, 4);
    i.unauthenticated_cap = std::clamp<size_t>(options.max_unauthenticated, 1, std::max<size_t>(i.budget / 4, 1));
    i.unauthenticated_per_source_cap = std::min(options.max_unauthenticated_per_address, i.unauthenticated_cap);
    i.authenticated_cap = i.budget - i.unauthenticated_cap;
    size_t reserve = std::min(options.reserved_for_other_sources, i.authenticated_cap / 2);
    i.authenticated_per_source_cap = std::min(options.max_authenticated_per_address, i.authenticated_cap - reserve);
    PSGD_LOG(Debug, "store server: descriptor budget ", i.budget, " (RLIMIT_NOFILE ", soft, "), at most ",
             i.authenticated_cap, " authenticated connections, ", i.authenticated_per_source_cap, " per source");
  }
  boost::system::error_code ec;
  tcp::resolver resolver(impl_->io);
  auto results = resolver.resolve(options.bind_address, std::to_string(options.port),
                                  tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || results.empty())
    PSGD_THROW(InvalidArgumentError, "store server bind address '", options.bind_address,
               "' does not resolve: ", ec.message());
  // The first of the name's addresses this host has ("localhost" may list ::1 first where IPv6 is off; clients
  // try each address the name resolves to). Only an address the host lacks moves on: any other failure (the
  // port in use: another job's store, which this job's clients would reach at the first address) is the error.
  auto& acceptor = impl_->acceptor;
  const auto absent = [](const boost::system::error_code& error) {
    return error == boost::system::errc::address_not_available ||
           error == boost::system::errc::address_family_not_supported ||
           error == boost::system::errc::protocol_not_supported;
  };
  for (const auto& result : results) {
    const tcp::endpoint endpoint = result.endpoint();
    boost::system::error_code ignored;
    acceptor.close(ignored);
    // Created close-on-exec in one step: another thread may fork and exec at any time.
    int fd = ::socket(endpoint.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
    if (fd < 0) {
      ec = {errno, boost::system::system_category()};
    } else if (acceptor.assign(endpoint.protocol(), fd, ec)) {
      ::close(fd);
    } else if (!acceptor.set_option(tcp::acceptor::reuse_address(true), ec) && !acceptor.bind(endpoint, ec) &&
               !acceptor.listen(asio::socket_base::max_listen_connections, ec) && !acceptor.non_blocking(true, ec)) {
      break;
    }
    if (!absent(ec)) break;
  }
  if (ec) {
    boost::system::error_code ignored;
    acceptor.close(ignored);
    PSGD_THROW(IoError, "store server cannot listen on ", where, ": ", ec.message());
  }
  impl_->bound_port = acceptor.local_endpoint().port();
  asio::post(impl_->io, [impl = impl_.get()] { impl->accept_ready(); });
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
  PSGD_LOG(Info, "store server listening on ", options.bind_address, ":", impl_->bound_port);
}

TcpStoreServer::~TcpStoreServer() { stop(); }

uint16_t TcpStoreServer::port() const { return impl_->bound_port; }

uint64_t TcpStoreServer::refused_clients() const { return impl_->refused.load(); }

uint64_t TcpStoreServer::shed_connections() const { return impl_->shed.load(); }

size_t TcpStoreServer::connection_budget() const { return impl_->budget; }

size_t TcpStoreServer::queued_reply_bytes() const { return impl_->queued_bytes_seen.load(std::memory_order_relaxed); }

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
    impl->log.flush();
  });
  impl_->thread.join();
}

}  // namespace powersgd::transport
