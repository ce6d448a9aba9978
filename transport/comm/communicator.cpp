#include "comm/communicator.hpp"

#include <gloo/algorithm.h>
#include <gloo/allgather.h>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/alltoall.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/barrier.h>
#include <gloo/barrier_all_to_one.h>
#include <gloo/broadcast.h>
#include <gloo/broadcast_one_to_all.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/math.h>
#include <gloo/types.h>

#include <arpa/inet.h>

#include <csignal>
#include <fstream>
#include <map>
#include <climits>
#include <cctype>
#include <cstring>

#include "comm/address.hpp"
#include "comm/device.hpp"
#include "comm/reduce.hpp"
#include "common/check.hpp"
#include "common/completion.hpp"
#include "common/log.hpp"
#include "powersgd_build_config.h"

namespace powersgd {

void Work::wait() const {
  PSGD_REQUIRE(state_ != nullptr, InvalidArgumentError, "Work::wait() on an empty Work handle");
  state_->wait();
}

bool Work::done() const {
  PSGD_REQUIRE(state_ != nullptr, InvalidArgumentError, "Work::done() on an empty Work handle");
  return state_->done();
}

std::unique_ptr<Communicator> Communicator::create(const CommOptions& options) {
  return transport::GlooCommunicator::create(options);
}

}  // namespace powersgd

namespace powersgd::transport {
namespace {

using GlooReduce = void (*)(void*, const void*, const void*, size_t);

GlooReduce new_style_sum(DataType type) {
  switch (type) {
    case DataType::Float32:
      return static_cast<GlooReduce>(&gloo::sum<float>);
    case DataType::Float64:
      return static_cast<GlooReduce>(&gloo::sum<double>);
    case DataType::Float16:
      return static_cast<GlooReduce>(&gloo::sum<gloo::float16>);
    case DataType::BFloat16:
      return &bfloat16_sum;
  }
  PSGD_ASSERT(false, "unknown DataType ", static_cast<int>(type));
  __builtin_unreachable();
}

template <typename T>
void run_legacy_allreduce(const std::shared_ptr<gloo::Context>& context, void* data, size_t count,
                          Algorithm algorithm, const gloo::ReductionFunction<T>* fn) {
  // Old-style classes take int counts: split larger buffers.
  constexpr size_t kMaxCount = INT_MAX / 8;
  for (size_t offset = 0; offset < count; offset += kMaxCount) {
    int n = static_cast<int>(std::min(kMaxCount, count - offset));
    std::vector<T*> ptrs{static_cast<T*>(data) + offset};
    if (algorithm == Algorithm::Ring)
      gloo::AllreduceRingChunked<T>(context, ptrs, n, fn).run();
    else
      gloo::AllreduceHalvingDoubling<T>(context, ptrs, n, fn).run();
  }
}

void legacy_allreduce(const std::shared_ptr<gloo::Context>& context, void* data, size_t count, DataType type,
                      Algorithm algorithm) {
  static const gloo::ReductionFunction<uint16_t> bf16(gloo::CUSTOM, &bfloat16_sum_inplace);
  switch (type) {
    case DataType::Float32:
      return run_legacy_allreduce<float>(context, data, count, algorithm, gloo::ReductionFunction<float>::sum);
    case DataType::Float64:
      return run_legacy_allreduce<double>(context, data, count, algorithm, gloo::ReductionFunction<double>::sum);
    case DataType::Float16:
      return run_legacy_allreduce<gloo::float16>(context, data, count, algorithm,
                                                 gloo::ReductionFunction<gloo::float16>::sum);
    case DataType::BFloat16:
      return run_legacy_allreduce<uint16_t>(context, data, count, algorithm, &bf16);
  }
}

// Gloo's element size comes from the pointer type.
void set_output(gloo::AllreduceOptions& opts, void* data, size_t count, DataType type) {
  switch (type) {
    case DataType::Float32:
      return opts.setOutput(static_cast<float*>(data), count);
    case DataType::Float64:
      return opts.setOutput(static_cast<double*>(data), count);
    case DataType::Float16:
      return opts.setOutput(static_cast<gloo::float16*>(data), count);
    case DataType::BFloat16:
      return opts.setOutput(static_cast<uint16_t*>(data), count);
  }
}

// Settings every rank must agree on, exchanged once at creation, followed by
// the listening ports of this rank's pairs (one per peer, uint16_t each).
struct Fingerprint {
  char version[16];
  int32_t world_size;
  int32_t transport;
  int32_t api;
  int32_t reserved;
  uint64_t ring_threshold_bytes;
  // Debian's Gloo listens on one port per pair and names the failed pair by
  // its peer's "[ip]:port": this table turns that back into a rank.
  char ip[48];
};

// Splits a TCP pair address ("[ip]:port$seq") into ip and port as Gloo prints
// it: the raw network-order sin_port read as a native integer (ntohs gives the
// real port). Port 0 if the address is not TCP.
std::pair<std::string, uint16_t> split_address(const std::string& text) {
  size_t open = text.find('[');
  size_t close = text.find("]:");
  if (open != 0 || close == std::string::npos) return {"", 0};
  unsigned long port = std::strtoul(text.c_str() + close + 2, nullptr, 10);
  return {text.substr(1, close - 1), static_cast<uint16_t>(port <= 65535 ? port : 0)};
}

// This process's established IPv4 TCP connections from the kernel's socket
// table: local port -> remote port (host byte order). Empty when /proc is
// unavailable.
std::map<uint16_t, uint16_t> established_connections() {
  std::map<uint16_t, uint16_t> connections;
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // header
  while (std::getline(table, line)) {
    unsigned local_ip = 0, local_port = 0, remote_ip = 0, remote_port = 0, state = 0;
    if (std::sscanf(line.c_str(), " %*u: %8X:%4X %8X:%4X %2X", &local_ip, &local_port, &remote_ip, &remote_port,
                    &state) == 5 &&
        state == 1 /* TCP_ESTABLISHED */)
      connections[static_cast<uint16_t>(local_port)] = static_cast<uint16_t>(remote_port);
  }
  return connections;
}

bool is_timeout_message(const std::string& message) {
  return message.find("Timed out") != std::string::npos || message.find("timeout") != std::string::npos ||
         message.find("Timeout") != std::string::npos;
}

}  // namespace

const char* to_string(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::Auto:
      return "auto";
    case Algorithm::Ring:
      return "ring";
    case Algorithm::Bcube:
      return "bcube";
    case Algorithm::HalvingDoubling:
      return "halving-doubling";
  }
  return "?";
}

