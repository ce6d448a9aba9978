#include "comm/communicator.hpp"

#include <gloo/common/error.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/address.hpp"
#include "comm/algorithms.hpp"
#include "comm/device.hpp"
#include "comm/fingerprint.hpp"
#include "comm/host_stage.hpp"
#include "comm/mesh.hpp"
#include "comm/options.hpp"
#include "common/agreed_collectives.hpp"
#include "common/check.hpp"
#include "common/comm_users.hpp"
#include "common/completion.hpp"
#include "common/fd.hpp"
#include "common/log.hpp"

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

namespace {
// The transport behind a Communicator made by create(); null for another implementation.
template <typename C>
auto gloo_of(C* comm) {
  using Gloo = std::conditional_t<std::is_const_v<C>, const transport::GlooCommunicator, transport::GlooCommunicator>;
  return dynamic_cast<Gloo*>(comm);
}
}  // namespace

std::unique_ptr<Communicator> Communicator::create_channel(int index) const {
  const auto* gloo = gloo_of(this);
  PSGD_REQUIRE(gloo != nullptr, UnsupportedError,
               "create_channel: only a communicator made by Communicator::create has channels");
  return gloo->create_channel(index);
}

uint64_t Communicator::communication_rounds() const {
  const auto* gloo = gloo_of(this);
  return gloo != nullptr ? gloo->rounds() : 0;
}

bool Communicator::sums_in_rank_order(size_t count, DataType type) const {
  const auto* gloo = gloo_of(this);
  if (gloo == nullptr) return false;
  if (gloo->size() == 1) return true;
  const transport::Algorithm chosen = gloo->choose(count * size_of(type));
  return chosen == transport::Algorithm::Direct || chosen == transport::Algorithm::ScatterGather;
}

namespace {
// A DataType outside the enum (a C++ caller's cast) is a bad argument like any other: checked among a call's
// refusal checks, so that every rank refuses the call (size_of would throw later, on that rank alone).
bool known_type(DataType type) {
  switch (type) {
    case DataType::Float32:
    case DataType::Float64:
    case DataType::Float16:
    case DataType::BFloat16:
      return true;
  }
  return false;
}
void require_known_type(DataType type, const char* call) {
  PSGD_REQUIRE(known_type(type), InvalidArgumentError, call, ": unknown DataType ", static_cast<int>(type),
               ": expected float32, float64, float16 or bfloat16");
}

Work in_rank_order(Communicator& comm, void* data, size_t count, DataType type,
                   transport::GlooCommunicator::Sizes sizes) {
  auto* gloo = gloo_of(&comm);
  // An unknown type goes on to allreduce_async, which refuses it on every rank (the algorithm is not used; Auto,
  // as for every rank, where the communicator has neither).
  const transport::Algorithm algorithm =
      gloo != nullptr ? gloo->choose_in_rank_order(known_type(type) ? count * size_of(type) : 0)
                      : transport::Algorithm::Auto;
  PSGD_REQUIRE(algorithm != transport::Algorithm::Auto, UnsupportedError,
               "allreduce_in_rank_order_async: this communicator has neither the direct nor the scatter-gather "
               "allreduce (made by create() with Gloo's new API, and PSGD_DIRECT_MAX_BYTES above 0 or "
               "PSGD_SCATTER_GATHER=1, only)");
  return gloo->allreduce_async(data, count, type, algorithm, sizes);
}
}  // namespace

Work Communicator::allreduce_in_rank_order_async(void* data, size_t count, DataType type) {
  return in_rank_order(*this, data, count, type, transport::GlooCommunicator::Sizes::Unknown);
}

size_t Communicator::lead_exchange_capacity() const {
  const auto* gloo = gloo_of(this);
  return gloo != nullptr ? gloo->lead_capacity() : 0;
}

Work Communicator::lead_exchange_async(const void* lead, void* leads, size_t lead_bytes, void* data, size_t count,
                                       DataType type, bool* summed) {
  const LeadPart part{data, count, type};
  return lead_exchange_async(lead, leads, lead_bytes, std::span<const LeadPart>(&part, 1), summed);
}

Work Communicator::lead_exchange_async(const void* lead, void* leads, size_t lead_bytes,
                                       std::span<const LeadPart> parts, bool* summed) {
  auto* gloo = gloo_of(this);
  const size_t capacity = lead_exchange_capacity();
  PSGD_REQUIRE(capacity > 0, InvalidArgumentError,
               "lead exchange: this communicator has none (made by create() with Gloo's new API, more than one rank, "
               "PSGD_DIRECT_EAGER=1 and PSGD_DIRECT_MAX_BYTES above 0, only)");
  return gloo->lead_allreduce_async(lead, leads, lead_bytes, parts, summed);
}

namespace detail {

using Sizes = transport::GlooCommunicator::Sizes;

Work allreduce_agreed_async(Communicator& comm, void* data, size_t count, DataType type) {
  auto* gloo = gloo_of(&comm);
  return gloo != nullptr ? gloo->allreduce_async(data, count, type, transport::Algorithm::Auto, Sizes::Agreed)
                         : comm.allreduce_async(data, count, type);
}

Work allreduce_in_rank_order_agreed_async(Communicator& comm, void* data, size_t count, DataType type) {
  return in_rank_order(comm, data, count, type, Sizes::Agreed);
}

Work broadcast_agreed_async(Communicator& comm, void* data, size_t bytes, int root) {
  auto* gloo = gloo_of(&comm);
  return gloo != nullptr ? gloo->broadcast_async(data, bytes, root, Sizes::Agreed)
                         : comm.broadcast_async(data, bytes, root);
}

Work allgather_agreed_async(Communicator& comm, const void* in, void* out, size_t bytes) {
  auto* gloo = gloo_of(&comm);
  return gloo != nullptr ? gloo->allgather_async(in, out, bytes, Sizes::Agreed) : comm.allgather_async(in, out, bytes);
}

}  // namespace detail
}  // namespace powersgd

