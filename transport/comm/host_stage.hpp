// Host-staged allreduce (PSGD_HOST_STAGE=1): the ranks that share a host send
// their buffers to the host's leader, which adds them in rank order; the
// leaders allreduce among themselves on a context of their own; each leader
// sends the result back to its host's ranks. Only the leaders' allreduce
// crosses hosts, so its rounds count hosts, not ranks. Design, sum order and
// rounds: docs/transport.md, "Host-staged allreduce". Private to transport.
#pragma once

#include <gloo/context.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/algorithms.hpp"
#include "comm/communicator.hpp"
#include "comm/shm_link.hpp"

namespace powersgd::transport {

// This rank's host key: PSGD_HOST_ID when set, else "<hostname> <ip>", `ip`
// being the transport's local address (hosts emulated by network namespaces
// share a hostname but not an address).
std::string host_key(const std::string& ip);

// Ranks grouped by host key. Hosts are ordered by their lowest rank; a host's
// ranks ascend; its leader is its lowest rank.
struct HostGroups {
  std::vector<std::vector<int>> hosts;
  std::vector<int> host_of;  // rank -> index in hosts
  // Staging changes nothing: one host, or one rank on every host.
  bool degenerate() const;
  // "2 hosts: {0, 1} {2, 3}", for logs.
  std::string describe() const;
};

// Pure: keys[r] is rank r's key, compared whole (no hash, so no collision), so
// every rank given the same keys computes the same groups.
HostGroups group_hosts(const std::vector<std::string>& keys);

// What a rank tells the others before staging: its host key, and the file
// descriptors it has to spare (were it to lead, the leaders' context takes
// leader_descriptors(hosts) of them).
struct HostReport {
  std::string key;
  uint64_t spare_descriptors = 0;
};

// Collective: every rank's report, through the communicator's blocking
// allgather (two of them: the key lengths and spare descriptors, then the keys
// padded to the longest).
std::vector<HostReport> exchange_host_reports(const HostReport& mine, int world_size,
                                              const std::function<void(const void*, void*, size_t)>& allgather);

// The descriptors a leader's context holds among `hosts` hosts: a pair and,
// until it connects, a listening socket per other host.
inline uint64_t leader_descriptors(size_t hosts) { return 2 * (hosts - 1); }

// The first leader (its rank) of `groups` whose report spares fewer than
// leader_descriptors; -1 where every leader can hold its context. The same on
// every rank given the same reports.
int leader_short_of_descriptors(const HostGroups& groups, const std::vector<HostReport>& reports);

// The staged allreduce of one communicator. Touched by its communication
// thread only, after creation.
class HostStage {
 public:
  // `leaders`: the leaders' context (rank = host index), connected; null on a
  // rank that leads no host. `groups` is not degenerate.
  HostStage(HostGroups groups, int rank, std::shared_ptr<gloo::Context> leaders, std::chrono::milliseconds timeout);

  int hosts() const { return static_cast<int>(groups_.hosts.size()); }
  bool leads() const { return leaders_ != nullptr; }
  const std::shared_ptr<gloo::Context>& leader_context() const { return leaders_; }

  // Sums `data` over every rank, in place: within each host in rank order
  // (the leader's own buffer first), then across hosts with `inter` (Direct,
  // Bcube or Ring) among the leaders; every rank ends with the leaders' bits.
  // `global` is the communicator's context (its pairs carry the hops within a
  // host), `tag` unique among operations in flight. Gloo's exceptions pass
  // through; a send or receive waits at most the timeout. MismatchError where
  // a rank's count or type differs from its leader's (that host's ranks; no
  // data changed) or the leaders' algorithm finds their counts or types differ (every
  // leader, its buffer then holding its host's sum, and its host's ranks, their
  // data unchanged); the other hosts' leaders then wait, so the caller breaks
  // the group.
  void allreduce(const std::shared_ptr<gloo::Context>& global, uint32_t tag, void* data, size_t count, DataType type,
                 Algorithm inter, CollectiveAlgorithms& algorithms);

