// The exchange at communicator creation: every rank's settings (which must
// agree) and its pairs' addresses (which turn Gloo's error messages back into
// ranks, comm/peer_attribution.hpp). Private to transport.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/options.hpp"
#include "comm/peer_attribution.hpp"

namespace powersgd::transport {

// Settings every rank must agree on. On the wire it is followed by the
// listening ports of the rank's pairs (one uint16_t per rank, as Gloo prints
// them): Debian's Gloo listens on one port per pair and names a failed pair by
// its peer's "[ip]:port".
//
// The first record ranks exchange through Gloo, so its size never changes:
// ranks whose builds differ must gather records of equal size to see that they
// differ (records of unequal size make Gloo's allgather abort the process); so
// does what comes before it (the store's protocol, Gloo's rendezvous, the
// all-to-all of one byte per rank that connects the pairs). A new setting
// takes a bit of `flags`; a new layout of any later exchange raises
// kWireRevision.
struct Fingerprint {
  char version[16];
  int32_t world_size;
  int32_t transport;
  int32_t api;
  uint16_t flags;          // kFlagHostStage | kFlagHostStageAuto | kFlagDirectNotEager | kFlagNoScatterGather
  uint16_t wire_revision;  // kWireRevision; the high half of a 32-bit `flags` before, 0 (little-endian hosts)
  uint64_t ring_threshold_bytes;
  uint64_t direct_max_bytes;
  char ip[48];
};
static_assert(sizeof(Fingerprint) == 96, "the creation record's size is part of the wire protocol");

// What every exchange after the fingerprint looks like. Raised whenever a
// message's layout or the sequence of exchanges changes, so that builds of one
// version that differ there fail with MismatchError at creation.
//   0: before this field (every build up to 2026-12-05)
//   1: public collectives agree on their shape first (agree_on_shape)
//   2: the lead exchange's header says whether it carries a shape (LeadKind)
//   3: a public collective refused on one rank sends a refusal where its shape would go
//   4: an allgather of at most 1 MiB received per rank is one exchange with every peer, not Gloo's ring
//      (after this record's own gather, which stays the ring of every build)
inline constexpr uint16_t kWireRevision = 4;

inline constexpr uint16_t kFlagHostStage = 1;        // PSGD_HOST_STAGE=1
inline constexpr uint16_t kFlagDirectNotEager = 2;   // PSGD_DIRECT_EAGER=0 (set where it is off: old fingerprints had 0)
inline constexpr uint16_t kFlagNoScatterGather = 4;  // PSGD_SCATTER_GATHER=0 (likewise)
inline constexpr uint16_t kFlagHostStageAuto = 8;    // PSGD_HOST_STAGE=auto (neither bit: 0, as older fingerprints)

// This rank's settings (ip empty).
Fingerprint make_fingerprint(const CommOptions& options, GlooApi api, size_t direct_max_bytes = 0,
                             HostStageMode host_stage = HostStageMode::Off, bool eager_direct = true,
                             bool scatter_gather = true);

// Throws MismatchError naming the first rank that differs from rank 0 and every
// field it differs in.
void require_same_fingerprints(const std::vector<Fingerprint>& all);

// Collective. `pair_addresses[r]`: this rank's pair towards rank r as Gloo
// prints it ("[ip]:port"; ignored for r == rank). `allgather(in, out, bytes)`:
// the communicator's blocking allgather. `connections`: this process's
// established connections (established_connections()). Checks that every rank
// has the same fingerprint (MismatchError), and returns what each rank's pair
// towards this rank looks like from here.
PeerTable exchange_fingerprints(const CommOptions& options, GlooApi api, size_t direct_max_bytes, HostStageMode host_stage,
                                bool eager_direct, bool scatter_gather,
                                const std::vector<std::string>& pair_addresses,
                                const std::function<void(const void* in, void* out, size_t bytes)>& allgather,
                                const std::function<ConnectionTable()>& connections);

}  // namespace powersgd::transport