namespace powersgd::transport {
namespace {

// A MismatchError that breaks the group (execute()): a host-staged allreduce's, where the other hosts' leaders
// wait for the odd one and the leaders' buffers may hold their hosts' sums.
class GroupBreakingMismatchError : public MismatchError {
 public:
  using MismatchError::MismatchError;
};

constexpr const char* kTokenFix =
    "set PSGD_TOKEN to the same secret on every rank (in a batch script, before srun or mpirun: export "
    "PSGD_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')), or use powersgd-run, which does "
    "(docs/reliability.md, \"What the token protects\")";

// Whether the transport's local address is loopback; one that does not resolve is not (Gloo reports it).
bool is_loopback_address(const std::string& address) {
  try {
    return is_loopback(address, HostRole{"PSGD_ADDR"});
  } catch (const IoError&) {
    return false;
  }
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
    case Algorithm::Direct:
      return "direct";
    case Algorithm::ScatterGather:
      return "scatter-gather";
  }
  return "?";
}

GlooCommunicator::Settings GlooCommunicator::Settings::from_env(GlooApi api) {
  Settings s;
  s.host_stage = host_stage_from_env();
  s.host_shm = host_shm_from_env();  // parsed wherever staging may run: a typo is named at creation
  const bool eager = eager_direct_from_env();
  s.eager_direct = api == GlooApi::New && eager;
  const bool scatter_gather = scatter_gather_from_env();
  s.scatter_gather = api == GlooApi::New && scatter_gather;
  const size_t direct_max_bytes = direct_max_bytes_from_env(scatter_gather);
  s.direct_max_bytes = api == GlooApi::New ? direct_max_bytes : 0;
  const bool offer = fingerprint_store_from_env();
  s.offer_record_in_store = api == GlooApi::New && offer;  // the legacy API's all-to-all carries no byte
  return s;
}

GlooCommunicator::GlooCommunicator(const CommOptions& options, GlooApi api, const Settings& settings)
    : options_(options), api_(api), settings_(settings) {
  // Refused here, before any collective: a rank that throws after one may close its connections while a peer
  // still waits for that collective's last message, which then fails there as a PeerError, not as this error.
  PSGD_REQUIRE(settings_.host_stage != HostStageMode::On || api_ == GlooApi::New, UnsupportedError,
               "PSGD_HOST_STAGE=1 needs Gloo's new API (TCP; the legacy API and ibverbs have no unbound buffers): "
               "set PSGD_HOST_STAGE=0");
  algorithms_ = make_algorithms(api_, options_.timeout, settings_.scatter_gather);
}

namespace {

// Descriptors a rank needs beyond its peers': its store client, the engine's
// files, the process's own.
constexpr uint64_t kDescriptorReserve = 64;
// A low estimate of the memory Gloo holds per peer (pair, buffers, store keys).
constexpr uint64_t kBytesPerPeer = 16 << 10;

// A world this host cannot hold fails at once, naming the value and the limit,
// instead of Gloo opening sockets until the descriptors run out (issue 32).
void check_world_fits_host(const CommOptions& options, HostStageMode host_stage) {
  const uint64_t world = static_cast<uint64_t>(options.world_size);
  if (world <= 1) return;
  // Gloo: a pair and, until it connects, a listening socket per peer; the
  // store's host: a connection per rank; a host's leader with PSGD_HOST_STAGE=1:
  // as many again at most for the leaders' context (rank 0 always leads). With
  // auto the leaders' context is counted once the hosts are known, and staging
  // is left off where a leader cannot hold it (setup_host_stage).
  const bool staged = host_stage == HostStageMode::On;
  uint64_t needed = 2 * (world - 1) * (staged ? 2 : 1) + (options.host_store ? world : 0) + kDescriptorReserve;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    uint64_t open = open_descriptor_count();
    uint64_t soft = static_cast<uint64_t>(limit.rlim_cur);
    PSGD_REQUIRE(needed + open <= soft, InvalidArgumentError, "world size ", world, " needs about ", needed,
                 " file descriptors on ", options.host_store ? "rank 0, which hosts the store" : "each rank",
                 " (two per peer for Gloo", staged ? ", two more per peer for the leaders' context" : "",
                 options.host_store ? ", one per rank for the store" : "", ", ",
                 kDescriptorReserve, " more), but RLIMIT_NOFILE allows ", soft, " with ", open,
                 " open: raise it (ulimit -n, at most ", limit.rlim_max == RLIM_INFINITY ? std::string("unlimited")
                                                                                    : std::to_string(limit.rlim_max),
                 ") or check WORLD_SIZE");
  }
  long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    uint64_t memory = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
    PSGD_REQUIRE(world <= memory / kBytesPerPeer, InvalidArgumentError, "world size ", world, " needs at least ",
                 world * kBytesPerPeer, " bytes of memory on each rank for its peers (", kBytesPerPeer,
                 " each), but the host has ", memory, ": check WORLD_SIZE");
  }
}

}  // namespace

std::unique_ptr<GlooCommunicator> GlooCommunicator::create(const CommOptions& options, GlooApi api) {
  return create_on_store(options, nullptr, "", api);
}

std::unique_ptr<GlooCommunicator> GlooCommunicator::create_on_store(const CommOptions& options,
                                                                    std::unique_ptr<Store> store,
                                                                    std::string store_name, GlooApi api) {
  const bool callers = store != nullptr;
  // ibverbs has only the legacy API.
  const GlooApi used = options.transport == TransportKind::Ibverbs ? GlooApi::Legacy : api;
  auto comm = make(options, std::move(store), std::move(store_name), used, Settings::from_env(used));
  comm->callers_store_ = callers;
  return comm;
}

std::unique_ptr<GlooCommunicator> GlooCommunicator::create_channel(int index) const {
  PSGD_REQUIRE(index >= 1 && index <= kMaxChannelIndex, InvalidArgumentError, "channel index ", index,
               ": expected 1 to ", int{kMaxChannelIndex}, " (0 is the communicator it is made from)");
  PSGD_REQUIRE(!callers_store_, UnsupportedError, "create_channel(", index, "): this communicator rendezvoused on ",
               store_name_, ", which it does not keep after its creation: make the channel on that store with a "
               "group id of its own (psgd_comm_init_on_store)");
  CommOptions options = options_;  // store_port is the bound one where this rank hosts the store on a free port
  options.host_store = false;
  options.run_id = (options.run_id.empty() ? std::string("default") : options.run_id) + "/channel" +
                   std::to_string(index);
  // This one's settings as created, with the bound it chose: the channel reads no environment and measures nothing.
  return make(options, nullptr, "", api_, settings_);
}

std::unique_ptr<GlooCommunicator> GlooCommunicator::make(const CommOptions& options, std::unique_ptr<Store> store,
                                                         std::string store_name, GlooApi api,
                                                         const Settings& settings) {
  PSGD_REQUIRE(options.world_size >= 1, InvalidArgumentError, "world size ", options.world_size,
               " is invalid: expected >= 1");
  PSGD_REQUIRE(options.rank >= 0 && options.rank < options.world_size, InvalidArgumentError, "rank ",
               options.rank, " is out of range: expected 0 to ", options.world_size - 1);
  // At most PSGD_TIMEOUT_MS's 24 h: every deadline is now + timeout (milliseconds::max() overflowed into the past).
  PSGD_REQUIRE(options.timeout.count() > 0 && options.timeout <= std::chrono::hours(24), InvalidArgumentError,
               "timeout ", options.timeout.count(), " ms is invalid: expected 1 to 86400000 ms (24 h)");
  // A peer that vanishes must surface as an error from send(), not kill us.
  std::signal(SIGPIPE, SIG_IGN);
  log::set_rank(options.rank);
  PSGD_REQUIRE(store != nullptr || options.store_port != 0 || (options.host_store && options.world_size == 1),
               InvalidArgumentError,
               "store port 0 is only valid for a single process hosting its own store: set MASTER_PORT");
  check_world_fits_host(options, settings.host_stage);
  std::unique_ptr<GlooCommunicator> comm(new GlooCommunicator(options, api, settings));
  comm->store_ = std::move(store);
  comm->store_name_ = std::move(store_name);
  comm->connect();
  return comm;
}

