#include "comm/algorithms.hpp"

#include <gloo/allgather.h>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/barrier_all_to_one.h>
#include <gloo/broadcast.h>
#include <gloo/broadcast_one_to_all.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/types.h>

#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <vector>

#include "comm/dtype.hpp"
#include "common/check.hpp"

namespace powersgd::transport {
namespace {

// ---- new style: free functions, options with tag and timeout ----

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

// Gloo's bcube (radix 2) on n ranks: one reduce-scatter step per factor of n's
// factorization into 2s and a remainder (computeGroupSizePerStep), then as many
// allgather steps.
uint64_t bcube_rounds(int n) {
  uint64_t steps = 0;
  for (; n % 2 == 0; n /= 2) ++steps;
  if (n > 1) ++steps;
  return 2 * steps;
}

class NewStyleAlgorithms final : public CollectiveAlgorithms {
 public:
  NewStyleAlgorithms(std::chrono::milliseconds timeout, bool scatter_gather)
      : timeout_(timeout), small_(scatter_gather ? Algorithm::ScatterGather : Algorithm::Bcube) {}
  GlooApi api() const override { return GlooApi::New; }
  Algorithm small_message_algorithm() const override { return small_; }
  void require_supported(Algorithm algorithm) const override {
    PSGD_REQUIRE(algorithm != Algorithm::HalvingDoubling, InvalidArgumentError,
                 "allreduce: halving-doubling needs Gloo's legacy API");
  }
  size_t max_allgather_bytes() const override { return SIZE_MAX; }

  std::vector<uint8_t> connect_pairs(const std::shared_ptr<gloo::Context>& context, uint32_t tag,
                                     uint8_t offer) override {
    // One byte to each rank: builds before the offer sent 0 and never read what they received.
    const size_t n = static_cast<size_t>(context->size);
    std::vector<uint8_t> in(n, offer), out(n);
    gloo::AlltoallOptions opts(context);
    opts.setInput(in.data(), n);
    opts.setOutput(out.data(), n);
    configure(opts, tag);
    gloo::alltoall(opts);
    return out;
  }

  void allreduce(const std::shared_ptr<gloo::Context>& context, uint32_t tag, void* data, size_t count,
                 DataType type, Algorithm algorithm) override {
    if (algorithm == Algorithm::Direct) return direct_allreduce(context, tag, data, count, type);
    if (algorithm == Algorithm::ScatterGather) return scatter_gather_allreduce(context, tag, data, count, type);
    gloo::AllreduceOptions opts(context);
    opts.setAlgorithm(algorithm == Algorithm::Ring ? gloo::AllreduceOptions::Algorithm::RING
                                                   : gloo::AllreduceOptions::Algorithm::BCUBE);
    set_output(opts, data, count, type);
    opts.setReduceFunction(sum_function(type));
    configure(opts, tag);
    gloo::allreduce(opts);
  }

  void broadcast(const std::shared_ptr<gloo::Context>& context, uint32_t tag, void* data, size_t bytes,
                 int root) override {
    gloo::BroadcastOptions opts(context);
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setRoot(root);
    configure(opts, tag);
    gloo::broadcast(opts);
  }

  void allgather(const std::shared_ptr<gloo::Context>& context, uint32_t tag, const void* in, void* out,
                 size_t bytes) override {
    if (takes_direct_allgather(context->size, bytes)) return direct_allgather(*context, tag, in, out, bytes);
    gloo::AllgatherOptions opts(context);
    // Gloo's input buffer is not written to; its API just lacks const.
    opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), bytes);
    opts.setOutput(static_cast<uint8_t*>(out), bytes * static_cast<size_t>(context->size));
    configure(opts, tag);
    gloo::allgather(opts);
  }

  void barrier(const std::shared_ptr<gloo::Context>& context, uint32_t tag) override {
    gloo::BarrierOptions opts(context);
    configure(opts, tag);
    gloo::barrier(opts);
  }

  uint64_t allreduce_rounds(Algorithm algorithm, int n) const override {
    if (algorithm == Algorithm::Direct) return 1;
    if (algorithm == Algorithm::ScatterGather) return 2;
    return algorithm == Algorithm::Ring ? ring_allreduce_rounds(n) : bcube_rounds(n);
  }
  uint64_t broadcast_rounds(int n) const override { return ceil_log2(n); }  // a binomial tree
  uint64_t allgather_rounds(int n, size_t bytes) const override {
    return takes_direct_allgather(n, bytes) ? 1 : static_cast<uint64_t>(n - 1);  // one exchange, or a ring
  }

