// Gloo's two collective APIs behind one interface, chosen once per
// communicator: NewStyle (the free functions over unbound buffers; TCP only in
// Debian's Gloo) and Legacy (the old-style algorithm classes; the only ones
// that work over ibverbs). One context never mixes both (mixing gave 40-90 ms
// latencies, /work/shared/notes/gloo.md). Private to transport.
#pragma once

#include <gloo/context.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/dtype.hpp"

namespace powersgd::transport {

// What a lead exchange carries (its header says which, so that one never passes for the other: MismatchError on
// every rank): a caller's lead (the engine's announce, Communicator::lead_exchange_async) or the shape a public
// collective sends first (GlooCommunicator::agree_on_call).
enum class LeadKind : uint8_t { Lead = 0, Shape = 1 };
// "a lead of 24 bytes", "the shape a public collective sends first (or a refused call)": for messages.
std::string describe_lead(LeadKind kind, size_t lead_bytes);
// A lead exchange's ranks passed leads of different kinds: `rank()` is the first rank whose kind is not rank
// 0's, `kind()` and `lead_bytes()` its lead's; the same on every rank (each sees every header).
class LeadKindMismatchError : public MismatchError {
 public:
  LeadKindMismatchError(const std::string& what, int rank, LeadKind kind, size_t lead_bytes)
      : MismatchError(what), rank_(rank), kind_(kind), lead_bytes_(lead_bytes) {}
  int rank() const { return rank_; }
  LeadKind kind() const { return kind_; }
  size_t lead_bytes() const { return lead_bytes_; }

 private:
  int rank_;
  LeadKind kind_;
  size_t lead_bytes_;
};

// Every collective runs on the communication thread with a context of more than
// one rank, a non-empty buffer, and a tag unique among operations in flight
// (the legacy classes have no tags). Gloo's exceptions pass through: the
// communicator translates them.
class CollectiveAlgorithms {
 public:
  virtual ~CollectiveAlgorithms() = default;
  virtual GlooApi api() const = 0;

  // The allreduce algorithm Auto picks below the ring threshold where direct does not take the message.
  virtual Algorithm small_message_algorithm() const = 0;
  // Throws InvalidArgumentError when this API has no `algorithm` (not Auto).
  virtual void require_supported(Algorithm algorithm) const = 0;
  // Largest allgather contribution per rank, in bytes.
  virtual size_t max_allgather_bytes() const = 0;

  // Makes every pair carry traffic once; no rank returns before every rank
  // has entered it. Each rank sends `offer` to every rank; returns every rank's
  // (rank order; every rank receives the same), or nothing where the API sends
  // no bytes (the legacy API's barrier).
  virtual std::vector<uint8_t> connect_pairs(const std::shared_ptr<gloo::Context>& context, uint32_t tag,
                                             uint8_t offer) = 0;
  virtual void allreduce(const std::shared_ptr<gloo::Context>& context, uint32_t tag, void* data, size_t count,
                         DataType type, Algorithm algorithm) = 0;
  virtual void broadcast(const std::shared_ptr<gloo::Context>& context, uint32_t tag, void* data, size_t bytes,
                         int root) = 0;
  // A ring of n - 1 exchanges (which writes `out` as it goes), or, once enable_direct_allgather was called and
  // the ranks' `bytes` come to at most 1 MiB received per rank, one exchange with every peer at once (the same
  // bytes on the wire, n - 2 rounds fewer; `out` written only once every contribution arrived).
  virtual void allgather(const std::shared_ptr<gloo::Context>& context, uint32_t tag, const void* in, void* out,
                         size_t bytes) = 0;
  virtual void barrier(const std::shared_ptr<gloo::Context>& context, uint32_t tag) = 0;

  // From now on the direct allreduce posts its receives one direct collective ahead, on every context it
  // runs on, for messages up to min(1 MiB, bound / (context size - 1)) per peer (docs/transport.md, "Eager
  // direct allreduce"). Every rank calls it at the same point of its sequence of collectives, with the same
  // bound. No effect with the legacy API.
  virtual void enable_eager_direct(size_t bound) = 0;
  // From now on small allgathers take one exchange (allgather above). Every rank calls it at the same point of its
  // sequence of collectives: after the fingerprint exchange, which takes the ring of every build where any rank
  // does not offer the store, so that ranks of builds that gather otherwise meet there and get a MismatchError.
  // No effect with the legacy API.
  virtual void enable_direct_allgather() = 0;
  // Drops the receives posted ahead and the buffers behind them: they hold the contexts' connections open,
  // which a broken group must close now.
  virtual void release_eager_direct() = 0;
  // Direct collectives that took the eager path since creation (on every context; for tests and benchmarks).
  virtual uint64_t eager_direct_collectives() const = 0;

