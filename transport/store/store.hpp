// Rendezvous key-value stores. Private to powersgd (tools link the internal
// library). Wire protocol of the TCP store: docs/store-protocol.md.
//
// All stores implement gloo::rendezvous::Store, with get() and wait() honouring
// the store's timeout (Gloo's own stores wait a hard-coded 30 s), plus add()
// (atomic counter) and check() (non-blocking existence test).
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace powersgd::transport {

// Limits enforced by every store (and by the TCP server on the wire).
inline constexpr size_t kMaxKeyBytes = 4096;
inline constexpr size_t kMaxValueBytes = 64u << 20;

class Store : public gloo::rendezvous::Store {
 public:
  // set: overwrites. get: waits up to timeout() for the key, then TimeoutError
  // naming the key. wait: waits for all keys; the timeout argument overrides.
  // Errors: TimeoutError, IoError (connection lost), InvalidArgumentError (limits).
  // Thread-safety: every store may be shared between threads (calls on one TCP
  // client are serialized); set_timeout() is not synchronized: call it before sharing.
  using gloo::rendezvous::Store::wait;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout()); }
  // get with the store's timeout (Gloo's form), and with the caller's: a deadline of its own (get_many's
  // fallback gets what is left of its timeout once its wait returned).
  std::vector<char> get(const std::string& key) final { return get(key, timeout()); }
  virtual std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override = 0;

  // Waits up to `timeout` for all keys, then returns their values in the order of `keys`: what wait() and a
  // get() of each would return, in one request where the store can (the TCP store, where its server offers
  // it: one round trip instead of 1 + keys.size()). TimeoutError naming the keys; InvalidArgumentError where
  // the values would not fit one reply (kMaxValueBytes + kMaxKeyBytes in all, about).
  virtual std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys,
                                                  std::chrono::milliseconds timeout);
  // How many keys one get_many may ask for where each value has about `value_bytes`: replies of at most 16 MiB
  // (within the store's frame) and 1024 keys (the TCP store takes up to 4096 per request); at least 1.
  static size_t keys_per_get_many(size_t value_bytes);

  // Atomically adds delta to the 64-bit counter stored at key (absent = 0) and
  // returns the new value. The counter is stored as decimal text, so get() reads
  // it; add() on a value that is not one, or an overflow, is InvalidArgumentError.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key exists; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Deletes key; true when it existed. Never blocks on other clients.
  virtual bool remove(const std::string& key) = 0;

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 private:
  std::chrono::milliseconds timeout_{300000};
};

// ---- TCP store (Boost.Asio) ----

struct TcpStoreServerOptions {
  std::string bind_address = "127.0.0.1";  // "0.0.0.0" / "::" to serve other hosts
  uint16_t port = 0;                        // 0: pick a free port
  std::string token;                        // empty: no authentication
  std::chrono::milliseconds client_idle_timeout{0};  // 0: none; a client waiting in get/wait is not idle
  // A frame whose first byte has arrived must complete within this (and a
  // client must read its last reply within it before the server closes).
  std::chrono::milliseconds frame_timeout{10000};
  // A new connection must authenticate (send a valid HELLO) within this.
  std::chrono::milliseconds auth_timeout{1000};
  // Caps on connections that have not authenticated yet, overall and per peer
  // address. Over a cap the oldest such connection is closed to admit the new one.
  size_t max_unauthenticated = 256;
  size_t max_unauthenticated_per_address = 64;
  // Cap on authenticated connections per source (a job holds one per rank and
  // communicator); every loopback address (127.0.0.0/8, ::1) is one source. A
  // HELLO over it, or over the descriptor budget below, first closes the oldest
  // authenticated connection of that source (of any source when the budget is
  // full) that has sent no request within auth_timeout of its HELLO; with none,
  // it is refused with the reason. So a process that knows the token (any local
  // process when there is none) and holds idle connections cannot keep a rank
  // out, and no source can take every descriptor.
  size_t max_authenticated_per_address = 1024;
  // The descriptor budget: every connection the server holds fits in
  // RLIMIT_NOFILE's soft limit, read when the server starts, less the
  // descriptors open then, less reserved_descriptors (for the rest of the
  // process: rank 0's own store client and Gloo's sockets). Accept therefore
  // never runs out of descriptors because of clients. The unauthenticated caps
  // take at most a quarter of it.
  size_t reserved_descriptors = 64;
  // Authenticated connections no single source may take (clamped to half of
  // what the budget leaves them), kept for ranks on other hosts.
  size_t reserved_for_other_sources = 64;
  // Quotas on the stored data: number of keys, and bytes of keys plus values. A
  // set or add beyond them fails with an Error reply naming the quota; the
  // connection stays usable.
  size_t max_keys = size_t{1} << 20;
  size_t max_bytes = size_t{4} << 30;
  // Bytes held by replies not yet written, per connection and in all (a value
  // shared by several replies counts once in all). A reply over either closes
  // its connection, as does a reply whose next bytes the client does not take
  // within frame_timeout. The server reads a connection's next request only
  // once its replies are written, so a reader holds at most about one reply.
  size_t max_queued_bytes_per_connection = kMaxValueBytes + (size_t{1} << 20);
  size_t max_queued_bytes = size_t{1} << 30;
};

// Serves on its own thread until destroyed or stop()ped. Never blocks or crashes
// on malformed, oversized, slow or vanished clients, nor on floods of idle
// connections; refuses clients with a wrong token (logging their address, at
// most one line per cause every 10 s) and keeps serving the others. Every socket
// it creates is close-on-exec.
class TcpStoreServer {
 public:
  // Binds and starts listening before returning (throws IoError naming the
  // address when it cannot), so clients may connect as soon as it returns.
  explicit TcpStoreServer(const TcpStoreServerOptions& options);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const;
  // Closes every connection (waiting clients get IoError) and joins the server
  // thread. Idempotent; the destructor calls it.
  void stop();
  // Number of connections refused so far (bad token, version or HELLO, or over
  // max_authenticated_per_address or the descriptor budget; for tests and logs).
  uint64_t refused_clients() const;
  // Number of connections closed to respect the caps so far (unauthenticated
  // ones, and authenticated ones that never sent a request).
  uint64_t shed_connections() const;
  // Connections the server may hold at once (the descriptor budget).
  size_t connection_budget() const;
  // Bytes held by queued replies now (see max_queued_bytes).
  size_t queued_reply_bytes() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Connects (retrying until timeout while the server is not up yet) and
// authenticates. Throws TimeoutError / IoError naming host:port, or
// IoError("... refused: wrong job token") when the server refuses the token.
std::unique_ptr<Store> connect_tcp_store(const std::string& host, uint16_t port, const std::string& token,
                                         std::chrono::milliseconds timeout);

// ---- file store for shared filesystems ----
// Keys live under directory/prefix/; prefix should be unique per run (run id).
std::unique_ptr<Store> make_file_store(const std::string& directory, const std::string& prefix,
                                       std::chrono::milliseconds timeout);

// ---- prefix wrapper: owns nothing, `inner` must outlive it ----
std::unique_ptr<Store> make_prefix_store(Store& inner, const std::string& prefix);

// The per-job key prefix derived from the job token: "job-" and 32 hex digits
// of SHA-1 over a domain tag and the token, so every rank computes the same
// one, it names no key another job could predict without the token, and it
// reveals nothing of the token (keys appear in logs and error messages).
// Empty for an empty token.
std::string job_key_prefix(const std::string& token);

}  // namespace powersgd::transport