GlooCommunicator::GlooCommunicator(const CommOptions& options, GlooApi api) : options_(options), api_(api) {
  if (options_.transport == TransportKind::Ibverbs) api_ = GlooApi::Legacy;
}

std::unique_ptr<GlooCommunicator> GlooCommunicator::create(const CommOptions& options, GlooApi api) {
  PSGD_REQUIRE(options.world_size >= 1, InvalidArgumentError, "world size ", options.world_size,
               " is invalid: expected >= 1");
  PSGD_REQUIRE(options.rank >= 0 && options.rank < options.world_size, InvalidArgumentError, "rank ",
               options.rank, " is out of range: expected 0 to ", options.world_size - 1);
  PSGD_REQUIRE(options.timeout.count() > 0, InvalidArgumentError, "timeout ", options.timeout.count(),
               " ms is invalid: expected > 0");
  PSGD_REQUIRE(options.store_port != 0 || (options.host_store && options.world_size == 1), InvalidArgumentError,
               "store port 0 is only valid for a single process hosting its own store: set MASTER_PORT");
  // A peer that vanishes must surface as an error from send(), not kill us.
  std::signal(SIGPIPE, SIG_IGN);
  log::set_rank(options.rank);
  std::unique_ptr<GlooCommunicator> comm(new GlooCommunicator(options, api));
  comm->connect();
  return comm;
}

void GlooCommunicator::connect() {
  if (options_.host_store) {
    TcpStoreServerOptions server;
    // Other hosts must reach the store unless the whole job is on loopback.
    server.bind_address = is_loopback(options_.store_addr) ? "127.0.0.1"
                          : options_.store_addr.find(':') != std::string::npos ? "::"
                                                                               : "0.0.0.0";
    server.port = options_.store_port;
    server.token = options_.token;
    server_ = std::make_unique<TcpStoreServer>(server);
    options_.store_port = server_->port();
  }
  store_ = connect_tcp_store(options_.store_addr, options_.store_port, options_.token, options_.timeout);
  store_->set_timeout(options_.timeout);

  // Every group that forms on this store gets a fresh generation, so a rebuilt
  // group never reads the keys of the one before.
  std::string run = "powersgd/" + (options_.run_id.empty() ? std::string("default") : options_.run_id);
  int64_t joined = store_->add(run + "/joined", 1);
  std::string prefix = run + "/g" + std::to_string((joined - 1) / options_.world_size);
  auto scoped = make_prefix_store(*store_, prefix);

  device_ = make_device(options_);
  context_ = std::make_shared<gloo::rendezvous::Context>(options_.rank, options_.world_size);
  context_->setTimeout(options_.timeout);  // before connectFullMesh: pairs copy it
  try {
    context_->connectFullMesh(*scoped, device_);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (is_timeout_message(message))
      PSGD_THROW(TimeoutError, "rendezvous of ", options_.world_size, " ranks at ", options_.store_addr, ":",
                 options_.store_port, " timed out after ", options_.timeout.count(), " ms: ", message);
    PSGD_THROW(IoError, "rendezvous of ", options_.world_size, " ranks at ", options_.store_addr, ":",
               options_.store_port, " failed: ", message);
  }
  thread_ = std::thread([this] { loop(); });
  check_fingerprint();
}