void GlooCommunicator::connect() {
  if (store_ != nullptr) {
    // The caller's store: nothing to host or connect.
  } else if (options_.host_store) {
    TcpStoreServerOptions server;
    // Only the address the other ranks use to reach MASTER_ADDR, never every
    // interface: a loopback MASTER_ADDR itself, a name as it resolves here (the
    // server binds the first of its addresses that binds, and every client tries
    // each of them: Debian's hosts file maps the host's own name to 127.0.1.1,
    // ip6-localhost to ::1), else the local address that faces it (MASTER_ADDR
    // itself when it names this host).
    const std::string& master = options_.store_addr;
    bool loopback = is_loopback(master, kMasterAddr);
    server.bind_address = loopback ? master : local_address_towards(master, kMasterAddr);
    server.port = options_.store_port;
    server.token = options_.token;
    // This process's Gloo pairs need descriptors beyond the store's budget.
    server.reserved_descriptors = kDescriptorReserve + 2 * static_cast<size_t>(options_.world_size);
    server_ = std::make_unique<TcpStoreServer>(server);
    options_.store_port = server_->port();
    if (!loopback && options_.token.empty())
      PSGD_LOG(Warn, "the rendezvous store on ", server.bind_address, ":", options_.store_port,
               " accepts any client that can reach it (it could redirect this job's traffic or stall its "
               "rendezvous): ", kTokenFix);
  }
  if (store_ == nullptr) {
    store_ = connect_tcp_store(options_.store_addr, options_.store_port, options_.token, options_.timeout);
    store_name_ = options_.store_addr + ":" + std::to_string(options_.store_port);
    // Every rank says so, not only the one hosting the store: under srun or mpirun (no launcher to make a token)
    // each task's log is where its user looks.
    if (!options_.host_store && options_.token.empty() && !is_loopback(options_.store_addr, kMasterAddr))
      PSGD_LOG(Warn, "this rank's rendezvous store ", store_name_,
               " asks no token of its clients (whoever reaches it could answer this rank with other peers' "
               "addresses or stall its rendezvous): ", kTokenFix);
  } else if (options_.token.empty() && options_.transport == TransportKind::Tcp && !options_.address.empty() &&
             !is_loopback_address(options_.address)) {
    // The caller's store (torch.distributed's TCPStore) authenticates nobody: without a token the job's keys
    // are predictable, with one they carry a prefix derived from it.
    PSGD_LOG(Warn, "the rendezvous keys in ", store_name_, " are predictable without PSGD_TOKEN (",
             options_.address, " is not loopback; a process that reaches the store could announce false "
             "addresses for this job's ranks): ", kTokenFix);
  }
  store_->set_timeout(options_.timeout);

  // Every group that forms on this store gets a fresh generation, so a rebuilt
  // group never reads the keys of the one before. With a token, keys also
  // carry a prefix derived from it (job_key_prefix), so no key of this job
  // can be predicted without the token.
  std::string run = "powersgd/" + (options_.token.empty() ? std::string() : job_key_prefix(options_.token) + "/") +
                    (options_.run_id.empty() ? std::string("default") : options_.run_id);
  int64_t joined = store_->add(run + "/joined", 1);
  int64_t generation = (joined - 1) / options_.world_size;
  std::string prefix = run + "/g" + std::to_string(generation);
  auto scoped = make_prefix_store(*store_, prefix);
  // Every rank of the generation must have joined before the full mesh is
  // built: Gloo's per-peer work is not bounded by the timeout, so a world that
  // never comes would otherwise outlast it. The last to join says so.
  if (joined == (generation + 1) * options_.world_size) scoped->set("joined-all", {'1'});
  try {
    scoped->wait({"joined-all"}, options_.timeout);
  } catch (const TimeoutError&) {
    // How many came, where the store still answers (a wait that timed out on the client's side closed it).
    std::string arrived = "fewer than " + std::to_string(options_.world_size);
    try {
      const int64_t joined_now = store_->add(run + "/joined", 0) - generation * options_.world_size;
      arrived = "only " + std::to_string(std::min<int64_t>(joined_now, options_.world_size)) + " of " +
                std::to_string(options_.world_size);
    } catch (const Error&) {
    }
    PSGD_THROW(TimeoutError, "rendezvous of ", options_.world_size, " ranks at ", store_name_, " timed out after ",
               options_.timeout.count(), " ms: ", arrived, " ranks joined (is WORLD_SIZE right, and did every rank "
               "start?)");
  }

  device_ = make_device(options_);
  context_ = std::make_shared<MeshContext>(options_.rank, options_.world_size);
  connect_mesh(*context_, *scoped, detail::concat("rendezvous of ", options_.world_size, " ranks"));
  worker_ = std::make_unique<SerialWorker<Op, Completion>>("communicator", [this](Op& op) { execute(op); });
  check_fingerprint(*scoped);  // every rank has auto, or none (the fingerprint compares the setting); staging alike
  algorithms_->enable_direct_allgather();  // every rank's build gathers alike (the fingerprint's wire revision)
  if (settings_.host_stage != HostStageMode::Off) setup_host_stage(*scoped);
  if (settings_.direct_max_bytes == kDirectAuto) measure_direct_bound();
  // Every rank at the same point, with the same bound (the fingerprint; auto is agreed).
  if (settings_.eager_direct) algorithms_->enable_eager_direct(settings_.direct_max_bytes);
}

void GlooCommunicator::connect_mesh(MeshContext& context, Store& store, const std::string& what) {
  const auto timed_out = [&](const std::string& reason) {
    return TimeoutError(detail::concat(what, " at ", store_name_, " timed out after ", options_.timeout.count(),
                                       " ms: ", reason));
  };
  try {
    context.connect_full_mesh(store, device_, options_.timeout);
  } catch (const TimeoutError& e) {  // the store's wait for a peer's addresses, within the mesh's deadline
    throw timed_out(e.what());
  } catch (const Error&) {
    throw;
  } catch (const MeshTimeout& e) {
    throw timed_out(detail::concat(e.what(), " (a rank died or stalled while the mesh was connected?)"));
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (is_timeout_message(message)) throw timed_out(message);
    PSGD_THROW(IoError, what, " at ", store_name_, " failed: ", message);
  }
}

