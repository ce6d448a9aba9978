// The PSGD_* settings of CommOptions::from_env, for communicators whose
// membership and rendezvous come from elsewhere (the C API's
// psgd_comm_init_on_store: torch.distributed's ranks and store).
#pragma once

#include "powersgd/comm.hpp"

namespace powersgd::transport {

// Sets token (PSGD_TOKEN), transport, iface, address (PSGD_IFACE / PSGD_ADDR as given; no
// default), ib_*, timeout and ring_threshold_bytes from the environment
// (docs/env.md). Throws InvalidArgumentError naming a bad variable.
void apply_env_settings(CommOptions& options);

// PSGD_DIRECT_MAX_BYTES (docs/env.md): the most bytes a rank may receive in one
// direct allreduce (GlooCommunicator::choose). Not in CommOptions, whose layout
// is the C++ ABI's (docs/abi.md); compared between ranks at creation like it.
// "auto": kDirectAuto, measured once the group is connected (GlooCommunicator::measure_direct_bound).
// Unset: auto where `scatter_gather` (then the bound changes the rounds, never the bits: direct and
// scatter-gather add in the same order), else kDirectFixedBytes (bcube's sums differ from direct's, so a
// bound measured from the network would make the bits depend on it).
inline constexpr size_t kDirectAuto = static_cast<size_t>(-1);
inline constexpr size_t kDirectFixedBytes = size_t{256} << 10;
size_t direct_max_bytes_from_env(bool scatter_gather);
// PSGD_DIRECT_EAGER: 1 (the default) posts the direct allreduce's receives one collective ahead (docs/transport.md,
// "Eager direct allreduce"); 0 leaves each exchange to Gloo's alltoall. Equal on every rank (the fingerprint).
bool eager_direct_from_env();
// PSGD_SCATTER_GATHER: 1 (the default) has Auto choose the scatter-gather allreduce (two rounds, sums in rank
// order) between the direct bound and the ring threshold; 0 chooses Gloo's bcube there (2 log2 n rounds), as
// before it. Equal on every rank (the fingerprint).
bool scatter_gather_from_env();
// PSGD_FINGERPRINT_STORE: 1 (the default) offers the store path for the creation records (fingerprint.hpp,
// kOfferRecordInStore); 0 does not, as builds before it. May differ between ranks (any 0: Gloo's ring).
bool fingerprint_store_from_env();
// PSGD_HOST_STAGE (docs/env.md): 0 off; 1 on (UnsupportedError where the
// API cannot stage); auto (the default) on where the API can stage and the
// leaders have the descriptors for their context. Staging takes effect only
// where some host has two ranks or more (HostGroups::degenerate). Any other
// value: InvalidArgumentError naming it.
enum class HostStageMode { Off, On, Auto };
HostStageMode host_stage_from_env();
const char* to_string(HostStageMode mode);

}  // namespace powersgd::transport
