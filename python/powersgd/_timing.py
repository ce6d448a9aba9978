"""Where a DDP step's reduction time goes (issue 20, item 3): the breakdown behind
PowerSGDState.timing_breakdown() and the PSGD_TORCH_TIMING log (docs/torch.md, "Where the reduction's time goes").

Off by default. When on, every compressed DDP iteration (step) is recorded with timestamps of the monotonic
clock (time.monotonic() here, std::chrono::steady_clock in the engine: both CLOCK_MONOTONIC on Linux), the
engine's own timestamps of each reduction (psgd_reduce_handle_times) and the engine worker's seconds by kind
(psgd_reducer_worker_seconds, read once per step after its last reduction). Per step, in seconds:

  hook            the backward thread's own work in the hook, all buckets: bookkeeping, the layout check and
                  the submission (ctypes included); not the wait for the reductions, not the completion.
  ctypes_submit   of which inside psgd_reducer_reduce_async_n.
  copies          dtype conversions between DDP's bucket and the engine (0 for float32 buckets: the engine
                  reads and writes DDP's bucket in place).
  tail            from the entry of the step's last hook call (every gradient of the step is ready: backward's
                  compute is over) until every future of the step is complete: what DDP waits for after
                  backward. Exactly tail_hook + tail_queue + tail_reduction + tail_handoff:
  tail_hook         the last hook call until the engine has its reduction (submitted);
  tail_queue        until the engine's worker starts it (it runs the buckets submitted before it first);
  tail_reduction    the last bucket's own reduction on the worker;
  tail_handoff      its end until every future is complete (the backward thread waking from its wait,
                    returning through ctypes, completing the futures and DDP's callbacks).
  compress, communicate, decompress, guard, check
                  the engine worker's seconds of the step by kind (all buckets; psgd_reducer_worker_seconds).
  engine_busy     the sum of the step's reductions' run times on the worker (started to finished); at least
                  the sum of the five kinds. engine_other = engine_busy - that sum.
  rounds          not seconds: the sequential communication rounds of the step (psgd_comm_communication_rounds
                  of the reducer's communicator, the step's difference; each costs at least one one-way network
                  delay: docs/scaling.md). States that share a communicator (one process group) count each
                  other's rounds where their steps overlap.

Recording costs one clock read per timestamp, one ctypes call per reduction and one worker round trip per step.
"""
import ctypes
import logging
import os
import time

from powersgd import _capi

logger = logging.getLogger("powersgd.torch")

# psgd_reducer_worker_seconds's order (powersgd.h).
ENGINE_KINDS = ("compress", "communicate", "decompress", "guard", "check")
TAIL_PARTS = ("tail_hook", "tail_queue", "tail_reduction", "tail_handoff")
FIELDS = (("hook", "ctypes_submit", "copies", "tail") + TAIL_PARTS + ENGINE_KINDS
          + ("engine_busy", "engine_other", "rounds"))