  void enable_eager_direct(size_t bound) override { eager_bound_ = bound; }
  void enable_direct_allgather() override { direct_allgather_ = true; }
  bool checks_sizes(Algorithm algorithm, size_t count, DataType type, int n) const override {
    // Direct on the receives posted ahead (eager_for's test): one exchange, every header read before anything
    // else. Not scatter-gather: a rank that finds a peer's header unlike its own still waits for that peer's
    // second exchange, which a peer in another collective never sends (a timeout).
    return algorithm == Algorithm::Direct && n > 1 && count * size_of(type) <= eager_capacity(static_cast<size_t>(n));
  }
  // The receives posted ahead hold kHeader + eager_capacity(n) bytes; a lead exchange's header is a word longer.
  size_t lead_capacity(int n) const override {
    const size_t capacity = n > 1 ? eager_capacity(static_cast<size_t>(n)) : 0;
    return capacity > kLeadHeader - kHeader ? capacity - (kLeadHeader - kHeader) : 0;
  }
  void release_eager_direct() override { eager_.clear(); }
  uint64_t eager_direct_collectives() const override {
    uint64_t done = 0;
    for (const Eager& e : eager_) done += e.sequence;
    return done;
  }

 private:
  // The direct allgather's bound on the bytes a rank receives (n - 1 peers' contributions): records, reports and
  // shapes take one exchange; larger gathers keep Gloo's ring, whose neighbour-to-neighbour steps do not make
  // every rank receive from every peer at once.
  static constexpr size_t kMaxDirectAllgatherBytes = size_t{1} << 20;
  // Beside the eager path's and scatter-gather's (0x52-0x54) and host_stage's (0x50-0x51, 0x55-0x5b).
  static constexpr uint8_t kDirectAllgatherSlotPrefix = 0x5c;

  bool takes_direct_allgather(int n, size_t bytes) const {
    return direct_allgather_ && n > 1 && bytes <= kMaxDirectAllgatherBytes / static_cast<size_t>(n - 1);
  }

  // Every rank sends its contribution to every peer at once and receives theirs (one exchange: two one-way
  // delays, as Gloo's unbound buffers wait for the receiver's notice; the ring pays them n - 1 times). Into a
  // buffer of its own, copied to `out` once all arrived: a failed gather leaves `out` as it was, and no late
  // message can land in the caller's memory. Sizes are agreed (the caller's contract, as for the ring).
  void direct_allgather(gloo::Context& context, uint32_t tag, const void* in, void* out, size_t bytes) {
    const size_t n = static_cast<size_t>(context.size), me = static_cast<size_t>(context.rank);
    if (gathered_.size() < n * bytes) gathered_.resize(n * bytes);
    if (contribution_.size() < bytes) contribution_.resize(bytes);
    std::memcpy(contribution_.data(), in, bytes);
    auto received = context.createUnboundBuffer(gathered_.data(), n * bytes);
    auto sent = context.createUnboundBuffer(contribution_.data(), bytes);
    const uint64_t slot = gloo::Slot::build(kDirectAllgatherSlotPrefix, tag);
    for (size_t peer = 0; peer < n; ++peer)
      if (peer != me) received->recv(static_cast<int>(peer), slot, peer * bytes, bytes);
    for (size_t peer = 0; peer < n; ++peer)
      if (peer != me) sent->send(static_cast<int>(peer), slot, 0, bytes);
    wait_exchange(*received, *sent, n - 1, "direct allgather");
    std::memcpy(gathered_.data() + me * bytes, contribution_.data(), bytes);
    std::memcpy(out, gathered_.data(), n * bytes);
  }

  // Gloo's unbound buffers rendezvous: a send leaves only once the receiver's "ready to receive" notice has
  // arrived, so an exchange whose receives are posted when its sends are costs two one-way delays. The eager
  // path posts the receives of a context's next direct or scatter-gather collective at the start of the
  // current one (into the other of two buffers), so their notices cross the network while it runs, and the
  // next one's first exchange leaves at once: one one-way delay per exchange after the first. A message to a
  // peer larger than the receives posted ahead (`capacity`) takes the path without them, as every rank
  // decides alike; the sums are the same either way (rank order).
  static constexpr size_t kMaxEagerBytesPerPeer = size_t{1} << 20;
  // Beside Gloo's 0x01-0x08, host_stage's 0x50-0x51 and 0x55-0x5b, scatter-gather's 0x53-0x54 (below) and the
  // direct allgather's 0x5c (above).
  static constexpr uint8_t kEagerDirectSlotPrefix = 0x52;

  // Each message starts with a header (kHeader bytes, so the payload stays 8-byte aligned; the stride of the
  // peers' slots is a multiple of 64): its payload's byte count (bits 0-55) and type (56-61): ranks that pass
  // different counts or types get a MismatchError naming both instead of summing stale bytes (Gloo's alltoall
  // enforced equal sizes by aborting) or one 16-bit format's bits as the other's. Float32's header is its byte
  // count alone.
  static constexpr size_t kHeader = 8;
  static constexpr int kHeaderTypeShift = 56;
  static constexpr uint64_t kHeaderBytesMask = (uint64_t{1} << kHeaderTypeShift) - 1;
  // Set in the header of scatter-gather's messages: a rank that runs direct where a peer runs scatter-gather with
  // the same count (an algorithm forced unlike on every rank) sees another header, not a peer's chunk as its
  // whole buffer.
  static constexpr uint64_t kScatterGatherHeaderBit = uint64_t{1} << 63;
  // Set in the lead exchange's header (lead_header below), so that no header passes for another kind's.
  static constexpr uint64_t kLeadHeaderBit = uint64_t{1} << 62;