  // The lead exchange (docs/transport.md, "Lead exchange"): the bytes one message carries behind its header
  // (lead and data together) on a context of `n` ranks, the same on every rank; 0 without the eager path.
  virtual size_t lead_capacity(int n) const = 0;
  // One exchange on the eager path (lead_bytes + ... within lead_capacity): every rank's `lead_bytes` arrive in
  // `leads` (rank r's at r * lead_bytes); each of `parts` (at most kMaxLeadParts; lead_parts_bytes' layout) is
  // summed in rank order, the direct algorithm's additions, where every rank passed the same counts and types,
  // not all 0, that fit with the lead. Returns whether they were: the same answer on every rank (every rank
  // sees every header); when not, no part changed. MismatchError where the ranks' lead_bytes or kinds differ.
  virtual bool lead_allreduce(const std::shared_ptr<gloo::Context>& context, LeadKind kind, const void* lead,
                              void* leads, size_t lead_bytes, std::span<const LeadPart> parts) = 0;

  // Whether an allreduce of `count` elements of `type` with `algorithm` on a context of `n` ranks reads every
  // rank's count and type (a header in every message) before any receive sized by the count, and fails at once
  // on every rank where one differs or a peer sent another kind of message: direct where the receives posted
  // ahead take the message. Elsewhere ranks that pass different sizes make Gloo's I/O thread throw (the process
  // aborts) or wait for a message that does not come, so the communicator agrees on sizes first.
  virtual bool checks_sizes(Algorithm algorithm, size_t count, DataType type, int n) const = 0;

  // Sequential communication rounds of each collective on `n` ranks: the
  // message exchanges one after the other, each of which waits for the one
  // before (so each costs at least one one-way delay of the network). What
  // Communicator::communication_rounds() adds up (docs/transport.md, "Rounds").
  virtual uint64_t allreduce_rounds(Algorithm algorithm, int n) const = 0;
  virtual uint64_t broadcast_rounds(int n) const = 0;
  virtual uint64_t allgather_rounds(int n, size_t bytes) const = 0;
};

// c[i] = a[i] + b[i] over n elements of one type (Gloo's new-style reduce
// function): the additions of the direct algorithm and of the host-staged one.
using SumFn = void (*)(void* c, const void* a, const void* b, size_t n);
SumFn sum_function(DataType type);

// `out` = the n contributions (`count` elements of `type` at contribution(r)) added in rank order, the first
// copied and each next one added: the additions of every rank-order algorithm here (direct, scatter-gather,
// the lead exchange, a host's sum when staged), so the same bits. contribution(0) may be `out` itself.
template <typename Contribution>
void add_in_rank_order(void* out, size_t count, DataType type, size_t n, Contribution contribution) {
  std::memmove(out, contribution(0), count * size_of(type));
  const SumFn sum = sum_function(type);
  for (size_t r = 1; r < n; ++r) sum(out, out, contribution(r), count);
}

// Where part `i` of `parts` starts in a lead exchange's data (lead_parts_bytes' layout).
inline size_t lead_part_offset(std::span<const LeadPart> parts, size_t i) {
  return (lead_parts_bytes(parts.first(i)) + 7) / 8 * 8;
}
// A part as its lead exchange's header describes it (staged or not): its bytes (bits 0-55) and type (56 and up);
// 0 for an empty part. Parts that differ in count or type differ in it. Only for a part that fits the capacity.
inline uint64_t lead_part_word(const LeadPart& part) {
  if (part.count == 0) return 0;
  return static_cast<uint64_t>(part.count * size_of(part.type)) | (static_cast<uint64_t>(part.type) << 56);
}
// Each part's elements into a message's data at `to`, or from one at `from` (lead_parts_bytes' layout).
inline void pack_lead_parts(std::span<const LeadPart> parts, uint8_t* to) {
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i].count > 0)
      std::memcpy(to + lead_part_offset(parts, i), parts[i].data, parts[i].count * size_of(parts[i].type));
}
inline void unpack_lead_parts(std::span<const LeadPart> parts, const uint8_t* from) {
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i].count > 0)
      std::memcpy(parts[i].data, from + lead_part_offset(parts, i), parts[i].count * size_of(parts[i].type));
}

// Gloo's unbound-buffer waits return false only when aborted, which nothing here does; were one to, it is a
// transport failure: throws gloo::IoException (fatal: the group breaks, so no pair is left with a dropped
// buffer's pending operation). For the direct and the host-staged allreduce.
void require_done(bool done, const char* what);

// Rounds of the algorithms both APIs share: ring allreduce (reduce-scatter,
// then allgather: 2 (n - 1)), the ring allgather (n - 1), and ceil(log2 n).
uint64_t ring_allreduce_rounds(int n);
uint64_t ceil_log2(int n);

// `timeout` bounds each new-style collective (the legacy classes use the
// context's timeout, set before the pairs connected). `scatter_gather`: the new API's small-message algorithm is
// scatter-gather, else bcube (PSGD_SCATTER_GATHER).
std::unique_ptr<CollectiveAlgorithms> make_algorithms(GlooApi api, std::chrono::milliseconds timeout,
                                                      bool scatter_gather);

}  // namespace powersgd::transport
