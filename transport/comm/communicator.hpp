// The Gloo implementation of powersgd::Communicator. Private to powersgd
// (tests and powersgd-bench use it to force an algorithm or the old-style API).
// Design: docs/transport.md.
#pragma once

#include <gloo/rendezvous/context.h>
#include <gloo/transport/device.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <vector>

#include "comm/mesh.hpp"
#include "comm/options.hpp"
#include "comm/peer_attribution.hpp"
#include "common/serial_worker.hpp"
#include "powersgd/comm.hpp"
#include "store/store.hpp"

namespace powersgd::transport {

enum class LeadKind : uint8_t;  // comm/algorithms.hpp

// Which of Gloo's two collective APIs the communicator uses. New: the free
// functions over unbound buffers (TCP only in Debian's Gloo). Legacy: the
// old-style algorithm classes (the only ones that work over ibverbs). One
// context never mixes both (mixing gave 40-90 ms latencies).
enum class GlooApi { New, Legacy };

// Allreduce algorithms. Auto: ring at or above ring_threshold_bytes; below it,
// with the new API, direct where every rank receives at most
// direct_max_bytes() in all ((size - 1) * bytes), else scatter-gather
// (PSGD_SCATTER_GATHER=0: bcube); with the legacy API halving-doubling.
// Direct (new API only): one round, every rank sends its whole buffer to every
// other and each sums the size() contributions in rank order, so every rank
// computes the same bits. ScatterGather (new API only): two rounds, rank r sums
// the contributions to the r-th chunk in rank order and sends the sum to every
// rank: the same bits as Direct, with the bytes of bcube or the ring.
// With host staging on (staged_hosts() > 0) the algorithm is the one the
// hosts' leaders run among themselves, and Auto chooses it for
// staged_hosts() participants instead of size() (docs/transport.md,
// "Host-staged allreduce").
enum class Algorithm { Auto, Ring, Bcube, HalvingDoubling, Direct, ScatterGather };
const char* to_string(Algorithm algorithm);

class CollectiveAlgorithms;
class HostStage;

class GlooCommunicator final : public Communicator {
 public:
  // Collective; see Communicator::create. api defaults to New on TCP; ibverbs
  // always uses Legacy.
  static std::unique_ptr<GlooCommunicator> create(const CommOptions& options, GlooApi api = GlooApi::New);
  // Collective, as create, but the ranks rendezvous through `store` (e.g. torch.distributed's, through the C
  // API's callbacks), which the communicator owns; options' store_addr, store_port, host_store are unused.
  // `store_name` names it in errors ("torch.distributed's store"). A null store: create's own.
  static std::unique_ptr<GlooCommunicator> create_on_store(const CommOptions& options, std::unique_ptr<Store> store,
                                                           std::string store_name, GlooApi api = GlooApi::New);
  ~GlooCommunicator() override;
  // Communicator::create_channel.
  std::unique_ptr<GlooCommunicator> create_channel(int index) const;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.world_size; }
  const CommOptions& options() const override { return options_; }
  GlooApi api() const { return api_; }

  // Whether the caller has agreed on every rank's sizes by other means (Agreed: the engine, whose order guard
  // compares them first, and messages of fixed size). Unknown (the public collectives): where Gloo's own
  // algorithms would run, whose receives are sized by the caller (ranks that pass different sizes there make
  // Gloo's I/O thread throw, which aborts the process), the ranks first exchange what they pass, one round, and
  // fail with a MismatchError on every rank where it differs (docs/transport.md, "Sizes agreed first").
  enum class Sizes { Agreed, Unknown };

