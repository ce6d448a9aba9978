#include "compute/backend.hpp"

#include <atomic>

#include "common/check.hpp"

namespace powersgd::compute {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = other.backend_;
    data_ = other.data_;
    size_ = other.size_;
    other.backend_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

namespace {
std::atomic<size_t> g_allocated_floats{0};
}  // namespace

size_t allocated_floats() { return g_allocated_floats.load(std::memory_order_relaxed); }

void DeviceBuffer::reset() {
  if (backend_ != nullptr && data_ != nullptr) {
    backend_->deallocate_raw(data_);
    g_allocated_floats.fetch_sub(size_, std::memory_order_relaxed);
  }
  backend_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

DeviceBuffer Backend::allocate(size_t count) {
  if (count == 0) return DeviceBuffer(this, nullptr, 0);
  DeviceBuffer buffer(this, allocate_raw(count), count);
  g_allocated_floats.fetch_add(count, std::memory_order_relaxed);
  return buffer;
}

std::unique_ptr<Backend> make_backend(DeviceKind kind, int device_index) {
  switch (kind) {
    case DeviceKind::Cpu: return make_cpu_backend();
    case DeviceKind::Cuda: return make_cuda_backend(device_index);
  }
  PSGD_ASSERT(false, "unknown device kind ", static_cast<int>(kind));
  return nullptr;
}

}  // namespace powersgd::compute
