// Process group over Gloo: rendezvous, collectives, failure reporting.
//
// Threading: a Communicator is used from one user thread at a time. Every
// collective, blocking or async, runs on the communicator's single
// communication thread in the order it was submitted, so ranks that submit the
// same sequence issue the same collectives in the same order.
//
// Failure: once a collective fails (peer gone, timeout), the communicator is
// broken: every pending and later operation fails with the same error (a
// PeerError naming the operation and the peer where known). Nothing aborts the
// process. Build a new Communicator (with a new run id) to continue.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "powersgd/error.hpp"

namespace powersgd {

enum class DataType { Float32, Float64, Float16, BFloat16 };
PSGD_API size_t size_of(DataType type);
PSGD_API const char* to_string(DataType type);

enum class TransportKind { Tcp, Ibverbs };

// One part of the data a lead exchange sums (Communicator::lead_exchange_async): `count` elements of `type` at
// `data`, summed in place.
struct LeadPart {
  void* data = nullptr;
  size_t count = 0;
  DataType type = DataType::Float32;
};
// The parts a lead exchange carries at most.
inline constexpr size_t kMaxLeadParts = 2;
// The highest index of a channel (Communicator::create_channel).
inline constexpr int kMaxChannelIndex = 255;
// The bytes `parts` take in a lead exchange's message: one after the other, each from a multiple of 8 bytes
// (so every part is aligned for its type), the last one unpadded. SIZE_MAX where that does not fit a size_t.
inline size_t lead_parts_bytes(std::span<const LeadPart> parts) {
  constexpr size_t kMax = static_cast<size_t>(-1);
  size_t end = 0;
  for (const LeadPart& part : parts) {
    if (part.count == 0) continue;
    const size_t element = size_of(part.type);
    const size_t at = (end + 7) / 8 * 8;
    if (end > kMax - 8 || part.count > (kMax - at) / element) return kMax;
    end = at + part.count * element;
  }
  return end;
}

struct PSGD_API CommOptions {
  int rank = -1;
  int world_size = -1;
  int local_rank = 0;
  // Rendezvous store. When host_store is true this rank (rank 0) starts the TCP
  // store server on store_port (0 = pick a free port; only for world_size 1).
  std::string store_addr = "127.0.0.1";
  uint16_t store_port = 0;
  bool host_store = false;
  std::string token;        // job token; empty = no authentication
  std::string run_id;       // key prefix, so reruns and rebuilt groups never collide
  // Data transport.
  TransportKind transport = TransportKind::Tcp;
  std::string iface;        // TCP: network interface name, or
  std::string address;      // TCP: local address/hostname to bind
  std::string ib_device;    // ibverbs: device name, empty = first
  int ib_port = 1;
  int ib_gid_index = 0;
  std::chrono::milliseconds timeout{300000};
  // Allreduce: ring at or above, direct or scatter-gather (tcp) or
  // halving-doubling (ibverbs) below. Default: the crossover measured in
  // docs/transport.md.
  size_t ring_threshold_bytes = size_t{8} << 20;

  // From RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (or OMPI_*, PMI_*, SLURM_*) and
  // PSGD_* (docs/env.md); under srun and a one-node mpirun, an unset MASTER_ADDR
  // or MASTER_PORT is derived (docs/launcher.md, "Slurm and MPI"). Throws
  // InvalidArgumentError naming a bad variable, or the launcher and the fix.
  static CommOptions from_env();