  // The lead exchange (Communicator::lead_exchange_async) staged: each rank
  // sends its header, lead and data to its host's leader; the leader checks
  // them against its own, adds the host's data in rank order into scratch
  // where every rank of the host passed the same, and runs one lead exchange
  // among the leaders (`algorithms`) whose lead is its host's status and
  // leads; it sends every rank's lead, whether the data was summed and the sum
  // back to its host. One round across hosts; each part's sums are those of
  // allreduce() with Direct among the leaders. The parts travel where
  // lead_bytes + lead_parts_bytes(parts) fit `capacity`, the communicator's
  // lead_capacity(algorithms.lead_capacity(hosts())), the same on every rank.
  // MismatchError on every rank where any lead's size or kind differs.
  bool lead_allreduce(const std::shared_ptr<gloo::Context>& global, uint32_t tag, LeadKind kind, const void* lead,
                      void* leads, size_t lead_bytes, std::span<const LeadPart> parts, size_t capacity,
                      CollectiveAlgorithms& algorithms);
  // The bytes a rank's lead and data may take in lead_allreduce, given the
  // leaders' lead exchange capacity: the leaders' lead (a status word and the
  // largest host's leads) and the host's data fit theirs. The same on every rank.
  size_t lead_capacity(size_t leaders_capacity) const;

  // Collective among the host's ranks, at creation on the communication thread: where `wanted` (PSGD_HOST_SHM)
  // on every rank of the host, the leader creates a shared-memory segment, its other ranks map it, and from
  // then on the hops within the host go through it instead of the pairs of `global` (over which this setup
  // runs). Where any rank of the host cannot (another /dev/shm or pid namespace, /dev/shm full), the host keeps
  // TCP, logged at info level: the bits are the same either way. Returns whether this host uses it.
  bool connect_shared_memory(gloo::Context& global, uint32_t tag, bool wanted);
  bool shared_memory() const { return shm_ != nullptr; }

  // After a fatal failure: closes the leaders' connections and this rank's side of the shared memory, so that
  // the other leaders and the host's ranks fail now rather than after their timeout.
  void close() {
    leaders_.reset();
    if (shm_ != nullptr) shm_->close();
  }

 private:
  // One message of a hop within a host: `bytes` at `data` to or from rank `peer`, on slot (slot_prefix, tag).
  struct HostMessage {
    int peer;
    uint8_t slot_prefix;
    void* data;
    size_t bytes;
  };
  enum class Direction { Send, Receive };

  const std::vector<int>& my_host() const;
  // `rank`'s place in my_host(): 0 for the leader (the shared memory's participant).
  size_t index_in_host(int rank) const;
  // Sends (or receives) every message and returns once each is done; a failure names `what`. Through the
  // shared memory where the host has it (one message after the other, each peer's in the order sent: a peer
  // stalled with a message longer than its ring delays the messages after it), else over the pairs of
  // `global` (all posted at once).
  void transfer(gloo::Context& global, Direction direction, uint32_t tag, const std::vector<HostMessage>& messages,
                const char* what) const;

  HostGroups groups_;
  int rank_;
  std::shared_ptr<gloo::Context> leaders_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<ShmHostLink> shm_;  // the host's segment, where connect_shared_memory set it up
  std::vector<uint8_t> received_;  // a leader's copies of its host's other buffers, kept between calls
  std::vector<uint64_t> headers_;  // a leader's headers of its host's other ranks (allreduce: count, type)
  std::vector<HostMessage> messages_;  // a leader's messages from (or to) its host's other ranks
  size_t largest_host_ = 0;  // ranks of the largest host
  // lead_allreduce's messages (a leader sums its host's data into its reply) and the leaders' leads, kept
  // between calls.
  std::vector<uint8_t> lead_in_, lead_out_, leaders_leads_;
};

}  // namespace powersgd::transport