namespace {

// File descriptors this process may still open beyond kDescriptorReserve (the most where unlimited; none where
// the open ones cannot be counted: a connected communicator holds some, so a count of 0 means /proc is not
// readable, and auto then does not stage rather than risk a leader running out).
uint64_t spare_descriptors() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY)
    return std::numeric_limits<uint64_t>::max();
  const uint64_t open = open_descriptor_count();
  if (open == 0) return 0;
  const uint64_t used = open + kDescriptorReserve;
  const auto soft = static_cast<uint64_t>(limit.rlim_cur);
  return soft > used ? soft - used : 0;
}

}  // namespace

void GlooCommunicator::setup_host_stage(Store& scoped) {
  // Every decision below is the same on every rank: the setting and the API are in the fingerprint, the
  // hosts and the leaders' descriptors come from one exchange.
  const std::string setting = detail::concat("PSGD_HOST_STAGE=", to_string(settings_.host_stage));
  if (settings_.host_stage == HostStageMode::Auto && api_ != GlooApi::New) {
    PSGD_LOG(Debug, setting, ": not staged: the legacy Gloo API (and ibverbs) have no unbound buffers");
    return;
  }
  PSGD_ASSERT(api_ == GlooApi::New, "PSGD_HOST_STAGE=1 with the legacy API is refused at construction");
  if (options_.world_size == 1) {
    PSGD_LOG(Debug, setting, " has no effect: a world of one");
    return;
  }
  // The transport's local address: that of this rank's pair towards any peer.
  const int peer = options_.rank == 0 ? 1 : 0;
  const std::string ip = split_pair_address(context_->getPair(peer)->address().str()).first;
  const std::vector<HostReport> reports =
      exchange_host_reports(HostReport{host_key(ip), spare_descriptors()}, options_.world_size,
                            [this](const void* in, void* out, size_t bytes) {
                              allgather_async(in, out, bytes, Sizes::Agreed).wait();  // fixed-size reports
                            });
  std::vector<std::string> keys;
  for (const auto& report : reports) keys.push_back(report.key);
  HostGroups groups = group_hosts(keys);
  if (groups.degenerate()) {
    const std::string why = detail::concat(setting, " has no effect: ", groups.describe(),
                                           " (staging needs two hosts or more and one of them with two ranks or more)");
    if (settings_.host_stage == HostStageMode::On) {
      PSGD_LOG(Info, why);
    } else {
      PSGD_LOG(Debug, why);
    }
    return;
  }
  if (const int short_leader = leader_short_of_descriptors(groups, reports); short_leader >= 0) {
    const std::string why = detail::concat(
        "rank ", short_leader, ", the leader of host ", groups.host_of[static_cast<size_t>(short_leader)], " of ",
        groups.hosts.size(), ", has ", reports[static_cast<size_t>(short_leader)].spare_descriptors,
        " file descriptors to spare (RLIMIT_NOFILE less those open and ", kDescriptorReserve,
        " in reserve) where the leaders' context needs ", leader_descriptors(groups.hosts.size()),
        " (two per other host)");
    PSGD_REQUIRE(settings_.host_stage != HostStageMode::On, InvalidArgumentError, "PSGD_HOST_STAGE=1: ", why,
                 ": raise its RLIMIT_NOFILE (ulimit -n) or set PSGD_HOST_STAGE=0");
    // Said once by rank 0 and once by the rank short of descriptors, not by every rank.
    if (options_.rank == 0 || options_.rank == short_leader) {
      PSGD_LOG(Warn, "PSGD_HOST_STAGE=auto: not staged: ", why, "; the allreduce runs among every rank");
    } else {
      PSGD_LOG(Debug, "PSGD_HOST_STAGE=auto: not staged: ", why);
    }
    return;
  }
  const int host = groups.host_of[static_cast<size_t>(options_.rank)];
  const int hosts = static_cast<int>(groups.hosts.size());
  std::shared_ptr<MeshContext> leaders;
  if (groups.hosts[static_cast<size_t>(host)].front() == options_.rank) {
    leaders = std::make_shared<MeshContext>(host, hosts);
    auto store = make_prefix_store(scoped, "leaders");
    connect_mesh(*leaders, *store, detail::concat("rendezvous of the ", hosts, " hosts' leaders"));
  }
  PSGD_LOG(Info, "host-staged allreduce over ", groups.describe(), "; this rank ",
           leaders != nullptr ? "leads its host" : "sends to its host's leader");
  stage_ = std::make_unique<HostStage>(std::move(groups), options_.rank, leaders, options_.timeout);
  staged_hosts_ = hosts;
  // Every leaders' pair carries traffic once; no rank goes on before every leader has:
  // a leader whose rendezvous failed has thrown and closed its connections, which fails the barrier.
  submit("host stage connect", [this](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    stage_->connect_shared_memory(*context, tag, settings_.host_shm);
    if (stage_->leads()) algorithms_->connect_pairs(stage_->leader_context(), tag, 0);
    algorithms_->barrier(context, tag);
  }).wait();
}

bool GlooCommunicator::host_shared_memory() const { return stage_ != nullptr && stage_->shared_memory(); }

size_t GlooCommunicator::direct_bound_for(double exchange_seconds, double round_seconds, double seconds_per_byte,
                                          int parties) {
  // Direct costs (n - 1) x bytes where scatter-gather costs about 2 x bytes in 2 rounds: the farther the
  // hosts, the larger the messages for which one round pays (docs/scaling.md measured 1 and 4 MiB at 5 ms one
  // way, 1 Gbit/s).
  constexpr size_t kLan = size_t{256} << 10;
  if (!(exchange_seconds >= 1e-3)) return kLan;
  const size_t by_latency = exchange_seconds < 4e-3 ? size_t{1} << 20 : size_t{4} << 20;
  // Where the bytes weigh too: direct takes d + (n - 1) B c, scatter-gather 2 d + 2 (n - 1) B c / n (d the
  // round scatter-gather adds, measured: a one-way delay at a distance, the scheduling of a round where the
  // cores are short; c the per-byte time; (n - 1) B what the bound compares), so direct is faster while
  // (n - 1) B <= d / c x n / (n - 2). Never below a LAN's bound: under it the probe's noise would decide.
  if (!(seconds_per_byte > 0) || !(round_seconds >= 0) || parties <= 2) return by_latency;  // not measured
  const double by_rate = round_seconds / seconds_per_byte * parties / (parties - 2);
  if (!(by_rate < static_cast<double>(by_latency))) return by_latency;
  return std::max(kLan, static_cast<size_t>(by_rate) & ~size_t{4095});
}