  static uint64_t data_header(size_t bytes, DataType type, bool scatter_gather) {
    return static_cast<uint64_t>(bytes) | (static_cast<uint64_t>(type) << kHeaderTypeShift) |
           (scatter_gather ? kScatterGatherHeaderBit : 0);
  }

  // "rank 2 sent 28 bytes where this rank (0) reduces 32", "rank 1 sent 16 bytes of bfloat16 where this rank
  // (0) reduces 16 bytes of float16": why a peer's header is not this rank's.
  static void require_same_header(uint64_t sent, uint64_t mine, const char* algorithm, int peer, size_t me) {
    if (sent == mine) return;
    PSGD_REQUIRE((sent & kLeadHeaderBit) == 0, MismatchError, algorithm, " allreduce: rank ", peer, " sent ",
                 (sent & kLeadShapeBit) != 0
                     ? "the shape a public collective sends first (another collective, or a call that rank refused: "
                       "its own error says why)"
                     : "a lead exchange's lead (the engine's announce)",
                 " where this rank (", me, ") reduces ", mine & kHeaderBytesMask,
                 " bytes: every rank must run the same collectives in the same order");
    const bool same_algorithm = ((sent ^ mine) & kScatterGatherHeaderBit) == 0;
    const bool same_type = (((sent ^ mine) & ~kScatterGatherHeaderBit) >> kHeaderTypeShift) == 0;
    const auto with = [&](uint64_t header) {
      std::string text;
      if (!same_type)
        text = detail::concat(" of ", to_string(static_cast<DataType>((header & ~kScatterGatherHeaderBit) >>
                                                                      kHeaderTypeShift)));
      if (!same_algorithm)
        text += (header & kScatterGatherHeaderBit) != 0 ? " with scatter-gather" : " with direct";
      return text;
    };
    PSGD_THROW(MismatchError, algorithm, " allreduce: rank ", peer, " sent ", sent & kHeaderBytesMask, " bytes",
               with(sent), " where this rank (", me, ") reduces ", mine & kHeaderBytesMask,
               same_type ? "" : " bytes", with(mine), ": every rank must pass the same count and type",
               same_algorithm ? "" : " and algorithm");
  }

  // Waits for the receives on `in` and the sends from `out` of one exchange with `peers` peers.
  void wait_exchange(gloo::transport::UnboundBuffer& in, gloo::transport::UnboundBuffer& out, size_t peers,
                     const char* what) const {
    for (size_t i = 0; i < peers; ++i)
      if (!in.waitRecv(timeout_)) require_done(false, (std::string(what) + ": a receive").c_str());
    for (size_t i = 0; i < peers; ++i)
      if (!out.waitSend(timeout_)) require_done(false, (std::string(what) + ": a send").c_str());
  }

  struct Eager {
    const gloo::Context* context = nullptr;
    size_t capacity = 0;    // payload bytes per peer of each receive posted ahead
    size_t stride = 0;      // kHeader + capacity, rounded up to 64: a peer's slot in `in`
    uint32_t sequence = 0;  // the eager direct collectives done on this context: the slot of the next
    std::array<std::vector<uint8_t>, 2> in;  // collective `sequence` receives into in[sequence % 2]
    std::array<std::unique_ptr<gloo::transport::UnboundBuffer>, 2> in_buffers;
    std::vector<uint8_t> out;  // a slot of `stride` per peer (direct sends slot 0 to every peer)
    std::unique_ptr<gloo::transport::UnboundBuffer> out_buffer;
  };

  // Receives of eager collective `sequence` from every peer, posted now.
  static void post_receives(const gloo::Context& context, Eager& e, uint32_t sequence) {
    const uint64_t slot = gloo::Slot::build(kEagerDirectSlotPrefix, sequence);
    auto& buffer = *e.in_buffers[sequence % 2];
    for (int peer = 0; peer < context.size; ++peer)
      if (peer != context.rank) buffer.recv(peer, slot, static_cast<size_t>(peer) * e.stride, kHeader + e.capacity);
  }

  // One eager exchange: the first `message_bytes` of e.out (header and payload, written by the caller) to every
  // peer on the slot of collective e.sequence, the next collective's receives posted first; waits for it and
  // returns the peers' messages (peer r's at r * e.stride).
  const uint8_t* exchange_eager(const gloo::Context& context, Eager& e, size_t message_bytes, const char* what) const {
    const uint32_t sequence = e.sequence;
    post_receives(context, e, sequence + 1);
    const uint64_t slot = gloo::Slot::build(kEagerDirectSlotPrefix, sequence);
    for (int peer = 0; peer < context.size; ++peer)
      if (peer != context.rank) e.out_buffer->send(peer, slot, 0, message_bytes);
    wait_exchange(*e.in_buffers[sequence % 2], *e.out_buffer, static_cast<size_t>(context.size - 1), what);
    ++e.sequence;
    return e.in[sequence % 2].data();
  }

