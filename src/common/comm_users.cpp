#include "comm_users.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace powersgd::detail {
namespace {

// One registry for the process. A communicator's users are detached outside
// the lock (a detach waits for reductions, up to the timeout), so that other
// communicators and their reducers are not held up; `detaching` keeps those
// users alive until their detach has returned.
struct Registry {
  std::mutex mutex;
  std::condition_variable detached;
  std::unordered_map<const void*, std::vector<CommUser*>> users;
  std::vector<CommUser*> detaching;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: communicators may outlive static destruction
  return *r;
}

}  // namespace

void attach_comm_user(const void* comm, CommUser* user) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.users[comm].push_back(user);
}

void detach_comm_user(const void* comm, CommUser* user) noexcept {
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  if (auto it = r.users.find(comm); it != r.users.end()) {
    std::erase(it->second, user);
    if (it->second.empty()) r.users.erase(it);
  }
  r.detached.wait(lock, [&] { return std::find(r.detaching.begin(), r.detaching.end(), user) == r.detaching.end(); });
}

void detach_all_comm_users(const void* comm) noexcept {
  Registry& r = registry();
  std::vector<CommUser*> users;
  {
    std::lock_guard lock(r.mutex);
    auto it = r.users.find(comm);
    if (it == r.users.end()) return;
    users = std::move(it->second);
    r.users.erase(it);
    r.detaching.insert(r.detaching.end(), users.begin(), users.end());
  }
  for (CommUser* user : users) {
    user->communicator_destroyed();
    {
      std::lock_guard lock(r.mutex);
      r.detaching.erase(std::find(r.detaching.begin(), r.detaching.end(), user));
    }
    r.detached.notify_all();
  }
}

}  // namespace powersgd::detail