void GlooCommunicator::measure_direct_bound() {
  if (options_.world_size == 1) {
    settings_.direct_max_bytes = direct_bound_for(0);
    return;
  }
  // The fastest of a few exchanges: scheduling and TCP's first packets only slow one down.
  auto fastest_of = [this](int untimed, int timed, std::vector<double>& buffer, Algorithm algorithm) {
    double fastest = std::numeric_limits<double>::infinity();
    for (int k = 0; k < untimed + timed; ++k) {
      const auto start = std::chrono::steady_clock::now();
      allreduce_async(buffer.data(), buffer.size(), DataType::Float64, algorithm).wait();
      if (k >= untimed)
        fastest = std::min(fastest, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return fastest;
  };
  auto slowest_rank = [this](double mine) {  // identical on every rank: every rank then chooses the same bound
    std::vector<double> all(static_cast<size_t>(options_.world_size));
    allgather_async(&mine, all.data(), sizeof(double), Sizes::Agreed).wait();
    return *std::max_element(all.begin(), all.end());
  };
  std::vector<double> one(1);
  const double exchange = fastest_of(0, 5, one, Algorithm::Direct);
  const double agreed = slowest_rank(exchange);
  const int parties = direct_parties();
  double round = 0, per_byte = 0;
  // Only where the latency alone would allow more than a LAN's bound (every rank decides alike, from agreed
  // values and settings), and where scatter-gather is the alternative: the round it adds (one double by
  // scatter-gather against direct: with no receives posted ahead, direct waits for Gloo's notice, then the
  // data, scatter-gather one round more), and the bytes' time from exchanges of 1 MiB received in all, about
  // 8 ms at 1 Gbit/s, so that it stands out. The first two of those are not timed: fresh connections grow TCP's
  // window over them (on 4 emulated hosts at 5 ms one way, 60 ms then about 24).
  if (direct_bound_for(agreed) > direct_bound_for(0) && parties > 2 && settings_.scatter_gather) {
    round = slowest_rank(std::max(0.0, fastest_of(1, 5, one, Algorithm::ScatterGather) - exchange));
    const size_t others = static_cast<size_t>(parties - 1);
    std::vector<double> probe(std::max<size_t>(1, (size_t{1} << 20) / others / sizeof(double)));
    const double probe_seconds = fastest_of(2, 5, probe, Algorithm::Direct);
    per_byte = slowest_rank(std::max(0.0, probe_seconds - exchange) / static_cast<double>(others * probe.size() * 8));
  }
  settings_.direct_max_bytes = direct_bound_for(agreed, round, per_byte, parties);
  PSGD_LOG(Info, "PSGD_DIRECT_MAX_BYTES=auto: ", settings_.direct_max_bytes, " bytes (one-round exchange ",
           agreed * 1e3, " ms on the slowest rank",
           per_byte > 0 ? detail::concat(", scatter-gather's extra round ", round * 1e3, " ms, ", 8e-9 / per_byte,
                                         " Gbit/s received")
                        : "",
           ")");
}

void GlooCommunicator::check_fingerprint(Store& scoped) {
  const int n = options_.world_size;
  const auto pair_addresses = [this, n] {
    std::vector<std::string> addresses(static_cast<size_t>(n));
    for (int peer = 0; peer < n; ++peer)
      if (peer != options_.rank) addresses[static_cast<size_t>(peer)] = context_->getPair(peer)->address().str();
    return addresses;
  };
  // This rank's record in the store before its byte of the all-to-all below offers it. Its pairs' addresses
  // are final: the mesh connected every pair (both sides of a connect wait for it).
  const bool offer = settings_.offer_record_in_store && n > 1;
  const std::vector<std::string> published = offer ? pair_addresses() : std::vector<std::string>();
  if (offer) {
    const std::vector<uint8_t> record =
        creation_record(options_, api_, settings_.direct_max_bytes, settings_.host_stage, settings_.eager_direct,
                        settings_.scatter_gather, published);
    scoped.set(fingerprint_key(options_.rank), std::vector<char>(record.begin(), record.end()));
  }
  // Every pair carries traffic once, and each rank's byte says whether its record is in the store.
  std::vector<uint8_t> offers;
  submit("connect", [this, n, offer, &offers](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (n > 1) offers = algorithms_->connect_pairs(context, tag, offer ? kOfferRecordInStore : 0);
  }).wait();
  // Every rank received the same bytes, so every rank takes the same path.
  fingerprints_from_store_ =
      offers.size() == static_cast<size_t>(n) && n > 1 &&
      std::all_of(offers.begin(), offers.end(), [](uint8_t o) { return (o & kOfferRecordInStore) != 0; });
  const auto allgather = [this](const void* in, void* out, size_t bytes) {
    allgather_async(in, out, bytes, Sizes::Agreed).wait();
  };
  try {
    if (fingerprints_from_store_) {
      PSGD_ASSERT(published == pair_addresses(), "a pair's address changed in the all-to-all after the mesh");
      peers_ = read_fingerprints(options_, scoped, published, &established_connections);
    } else {
      // The records travel by the ring: the same allgather on every rank whatever the settings compared (the
      // direct bound, staging), as a barrier, which takes the lead exchange where the direct bound allows,
      // could not be.
      peers_ = exchange_fingerprints(options_, api_, settings_.direct_max_bytes, settings_.host_stage,
                                     settings_.eager_direct, settings_.scatter_gather, pair_addresses(), allgather,
                                     &established_connections);
    }
  } catch (const MismatchError&) {
    // Every rank read or gathered the same records, so every rank throws here, and create() then closes its
    // connections and, where it hosts the store, the store. None may do so before every other rank has its
    // records: Gloo fails a rank's pending receives on any pair's end of stream (the ring), and a store that
    // closed fails the reads still in flight (the store path: its host's own read is a loopback round trip),
    // so a rank still waiting for one would get a PeerError or IoError, not this MismatchError. One more
    // allgather first (no rank's completes before every rank has entered it, its records in hand); its own
    // failure (a rank that passed it and closed) changes nothing here: this rank has its records.
    try {
      const uint64_t mine = 0;
      std::vector<uint64_t> all(static_cast<size_t>(n));
      allgather(&mine, all.data(), sizeof(mine));
    } catch (const Error&) {
    }
    throw;
  }
}

GlooCommunicator::~GlooCommunicator() {
  // Reducers on this communicator finish their reductions in flight and are
  // detached while everything they use still stands; later calls on them fail.
  detail::detach_all_comm_users(static_cast<const Communicator*>(this));
  if (worker_ != nullptr)
    worker_->stop(std::make_exception_ptr(IoError("communicator destroyed before the operation ran")));
  // The receives posted ahead hold the contexts; the worker has stopped, so nothing uses them now.
  algorithms_->release_eager_direct();
  // context_ and device_ close their sockets here, Gloo's pairs at once (MeshContext's close_context:
  // docs/transport.md, step 4 of the rendezvous), the device after a tick of its loop (up to 10 ms).
}

std::string GlooCommunicator::pair_address(int peer) const {
  PSGD_REQUIRE(peer >= 0 && peer < options_.world_size && peer != options_.rank, InvalidArgumentError, "peer ", peer,
               ": expected another rank of [0, ", options_.world_size, ")");
  return context_->getPair(peer)->address().str();
}

uint64_t GlooCommunicator::eager_direct_collectives() const { return algorithms_->eager_direct_collectives(); }

bool GlooCommunicator::direct_takes(size_t bytes) const {
  // Every rank receives (size - 1) * bytes: one round where that is cheap (docs/transport.md, "Rounds"). Staged,
  // the leaders run the algorithm: a leader receives (hosts - 1) * bytes.
  const auto others = static_cast<size_t>(direct_parties() - 1);
  return settings_.direct_max_bytes > 0 && (others == 0 || bytes <= settings_.direct_max_bytes / others);
}

Algorithm GlooCommunicator::choose(size_t bytes) const {
  if (bytes >= options_.ring_threshold_bytes) return Algorithm::Ring;
  return direct_takes(bytes) ? Algorithm::Direct : algorithms_->small_message_algorithm();
}

Algorithm GlooCommunicator::choose_in_rank_order(size_t bytes) const {
  if (api_ != GlooApi::New) return Algorithm::Auto;
  if (direct_takes(bytes)) return Algorithm::Direct;
  if (settings_.scatter_gather) return Algorithm::ScatterGather;
  return settings_.direct_max_bytes > 0 ? Algorithm::Direct : Algorithm::Auto;
}

Work GlooCommunicator::submit(std::string name, RunFn run) {
  {
    std::lock_guard lock(broken_mutex_);
    if (broken_ != nullptr) {
      auto state = std::make_shared<Completion>();
      state->finish(broken_);
      return Work(state);
    }
  }
  return Work(worker_->submit(Op{std::move(name), std::move(run)}));
}

void GlooCommunicator::execute(Op& op) {
  {
    std::lock_guard lock(broken_mutex_);
    if (broken_ != nullptr) std::rethrow_exception(broken_);
  }
  try {
    op.run(context_, next_tag_++);
  } catch (...) {
    std::exception_ptr error = translate(op.name, std::current_exception());
    // Configuration errors every rank detects alike leave the group usable;
    // a transport failure breaks it for good.
    bool fatal = false;
    try {
      std::rethrow_exception(error);
    } catch (const PeerError&) {
      fatal = true;
    } catch (const GroupBreakingMismatchError&) {
      fatal = true;
    } catch (...) {
    }
    if (fatal) {
      {
        std::lock_guard lock(broken_mutex_);
        broken_ = error;
      }
      // Closing every connection makes the failure reach all peers now,
      // instead of the ranks not connected to the culprit waiting for
      // their timeout.
      algorithms_->release_eager_direct();  // its receives posted ahead hold the connections open
      context_.reset();
      if (stage_ != nullptr) stage_->close();
    }
    std::rethrow_exception(error);
  }
}

std::exception_ptr GlooCommunicator::translate(const std::string& op, std::exception_ptr error) const {
  std::string message;
  bool timeout = false;
  int peer = -1;
  const char* cause = nullptr;  // said after the message, where it does not say it itself
  bool hop = false;             // a HostHopError: its peer and kind are known
  try {
    std::rethrow_exception(error);
  } catch (const Error&) {
    return error;
  } catch (const HostHopError& e) {
    // A hop within a host through shared memory: the peer is known, not guessed from a message, and the
    // message says what it did.
    hop = true;
    message = e.what();
    timeout = e.timeout();
    peer = e.peer();
    if (timeout) cause = "a peer stalled; PSGD_TIMEOUT_MS";
  } catch (const gloo::EnforceNotMet& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = e.what();
  }
  if (!hop) {
    timeout = is_timeout_message(message);
    // A timeout names a peer only where Gloo's message does: the first connection found closed is then most
    // often another rank that gave up first (with 3 ranks and one stalled, the two others named each other).
    peer = timeout ? peer_named_in(peers_, message) : attribute_peer(peers_, message, established_connections());
    cause = timeout ? "a peer stalled or is unreachable; PSGD_TIMEOUT_MS" : "a peer exited or its connection broke";
  }
  const std::string who = peer >= 0 ? detail::concat(" with peer rank ", peer) : std::string(" (peer unknown)");
  const std::string what =
      detail::concat(op, timeout ? detail::concat(" timed out after ", options_.timeout.count(), " ms") : " failed",
                     who, ": ", message, cause != nullptr ? detail::concat(" (", cause, ")") : std::string());
  // The error carries the message to the caller, who reports it (a Python exception, a C status): logged at
  // debug only, so stderr does not say it twice (issue 30).
  PSGD_LOG(Debug, what);
  return std::make_exception_ptr(PeerError(timeout ? ErrorCode::Timeout : ErrorCode::Io, op, peer, what));
}

std::vector<GlooCommunicator::Shape> GlooCommunicator::agree_on_call(const std::shared_ptr<gloo::Context>& context,
                                                                     uint32_t tag, const Shape& mine) {
  static_assert(sizeof(Shape) == 24, "a lead of the lead exchange: a multiple of 8 bytes");
  const auto n = static_cast<size_t>(context->size);
  const auto me = static_cast<size_t>(context->rank);
  const auto operation_of = [](ShapeKind kind) -> const char* {
    switch (kind) {
      case ShapeKind::Allreduce:
        return "allreduce";
      case ShapeKind::Broadcast:
        return "broadcast";
      case ShapeKind::Allgather:
        return "allgather";
      case ShapeKind::Barrier:
        return "barrier";
      case ShapeKind::CheckSame:
        return "check_same";
      case ShapeKind::Refused:
        return "refused call";
      case ShapeKind::LeadExchange:
        return "lead exchange";
    }
    return nullptr;  // a peer's odd bytes
  };
  // `by`: name the algorithm (where two calls differ in it alone).
  const auto describe = [&](const Shape& shape, bool by) -> std::string {
    switch (shape.kind) {
      case ShapeKind::Allreduce:
        return detail::concat("allreduce of ", shape.size, " x ", to_string(static_cast<DataType>(shape.detail)),
                              by ? detail::concat(" by ", to_string(static_cast<Algorithm>(shape.algorithm)))
                                 : std::string());
      case ShapeKind::Broadcast:
        return detail::concat("broadcast of ", shape.size, " bytes from root ", shape.detail);
      case ShapeKind::Allgather:
        return detail::concat("allgather of ", shape.size, " bytes per rank");
      case ShapeKind::Barrier:
      case ShapeKind::CheckSame:
      case ShapeKind::Refused:       // named before any other difference (below)
      case ShapeKind::LeadExchange:  // never sent as a call's shape
        return operation_of(shape.kind);
    }
    return detail::concat("a collective of kind ", static_cast<uint32_t>(shape.kind));
  };
  std::vector<Shape> all(n);
  const size_t capacity = lead_capacity();
  if (capacity >= sizeof(Shape)) {
    add_rounds(1);
    try {
      exchange_leads(context, tag, LeadKind::Shape, &mine, all.data(), sizeof(Shape), {});
    } catch (const MismatchError& e) {  // a peer in another kind of collective: say what this rank called
      throw MismatchError(detail::concat(describe(mine, false), ", its shape sent first: ", e.what()));
    }
  } else {
    add_rounds(algorithms_->allgather_rounds(context->size, sizeof(Shape)));
    algorithms_->allgather(context, tag, &mine, all.data(), sizeof(Shape));  // the same size on every rank
  }
  // A refusal first: the lowest refusing rank's, named alike on every other rank; a refusing rank throws its own
  // error (refuse).
  const auto is_refusal = [](const Shape& shape) {
    return shape.magic == Shape::kMagic && shape.kind == ShapeKind::Refused;
  };
  if (mine.kind == ShapeKind::Refused) return all;
  const auto refusing = std::find_if(all.begin(), all.end(), is_refusal);
  const char* const operation = operation_of(mine.kind);
  if (refusing != all.end()) {
    const auto others = std::count_if(refusing + 1, all.end(), is_refusal);
    const char* const call = operation_of(static_cast<ShapeKind>(refusing->detail));
    throw MismatchError(detail::concat(
        operation, ": rank ", refusing - all.begin(),
        others > 0 ? detail::concat(" (and ", others, " other rank(s))") : std::string(), " refused its ",
        call != nullptr ? call : "call", " (its own arguments: that rank's error says why) where this rank (", me,
        ") calls ", describe(mine, false), ": nothing was sent; the group stays usable"));
  }
  // The message names this rank's call once, after the peer's: "allreduce: rank 1 calls allreduce of 48 x
  // float32 where this rank (0) calls allreduce of 32 x float32: ...".
  for (size_t r = 0; r < n; ++r) {
    if (r == me) continue;
    const Shape& theirs = all[r];
    PSGD_REQUIRE(theirs.magic == Shape::kMagic, MismatchError, operation, ": rank ", r,
                 " sent a message that describes no collective where this rank (", me, ") calls ",
                 describe(mine, false), ": every rank must run the same collectives in the same order");
    // check_same compares its fingerprint (the size) itself, with its own message.
    const bool same_but_algorithm = theirs.kind == mine.kind && theirs.detail == mine.detail &&
                                    (theirs.size == mine.size || mine.kind == ShapeKind::CheckSame);
    const bool by = same_but_algorithm && theirs.algorithm != mine.algorithm;
    PSGD_REQUIRE(same_but_algorithm && theirs.algorithm == mine.algorithm,
                 MismatchError, operation, ": rank ", r, " calls ", describe(theirs, by), " where this rank (", me,
                 ") calls ", describe(mine, by),
                 ": every rank must run the same collectives with the same sizes (no data was sent; the group "
                 "stays usable)");
  }
  return all;
}

void GlooCommunicator::refuse_unless(ShapeKind call, Sizes sizes, const std::function<void()>& checks) {
  try {
    checks();
  } catch (const Error&) {
    refuse(call, sizes, std::current_exception());
  }
}

void GlooCommunicator::refuse(ShapeKind call, Sizes sizes, std::exception_ptr error) {
  if (sizes == Sizes::Unknown && size() > 1) {
    try {
      submit("the shape exchange of a refused call",
             [this, call](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
               agree_on_call(context, tag, {.kind = ShapeKind::Refused, .detail = static_cast<int32_t>(call)});
             })
          .wait();
    } catch (...) {  // a peer in another collective, or a broken group: this call's own error says more
    }
  }
  std::rethrow_exception(error);
}

uint32_t GlooCommunicator::agree_on_shape(const std::shared_ptr<gloo::Context>& context, uint32_t tag, Sizes sizes,
                                          const Shape& mine) {
  if (sizes == Sizes::Agreed) return tag;
  agree_on_call(context, tag, mine);
  return next_tag_++;
}

Work GlooCommunicator::allreduce_async(void* data, size_t count, DataType type, Algorithm algorithm, Sizes sizes) {
  // Every check of the arguments refuses collectively: a rank that fails one alone takes the call's place in
  // the sequence, and where every rank fails it, every rank refuses alike.
  refuse_unless(ShapeKind::Allreduce, sizes, [&] {
    require_known_type(type, "allreduce");
    PSGD_REQUIRE(data != nullptr || count == 0, InvalidArgumentError, "allreduce: data is null for ", count,
                 " elements");
    if (algorithm == Algorithm::Auto) algorithm = choose(count * size_of(type));
    algorithms_->require_supported(algorithm);
  });
  std::string name = detail::concat("allreduce(", count, " x ", to_string(type), ", ", to_string(algorithm), ")");
  if (stage_ != nullptr) name = detail::concat("allreduce(", count, " x ", to_string(type), ", host-staged, ",
                                               to_string(algorithm), " among ", staged_hosts_, " hosts)");
  return submit(std::move(name), [=, this](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (context->size == 1) return;
    // Direct on the receives posted ahead reads every rank's header (count and type) before anything sized by the
    // count; a count of 0 sends nothing that could. Staged, always: the hops within a host carry headers of
    // their own, whose mismatch breaks the group (the leaders' buffers already hold their hosts' sums).
    const bool headers_check = count > 0 && stage_ == nullptr && algorithms_->checks_sizes(algorithm, count, type,
                                                                                          context->size);
    tag = agree_on_shape(context, tag, headers_check ? Sizes::Agreed : sizes,
                         {.kind = ShapeKind::Allreduce,
                          .algorithm = static_cast<uint16_t>(algorithm),
                          .detail = static_cast<int32_t>(type),
                          .size = count});
    if (count == 0) return;
    if (stage_ != nullptr) {
      // Only the leaders' rounds cross hosts; the hops within a host cost no network delay.
      add_rounds(algorithms_->allreduce_rounds(algorithm, staged_hosts_));
      try {
        stage_->allreduce(context, tag, data, count, type, algorithm, *algorithms_);
      } catch (const MismatchError& e) {
        // Counts that differ within a host leave the other hosts' leaders waiting for its leader, and the
        // leaders' buffers hold their hosts' sums where theirs differ: the group breaks now, so that every rank
        // fails at once rather than after the timeout.
        throw GroupBreakingMismatchError(
            detail::concat(e.what(), "; host-staged (PSGD_HOST_STAGE=1): the group is broken"));
      }
      return;
    }
    add_rounds(algorithms_->allreduce_rounds(algorithm, context->size));
    algorithms_->allreduce(context, tag, data, count, type, algorithm);
  });
}

size_t GlooCommunicator::lead_capacity() const {
  if (!settings_.eager_direct) return 0;
  // Staged: the leaders' exchange carries every rank of the largest host's lead beside the host's data.
  if (stage_ != nullptr) return stage_->lead_capacity(algorithms_->lead_capacity(staged_hosts_));
  return algorithms_->lead_capacity(options_.world_size);
}

Work GlooCommunicator::lead_allreduce_async(const void* lead, void* leads, size_t lead_bytes,
                                            std::span<const LeadPart> parts, bool* summed) {
  const size_t capacity = lead_capacity();
  // A capacity of 0 (no lead exchange) fails the size check on every rank: each sends its refusal (in Gloo's
  // allgather of the shapes), so every rank refuses alike.
  refuse_unless(ShapeKind::LeadExchange, Sizes::Unknown, [&] {
    PSGD_REQUIRE(lead != nullptr && leads != nullptr && summed != nullptr, InvalidArgumentError,
                 "lead exchange: null lead, leads or summed");
    PSGD_REQUIRE(lead_bytes > 0 && lead_bytes % 8 == 0 && lead_bytes <= capacity, InvalidArgumentError,
                 "lead exchange: a lead of ", lead_bytes,
                 " bytes; expected a positive multiple of 8 up to the capacity ", capacity);
    PSGD_REQUIRE(parts.size() <= kMaxLeadParts, InvalidArgumentError, "lead exchange: ", parts.size(),
                 " data parts; expected at most ", kMaxLeadParts);
    for (size_t i = 0; i < parts.size(); ++i) {
      PSGD_REQUIRE(parts[i].data != nullptr || parts[i].count == 0, InvalidArgumentError, "lead exchange: part ", i,
                   "'s data is null for ", parts[i].count, " elements");
      require_known_type(parts[i].type, "lead exchange");
    }
  });
  std::string name = detail::concat("lead exchange(", lead_bytes, " bytes");
  for (const LeadPart& part : parts) name += detail::concat(" + ", part.count, " x ", to_string(part.type));
  name += stage_ != nullptr ? ", host-staged)" : ")";
  std::array<LeadPart, kMaxLeadParts> copied{};
  std::copy(parts.begin(), parts.end(), copied.begin());
  const size_t count = parts.size();
  return submit(std::move(name), [=, this](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    add_rounds(1);  // staged: the leaders' exchange; the hops within a host cost no network delay
    *summed = exchange_leads(context, tag, LeadKind::Lead, lead, leads, lead_bytes,
                             std::span<const LeadPart>(copied.data(), count));
  });
}

bool GlooCommunicator::exchange_leads(const std::shared_ptr<gloo::Context>& context, uint32_t tag, LeadKind kind,
                                      const void* lead, void* leads, size_t lead_bytes,
                                      std::span<const LeadPart> parts) {
  if (stage_ != nullptr)
    return stage_->lead_allreduce(context, tag, kind, lead, leads, lead_bytes, parts, lead_capacity(),
                                  *algorithms_);
  return algorithms_->lead_allreduce(context, kind, lead, leads, lead_bytes, parts);
}

Work GlooCommunicator::broadcast_async(void* data, size_t bytes, int root, Sizes sizes) {
  refuse_unless(ShapeKind::Broadcast, sizes, [&] {
    PSGD_REQUIRE(root >= 0 && root < size(), InvalidArgumentError, "broadcast: root ", root,
                 " is out of range: expected 0 to ", size() - 1);
    PSGD_REQUIRE(data != nullptr || bytes == 0, InvalidArgumentError, "broadcast: data is null for ", bytes,
                 " bytes");
  });
  std::string name = detail::concat("broadcast(", bytes, " bytes, root ", root, ")");
  return submit(std::move(name), [=, this](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (context->size == 1) return;
    tag = agree_on_shape(context, tag, sizes, {.kind = ShapeKind::Broadcast, .detail = root, .size = bytes});
    if (bytes == 0) return;
    add_rounds(algorithms_->broadcast_rounds(context->size));
    algorithms_->broadcast(context, tag, data, bytes, root);
  });
}

Work GlooCommunicator::allgather_async(const void* in, void* out, size_t bytes, Sizes sizes) {
  refuse_unless(ShapeKind::Allgather, sizes, [&] {
    PSGD_REQUIRE((in != nullptr && out != nullptr) || bytes == 0, InvalidArgumentError,
                 "allgather: null buffer for ", bytes, " bytes");
    PSGD_REQUIRE(bytes <= algorithms_->max_allgather_bytes(), InvalidArgumentError, "allgather: ", bytes,
                 " bytes per rank exceeds Gloo's legacy limit of ", algorithms_->max_allgather_bytes());
  });
  return submit(detail::concat("allgather(", bytes, " bytes)"),
                [=, this](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
                  if (context->size == 1) {
                    if (bytes > 0) std::memmove(out, in, bytes);
                    return;
                  }
                  tag = agree_on_shape(context, tag, sizes, {.kind = ShapeKind::Allgather, .size = bytes});
                  if (bytes == 0) return;
                  add_rounds(algorithms_->allgather_rounds(context->size, bytes));
                  algorithms_->allgather(context, tag, in, out, bytes);
                });
}

Work GlooCommunicator::barrier_async() {
  // The shapes' exchange is itself a barrier (no rank's completes before every rank's shape arrived), and a peer
  // in another collective makes it a MismatchError instead of a wait for the timeout (or, with Gloo's legacy
  // barrier against a peer's allgather on the same slot, an abort).
  return submit("barrier", [this](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (context->size == 1) return;
    agree_on_call(context, tag, {.kind = ShapeKind::Barrier});
  });
}

void GlooCommunicator::check_same(uint64_t fingerprint, const std::string& what) {
  std::vector<Shape> all;
  submit("check_same", [&](const std::shared_ptr<gloo::Context>& context, uint32_t tag) {
    if (context->size > 1) all = agree_on_call(context, tag, {.kind = ShapeKind::CheckSame, .size = fingerprint});
  }).wait();
  for (size_t r = 1; r < all.size(); ++r)
    PSGD_REQUIRE(all[r].size == all[0].size, MismatchError, what, " differs between ranks: rank ", r,
                 " has fingerprint ", std::hex, all[r].size, ", rank 0 has ", all[0].size);
}

}  // namespace powersgd::transport