  // Payload bytes per peer of the receives posted ahead on a context of n > 1 ranks (0: the eager path is off):
  // a multiple of 64, the same on every rank (same bound, same context size), so is every choice made by it.
  size_t eager_capacity(size_t n) const {
    return eager_bound_ == 0 ? 0 : std::min(kMaxEagerBytesPerPeer, eager_bound_ / (n - 1)) / 64 * 64;
  }

  // This context's eager state, made (with the first collective's receives posted) on its first use; null
  // where messages of `bytes` per peer do not fit the receives posted ahead.
  Eager* eager_for(const std::shared_ptr<gloo::Context>& context, size_t bytes) {
    if (eager_bound_ == 0) return nullptr;
    const size_t n = static_cast<size_t>(context->size);
    const size_t capacity = eager_capacity(n);
    if (bytes > capacity) return nullptr;
    for (Eager& e : eager_)
      if (e.context == context.get()) return &e;
    Eager& e = eager_.emplace_back();
    e.context = context.get();
    e.capacity = capacity;
    e.stride = (kHeader + capacity + 63) / 64 * 64;
    for (size_t i = 0; i < 2; ++i) {
      e.in[i].resize(n * e.stride);
      e.in_buffers[i] = context->createUnboundBuffer(e.in[i].data(), e.in[i].size());
    }
    e.out.resize(n * e.stride);
    e.out_buffer = context->createUnboundBuffer(e.out.data(), e.out.size());
    post_receives(*context, e, 0);
    return &e;
  }