  Work allreduce_async(void* data, size_t count, DataType type) override {
    return allreduce_async(data, count, type, Algorithm::Auto, Sizes::Unknown);
  }
  // Explicit algorithm (Bcube needs the new API, HalvingDoubling the legacy one), for tests, powersgd-bench and
  // auto's probe, which pass the same sizes on every rank: the sizes are taken as agreed unless `sizes` says
  // Unknown (then as the public call does, with this algorithm).
  Work allreduce_async(void* data, size_t count, DataType type, Algorithm algorithm, Sizes sizes = Sizes::Agreed);
  Work broadcast_async(void* data, size_t bytes, int root) override {
    return broadcast_async(data, bytes, root, Sizes::Unknown);
  }
  Work broadcast_async(void* data, size_t bytes, int root, Sizes sizes);
  Work allgather_async(const void* in, void* out, size_t bytes) override {
    return allgather_async(in, out, bytes, Sizes::Unknown);
  }
  Work allgather_async(const void* in, void* out, size_t bytes, Sizes sizes);
  Work barrier_async() override;
  void check_same(uint64_t fingerprint, const std::string& what) override;
  uint64_t rounds() const { return rounds_.load(std::memory_order_relaxed); }
  // The number of hosts an allreduce is staged over (PSGD_HOST_STAGE=1 with at
  // least two hosts, one of them with two ranks or more); 0: not staged.
  int staged_hosts() const { return staged_hosts_; }
  // Whether this rank's hops within its host go through shared memory (PSGD_HOST_SHM; staged, this host shares).
  bool host_shared_memory() const;

  // Communicator::lead_exchange_capacity and lead_exchange_async (the eager path's; docs/transport.md, "Lead exchange").
  size_t lead_capacity() const;
  Work lead_allreduce_async(const void* lead, void* leads, size_t lead_bytes, std::span<const LeadPart> parts,
                            bool* summed);

  // The algorithm Auto picks for a message of `bytes`.
  Algorithm choose(size_t bytes) const;
  // The algorithm allreduce_in_rank_order_async runs for a message of `bytes`: Direct or ScatterGather, as Auto
  // chooses below the ring threshold (Direct where scatter-gather is off); Auto where neither is available.
  Algorithm choose_in_rank_order(size_t bytes) const;

  // Auto picks Direct for a message of `bytes` when (size() - 1) * bytes is at
  // most this (PSGD_DIRECT_MAX_BYTES; 0: never; new API only).
  size_t direct_max_bytes() const { return settings_.direct_max_bytes; }
  // Direct allreduces that took the eager path (PSGD_DIRECT_EAGER=1; docs/transport.md), counted on the
  // communication thread: read it between operations, not while one runs.
  uint64_t eager_direct_collectives() const;
  // Whether the ranks' creation records came through the store (every rank offered it), not Gloo's ring
  // (docs/transport.md, step 5 of the rendezvous).
  bool fingerprints_from_store() const { return fingerprints_from_store_; }
  // For tests: this rank's pair towards `peer` as Gloo prints it, and rank r's pair towards this rank as the
  // table of peers has it ("[ip]:port"; empty where unknown), which names a peer in Gloo's errors.
  std::string pair_address(int peer) const;
  std::string peer_address(int peer) const { return peers_.addresses.at(static_cast<size_t>(peer)); }
  // The bound PSGD_DIRECT_MAX_BYTES=auto chooses (docs/transport.md, "Rounds") from the slowest rank's
  // one-round exchange time and, where measured (seconds_per_byte 0: not), the round scatter-gather adds, the
  // per-byte receive time and the number of parties to the exchange (ranks, or hosts when staged), each the
  // largest over the ranks: a pure function, so every rank that sees the same agreed numbers chooses the same
  // bound.
  static size_t direct_bound_for(double exchange_seconds, double round_seconds = 0, double seconds_per_byte = 0,
                                 int parties = 0);

 private:
  // Runs on the communication thread with the context (the only thread that
  // touches it after creation) and a tag unique among operations in flight.
  using RunFn = std::function<void(const std::shared_ptr<gloo::Context>& context, uint32_t tag)>;
  struct Op {
    std::string name;
    RunFn run;
  };