void GlooCommunicator::check_fingerprint() {
  const size_t n = static_cast<size_t>(options_.world_size);
  // Pairs finish connecting lazily; the pair addresses below are final only
  // once every pair has carried traffic.
  GlooApi api = api_;
  std::chrono::milliseconds timeout = options_.timeout;
  submit("connect", [=](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (n == 1) return;
    if (api == GlooApi::Legacy) return gloo::BarrierAllToAll(context).run();
    std::vector<uint8_t> in(n), out(n);
    gloo::AlltoallOptions opts(context);
    opts.setInput(in.data(), n);
    opts.setOutput(out.data(), n);
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::alltoall(opts);
  }).wait();
  const size_t record = sizeof(Fingerprint) + n * sizeof(uint16_t);
  std::vector<uint8_t> mine(record, 0);
  Fingerprint header{};
  std::snprintf(header.version, sizeof(header.version), "%s", PSGD_VERSION);
  header.world_size = options_.world_size;
  header.transport = static_cast<int32_t>(options_.transport);
  header.api = static_cast<int32_t>(api_);
  header.ring_threshold_bytes = options_.ring_threshold_bytes;
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == options_.rank) continue;
    auto [ip, port] = split_address(context_->getPair(static_cast<int>(peer))->address().str());
    std::snprintf(header.ip, sizeof(header.ip), "%s", ip.c_str());
    std::memcpy(mine.data() + sizeof(Fingerprint) + peer * sizeof(uint16_t), &port, sizeof(port));
  }
  std::memcpy(mine.data(), &header, sizeof(header));
  std::vector<uint8_t> gathered(record * n);
  allgather(mine.data(), gathered.data(), record);

  std::vector<Fingerprint> all(n);
  peer_addresses_.assign(n, std::string());
  pair_sockets_.assign(n, {0, 0});
  auto connections = established_connections();
  for (size_t r = 0; r < n; ++r) {
    const uint8_t* base = gathered.data() + r * record;
    std::memcpy(&all[r], base, sizeof(Fingerprint));
    uint16_t port = 0;
    std::memcpy(&port, base + sizeof(Fingerprint) + static_cast<size_t>(options_.rank) * sizeof(uint16_t),
                sizeof(port));
    std::string ip(all[r].ip, strnlen(all[r].ip, sizeof(all[r].ip)));
    if (port != 0 && all[r].world_size == options_.world_size)
      peer_addresses_[r] = detail::concat("[", ip, "]:", port);
    if (static_cast<int>(r) == options_.rank) continue;
    uint16_t local = ntohs(split_address(context_->getPair(static_cast<int>(r))->address().str()).second);
    if (auto it = connections.find(local); local != 0 && it != connections.end())
      pair_sockets_[r] = {local, it->second};
  }
  if (log::enabled(log::Level::Debug)) {
    std::string table;
    for (size_t r = 0; r < n; ++r)
      table += detail::concat(" ", r, "=", peer_addresses_[r], " (local port ", pair_sockets_[r].first, ")");
    PSGD_LOG(Debug, "peers' pair addresses towards this rank:", table);
  }
  const Fingerprint& ref = all[0];
  for (size_t r = 1; r < all.size(); ++r) {
    const Fingerprint& f = all[r];
    std::string diff;
    auto field = [&](const char* name, const auto& a, const auto& b) {
      if (!(a == b)) diff += detail::concat(diff.empty() ? "" : ", ", name, " ", b, " (rank 0: ", a, ")");
    };
    field("version", std::string(ref.version), std::string(f.version));
    field("world size", ref.world_size, f.world_size);
    field("transport", ref.transport == 0 ? "tcp" : "ibverbs", f.transport == 0 ? "tcp" : "ibverbs");
    field("gloo api", ref.api == 0 ? "new" : "legacy", f.api == 0 ? "new" : "legacy");
    field("PSGD_RING_THRESHOLD_BYTES", ref.ring_threshold_bytes, f.ring_threshold_bytes);
    PSGD_REQUIRE(diff.empty(), MismatchError, "process group configuration mismatch: rank ", r, " has ", diff,
                 "; every rank must use the same powersgd version and PSGD_* settings");
  }
}