  // Returns false where the eager path does not take this message (then nothing was sent or posted).
  bool eager_direct_allreduce(const std::shared_ptr<gloo::Context>& context, void* data, size_t count,
                              DataType type) {
    const size_t bytes = count * size_of(type);
    Eager* found = eager_for(context, bytes);
    if (found == nullptr) return false;
    Eager& e = *found;
    const int n = context->size, me = context->rank;
    const uint64_t header = data_header(bytes, type, false);
    std::memcpy(e.out.data(), &header, kHeader);
    std::memcpy(e.out.data() + kHeader, data, bytes);
    const uint8_t* received = exchange_eager(*context, e, kHeader + bytes, "direct allreduce");
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      uint64_t sent = 0;
      std::memcpy(&sent, received + static_cast<size_t>(r) * e.stride, kHeader);
      require_same_header(sent, header, "direct", r, static_cast<size_t>(me));
    }
    // The contributions in rank order, as the alltoall path adds them.
    add_in_rank_order(data, count, type, static_cast<size_t>(n), [&](size_t r) {
      return r == static_cast<size_t>(me) ? e.out.data() + kHeader : received + r * e.stride + kHeader;
    });
    return true;
  }

  // The lead exchange's header (kLeadHeader bytes, two words). The first: part 0's bytes (bits 0-31; 0: none),
  // the lead's bytes (32-54), whether the lead is a public collective's shape (kLeadShapeBit) and part 0's type
  // (56-61); kLeadHeaderBit marks it, so that a direct or scatter-gather message never passes for one. The
  // second: part 1's bytes (0-31) and type (56-61). Nothing is sent of a part that does not fit (none then).
  static constexpr size_t kLeadHeader = 2 * kHeader;
  static constexpr int kLeadBytesShift = 32, kLeadShapeShift = 55;
  static constexpr uint64_t kLeadShapeBit = uint64_t{1} << kLeadShapeShift;
  static_assert(kMaxLeadParts == 2, "a lead exchange's header describes two parts");
  static uint64_t part_word(const LeadPart& part, bool sent) { return sent ? lead_part_word(part) : 0; }
  static std::array<uint64_t, 2> lead_header(LeadKind kind, size_t lead_bytes, std::span<const LeadPart> parts,
                                             bool sent) {
    const LeadPart none{};
    return {kLeadHeaderBit | (kind == LeadKind::Shape ? kLeadShapeBit : 0) |
                (static_cast<uint64_t>(lead_bytes) << kLeadBytesShift) |
                part_word(parts.empty() ? none : parts[0], sent),
            part_word(parts.size() > 1 ? parts[1] : none, sent)};
  }
  static size_t lead_bytes_of(uint64_t header) {
    return static_cast<size_t>((header >> kLeadBytesShift) & ((uint64_t{1} << (kLeadShapeShift - kLeadBytesShift)) - 1));
  }
  static LeadKind lead_kind_of(uint64_t header) {
    return (header & kLeadShapeBit) != 0 ? LeadKind::Shape : LeadKind::Lead;
  }

  bool lead_allreduce(const std::shared_ptr<gloo::Context>& context, LeadKind kind, const void* lead, void* leads,
                      size_t lead_bytes, std::span<const LeadPart> parts) override {
    const int n = context->size, me = context->rank;
    Eager* found = eager_for(context, lead_bytes);
    // The Communicator checked lead_bytes against lead_capacity: the same on every rank.
    PSGD_ASSERT(found != nullptr && lead_bytes % 8 == 0 && lead_bytes <= lead_capacity(n) && parts.size() <= 2,
                "lead exchange of ", lead_bytes, " bytes and ", parts.size(), " parts");
    Eager& e = *found;
    // Data that does not fit beside the lead stays behind (as on every rank that passes as many bytes).
    const size_t data_bytes = lead_parts_bytes(parts);
    const bool sent = data_bytes > 0 && data_bytes <= lead_capacity(n) - lead_bytes;
    const std::array<uint64_t, 2> header = lead_header(kind, lead_bytes, parts, sent);
    const size_t bytes = sent ? data_bytes : 0;
    std::memcpy(e.out.data(), header.data(), kLeadHeader);
    std::memcpy(e.out.data() + kLeadHeader, lead, lead_bytes);
    if (sent) pack_lead_parts(parts, e.out.data() + kLeadHeader + lead_bytes);
    const uint8_t* received = exchange_eager(*context, e, kLeadHeader + lead_bytes + bytes, "lead exchange");
    // Rank r's header words (word 1 read only where word 0 is a lead's: a message of another kind may end there).
    const auto header_of = [&](int r, size_t word = 0) {
      uint64_t value = header[word];
      if (r != me) std::memcpy(&value, received + static_cast<size_t>(r) * e.stride + word * kHeader, kHeader);
      return value;
    };
    for (int r = 0; r < n; ++r) {
      const uint64_t sent_header = header_of(r);
      PSGD_REQUIRE((sent_header & kLeadHeaderBit) != 0, MismatchError, "lead exchange: rank ", r, " sent ",
                   (sent_header & kScatterGatherHeaderBit) != 0 ? "a scatter-gather" : "a direct", " allreduce's ",
                   sent_header & kHeaderBytesMask, " bytes of ",
                   to_string(static_cast<DataType>((sent_header & ~kScatterGatherHeaderBit) >> kHeaderTypeShift)),
                   " where this rank (", me, ") sends a lead of ", lead_bytes,
                   " bytes: every rank must run the same collectives in the same order");
    }
    // The first rank whose kind is not rank 0's: the same on every rank, each seeing every header.
    const uint64_t first = header_of(0);
    for (int r = 1; r < n; ++r) {
      const uint64_t sent_header = header_of(r);
      if (lead_kind_of(sent_header) != lead_kind_of(first))
        throw LeadKindMismatchError(
            detail::concat("lead exchange: rank ", r, " sent ",
                           describe_lead(lead_kind_of(sent_header), lead_bytes_of(sent_header)), " where rank 0 sent ",
                           describe_lead(lead_kind_of(first), lead_bytes_of(first)), " (this rank, ", me, ": ",
                           describe_lead(kind, lead_bytes),
                           "): every rank must run the same collectives in the same order"),
            r, lead_kind_of(sent_header), lead_bytes_of(sent_header));
    }
    bool summed = sent;
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      const uint64_t sent_header = header_of(r);
      if (lead_bytes_of(sent_header) != lead_bytes)
        PSGD_THROW(MismatchError, "lead exchange: rank ", r, " sent ", describe_lead(kind, lead_bytes_of(sent_header)),
                   " where this rank (", me, ") sends ", describe_lead(kind, lead_bytes),
                   ": every rank must pass the same lead");
      summed = summed && sent_header == header[0] && header_of(r, 1) == header[1];  // the same parts
    }
    auto* out = static_cast<uint8_t*>(leads);
    for (int r = 0; r < n; ++r)
      std::memcpy(out + static_cast<size_t>(r) * lead_bytes,
                  r == me ? static_cast<const uint8_t*>(lead)
                          : received + static_cast<size_t>(r) * e.stride + kLeadHeader,
                  lead_bytes);
    if (!summed) return false;
    // Each part's contributions in rank order, as the direct algorithm adds them: the same bits.
    for (size_t i = 0; i < parts.size(); ++i) {
      if (parts[i].count == 0) continue;
      const size_t at = kLeadHeader + lead_bytes + lead_part_offset(parts, i);
      add_in_rank_order(parts[i].data, parts[i].count, parts[i].type, static_cast<size_t>(n), [&](size_t r) {
        return (r == static_cast<size_t>(me) ? e.out.data() : received + r * e.stride) + at;
      });
    }
    return true;
  }

  // One round: every rank sends its buffer to every other at once (an alltoall
  // of size() copies), then sums the size() contributions in rank order, the
  // same additions in the same order on every rank: bitwise the same sums.
  void direct_allreduce(const std::shared_ptr<gloo::Context>& context, uint32_t tag, void* data, size_t count,
                        DataType type) {
    if (eager_direct_allreduce(context, data, count, type)) return;
    const size_t n = static_cast<size_t>(context->size);
    const size_t bytes = count * size_of(type);
    // Kept between calls (the communication thread's alone): a reduction's three small collectives allocate
    // nothing once the largest has run.
    if (direct_in_.size() < n * bytes) {
      direct_in_.resize(n * bytes);
      direct_out_.resize(n * bytes);
    }
    uint8_t* in = direct_in_.data();
    uint8_t* out = direct_out_.data();
    for (size_t r = 0; r < n; ++r) std::memcpy(in + r * bytes, data, bytes);
    gloo::AlltoallOptions opts(context);
    opts.setInput(in, n * bytes);
    opts.setOutput(out, n * bytes);
    configure(opts, tag);
    gloo::alltoall(opts);
    add_in_rank_order(data, count, type, n, [&](size_t r) { return out + r * bytes; });
  }

  // Rank order, in two rounds at any size (docs/transport.md, "Scatter-gather allreduce"): each rank sends
  // chunk r of its buffer to rank r (a reduce-scatter), rank r adds the size() contributions to its chunk
  // in rank order, then sends the sum to every rank (an allgather). Each element is the sum the direct
  // algorithm computes, the same additions in the same order: the same bits on every rank, and the same
  // bits as direct. Bytes per rank 2 (n - 1) / n x the buffer each way, as bcube and the ring. Every
  // message starts with the sender's byte count (kHeader): ranks that pass different counts get a
  // MismatchError naming both once both exchanges are done (each rank sends its second one in any case,
  // with no payload after a mismatch, so that no receive is left posted).
  // (Names of their own: Gloo's gloo::kScatterSlotPrefix and gloo::kGatherSlotPrefix are other values.)
  static constexpr uint8_t kSumScatterSlotPrefix = 0x53;  // the first exchange where it is not posted ahead
  static constexpr uint8_t kSumGatherSlotPrefix = 0x54;

  // Elements [first, first + length) of chunk r of `count` over n ranks: the first count % n chunks one longer.
  struct Chunk {
    size_t first = 0, length = 0;
  };
  static Chunk chunk_of(size_t count, size_t n, size_t r) {
    const size_t base = count / n, longer = count % n;
    return {r * base + std::min(r, longer), base + (r < longer ? 1 : 0)};
  }

  void scatter_gather_allreduce(const std::shared_ptr<gloo::Context>& context, uint32_t tag, void* data,
                                size_t count, DataType type) {
    const size_t n = static_cast<size_t>(context->size), me = static_cast<size_t>(context->rank);
    const size_t element = size_of(type), bytes = count * element;
    auto* values = static_cast<uint8_t*>(data);
    const Chunk mine = chunk_of(count, n, me);
    const size_t most = chunk_of(count, n, 0).length * element;  // the longest chunk's bytes
    const size_t stride = (kHeader + most + 63) / 64 * 64;       // a message's slot: payloads stay aligned
    const uint64_t header = data_header(bytes, type, true);

    // The second exchange's receives first, so that their notices cross the network during the first.
    if (gather_in_.size() < n * stride) gather_in_.resize(n * stride);
    if (gather_out_.size() < stride) gather_out_.resize(stride);
    auto gather_in = context->createUnboundBuffer(gather_in_.data(), n * stride);
    auto gather_out = context->createUnboundBuffer(gather_out_.data(), stride);
    const uint64_t gather_slot = gloo::Slot::build(kSumGatherSlotPrefix, tag);
    for (size_t peer = 0; peer < n; ++peer)
      if (peer != me) gather_in->recv(static_cast<int>(peer), gather_slot, peer * stride, stride);

    // The first exchange: peer p's chunk behind the header, from slot p of `out` (every rank passed the same
    // count, so the receives posted for it are at least that long); into the receives posted ahead where every
    // chunk fits them.
    const auto scatter = [&](uint8_t* out, gloo::transport::UnboundBuffer& out_buffer, size_t out_stride,
                             gloo::transport::UnboundBuffer& in_buffer, uint64_t slot) {
      for (size_t peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        const Chunk c = chunk_of(count, n, peer);
        std::memcpy(out + peer * out_stride, &header, kHeader);
        std::memcpy(out + peer * out_stride + kHeader, values + c.first * element, c.length * element);
        out_buffer.send(static_cast<int>(peer), slot, peer * out_stride, kHeader + c.length * element);
      }
      wait_exchange(in_buffer, out_buffer, n - 1, "scatter-gather allreduce");
    };
    const uint8_t* received = nullptr;  // peer r's contribution to this rank's chunk at received + r * step
    size_t step = 0;
    if (Eager* e = eager_for(context, most)) {
      const uint32_t sequence = e->sequence;
      post_receives(*context, *e, sequence + 1);
      scatter(e->out.data(), *e->out_buffer, e->stride, *e->in_buffers[sequence % 2],
              gloo::Slot::build(kEagerDirectSlotPrefix, sequence));
      ++e->sequence;
      received = e->in[sequence % 2].data();
      step = e->stride;
    } else {
      if (scatter_in_.size() < n * stride) scatter_in_.resize(n * stride);
      if (scatter_out_.size() < n * stride) scatter_out_.resize(n * stride);
      auto in = context->createUnboundBuffer(scatter_in_.data(), n * stride);
      auto out = context->createUnboundBuffer(scatter_out_.data(), n * stride);
      const uint64_t slot = gloo::Slot::build(kSumScatterSlotPrefix, tag);
      for (size_t peer = 0; peer < n; ++peer)
        if (peer != me) in->recv(static_cast<int>(peer), slot, peer * stride, stride);
      scatter(scatter_out_.data(), *out, stride, *in, slot);
      received = scatter_in_.data();
      step = stride;
    }
    // Every rank sees every other's header: where two counts differ, every rank finds one that differs from
    // its own, so the second exchange's headers need no check of their own.
    int mismatched = -1;  // the first peer whose header differs from this rank's
    uint64_t theirs = 0;
    for (size_t peer = 0; peer < n && mismatched < 0; ++peer) {
      if (peer == me) continue;
      std::memcpy(&theirs, received + peer * step, kHeader);
      if (theirs != header) mismatched = static_cast<int>(peer);
    }

    // This rank's chunk: the contributions in rank order, as direct adds them.
    uint8_t* sum = gather_out_.data() + kHeader;
    std::memcpy(gather_out_.data(), &header, kHeader);
    const size_t payload = mismatched < 0 ? mine.length * element : 0;
    if (payload > 0)
      add_in_rank_order(sum, mine.length, type, n, [&](size_t r) {
        return r == me ? values + mine.first * element : received + r * step + kHeader;
      });
    for (size_t peer = 0; peer < n; ++peer)
      if (peer != me) gather_out->send(static_cast<int>(peer), gather_slot, 0, kHeader + payload);
    wait_exchange(*gather_in, *gather_out, n - 1, "scatter-gather allreduce");
    if (mismatched >= 0) require_same_header(theirs, header, "scatter-gather", mismatched, me);
    for (size_t peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      const Chunk c = chunk_of(count, n, peer);
      std::memcpy(values + c.first * element, gather_in_.data() + peer * stride + kHeader, c.length * element);
    }
    std::memcpy(values + mine.first * element, sum, mine.length * element);
  }

  template <typename Options>
  void configure(Options& opts, uint32_t tag) const {
    opts.setTag(tag);
    opts.setTimeout(timeout_);
  }

  std::chrono::milliseconds timeout_;
  Algorithm small_;                              // ScatterGather, or Bcube with PSGD_SCATTER_GATHER=0
  std::vector<uint8_t> direct_in_, direct_out_;  // direct_allreduce's staging: size() copies each way
  // scatter_gather_allreduce's messages, kept between calls as direct's: about the buffer's bytes each
  // (scatter_*: the first exchange where it is not posted ahead; gather_out_: one chunk).
  std::vector<uint8_t> scatter_in_, scatter_out_, gather_in_, gather_out_;
  std::vector<uint8_t> gathered_, contribution_;  // direct_allgather's, kept between calls as direct's
  bool direct_allgather_ = false;                 // enable_direct_allgather was called
  size_t eager_bound_ = 0;                       // 0: the eager path is off
  std::vector<Eager> eager_;                     // per context (the group's; the host leaders')
};