  // The transport's settings from the environment (docs/env.md), as this build applies them with `api` (each
  // variable parsed with every API, so a typo is named everywhere). A channel takes its first's instead.
  struct Settings {
    HostStageMode host_stage = HostStageMode::Off;  // PSGD_HOST_STAGE, the setting (stage_: whether it staged)
    bool host_shm = true;  // PSGD_HOST_SHM: the hops within a host through shared memory where staged
    bool eager_direct = false;  // PSGD_DIRECT_EAGER (new API only)
    bool scatter_gather = false;  // PSGD_SCATTER_GATHER (new API only)
    size_t direct_max_bytes = 0;  // PSGD_DIRECT_MAX_BYTES (new API only); kDirectAuto: measured at creation
    bool offer_record_in_store = false;  // PSGD_FINGERPRINT_STORE (new API only)
    static Settings from_env(GlooApi api);
  };
  GlooCommunicator(const CommOptions& options, GlooApi api, const Settings& settings);
  // create_on_store with `settings`; create_channel with the settings of the communicator it is made from, whose
  // direct bound (agreed by every rank) replaces auto, so a channel measures nothing.
  static std::unique_ptr<GlooCommunicator> make(const CommOptions& options, std::unique_ptr<Store> store,
                                                std::string store_name, GlooApi api, const Settings& settings);
  void connect();
  // Collective: every rank's creation record compared (MismatchError), the pairs connected, peers_ filled. By
  // the store where every rank offers it (this rank published its record in `scoped` if it offers), else
  // Gloo's ring.
  void check_fingerprint(Store& scoped);
  // Collective, at creation with PSGD_HOST_STAGE=1: groups the ranks by host
  // and, unless that is degenerate, connects the leaders' context and sets stage_.
  void setup_host_stage(Store& scoped);
  // The context's full mesh, connected within the timeout (MeshContext), Gloo's errors translated, naming
  // `what` ("rendezvous of 4 ranks").
  void connect_mesh(MeshContext& context, Store& store, const std::string& what);
  Work submit(std::string name, RunFn run);
  // The communication thread's body for one operation: fails at once when the
  // group is broken; translates Gloo's errors, breaking the group on a PeerError.
  void execute(Op& op);
  void add_rounds(uint64_t rounds) { rounds_.fetch_add(rounds, std::memory_order_relaxed); }
  // Collective, at creation with PSGD_DIRECT_MAX_BYTES=auto: times a few one-round exchanges, agrees on the
  // slowest rank's fastest one; where that is above a LAN's, also times exchanges of 1 MiB in all and agrees on
  // the largest per-byte time; sets settings_.direct_max_bytes.
  void measure_direct_bound();
  std::exception_ptr translate(const std::string& op, std::exception_ptr error) const;
  // Whether a message of `bytes` is within the direct bound (for size() - 1 peers, or the other hosts' leaders
  // when staged).
  bool direct_takes(size_t bytes) const;
  // Who exchanges in a direct allreduce: every rank, or, staged, each host's leader.
  int direct_parties() const { return stage_ != nullptr ? staged_hosts_ : options_.world_size; }
  // What a public collective passes, as every rank sends it to every other before Gloo's own algorithms run
  // (Sizes::Unknown). 24 bytes: a lead of the lead exchange (a multiple of 8).
  // Refused: a call this rank refused (its own arguments: refuse), sent where its peers send the call's shape
  // or their leads. LeadExchange: only as the call a refusal names.
  enum class ShapeKind : uint16_t {
    Allreduce = 1,
    Broadcast = 2,
    Allgather = 3,
    Barrier = 4,
    CheckSame = 5,
    Refused = 6,
    LeadExchange = 7
  };
  struct Shape {
    uint64_t magic = kMagic;  // on Gloo's allgather, no other 24 bytes pass for a shape
    ShapeKind kind = ShapeKind::Allreduce;
    // allreduce: the Algorithm it runs (the public allreduce and allreduce_in_rank_order_async may choose
    // differently for one count); else 0
    uint16_t algorithm = 0;
    int32_t detail = 0;  // allreduce: the DataType; broadcast: the root; refused: the refused call's ShapeKind; else 0
    uint64_t size = 0;   // allreduce: elements; broadcast, allgather: bytes; check_same: the fingerprint
    static constexpr uint64_t kMagic = 0x5041485344475350;  // "PSGDSHAP"
  };
  // On the communication thread: every rank's shape to every other in one round (the lead exchange; without it
  // Gloo's allgather of the shapes), a barrier too. MismatchError on every rank where one differs (in anything
  // but a check_same's fingerprint, which check_same compares), naming the first such rank and both calls
  // (nothing else was sent: the group stays usable); where a rank refused its call (refuse), naming the lowest
  // such rank on every rank but those that refused. Returns every rank's shape.
  std::vector<Shape> agree_on_call(const std::shared_ptr<gloo::Context>& context, uint32_t tag, const Shape& mine);
  // A public collective this rank refuses (`error`: its arguments; `call`: which collective) still takes its place
  // in the sequence of collectives where its peers agree on the call's shape first (Sizes::Unknown, more than one
  // rank): it sends a refusal for a shape, so that every peer fails the call at once with a MismatchError naming
  // this rank, nothing else is sent and the group stays usable. A refused lead exchange sends it as a shape in a
  // lead exchange (its peers' leads then fail with a MismatchError on the kinds). Throws `error` once that
  // exchange is done (failed or not: a failure of its own breaks the group, which the next call reports), at
  // once without one.
  [[noreturn]] void refuse(ShapeKind call, Sizes sizes, std::exception_ptr error);
  // Runs a call's argument checks; an Error they throw is refused (refuse).
  void refuse_unless(ShapeKind call, Sizes sizes, const std::function<void()>& checks);
  // Before the collective `mine` describes, where the caller passed Sizes::Unknown: agree_on_call. Returns the
  // tag the collective then runs with: `tag` where sizes were agreed, a fresh one after the exchange (which used
  // `tag`), the same on every rank.
  uint32_t agree_on_shape(const std::shared_ptr<gloo::Context>& context, uint32_t tag, Sizes sizes,
                          const Shape& mine);
  // On the communication thread: one lead exchange of `kind` (CollectiveAlgorithms::lead_allreduce), staged where
  // this communicator stages (HostStage::lead_allreduce, within lead_capacity()). Returns whether `parts` were summed.
  bool exchange_leads(const std::shared_ptr<gloo::Context>& context, uint32_t tag, LeadKind kind, const void* lead,
                      void* leads, size_t lead_bytes, std::span<const LeadPart> parts);