def interval_from_env():
    """PSGD_TORCH_TIMING: unset, empty or 0 = off; N >= 1 = record, and log the mean breakdown every N steps."""
    text = os.environ.get("PSGD_TORCH_TIMING", "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError("PSGD_TORCH_TIMING=%r: expected an integer >= 0 (0: off; N: log the reduction's timing "
                         "breakdown every N compressed steps)" % text)
    return value


def engine_seconds(lib, reducer):
    """The engine worker's cumulative seconds by kind (ENGINE_KINDS), as a tuple."""
    out = (ctypes.c_double * len(ENGINE_KINDS))()
    known = ctypes.c_size_t()
    status = lib.psgd_reducer_worker_seconds(reducer, out, len(ENGINE_KINDS), ctypes.byref(known))
    _capi.check(status)  # PowerSGDError with the library's reason
    return tuple(out)


def communication_rounds(lib, comm):
    """The communicator's sequential communication rounds so far (psgd_comm_communication_rounds)."""
    rounds = ctypes.c_uint64()
    status = lib.psgd_comm_communication_rounds(comm, ctypes.byref(rounds))
    _capi.check(status)  # PowerSGDError with the library's reason
    return rounds.value


def handle_times(lib, handle):
    """(submitted, started, finished) of a finished reduction, seconds of CLOCK_MONOTONIC."""
    submitted, started, finished = ctypes.c_double(), ctypes.c_double(), ctypes.c_double()
    status = lib.psgd_reduce_handle_times(handle, ctypes.byref(submitted), ctypes.byref(started),
                                          ctypes.byref(finished))
    _capi.check(status)  # PowerSGDError with the library's reason
    return submitted.value, started.value, finished.value


class StepTimer:
    """Records the steps of one PowerSGDState. Used from the thread that runs backward() only."""

    def __init__(self, log_every=0):
        self.log_every = log_every
        self.steps = []            # one dict of FIELDS per recorded step
        self._baseline = None      # (engine_seconds, communication_rounds) at the start of the step being recorded
        self._open = None          # the step being recorded

    # ---- the hook's calls ----

    def bucket_entered(self, lib, reducer, comm):
        """A hook call of a compressed step begins; returns its entry time. The step's first call reads the
        engine's seconds and the rounds when no recorded step ended just before (no reduction is in flight
        then)."""
        if self._open is None:
            if self._baseline is None:
                self._baseline = (engine_seconds(lib, reducer), communication_rounds(lib, comm))
            self._open = {"hook": 0.0, "ctypes_submit": 0.0, "copies": 0.0, "runs": [], "last_entry": None}
        return time.monotonic()

    def submit_took(self, seconds):
        self._open["ctypes_submit"] += seconds

    def copy_took(self, seconds):
        self._open["copies"] += seconds

    def bucket_left(self, own_seconds):
        """own_seconds: the hook call's time less its wait for the reductions and their completion."""
        self._open["hook"] += own_seconds

    def last_entered(self, entered):
        self._open["last_entry"] = entered

    def reduction_finished(self, times):
        self._open["runs"].append(times)

    def abandon(self):
        """The step failed: nothing of it is recorded; the next step reads a new baseline."""
        self._open = None
        self._baseline = None

    def step_completed(self, completed, lib, reducer, comm):
        """completed: when every future of the step was complete (time.monotonic())."""
        step, self._open = self._open, None
        now_engine, now_rounds = engine_seconds(lib, reducer), communication_rounds(lib, comm)
        (baseline, rounds_before), self._baseline = self._baseline, (now_engine, now_rounds)
        submitted, started, finished = step["runs"][-1]
        record = {
            "hook": step["hook"], "ctypes_submit": step["ctypes_submit"], "copies": step["copies"],
            "tail": completed - step["last_entry"],
            "tail_hook": submitted - step["last_entry"],
            "tail_queue": started - submitted,
            "tail_reduction": finished - started,
            "tail_handoff": completed - finished,
        }
        for kind, now_value, before in zip(ENGINE_KINDS, now_engine, baseline):
            record[kind] = now_value - before
        record["engine_busy"] = sum(f - s for _, s, f in step["runs"])
        record["engine_other"] = record["engine_busy"] - sum(record[kind] for kind in ENGINE_KINDS)
        record["rounds"] = now_rounds - rounds_before
        self.steps.append(record)
        if self.log_every and len(self.steps) % self.log_every == 0:
            logger.info("PowerSGD reduction timing, mean of the last %d steps: %s", self.log_every,
                        format_breakdown(mean(self.steps[-self.log_every:])))

    # ---- reading ----

    def breakdown(self):
        return mean(self.steps)


def mean(steps):
    """The mean of each field over `steps` and "steps": how many; {"steps": 0} when none."""
    if not steps:
        return {"steps": 0}
    result = {name: sum(step[name] for step in steps) / len(steps) for name in FIELDS}
    result["steps"] = len(steps)
    return result


def format_breakdown(b):
    """One line of a breakdown in milliseconds, e.g. for a log or a benchmark's output."""
    if not b.get("steps"):
        return "no compressed step recorded"
    ms = {name: 1000.0 * b[name] for name in FIELDS if name != "rounds"}
    return ("tail %.2f ms = hook %.2f + queue %.2f + last reduction %.2f + hand-off %.2f; backward thread in "
            "hook %.2f ms (ctypes submit %.2f, copies %.2f); engine worker %.2f ms = compress %.2f + communicate "
            "%.2f + decompress %.2f + guard %.2f + check %.2f + other %.2f; %.2f communication rounds (mean of %d steps)"
            % (ms["tail"], ms["tail_hook"], ms["tail_queue"], ms["tail_reduction"], ms["tail_handoff"], ms["hook"],
               ms["ctypes_submit"], ms["copies"], ms["engine_busy"], ms["compress"], ms["communicate"],
               ms["decompress"], ms["guard"], ms["check"], ms["engine_other"], b["rounds"], b["steps"]))
