// The order in which the users of one communicator (Reducers) issue their
// collectives. Each user issues collectives from its own worker thread and the
// communicator runs them in the order they arrive, which must be the same on
// every rank: two users whose work is in flight at once would otherwise arrive
// in an order that depends on timing. So each piece of work that issues
// collectives (a reduction, add_bucket's layout check, a job checkpoint) takes
// a turn on the thread that asks for it, in program order, and issues its
// collectives only once every earlier turn on the communicator was released.
// Ranks that make the same calls in the same order on one thread then issue the
// same collectives in the same order (docs/engine.md, "Threads and wire order").
// Keyed by the communicator's address, like comm_users.hpp. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>

namespace powersgd::detail {

class CommTurns : public std::enable_shared_from_this<CommTurns> {
 public:
  // A place in the communicator's order. Move-only; released by release() or
  // by its destructor (work that never ran gives its place up the same way).
  class Turn {
   public:
    Turn() = default;  // holds no place: wait() returns at once
    Turn(Turn&& other) noexcept { *this = std::move(other); }
    Turn& operator=(Turn&& other) noexcept;
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    ~Turn() { release(); }

    // Blocks until every earlier turn was released. Unbounded: each earlier
    // holder's collectives are bounded by its communicator's timeout.
    void wait() const;
    // Gives the place up; the next turn may go. Idempotent.
    void release() noexcept;
    // Whether this place comes right after `earlier`'s on the same communicator
    // (no other work's turn between them): work in this turn may then run inside
    // `earlier`'s turn without changing the communicator's order.
    bool follows(const Turn& earlier) const {
      return owner_ != nullptr && owner_ == earlier.owner_ && number_ == earlier.number_ + 1;
    }

   private:
    friend class CommTurns;
    std::shared_ptr<CommTurns> owner_;
    uint64_t number_ = 0;
  };

  // The next place, after every turn taken so far.
  Turn take();

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  uint64_t next_ = 0;               // the number take() gives next
  uint64_t current_ = 0;            // the turn that may go now
  std::set<uint64_t> given_up_;     // released before their turn came (never ran)
};

// The turns of the communicator at `comm`, shared by its users: the same object
// while any user holds it, a fresh one after all let it go.
std::shared_ptr<CommTurns> comm_turns(const void* comm);

}  // namespace powersgd::detail