// ---- legacy: the old-style algorithm classes ----

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

// Gloo's legacy barriers return once their messages are posted, not sent: the
// root of BarrierAllToOne leaves right after posting its releases. A rank that
// then exits or tears the context down can lose them, and its peers fail with
// "Connection closed by peer" inside the barrier (seen once in comm-legacy-n3,
// whose ranks exit right after their last barrier). These wait for their own
// sends to complete before returning.
template <typename GlooBarrier>
class FlushedBarrier : public GlooBarrier {
 public:
  using GlooBarrier::GlooBarrier;
  void run() {
    GlooBarrier::run();
    for (auto& buffer : this->sendBuffers_) buffer->waitSend();
  }
};

class LegacyAlgorithms final : public CollectiveAlgorithms {
 public:
  GlooApi api() const override { return GlooApi::Legacy; }
  Algorithm small_message_algorithm() const override { return Algorithm::HalvingDoubling; }
  void require_supported(Algorithm algorithm) const override {
    PSGD_REQUIRE(algorithm != Algorithm::Direct, InvalidArgumentError,
                 "allreduce: direct needs Gloo's new API (not available on ibverbs)");
    PSGD_REQUIRE(algorithm != Algorithm::Bcube, InvalidArgumentError,
                 "allreduce: bcube needs Gloo's new API (not available on ibverbs)");
    PSGD_REQUIRE(algorithm != Algorithm::ScatterGather, InvalidArgumentError,
                 "allreduce: scatter-gather needs Gloo's new API (not available on ibverbs)");
  }
  size_t max_allgather_bytes() const override { return INT_MAX; }
  void enable_eager_direct(size_t) override {}  // no direct algorithm here
  void enable_direct_allgather() override {}     // AllgatherRing only
  bool checks_sizes(Algorithm, size_t, DataType, int) const override { return false; }  // no headers
  size_t lead_capacity(int) const override { return 0; }
  bool lead_allreduce(const std::shared_ptr<gloo::Context>&, LeadKind, const void*, void*, size_t,
                      std::span<const LeadPart>) override {
    PSGD_ASSERT(false, "the lead exchange needs Gloo's new API");
    return false;
  }
  void release_eager_direct() override {}
  uint64_t eager_direct_collectives() const override { return 0; }

