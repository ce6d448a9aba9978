// A Gloo context whose full mesh connects within one timeout. Private to transport.
#pragma once

#include <gloo/rendezvous/context.h>
#include <gloo/transport/device.h>

#include <chrono>
#include <memory>
#include <stdexcept>

#include "store/store.hpp"

namespace powersgd::transport {

// The mesh was not connected before its deadline; what() names the rank not reached.
struct MeshTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Gloo's rendezvous context, its full mesh connected with one deadline. Debian's Gloo (connectFullMesh)
// connects the pairs one after the other, and a pair's connect waits up to 5 times the pair's timeout
// (tcp::Pair::waitUntil: "a longer timeout when waiting for initial connect"), so a rank that died while the
// mesh was connected held a peer waiting on it 5 timeouts (15.5 s at 3 s). Here the pairs connect at once
// (a thread each, up to 256 peers), and every wait ends at the one deadline: the store's for the peers'
// addresses (one get_many for all), and a pair's connect, whose pair a watchdog closes when the deadline and a
// short grace passed (Pair::close wakes the connect; Gloo takes the pair's lock for it, so never mid-setup; the
// grace lets a connection already made finish instead of being reset). The store's set keeps the store's own
// timeout.
// The pairs keep the whole timeout for what follows (the legacy API's waits). The store keys are
// connectFullMesh's (rank -> its pairs' addresses; "rank_<r>" -> host name), so ranks of an older build meet
// these and fail the fingerprint check (MismatchError), not a timeout.
class MeshContext final : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;

  // Sets the context's timeout to `timeout` (pairs copy it) and connects every pair before now + timeout.
  // Throws MeshTimeout past it, TimeoutError naming the lowest peer whose addresses never came, Gloo's
  // exception where a connect failed (the lowest such peer's; the other connects then end after the grace).
  void connect_full_mesh(Store& store, const std::shared_ptr<gloo::transport::Device>& device,
                         std::chrono::milliseconds timeout);
};

// Destroys `transport`'s pairs, several at a time, where `transport` is its last reference (as its destructor
// would, only sooner): each pair's close waits for a tick of Gloo's device loop (up to 10 ms,
// tcp::Loop::unregisterDescriptor), so one after the other, as Gloo's context does, a rank's pairs took 10 ms
// each (4 s for 400 peers). A mesh that failed to connect closes its pairs so. Never throws (a thread that
// cannot be started leaves its pairs to the caller). `device`: the one `transport` was made by; only a TCP
// device's pairs are closed so. Not from Gloo's device loop thread (its closes would wait for its own tick).
void close_pairs(std::shared_ptr<gloo::transport::Context>& transport, const gloo::transport::Device* device);

}  // namespace powersgd::transport