GlooCommunicator::~GlooCommunicator() {
  std::deque<Op> dropped;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  wake_.notify_all();
  auto error = std::make_exception_ptr(
      IoError("communicator destroyed before the operation ran"));
  for (auto& op : dropped) op.state->finish(error);
  if (thread_.joinable()) thread_.join();
  // context_ and device_ close their sockets here; with peers gone that is immediate.
}

Algorithm GlooCommunicator::choose(size_t bytes) const {
  if (bytes >= options_.ring_threshold_bytes) return Algorithm::Ring;
  return api_ == GlooApi::New ? Algorithm::Bcube : Algorithm::HalvingDoubling;
}

Work GlooCommunicator::submit(std::string name, RunFn run) {
  auto state = std::make_shared<Completion>();
  {
    std::lock_guard lock(mutex_);
    if (broken_ == nullptr) {
      queue_.push_back(Op{std::move(name), std::move(run), state});
      wake_.notify_one();
      return Work(state);
    }
  }
  state->finish(broken_);
  return Work(state);
}

void GlooCommunicator::loop() {
  for (;;) {
    Op op;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    {
      std::lock_guard lock(mutex_);
      error = broken_;
    }
    if (error == nullptr) {
      try {
        op.run(context_, next_tag_++);
      } catch (...) {
        error = translate(op.name, std::current_exception());
        // Configuration errors every rank detects alike leave the group usable;
        // a transport failure breaks it for good.
        bool fatal = false;
        try {
          std::rethrow_exception(error);
        } catch (const PeerError&) {
          fatal = true;
        } catch (...) {
        }
        if (fatal) {
          {
            std::lock_guard lock(mutex_);
            broken_ = error;
          }
          // Closing every connection makes the failure reach all peers now,
          // instead of the ranks not connected to the culprit waiting for
          // their timeout.
          context_.reset();
        }
      }
    }
    op.state->finish(error);
  }
}

int GlooCommunicator::peer_from_message(const std::string& message) const {
  for (size_t r = 0; r < peer_addresses_.size(); ++r) {
    const std::string& address = peer_addresses_[r];
    size_t at = address.empty() ? std::string::npos : message.find(address);
    // "[ip]:1234" must not match "[ip]:12345".
    if (at != std::string::npos && !std::isdigit(static_cast<unsigned char>(message[at + address.size()])))
      return static_cast<int>(r);
  }
  // Gloo prints the peer of a reset connection from getpeername() on the dead
  // socket, i.e. garbage: look for the pair whose connection is gone instead.
  auto connections = established_connections();
  for (size_t r = 0; r < pair_sockets_.size(); ++r) {
    auto [local, remote] = pair_sockets_[r];
    auto it = connections.find(local);
    if (local != 0 && (it == connections.end() || it->second != remote)) return static_cast<int>(r);
  }
  return -1;
}

std::exception_ptr GlooCommunicator::translate(const std::string& op, std::exception_ptr error) const {
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const Error&) {
    return error;
  } catch (const gloo::EnforceNotMet& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = e.what();
  }
  bool timeout = is_timeout_message(message);
  int peer = peer_from_message(message);
  std::string who = peer >= 0 ? detail::concat(" with peer rank ", peer) : std::string(" (peer unknown)");
  std::string what = timeout ? detail::concat(op, " timed out after ", options_.timeout.count(), " ms", who, ": ",
                                              message, " (a peer stalled or is unreachable; PSGD_TIMEOUT_MS)")
                             : detail::concat(op, " failed", who, ": ", message,
                                              " (a peer exited or its connection broke)");
  PSGD_LOG(Error, what);
  return std::make_exception_ptr(PeerError(timeout ? ErrorCode::Timeout : ErrorCode::Io, op, peer, what));
}

