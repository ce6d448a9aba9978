#include "engine/fault_injection.hpp"

#include <mutex>

#include "common/check.hpp"

namespace powersgd::engine {
namespace {

std::mutex armed_mutex;
std::optional<Fault> armed;

}  // namespace

void arm_fault(const Fault& fault) {
  std::lock_guard lock(armed_mutex);
  armed = fault;
}

std::optional<Fault> take_armed_fault() {
  std::lock_guard lock(armed_mutex);
  std::optional<Fault> fault = armed;
  armed.reset();
  return fault;
}

bool holds(const std::optional<Fault>& fault, int64_t step) {
  return fault && (fault->hold || (fault->point == FaultPoint::Hold && (fault->step < 0 || fault->step == step)));
}

bool fault_at(const std::optional<Fault>& fault, FaultPoint point, int64_t step) {
  return fault && fault->point == point && fault->step == step;
}

void maybe_inject(const std::optional<Fault>& fault, FaultPoint point, int64_t step) {
  if (fault_at(fault, point, step))
    PSGD_THROW(IoError, "injected fault (engine::arm_fault, test only) in ",
               point == FaultPoint::Prepare    ? "prepare of step "
               : point == FaultPoint::Allocate ? "the buffers' allocation, attempt "
                                               : "the compute between the P and Q collectives of step ",
               step);
}

}  // namespace powersgd::engine