  std::vector<uint8_t> connect_pairs(const std::shared_ptr<gloo::Context>& context, uint32_t, uint8_t) override {
    FlushedBarrier<gloo::BarrierAllToAll>(context).run();
    return {};
  }

  void allreduce(const std::shared_ptr<gloo::Context>& context, uint32_t, void* data, size_t count, DataType type,
                 Algorithm algorithm) override {
    static const gloo::ReductionFunction<uint16_t> bf16(gloo::CUSTOM, &bfloat16_sum_inplace);
    static const gloo::ReductionFunction<uint16_t> fp16(gloo::CUSTOM, &float16_sum_inplace);
    switch (type) {
      case DataType::Float32:
        return run_legacy_allreduce<float>(context, data, count, algorithm, gloo::ReductionFunction<float>::sum);
      case DataType::Float64:
        return run_legacy_allreduce<double>(context, data, count, algorithm, gloo::ReductionFunction<double>::sum);
      case DataType::Float16:
        return run_legacy_allreduce<uint16_t>(context, data, count, algorithm, &fp16);
      case DataType::BFloat16:
        return run_legacy_allreduce<uint16_t>(context, data, count, algorithm, &bf16);
    }
  }

  void broadcast(const std::shared_ptr<gloo::Context>& context, uint32_t, void* data, size_t bytes,
                 int root) override {
    std::vector<uint8_t*> ptrs{static_cast<uint8_t*>(data)};
    gloo::BroadcastOneToAll<uint8_t>(context, ptrs, bytes, root).run();
  }

