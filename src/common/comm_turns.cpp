#include "comm_turns.hpp"

#include <unordered_map>
#include <utility>

namespace powersgd::detail {

CommTurns::Turn& CommTurns::Turn::operator=(Turn&& other) noexcept {
  if (this != &other) {
    release();
    owner_ = std::move(other.owner_);
    number_ = other.number_;
    other.owner_.reset();
  }
  return *this;
}

CommTurns::Turn CommTurns::take() {
  Turn turn;
  std::lock_guard lock(mutex_);
  turn.owner_ = shared_from_this();
  turn.number_ = next_++;
  return turn;
}

void CommTurns::Turn::wait() const {
  if (owner_ == nullptr) return;
  std::unique_lock lock(owner_->mutex_);
  owner_->released_.wait(lock, [&] { return owner_->current_ == number_; });
}

void CommTurns::Turn::release() noexcept {
  if (owner_ == nullptr) return;
  const std::shared_ptr<CommTurns> owner = std::move(owner_);
  owner_.reset();
  {
    std::lock_guard lock(owner->mutex_);
    if (number_ != owner->current_) {
      owner->given_up_.insert(number_);  // its turn will be skipped when it comes
      return;
    }
    ++owner->current_;
    for (auto it = owner->given_up_.begin(); it != owner->given_up_.end() && *it == owner->current_;
         it = owner->given_up_.erase(it))
      ++owner->current_;
  }
  owner->released_.notify_all();
}

std::shared_ptr<CommTurns> comm_turns(const void* comm) {
  static std::mutex mutex;
  static auto* turns = new std::unordered_map<const void*, std::weak_ptr<CommTurns>>;  // never destroyed
  std::lock_guard lock(mutex);
  std::erase_if(*turns, [](const auto& entry) { return entry.second.expired(); });
  std::shared_ptr<CommTurns> shared = (*turns)[comm].lock();
  if (shared == nullptr) {
    shared = std::make_shared<CommTurns>();
    (*turns)[comm] = shared;
  }
  return shared;
}

}  // namespace powersgd::detail
