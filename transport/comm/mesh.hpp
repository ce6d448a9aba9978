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
  // Closes the pairs at once where it holds the transport context's last reference (close_context).
  ~MeshContext() override;

  // Sets the context's timeout to `timeout` (pairs copy it) and connects every pair before now + timeout.
  // Throws MeshTimeout past it, TimeoutError naming the lowest peer whose addresses never came, Gloo's
  // exception where a connect failed (the lowest such peer's; the other connects then end after the grace).
  void connect_full_mesh(Store& store, const std::shared_ptr<gloo::transport::Device>& device,
                         std::chrono::milliseconds timeout);
};

// Drops `transport`, the pairs closing at once where it was the last reference: each pair's close waits for a
// tick of Gloo's TCP device loop (up to 10 ms, tcp::Loop::unregisterDescriptor), so as Gloo's context destroys
// them, one after the other, a rank's pairs took 10 ms each (4 s for 400 peers). Here the loop ticks without
// its wait while they close (microseconds each where a core is free), all on the calling thread. Never throws
// (where the loop cannot be woken, the pairs close as Gloo closes them). `device`: the one `transport` was made
// by; another transport's (ibverbs) are dropped as they are. Not from Gloo's device loop thread: the loop would
// not tick while the pairs close there, and the wake-up would wait 1 s before taking itself out.
void close_context(std::shared_ptr<gloo::transport::Context>& transport, gloo::transport::Device* device);

}  // namespace powersgd::transport
