#include "engine/fault_injection.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

void maybe_inject(const std::optional<Fault>& fault, FaultPoint point, int64_t step, const std::vector<int>& buckets) {
  if (fault && fault->bucket >= 0 && std::find(buckets.begin(), buckets.end(), fault->bucket) == buckets.end()) return;
  maybe_inject(fault, point, step);
}

void maybe_inject(const std::optional<Fault>& fault, FaultPoint point, int64_t step) {
  if (!fault_at(fault, point, step)) return;
  if (fault->effect == FaultEffect::Exit) ::_exit(0);
  if (fault->effect == FaultEffect::Stop) {
    // The child only sleeps and signals (async-signal-safe after a fork of a threaded process).
    const pid_t stopped = ::getpid();
    const pid_t watchdog = ::fork();
    PSGD_REQUIRE(watchdog >= 0, IoError, "injected stall: fork failed");
    if (watchdog == 0) {
      ::usleep(static_cast<useconds_t>(fault->stop_ms) * 1000);
      ::kill(stopped, SIGCONT);
      ::_exit(0);
    }
    ::raise(SIGSTOP);
    ::waitpid(watchdog, nullptr, 0);
    return;  // continued: the step goes on, and meets peers that gave up on it
  }
  PSGD_THROW(IoError, "injected fault (engine::arm_fault, test only) in ",
             point == FaultPoint::Prepare    ? "prepare of step "
             : point == FaultPoint::Allocate ? "the buffers' allocation, attempt "
             : point == FaultPoint::Note     ? "the learning-rate note's application in step "
             : point == FaultPoint::Switch   ? "a rank level switch at the commit of step "
             : point == FaultPoint::Apply    ? "the application of a checkpoint of step "
                                             : "the compute between the P and Q collectives of step ",
             step);
}

}  // namespace powersgd::engine