  // A world of one: rank 0 of 1, hosting its own store on a free loopback port.
  // For single-process runs (benchmarks, tests, a trainer without a launcher).
  static CommOptions single_process();
};

class Communicator;
// Opaque to users: the completion state behind Work and ReduceHandle.
class Completion;
namespace transport {
class GlooCommunicator;
}

// Handle of an async operation. wait() blocks until it finished and rethrows its
// error. Copyable; all copies refer to the same operation.
class PSGD_API Work {
 public:
  Work() = default;
  void wait() const;
  bool done() const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class transport::GlooCommunicator;  // the only maker of non-empty handles
  explicit Work(std::shared_ptr<Completion> state) : state_(std::move(state)) {}
  std::shared_ptr<Completion> state_;
};

class PSGD_API Communicator {
 public:
  // Collective: rendezvous with all ranks, connect the full mesh, then check
  // that every rank agrees on version, world size and settings (throws
  // MismatchError naming the first differing rank). Blocks up to
  // options.timeout. Sets SIGPIPE to ignored for the whole process (a write to a
  // dead peer must become an error, not kill the process). Design and failure
  // semantics: docs/transport.md.
  static std::unique_ptr<Communicator> create(const CommOptions& options);
  static std::unique_ptr<Communicator> from_env() { return create(CommOptions::from_env()); }

  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const CommOptions& options() const = 0;

  // Async collectives. Buffers must stay valid and untouched until the Work is
  // done. All ranks must call the same collectives in the same order with the
  // same count/dtype/root: where they do not, a Communicator made by create()
  // fails the collective with MismatchError on every rank, naming both calls,
  // before any data moves (the group stays usable; docs/transport.md, "Sizes
  // agreed first"). That holds for barrier and check_same too. A call whose
  // arguments this rank refuses (a root out of range, a null buffer) throws
  // InvalidArgumentError from the call itself, after its refusal reached every
  // rank in the call's place (the others fail it with MismatchError naming this
  // rank): it waits for the collectives queued before it and for the others to
  // reach the call, as any collective does.
  virtual Work allreduce_async(void* data, size_t count, DataType type) = 0;  // sum, in place
  virtual Work broadcast_async(void* data, size_t bytes, int root) = 0;
  // out receives size() * bytes: rank i's `in` at out + i * bytes.
  virtual Work allgather_async(const void* in, void* out, size_t bytes) = 0;
  virtual Work barrier_async() = 0;

  // Blocking forms.
  void allreduce(void* data, size_t count, DataType type) { allreduce_async(data, count, type).wait(); }
  void broadcast(void* data, size_t bytes, int root) { broadcast_async(data, bytes, root).wait(); }
  void allgather(const void* in, void* out, size_t bytes) { allgather_async(in, out, bytes).wait(); }
  void barrier() { barrier_async().wait(); }

  // Collective: throws MismatchError naming `what` and the first rank whose
  // fingerprint differs from rank 0's. Used to check layouts and configurations.
  virtual void check_same(uint64_t fingerprint, const std::string& what) = 0;

  // Sequential communication rounds of the collectives this communicator ran so
  // far: each collective adds the number of message exchanges its algorithm
  // makes one after the other (each waits for the one before, so each costs at
  // least one one-way network delay): 1 for the direct allreduce, 2 (size - 1)
  // for the ring, 2 log2(size) for bcube (docs/transport.md, "Rounds");
  // host-staged (PSGD_HOST_STAGE: by default where ranks share a host) an
  // allreduce counts only the rounds that cross hosts (its
  // algorithm's among the hosts' leaders). The collectives run one at a time,
  // so the difference over a training step is the rounds on the step's
  // critical path. 0 for a Communicator not made by create().
  uint64_t communication_rounds() const;

  // Whether an allreduce of `count` elements of `type` adds each element's n
  // contributions in one fixed order that does not depend on the element's
  // offset in the buffer: rank order (the direct and the scatter-gather
  // algorithms; a world of one), or host-staged within each host in
  // rank order, then the hosts in order (direct or scatter-gather among the
  // hosts' leaders; docs/transport.md, "Host-staged allreduce"). Then one allreduce of two buffers laid end to end gives the
  // same bits as two allreduces. The engine fuses queued reductions into one
  // only where this holds (docs/engine.md, "Fusing queued reductions"). False
  // for a Communicator not made by create().
  bool sums_in_rank_order(size_t count, DataType type) const;
  // An allreduce (sum, in place) that adds each element's contributions in the
  // order of sums_in_rank_order whatever its size (direct where every rank
  // receives (size() - 1) * count elements within PSGD_DIRECT_MAX_BYTES, one
  // round; else scatter-gather, two rounds of about count elements each way;
  // host-staged, among the hosts' leaders): for buffers that join allreduces
  // each of which sums_in_rank_order, so the joined one keeps their bits and
  // moves the same bytes. UnsupportedError where sums_in_rank_order is false
  // for every size (not made by create(), the legacy Gloo API, or both
  // PSGD_DIRECT_MAX_BYTES=0 and PSGD_SCATTER_GATHER=0).
  Work allreduce_in_rank_order_async(void* data, size_t count, DataType type);

