// The hops within a host through shared memory (PSGD_HOST_SHM): one POSIX shared-memory segment per host,
// created by the host's leader, holding a byte ring each way between the leader and each other rank of the
// host. Messages are framed (slot, tag, length), so that ranks out of step fail instead of misreading. Waits
// sleep on futexes in the segment and, every few milliseconds, look whether the peer closed its side (its
// group broke) or its process is gone (/proc/<pid>/stat, its start time guarding against a reused pid): a
// peer that exits fails the waiter at once, one that stalls after the timeout. Fork-safe: a child that
// inherits the mapping neither closes nor unlinks it. Design: docs/transport.md,
// "Host-staged allreduce". Private to transport.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <sys/types.h>

namespace powersgd::transport {

// A hop within a host failed: `peer` (a rank) exited, closed its side, stalled past the timeout (`timeout`), or
// sent what this rank did not expect. GlooCommunicator::translate makes it a PeerError naming `peer`.
class HostHopError : public std::runtime_error {
 public:
  HostHopError(int peer, bool timeout, const std::string& what) : std::runtime_error(what), peer_(peer), timeout_(timeout) {}
  int peer() const { return peer_; }
  bool timeout() const { return timeout_; }

 private:
  int peer_;
  bool timeout_;
};

// Whether the hops within a host may go through shared memory (PSGD_HOST_SHM: auto, the default, or 0).
bool host_shm_from_env();

// One host's segment as one rank maps it. Participant 0 is the leader; participant i + 1 is the host's i-th
// other rank. Used by one thread at a time (the communication thread).
class ShmHostLink {
 public:
  // The leader: creates a segment (named after this process and 64 random bits, mode 0600, its memory
  // reserved at once so that a full /dev/shm fails here and not with a SIGBUS later) for `members` other
  // ranks, `ring_bytes` each way apiece (a power of two), after removing this user's segments whose creator
  // is gone (killed before it unlinked). Null with `why` set where that fails.
  static std::unique_ptr<ShmHostLink> create(size_t members, size_t ring_bytes, std::string& why);
  // A member: maps the segment `name` as participant `participant` (>= 1). Null with `why` set where it cannot
  // (another /dev/shm, another user, a segment of another layout).
  static std::unique_ptr<ShmHostLink> open(const std::string& name, size_t participant, std::string& why);
  ~ShmHostLink();
  ShmHostLink(const ShmHostLink&) = delete;
  ShmHostLink& operator=(const ShmHostLink&) = delete;

  const std::string& name() const { return name_; }
  // Records this process (pid and start time) as present. Before any transfer.
  void attach();
  // Whether `participant` has attached from this pid namespace and its process is visible from here as the
  // one that attached: the waits can then tell when it exits.
  bool sees(size_t participant) const;
  // Removes the segment's name (the leader, once every member has opened it or given up); the mapping stays.
  void unlink();
  // Marks this side closed and wakes every waiter: the peers' waits fail now, not after their timeout.
  void close();

  // The segment's records, defined in shm_link.cpp.
  struct Participant;
  struct RingControl;

  // One framed message to (from) `peer_participant`, who is rank `peer_rank`. A receive takes a message of at
  // most `capacity` bytes and returns its length. Each waits at most `timeout` in all. HostHopError where the
  // peer exits, closes, stalls or sends another slot, tag or a longer message.
  void send(size_t peer_participant, int peer_rank, uint8_t slot, uint32_t tag, const void* data, size_t bytes,
            std::chrono::milliseconds timeout);
  size_t receive(size_t peer_participant, int peer_rank, uint8_t slot, uint32_t tag, void* data, size_t capacity,
                 std::chrono::milliseconds timeout);

 private:
  ShmHostLink(std::string name, void* base, size_t bytes, size_t participant);
  using Deadline = std::chrono::steady_clock::time_point;
  // The ring `peer_participant` and this rank share in the direction `outgoing`.
  size_t ring_index(size_t peer_participant, bool outgoing) const;
  void write(size_t ring, size_t peer, int peer_rank, const void* data, size_t bytes, Deadline deadline);
  void read(size_t ring, size_t peer, int peer_rank, void* data, size_t bytes, Deadline deadline);

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t participant_ = 0;
  // Where the segment's parts are, from its header (fixed at creation).
  size_t members_ = 0;
  size_t ring_bytes_ = 0;
  Participant* participants_ = nullptr;  // members_ + 1, the leader first
  RingControl* controls_ = nullptr;      // 2 x members_
  uint8_t* rings_ = nullptr;             // 2 x members_ rings of ring_bytes_
  pid_t owner_ = 0;  // the process that created or opened it: a forked child neither closes nor unlinks
  bool unlinked_ = false;
};

}  // namespace powersgd::transport
