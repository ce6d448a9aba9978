// Objects that use a Communicator without owning it (a Reducer holds a
// reference) register here, so that the communicator's destructor can detach
// them before it goes: a user that outlives its communicator then fails with an
// error instead of following a dangling reference. Keyed by the communicator's
// address, so the common layer needs no communicator type. Thread-safe.
#pragma once

namespace powersgd::detail {

class CommUser {
 public:
  // Called at most once, by the communicator's destructor before it releases
  // anything: returns when the user's work in flight has ended (collectives are
  // bounded by the communicator's timeout); the user never touches the
  // communicator afterwards. Must not throw.
  virtual void communicator_destroyed() noexcept = 0;

 protected:
  virtual ~CommUser() = default;
};

void attach_comm_user(const void* comm, CommUser* user);
// The user goes first (its destructor calls this). Blocks while the
// communicator's destructor is detaching this user, so the user outlives that
// call. No effect when the user was already detached.
void detach_comm_user(const void* comm, CommUser* user) noexcept;
// A communicator's destructor calls this first, while everything its users
// may still use stands (transport::GlooCommunicator does): communicator_destroyed()
// on every user attached to `comm`, then forgets them.
void detach_all_comm_users(const void* comm) noexcept;

}  // namespace powersgd::detail