  // The lead exchange (docs/transport.md, "Lead exchange"; the engine's order
  // guard carries its announce and a reduction's first collective in it):
  // lead_exchange_capacity() is the bytes one rank's message carries (a lead
  // and its data together), the same on every rank; 0 where the communicator
  // has no lead exchange (not made by create(), a world of one, the legacy Gloo
  // API, PSGD_DIRECT_EAGER=0, PSGD_DIRECT_MAX_BYTES=0). With PSGD_HOST_STAGE in
  // effect it is staged (the leaders exchange their hosts' leads and sums).
  size_t lead_exchange_capacity() const;
  // Collective, one round: every rank's `lead_bytes` (a multiple of 8, the same
  // on every rank, within the capacity) arrive in `leads` (size() * lead_bytes:
  // rank r's at r * lead_bytes, as allgather), and `data` (`count` elements of
  // `type`, in place; count 0: none) is summed with the bits of
  // allreduce_in_rank_order_async (rank order; staged: host, then hosts), where
  // every rank passed the same nonzero count and type and lead_bytes + count *
  // size fits the capacity. `*summed`
  // says whether it was, the same on every rank (each sees every rank's
  // header); when not, `data` is unchanged. Where the ranks' lead_bytes differ:
  // MismatchError on every rank. InvalidArgumentError where the lead does not
  // fit or the communicator has no lead exchange.
  Work lead_exchange_async(const void* lead, void* leads, size_t lead_bytes, void* data, size_t count,
                           DataType type, bool* summed);
  // The same with the data in up to kMaxLeadParts parts, each of its own type (an engine's float32 values and
  // its 16-bit factors in one exchange): each part summed as allreduce_in_rank_order_async sums it alone, all
  // of them or none (*summed). They travel where lead_bytes + lead_parts_bytes(parts) fits the capacity and
  // every rank passed the same counts and types. InvalidArgumentError for more parts, or a null part of a
  // nonzero count.
  Work lead_exchange_async(const void* lead, void* leads, size_t lead_bytes, std::span<const LeadPart> parts,
                           bool* summed);

  // Collective over this communicator's ranks: a channel, another communicator of the same ranks whose
  // collectives run on a thread and connections of their own, so that a Reducer on it overlaps one on this
  // communicator on the wire (docs/scaling.md, "Channels"). It rendezvouses on this one's store, without
  // hosting it (where this process hosts the store, keep the communicator that hosts it until every rank's
  // channel is made), under this one's run id + "/channel<index>" (a group or run id of that form would meet
  // it), with this one's options and transport settings as created, and its direct bound
  // (PSGD_DIRECT_MAX_BYTES: auto is not measured again). `index` 1 to kMaxChannelIndex, the same on every
  // rank, one call per index at a time; ranks that pass different ones never meet (TimeoutError after the
  // timeout), and an index whose creation failed is spent (make the next one with another). Reads only what
  // creation fixed, so any thread may call it while this communicator runs collectives.
  // InvalidArgumentError for an index out of range; UnsupportedError for a communicator not made by create(),
  // or one made on the caller's store (the C API's psgd_comm_init_on_store, which this one does not keep: make
  // the channel there, with a group id of its own).
  std::unique_ptr<Communicator> create_channel(int index) const;
};

}  // namespace powersgd