  void allgather(const std::shared_ptr<gloo::Context>& context, uint32_t, const void* in, void* out,
                 size_t bytes) override {
    std::vector<const uint8_t*> ptrs{static_cast<const uint8_t*>(in)};
    gloo::AllgatherRing<uint8_t>(context, ptrs, static_cast<uint8_t*>(out), static_cast<int>(bytes)).run();
  }

  void barrier(const std::shared_ptr<gloo::Context>& context, uint32_t) override {
    FlushedBarrier<gloo::BarrierAllToOne>(context).run();
  }

  uint64_t allreduce_rounds(Algorithm algorithm, int n) const override {
    if (algorithm == Algorithm::Ring) return ring_allreduce_rounds(n);
    // Halving-doubling: log2 of the largest power of two p <= n steps each way, and
    // with n > p one step before and one after to fold the other n - p ranks in.
    const uint64_t log_p = ceil_log2(n + 1) - 1;
    return 2 * log_p + ((uint64_t{1} << log_p) == static_cast<uint64_t>(n) ? 0 : 2);
  }
  uint64_t broadcast_rounds(int) const override { return 1; }  // the root sends to every rank at once
  uint64_t allgather_rounds(int n, size_t) const override { return static_cast<uint64_t>(n - 1); }  // a ring
};

}  // namespace

std::string describe_lead(LeadKind kind, size_t lead_bytes) {
  return kind == LeadKind::Shape ? std::string("the shape a public collective sends first (or a refused call)")
                                 : detail::concat("a lead of ", lead_bytes, " bytes");
}

SumFn sum_function(DataType type) {
  switch (type) {
    case DataType::Float32:
      return &float_sum;
    case DataType::Float64:
      return &double_sum;
    case DataType::Float16:
      return &float16_sum;
    case DataType::BFloat16:
      return &bfloat16_sum;
  }
  PSGD_ASSERT(false, "unknown DataType ", static_cast<int>(type));
  __builtin_unreachable();
}

uint64_t ring_allreduce_rounds(int n) { return 2 * static_cast<uint64_t>(n - 1); }

void require_done(bool done, const char* what) {
  if (!done) throw ::gloo::IoException(std::string(what) + " was aborted");
}

uint64_t ceil_log2(int n) {
  uint64_t log = 0;
  while ((uint64_t{1} << log) < static_cast<uint64_t>(n)) ++log;
  return log;
}

std::unique_ptr<CollectiveAlgorithms> make_algorithms(GlooApi api, std::chrono::milliseconds timeout,
                                                      bool scatter_gather) {
  if (api == GlooApi::Legacy) return std::make_unique<LegacyAlgorithms>();
  return std::make_unique<NewStyleAlgorithms>(timeout, scatter_gather);
}

}  // namespace powersgd::transport
