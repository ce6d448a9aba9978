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
#include "store/store.hpp"

namespace powersgd::transport {

// Settings every rank must agree on. In the record it is followed by the
// local ports of the rank's connected pairs (one uint16_t per rank, as Gloo
// prints them): Gloo names a failed pair by its peer's "[ip]:port".
//
// The first record ranks exchange, through Gloo's ring where some rank's build
// does not offer the store (every build before it), so its size never changes:
// ranks whose builds differ must gather records of equal size to see that they
// differ (records of unequal size make Gloo's allgather abort the process); so
// does what comes before it (the store's protocol, Gloo's rendezvous, the
// all-to-all of one byte per rank that connects the pairs, whose value only
// builds that offer the store read). Through the store a record of another size
// is a mismatch named like any other. A new setting takes a bit of `flags`; a
// new layout of any later exchange raises kWireRevision.
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
//      (after this record's own exchange: the store where every rank offers it, else the ring of every build)
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

// Where a rank's record reaches the others. A rank offers the store path in its byte of the all-to-all that
// connects the pairs (kOfferRecordInStore), having published its record under fingerprint_key(rank) before:
// every rank sees every rank's byte, so every rank takes the same path. The store path where every rank offers
// it (one get_many after the all-to-all: every offering rank published before sending its byte); else Gloo's
// ring, which builds before it (byte 0) make and meet.
inline constexpr uint8_t kOfferRecordInStore = 1;
std::string fingerprint_key(int rank);

// This rank's record: its Fingerprint, then the local port of its pair towards each rank (a uint16_t per rank,
// as Gloo prints them; 0 at its own). `pair_addresses[r]`: this rank's pair towards rank r as Gloo prints it
// ("[ip]:port"; ignored for r == rank), final once the pair connected (its socket's name).
std::vector<uint8_t> creation_record(const CommOptions& options, GlooApi api, size_t direct_max_bytes,
                                     HostStageMode host_stage, bool eager_direct, bool scatter_gather,
                                     const std::vector<std::string>& pair_addresses);

// Every rank's record (rank order) compared: MismatchError naming the first rank that differs from rank 0 (or
// whose record has another size), the same on every rank that holds the same records. Returns what each
// rank's pair towards this rank looks like from here; `established`: this process's established connections.
PeerTable compare_records(const CommOptions& options, const std::vector<std::vector<uint8_t>>& records,
                          const std::vector<std::string>& pair_addresses, const ConnectionTable& established);

// Collective, the ring: this rank's record gathered with every rank's by `allgather(in, out, bytes)` (the
// communicator's blocking allgather), then compared. `connections`: established_connections().
PeerTable exchange_fingerprints(const CommOptions& options, GlooApi api, size_t direct_max_bytes,
                                HostStageMode host_stage, bool eager_direct, bool scatter_gather,
                                const std::vector<std::string>& pair_addresses,
                                const std::function<void(const void* in, void* out, size_t bytes)>& allgather,
                                const std::function<ConnectionTable()>& connections);

// The store path, once every rank offered it in the all-to-all: every rank's record read from `store` (all
// present; one request per 1024 ranks), then compared.
PeerTable read_fingerprints(const CommOptions& options, Store& store, const std::vector<std::string>& pair_addresses,
                            const std::function<ConnectionTable()>& connections);

}  // namespace powersgd::transport