Work GlooCommunicator::allreduce_async(void* data, size_t count, DataType type, Algorithm algorithm) {
  PSGD_REQUIRE(data != nullptr || count == 0, InvalidArgumentError, "allreduce: data is null for ", count,
               " elements");
  size_t bytes = count * size_of(type);
  if (algorithm == Algorithm::Auto) algorithm = choose(bytes);
  PSGD_REQUIRE(algorithm != Algorithm::Bcube || api_ == GlooApi::New, InvalidArgumentError,
               "allreduce: bcube needs Gloo's new API (not available on ibverbs)");
  PSGD_REQUIRE(algorithm != Algorithm::HalvingDoubling || api_ == GlooApi::Legacy, InvalidArgumentError,
               "allreduce: halving-doubling needs Gloo's legacy API");
  std::string name = detail::concat("allreduce(", count, " x ", to_string(type), ", ", to_string(algorithm), ")");
  GlooApi api = api_;
  std::chrono::milliseconds timeout = options_.timeout;
  return submit(std::move(name), [=](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (count == 0 || context->size == 1) return;
    if (api == GlooApi::Legacy) return legacy_allreduce(context, data, count, type, algorithm);
    gloo::AllreduceOptions opts(context);
    opts.setAlgorithm(algorithm == Algorithm::Ring ? gloo::AllreduceOptions::Algorithm::RING
                                                   : gloo::AllreduceOptions::Algorithm::BCUBE);
    set_output(opts, data, count, type);
    opts.setReduceFunction(new_style_sum(type));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allreduce(opts);
  });
}

Work GlooCommunicator::broadcast_async(void* data, size_t bytes, int root) {
  PSGD_REQUIRE(root >= 0 && root < size(), InvalidArgumentError, "broadcast: root ", root,
               " is out of range: expected 0 to ", size() - 1);
  PSGD_REQUIRE(data != nullptr || bytes == 0, InvalidArgumentError, "broadcast: data is null for ", bytes, " bytes");
  GlooApi api = api_;
  std::chrono::milliseconds timeout = options_.timeout;
  return submit(detail::concat("broadcast(", bytes, " bytes, root ", root, ")"), [=](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (bytes == 0 || context->size == 1) return;
    if (api == GlooApi::Legacy) {
      std::vector<uint8_t*> ptrs{static_cast<uint8_t*>(data)};
      return gloo::BroadcastOneToAll<uint8_t>(context, ptrs, bytes, root).run();
    }
    gloo::BroadcastOptions opts(context);
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::broadcast(opts);
  });
}

Work GlooCommunicator::allgather_async(const void* in, void* out, size_t bytes) {
  PSGD_REQUIRE((in != nullptr && out != nullptr) || bytes == 0, InvalidArgumentError,
               "allgather: null buffer for ", bytes, " bytes");
  PSGD_REQUIRE(api_ == GlooApi::New || bytes <= INT_MAX, InvalidArgumentError, "allgather: ", bytes,
               " bytes per rank exceeds Gloo's legacy limit of ", INT_MAX);
  GlooApi api = api_;
  std::chrono::milliseconds timeout = options_.timeout;
  return submit(detail::concat("allgather(", bytes, " bytes)"), [=](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (bytes == 0) return;
    if (context->size == 1) {
      std::memmove(out, in, bytes);
      return;
    }
    if (api == GlooApi::Legacy) {
      std::vector<const uint8_t*> ptrs{static_cast<const uint8_t*>(in)};
      return gloo::AllgatherRing<uint8_t>(context, ptrs, static_cast<uint8_t*>(out), static_cast<int>(bytes)).run();
    }
    gloo::AllgatherOptions opts(context);
    // Gloo's input buffer is not written to; its API just lacks const.
    opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), bytes);
    opts.setOutput(static_cast<uint8_t*>(out), bytes * static_cast<size_t>(context->size));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allgather(opts);
  });
}

Work GlooCommunicator::barrier_async() {
  GlooApi api = api_;
  std::chrono::milliseconds timeout = options_.timeout;
  return submit("barrier", [=](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (context->size == 1) return;
    if (api == GlooApi::Legacy) return gloo::BarrierAllToOne(context).run();
    gloo::BarrierOptions opts(context);
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::barrier(opts);
  });
}

void GlooCommunicator::check_same(uint64_t fingerprint, const std::string& what) {
  std::vector<uint64_t> all(static_cast<size_t>(size()));
  allgather(&fingerprint, all.data(), sizeof(fingerprint));
  for (size_t r = 1; r < all.size(); ++r)
    PSGD_REQUIRE(all[r] == all[0], MismatchError, what, " differs between ranks: rank ", r, " has fingerprint ",
                 std::hex, all[r], ", rank 0 has ", all[0]);
}

}  // namespace powersgd::transport