  CommOptions options_;
  GlooApi api_;
  Settings settings_;  // as created; direct_max_bytes is the bound auto chose once measured
  bool fingerprints_from_store_ = false;
  int staged_hosts_ = 0;     // set at creation, with stage_
  // Rounds of the collectives run so far (communication_rounds()), added by the communication thread.
  std::atomic<uint64_t> rounds_{0};
  std::unique_ptr<CollectiveAlgorithms> algorithms_;
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<Store> store_;
  std::string store_name_;  // in rendezvous errors: "ADDR:PORT", or the caller's store's name
  bool callers_store_ = false;  // made on the caller's store (create_on_store), which lives no longer than creation
  std::shared_ptr<gloo::transport::Device> device_;
  // Dropped by the communication thread after a fatal failure.
  std::shared_ptr<MeshContext> context_;
  // Which rank a failure message is about (filled by the fingerprint exchange).
  PeerTable peers_;
  // The staged allreduce (null unless staging is in effect); after creation the communication thread's alone.
  std::unique_ptr<HostStage> stage_;

  std::mutex broken_mutex_;
  std::exception_ptr broken_;  // first failure; every later op fails with it
  uint32_t next_tag_ = 0;      // touched by the communication thread only
  // Last member: stopped (pending operations cancelled) before the rest goes.
  std::unique_ptr<SerialWorker<Op, Completion>> worker_;
};

}  // namespace powersgd::transport
