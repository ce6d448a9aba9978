// Test-only fault injection (docs/reliability.md, "Fault injection"): a real
// failure of this rank's local work at a chosen step, to test that the other
// ranks fail together with it instead of waiting for the timeout. Not part of
// the public API; tests that link the internal library arm it. Armed faults are
// taken by the next Reducer constructed in this process (one Reducer each), so
// nothing is read per step but the Reducer's own copy.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace powersgd::engine {

enum class FaultPoint {
  Prepare,  // local compute before the step's first collective
  Between,  // local compute between the P and the Q collectives (compressed steps)
  Output,   // not a failure: flips the lowest bit of the first output element of the
            // step's first bucket on this rank (a replica that drifted; the divergence detector's test)
  Allocate,  // the buffers' allocation at the first reduce, save or load (a device or host out of
             // memory): its attempt number `step` (0: the first) throws
  Note,      // the learning-rate note's application in the reduction of step `step` (after the levels switched:
             // a host out of memory in a level switch's copies), on every attempt at that step
  Switch,    // a rank level switch at the commit of step `step` (the policy's: end of a boost, warm-up, window),
             // after its copies to the host, before the bucket changes
  Apply,     // the application of a loaded checkpoint (load, load_shared, load_job) whose iteration is `step`,
             // once its first bucket is prepared (a host or device out of memory part-way)
  Hold,      // not a failure: the worker holds the first single-bucket reduction of step `step` (every step when
             // `step` < 0) until the step's other buckets are queued behind it (at most 10 s), so that
             // fusing them (docs/engine.md, "Fusing queued reductions") does not depend on timing
};

// What a fault at Prepare or Between does to this rank.
enum class FaultEffect {
  Throw,  // its local work throws IoError: a rank that fails while staying alive
  Exit,   // the process exits at once with status 0, its sockets closed as SIGKILL would: a rank that dies mid-step
          // (status 0 keeps powersgd-run from cancelling the survivors)
  Stop,   // the process stops (SIGSTOP) for `stop_ms`, then a watchdog child continues it: a rank that stalls
};

struct Fault {
  FaultPoint point = FaultPoint::Prepare;
  int64_t step = 0;  // the step (iteration) at which this rank's local work throws IoError (Output: is perturbed;
                     // Allocate: the attempt)
  bool hold = false;  // also hold every step's first reduction as FaultPoint::Hold does (fusing tests)
  FaultEffect effect = FaultEffect::Throw;  // Prepare and Between only
  int64_t stop_ms = 0;                      // FaultEffect::Stop: how long the process stays stopped
  int bucket = -1;  // Prepare and Between: only the reductions of this bucket (-1: every reduction of the step)
  // Hold: once the others are queued, the lookahead prepares them, as it does while an earlier reduction
  // communicates (their first collective is then carried with the held one's); false: claimed unprepared.
  bool hold_prepares = true;
};

// Arms `fault` for the next Reducer this process constructs. Thread-safe.
void arm_fault(const Fault& fault);
// The armed fault, if any, disarming it (the Reducer's constructor calls this).
std::optional<Fault> take_armed_fault();

// Whether `fault` is at `point` of `step`.
bool fault_at(const std::optional<Fault>& fault, FaultPoint point, int64_t step);

// Whether `fault` holds the first reduction of `step` (FaultPoint::Hold, or Fault::hold).
bool holds(const std::optional<Fault>& fault, int64_t step);

// When `fault` is at `point` of `step`: throws IoError("injected fault ..."), exits or stops (Fault::effect).
void maybe_inject(const std::optional<Fault>& fault, FaultPoint point, int64_t step);
// The same for a reduction of `buckets` (Prepare, Between): only where Fault::bucket is -1 or among them.
void maybe_inject(const std::optional<Fault>& fault, FaultPoint point, int64_t step, const std::vector<int>& buckets);

}  // namespace powersgd::engine
