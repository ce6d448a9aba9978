"""PowerSGD for PyTorch DDP, backed by the powersgd engine: a drop-in for
torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.

    from powersgd.torch import PowerSGDState, powerSGD_hook
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
    ddp_model.register_comm_hook(state, powerSGD_hook)

What happens per DDP bucket and iteration (details: docs/torch.md):
- DDP rebuilds its buckets once, before the forward pass of iteration 1 (iteration 2 with static_graph=True),
  or never (find_unused_parameters=True without static_graph); so the layout seen in iteration 2 is final in
  every mode.
- Compression starts at DDP iteration start_powerSGD_iter, as PyTorch's (which needs start_powerSGD_iter > 1
  with error feedback or warm start; so does this one). Until then the hook is torch's allreduce_hook. At
  iteration start_powerSGD_iter the hook declares DDP's layout to the engine (one engine bucket per DDP bucket,
  keyed by bucket.index()): at its first bucket from the last iteration's layout when that is final (from this
  process's iteration DECLARATION_ITER = 3 on), else at its last bucket from its own layout (iteration 2: final;
  reduced synchronously once). From then on each bucket's reduction starts asynchronously on the engine's
  worker thread, in place on DDP's bucket; the step's last hook call (bucket.is_last()) waits for them (no GIL
  held) and completes their futures.
- The first hook call of a process compares the state's arguments and iter over the process group (one
  all_gather_object): a difference fails every rank at once, naming the argument and each rank's value.
- A layout that changes after the declaration, a lost peer, NaN/Inf gradients, a mismatch between ranks:
  the future fails with PowerSGDError (a RuntimeError) naming the failure, which DDP raises from backward().

The engine's communicators rendezvous through torch's own store (the default group's: _store.py), so no
second store or port. torch.distributed.init_process_group() works under torchrun and under powersgd-run
(which gives torch MASTER_ADDR/MASTER_PORT of its own); init_process_group() below adds the interface torch's
Gloo needs in powersgd-run's emulated cluster.

Checkpoints: state_dict() / load_state_dict() and pickling are local (this rank's own state, no collective);
job_state_dict() is the collective checkpoint with the ranks' mean error memory (_checkpoint.py).

process_group is honoured: with a group other than the whole job, the engine's communicator is one of the
group's members (psgd_comm_init_on_store with the group's id), rendezvousing under a key of the group's
ranks; a group this process is not in, or anything torch.distributed does not know as a group, is a
ValueError at construction.

Without DDP: LocalSteps (_local_steps.py, docs/local-steps.md) takes local steps with a PowerSGD-compressed
outer step every H inner steps, over the C API's psgd_outer_*.

Several PowerSGDStates (several DDP models, e.g. a GAN's generator and discriminator) may serve one process
group: each has its own engine reducer, and they share the process's engine communicator for the group, on
which the engine runs their collectives in the order the hooks start their reductions (docs/engine.md,
"Several reducers on one communicator"). That order is the same on every rank because every hook runs on
the thread that runs backward(); call a state's methods from that thread too.
"""
import ctypes
import datetime
import hashlib
import logging
import numbers
import os
import re
import socket
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from powersgd import _capi, _checkpoint, _store, _timing
from powersgd._capi import PowerSGDError

logger = logging.getLogger(__name__)

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook", "init_process_group", "PowerSGDError",
           "DECLARATION_ITER", "LocalSteps"]

# The engine's PSGD_TIMEOUT_MS accepts 1 ms to 24 h (transport/comm/options.cpp).
_MAX_TIMEOUT_MS = 24 * 3600 * 1000

# The first iteration of a process in which a declaration at its first bucket can use the last iteration's layout:
# DDP's layout is final from iteration 2 of a process on (_checkpoint.DECLARATION_ITER).
DECLARATION_ITER = _checkpoint.DECLARATION_ITER

# PSGD_TORCH_TIMING (_timing.py): read at import, so a bad value is an error here, not a rank-local failure
# inside a collective declaration.
_TIMING_LOG_EVERY = _timing.interval_from_env()

_comm_lock = threading.Lock()
# The process's engine communicators (_Comm), created on first use: None keys the whole job's, a _Group's members
# the one of that subgroup. Each serves the default process group it was made under (its store): after
# torch.distributed.destroy_process_group() and a new init_process_group() the next use makes a new one.
_comms = {}


class _Comm:
    """An engine communicator (psgd_comm*) of _comms: passed to the C API as the handle (ctypes reads
    _as_parameter_). Made under the default process group `default_group` (held weakly) as rank `rank` of `size`;
    destroyed once neither _comms nor a reducer's owner (PowerSGDState, LocalSteps: their _comm) holds it, so a
    stale one goes when the last state using it does (psgd_comm_destroy; a reducer left over is detached)."""

    def __init__(self, handle, default_group, rank, size):
        self._as_parameter_ = handle
        self._default_group = weakref.ref(default_group)
        self.rank, self.size = rank, size

    def made_under(self, default_group):
        """Whether this communicator was made under `default_group` (the same object, still alive)."""
        return self._default_group() is default_group

    def serves(self, default_group, rank, size):
        """Whether this communicator was made under `default_group` as `rank` of `size`."""
        return self.made_under(default_group) and (self.rank, self.size) == (rank, size)

    def __del__(self):
        handle, self._as_parameter_ = self._as_parameter_, None
        if handle is None or sys.is_finalizing():  # at exit the process ends it (as before the cache dropped any)
            return
        try:
            _capi.lib.psgd_comm_destroy(handle)
        except Exception:
            pass


class _Group:
    """A torch.distributed subgroup as the engine serves it: this process's rank in it and the members'
    global ranks in group-rank order."""

    def __init__(self, rank, members):
        self.rank, self.members = rank, tuple(members)
        # The rendezvous key of the members (psgd_comm_init_group): two groups share one only if they have
        # the same members, and then they may share the communicator.
        text = ",".join(map(str, sorted(self.members)))
        if len(text) > 150:
            text = "n%d-sha256-%s" % (len(self.members), hashlib.sha256(text.encode()).hexdigest()[:40])
        self.id = "ranks-" + text


def _members(group):
    """A _group_of() result's global ranks, None for the whole job."""
    return None if group is None else list(group.members)


def _group_of(process_group):
    """None for the whole job (None, the default group, or a group of every rank in rank order); else the
    _Group. ValueError for a group this process is not in, or anything torch.distributed does not know as a
    process group: the engine must never average over ranks DDP does not."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return None
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("PowerSGDState: process_group is torch.distributed.GroupMember.NON_GROUP_MEMBER: this "
                         "process (global rank %s) is not a member of the group; expected the group the DDP "
                         "model averages over, created on its members" % (dist.get_rank() if dist.is_initialized()
                                                                          else "?",))
    if not dist.is_initialized():
        raise ValueError("PowerSGDState: process_group = %r, but torch.distributed is not initialized: expected "
                         "None or a group of the initialized default group" % (process_group,))
    try:
        members = dist.distributed_c10d.get_process_group_ranks(process_group)
        members = sorted(members, key=lambda member: dist.get_group_rank(process_group, member))
        rank = dist.get_rank(process_group)
    except (KeyError, TypeError, RuntimeError, ValueError) as e:
        raise ValueError("PowerSGDState: process_group = %r: expected None, torch.distributed's default group or "
                         "a group made by torch.distributed.new_group (%s)" % (process_group, e)) from None
    if members == list(range(dist.get_world_size())):
        return None
    return _Group(rank, members)


def _group_timeout(process_group):
    """The timeout torch.distributed's group (None: the default group) was created with, or None where torch
    does not say (a backend without options._timeout)."""
    try:
        pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        timeout = pg.options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def _with_timeout(timeout, create):
    """create() with PSGD_TIMEOUT_MS set to `timeout` (a timedelta) for the call, unless the environment sets
    it."""
    previous = os.environ.get("PSGD_TIMEOUT_MS")
    if previous is None and timeout is not None:
        milliseconds = int(timeout.total_seconds() * 1000)
        os.environ["PSGD_TIMEOUT_MS"] = str(min(max(1, milliseconds), _MAX_TIMEOUT_MS))
    try:
        return create()
    finally:
        if previous is None:
            os.environ.pop("PSGD_TIMEOUT_MS", None)


def _engine_comm(group=None, timeout=None):
    """The process's engine communicator (a _Comm) for the whole job (group None) or for `group` (a _Group).
    Collective on first use: a rendezvous of every rank of the job, or of the group's members, through torch's
    default store (_store.py: no second store or port). The first use creates it with `timeout` (a timedelta;
    PSGD_TIMEOUT_MS for the creation only, unless the environment sets it). A communicator made under another
    default process group (destroy_process_group() and init_process_group() since), or for another rank or
    size, is not reused: it is dropped from the cache (destroyed once no state uses it) and a new one made."""
    key = None if group is None else group.members
    default_group = dist.distributed_c10d._get_default_group()  # RuntimeError where torch is not initialized
    rank, size = (dist.get_rank(), dist.get_world_size()) if group is None else (group.rank, len(group.members))
    with _comm_lock:
        comm = _comms.get(key)
        if comm is None or not comm.serves(default_group, rank, size):
            # Every communicator of an earlier default process group goes too (a subgroup's, not asked for
            # again, kept its connections to the old peers).
            for stale in [k for k, c in _comms.items() if k == key or not c.made_under(default_group)]:
                del _comms[stale]
            handle = _with_timeout(timeout, lambda: _store.init_comm(rank, size, None if group is None else group.id))
            _comms[key] = _Comm(handle, default_group, rank, size)
        return _comms[key]


def _interface_of(address):
    """The name of the network interface that holds IPv4 `address`, or None."""
    import fcntl
    import struct
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
            except OSError:
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=30)):
    """torch.distributed.init_process_group(backend) (env://) that also works in powersgd-run's emulated cluster.

    torchrun and powersgd-run alike give torch MASTER_ADDR:MASTER_PORT (powersgd-run keeps its own store in
    PSGD_STORE_ADDR/PSGD_STORE_PORT), so a plain torch.distributed.init_process_group works under both. In
    powersgd-run's emulated cluster (PSGD_ADDR set by the launcher, PSGD_STORE_HOSTED=1) this also points
    torch's Gloo at the interface holding that address (GLOO_SOCKET_IFNAME, unless already set): torch would
    otherwise bind to its hostname's address, loopback inside the namespace. Collective.
    """
    if (os.environ.get("PSGD_STORE_HOSTED") == "1" and os.environ.get("PSGD_ADDR")
            and not os.environ.get("GLOO_SOCKET_IFNAME")):
        interface = _interface_of(os.environ["PSGD_ADDR"])
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group(backend, timeout=timeout)


def _bool(name, value, owner="PowerSGDState"):
    if value not in (True, False, 0, 1):
        raise ValueError("%s: %s = %r: expected True or False" % (owner, name, value))
    return int(bool(value))


def _integer(name, value, low, high, expected):
    """`value` as an int in [low, high] (high None: no limit); TypeError or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError("PowerSGDState: %s = %r: expected %s" % (name, value, expected))
    if value < low or (high is not None and value > high):
        raise ValueError("PowerSGDState: %s = %r: expected %s" % (name, value, expected))
    return int(value)


# The psgd_config field of each PowerSGDState argument whose name differs (the others have the field's name).
_FIELD_OF_ARGUMENT = {"matrix_approximation_rank": "rank", "start_powerSGD_iter": "start_iter",
                      "use_error_feedback": "error_feedback", "random_seed": "seed",
                      "batch_tensors_with_same_shape": "batch_same_shape"}
_ARGUMENT_OF_FIELD = {field: argument for argument, field in _FIELD_OF_ARGUMENT.items()}
# What the C types of psgd_config's integer fields hold (the engine's ranges are psgd_config_validate's).
_C_INTEGERS = {ctypes.c_int: (-2**31, 2**31 - 1, "-2**31 to 2**31 - 1"),
               ctypes.c_int64: (-2**63, 2**63 - 1, "-2**63 to 2**63 - 1"),
               ctypes.c_uint64: (0, 2**64 - 1, "0 to 2**64 - 1")}


def _set_field(config, argument, value, owner="PowerSGDState"):
    """Sets the psgd_config field of a PowerSGDState argument: TypeError for a value of another type, ValueError
    for an integer its C type cannot hold. The engine's ranges are checked by _validate."""
    field = _FIELD_OF_ARGUMENT.get(argument, argument)
    ctype = dict(_capi.Config._fields_)[field]
    real = ctype is ctypes.c_double
    if isinstance(value, bool) or not isinstance(value, numbers.Real if real else numbers.Integral):
        raise TypeError("%s: %s = %r: expected %s" % (owner, argument, value, "a number" if real else "an integer"))
    if not real:
        low, high, text = _C_INTEGERS[ctype]
        if not low <= value <= high:
            raise ValueError("%s: %s = %r: expected an integer %s" % (owner, argument, value, text))
    setattr(config, field, value)


def _user_terms(message):
    """The engine's message with psgd_config's fields (config.start_iter, config.rank) named as PowerSGDState's
    arguments (start_powerSGD_iter, matrix_approximation_rank)."""
    return re.sub(r"config\.(\w+)", lambda m: _ARGUMENT_OF_FIELD.get(m.group(1), m.group(1)), message)


def _validate(config, owner="PowerSGDState"):
    """psgd_config_validate (the engine's ranges and rules): ValueError with the engine's message, naming the
    PowerSGDState arguments instead of psgd_config's fields."""
    if _capi.lib.psgd_config_validate(ctypes.byref(config)) != 0:
        message = _capi.last_error().split(": ", 1)[-1]  # without "psgd_config_validate: "
        raise ValueError(owner + ": " + _user_terms(message))


def _check_schedule(start, error_feedback, warm_start):
    """PyTorch's rule: the per-bucket error memory and warm-start factors cannot follow DDP's rebuild of its
    buckets after the first iterations, so compression with either starts at iteration 2 or later."""
    if (error_feedback or warm_start) and start <= 1:
        raise ValueError("PowerSGDState: start_powerSGD_iter = %d: expected > 1 with use_error_feedback or "
                         "warm_start (as PyTorch's: DDP rebuilds its buckets after iteration 0, and the error "
                         "memory and warm-start factors of a bucket cannot follow it)" % start)


class PowerSGDState:
    """PyTorch's PowerSGDState, by name, signature and defaults; the arguments mean what they mean there
    (docs/torch.md lists the differences: the rank is at most 64, a layout change after the declaration
    fails). Keyword-only extras configure the engine's adaptive rank, alternating, the factors' type on the
    wire, wire_dtype="f32"|"bf16"|"fp16", and its divergence detector, divergence_check_interval (docs/engine.md).
    Every argument is validated here, by the engine's own validation (psgd_config_validate): TypeError or
    ValueError naming it."""

    def __init__(self, process_group, matrix_approximation_rank=1, start_powerSGD_iter=1_000,
                 min_compression_rate=2, use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0,
                 random_seed=0, compression_stats_logging_frequency=10_000,
                 batch_tensors_with_same_shape: bool = False, *, adaptive=False, rank_low=1, rank_high=4,
                 adaptive_interval=100, adaptive_threshold=0.5, alternating=False, warmup_steps=0,
                 lr_boost_steps=100, lr_watch=None, wire_dtype="f32", divergence_check_interval=100):
        logger.info("PowerSGD config: matrix_approximation_rank = %s; start_powerSGD_iter = %s; "
                    "min_compression_rate = %s; orthogonalization_epsilon = %s; use_error_feedback = %s; "
                    "warm_start = %s; random_seed = %s; compression_stats_logging_frequency = %s; "
                    "batch_tensors_with_same_shape = %s; adaptive = %s; rank_low = %s; rank_high = %s; "
                    "adaptive_interval = %s; adaptive_threshold = %s; alternating = %s",
                    matrix_approximation_rank, start_powerSGD_iter, min_compression_rate,
                    orthogonalization_epsilon, use_error_feedback, warm_start, random_seed,
                    compression_stats_logging_frequency, batch_tensors_with_same_shape, adaptive, rank_low,
                    rank_high, adaptive_interval, adaptive_threshold, alternating)
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        # As PyTorch's: at least 1 (it reports at least once).
        self.compression_stats_logging_frequency = max(1, _integer(
            "compression_stats_logging_frequency", compression_stats_logging_frequency, -2**63, None,
            "an integer (below 1: every iteration)"))
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.adaptive = adaptive
        self.rank_low = rank_low
        self.rank_high = rank_high
        self.adaptive_interval = adaptive_interval
        self.adaptive_threshold = adaptive_threshold
        self.alternating = alternating
        # The rank policy (docs/engine.md, "Rank policy and decision log"); lr_watch: an optimizer whose
        # param_groups' lr is read at each iteration's first bucket: a decrease is one note_lr_change().
        self.warmup_steps = warmup_steps
        self.lr_boost_steps = lr_boost_steps
        if lr_watch is not None and not hasattr(lr_watch, "param_groups"):
            raise TypeError("PowerSGDState: lr_watch = %r: expected a torch.optim optimizer (with param_groups)"
                            % (lr_watch,))
        self.lr_watch = lr_watch
        self._watched_lrs = None if lr_watch is None else [g["lr"] for g in lr_watch.param_groups]
        self.lr_notes = 0            # note_lr_change() calls, the watcher's included
        self._note_pending = False   # a note made before the engine reducer exists
        self.wire_dtype = wire_dtype  # "f32", "bf16" or "fp16": the factors' type on the wire
        # The engine's divergence detector: every N steps the ranks compare their outputs' hashes (0: off).
        self.divergence_check_interval = divergence_check_interval
        # Every field is checked now, with the engine's ranges, not first at the declaration inside backward().
        self._engine_config(whole_bucket=False)
        self.iter = 0               # DDP iterations completed (bucket.is_last() closes one), as the reference
        self._init_runtime()

    @property
    def process_group(self):
        """The group DDP averages over (None: the whole job). Settable until the engine reducer exists, e.g.
        after torch.load(state), as PyTorch documents for its own state: the engine's communicator follows it
        (before, an assignment changed torch's collectives only, and the engine averaged over every rank).
        ValueError for a group this process is not in, or another group once the reducer exists."""
        return self._process_group

    @process_group.setter
    def process_group(self, process_group):
        group = _group_of(process_group)  # None: the whole job
        if getattr(self, "_reducer", None) is not None and _members(group) != _members(self._group):
            raise ValueError("PowerSGDState: process_group cannot change once the engine reducer exists (from "
                             "the first compressed iteration): it serves ranks %s; set the group before training, "
                             "or make a new PowerSGDState" % (_members(self._group) or "all",))
        self._process_group = process_group
        self._group = group

    def _init_runtime(self):
        """What lives in this process only (__init__ and __setstate__): engine handles, threads, layouts."""
        self._plain_bytes = 0       # bytes this rank passed to torch's allreduce before the declaration
        self._layout = {}           # bucket index -> gradient shapes, of the iteration in progress
        self._previous_layout = {}  # ... of the last completed iteration
        self._declared = None       # the layout given to the engine
        self._whole_bucket = None   # which hook declared it
        self._reducer = None
        self._comm = None           # the engine communicator of the reducer (shared: _comms)
        self._failure = None        # the first error: every later bucket fails with it, no collective issued
        self._pending = []          # (handle, future, buffer, work) of the step's reductions in flight
        # Iterations this object saw in this process: DDP's own count, which decides when its layout is final
        # (iter may have been restored from a checkpoint, or set by hand as torch's __setstate__ does).
        self._local_iter = 0
        # Checkpoint support (_checkpoint.py): parameters are named by their place in this process's first
        # iteration (DDP's initial buckets, the same for one model in every run), so that a resumed run can
        # map the declared buckets onto the buckets of a fresh DDP before it rebuilds them.
        self._param_keys = {}       # parameter data_ptr -> key
        self._layout_keys = {}      # bucket index -> parameter keys, of the iteration in progress (until declared)
        self._previous_layout_keys = {}
        self._order = []            # bucket indices in call order, of the iteration in progress (until declared)
        self._previous_order = []
        self._declared_keys = None
        self._declared_order = None
        self._declared_at = None    # iter at the declaration: the engine's start_iter is relative to it
        self._restored = None       # a loaded engine checkpoint, applied at the next iteration's first bucket
        self._restored_layout = None  # a loaded final layout (saved before compression started), declared when due
        self._deferred = []         # DDP's layout not final yet in this process: this iteration's buckets
        self._provisional = False   # declared from a layout DDP may still rebuild (start_powerSGD_iter 0 or 1)
        self._retired = (0, 0, 0)   # numel before, after, bytes of reducers replaced by a redeclaration
        self._agreed = False        # the arguments and iter compared over the group (first hook call)

    _timer = None  # a _timing.StepTimer while the reduction's timing is recorded (enable_timing, PSGD_TORCH_TIMING)

    # ---- configuration ----

    def _engine_config(self, whole_bucket):
        """The engine's psgd_config of the attributes (start_iter: start_powerSGD_iter, which _create_reducer
        makes relative to the declaration), checked by the engine's own validation (psgd_config_validate);
        tests/python/ddp_hook.py's `validation` case gives every bad value to the constructor and to the
        engine's psgd_reducer_create and checks that both refuse it."""
        c = _capi.default_config()
        for argument in ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                         "orthogonalization_epsilon", "random_seed", "rank_low", "rank_high", "adaptive_interval",
                         "adaptive_threshold", "divergence_check_interval", "warmup_steps", "lr_boost_steps"):
            _set_field(c, argument, getattr(self, argument))
        c.error_feedback = _bool("use_error_feedback", self.use_error_feedback)
        c.warm_start = _bool("warm_start", self.warm_start)
        c.batch_same_shape = _bool("batch_tensors_with_same_shape", self.batch_tensors_with_same_shape)
        c.whole_bucket = int(whole_bucket)
        c.adaptive = _bool("adaptive", self.adaptive)
        c.alternating = _bool("alternating", self.alternating)
        if not isinstance(self.wire_dtype, str) or self.wire_dtype not in _capi.WIRE_DTYPES:
            raise ValueError("PowerSGDState: wire_dtype = %r: expected 'f32', 'bf16' or 'fp16'" % (self.wire_dtype,))
        c.wire_dtype = _capi.WIRE_DTYPES[self.wire_dtype]
        _validate(c)
        _check_schedule(c.start_iter, c.error_feedback, c.warm_start)
        return c

    # ---- statistics ----

    def compression_stats(self):
        """(compress_rate, numel_before_compression, numel_after_compression), cumulative over compressed
        steps, as the reference's compression_stats()."""
        s = self._stats()
        before, after = s.numel_before + self._retired[0], s.numel_after + self._retired[1]
        return (before / after if after else 0.0), before, after

    def bytes_sent(self):
        """Payload bytes this rank passed to collectives for gradients: torch's allreduce before the
        declaration, the engine's collectives after it."""
        return self._plain_bytes + self._retired[2] + self._stats().bytes_sent

    def _stats(self):
        s = _capi.Stats()
        if self._reducer is not None:
            _capi.check(_capi.lib.psgd_reducer_stats(self._reducer, ctypes.byref(s)))
        return s

    def enable_timing(self, log_every=0):
        """Records where each compressed step's reduction time goes (timing_breakdown()); log_every N >= 1
        also logs the mean every N steps (logger powersgd.torch, INFO). The environment variable
        PSGD_TORCH_TIMING=N does the same for every state. Discards what was recorded before."""
        self._timer = _timing.StepTimer(_integer("log_every", log_every, 0, None, "an integer >= 0"))

    def timing_breakdown(self):
        """The mean per compressed step, in seconds, of where the reduction's time went, over the steps
        recorded since enable_timing() (or PSGD_TORCH_TIMING); "steps" says how many (0: none, or timing
        is off). Fields: powersgd/_timing.py and docs/torch.md."""
        return self._timer.breakdown() if self._timer is not None else {"steps": 0}

    def close(self):
        """Waits for reductions in flight and frees the engine reducer (also done at garbage collection)."""
        pending, self._pending = self._pending, []
        for handle, *_ in pending:  # left by a step that raised before its last bucket
            _capi.lib.psgd_reduce_handle_free(handle)  # the reduction still completes; destroy waits for it
        if self._reducer is not None:
            _capi.lib.psgd_reducer_destroy(self._reducer)
            self._reducer = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    # ---- the hook ----

    def _hook(self, bucket, whole_bucket):
        """DDP's hook. Whatever fails in it (an attribute changed to a bad value, a bucket of another dtype, a
        file of a restored checkpoint) fails this bucket's future and every later bucket's (the state's
        failure), as the engine's errors do: raised into DDP instead, it left DDP's reducer unable to run
        another backward (INTERNAL ASSERT FAILED, unmarked_param_indices) and the iteration open."""
        try:
            return self._hook_bucket(bucket, whole_bucket)
        except Exception as error:
            if self._failure is None:
                self._failure = error
            # The step's reductions in flight write into their buffers (a copy, for another dtype) until done:
            # waited for before those are let go (bounded by the communicator's timeout).
            pending, self._pending = self._pending, []
            for handle, future, *_ in pending:
                _capi.lib.psgd_reduce_handle_wait(handle)
                _capi.lib.psgd_reduce_handle_free(handle)
                future.set_exception(self._failure)
            if bucket.is_last() and self._layout:
                self._close_iteration()
            return self._failed_future(self._failure)

    def _hook_bucket(self, bucket, whole_bucket):
        entered = time.monotonic()
        timer = None
        buffer = bucket.buffer()
        index = bucket.index()
        if buffer.dtype not in _DTYPES or buffer.device.type != "cpu":
            raise TypeError("powersgd.torch: bucket %d holds %s gradients on %s: expected float32, float64, "
                            "float16 or bfloat16 on the CPU" % (index, buffer.dtype, buffer.device))
        first = not self._layout
        if first and not self._agreed and self._failure is None:
            self._agree()
        self._layout[index] = tuple(tuple(g.shape) for g in bucket.gradients())
        if self._local_iter < DECLARATION_ITER:
            _checkpoint.record_keys(self, bucket, index)
        due = self.iter >= self.start_powerSGD_iter
        if first and due and self._reducer is None and self._failure is None:
            self._declare_at_first_bucket(whole_bucket)
        if first and self._watched_lrs is not None:
            lrs = [g["lr"] for g in self.lr_watch.param_groups]
            if any(now < before for now, before in zip(lrs, self._watched_lrs)):
                self.note_lr_change()
            self._watched_lrs = lrs
        last = bucket.is_last()
        if self._failure is not None:
            future = self._failed_future(self._failure)
        elif not due or (self._reducer is None and self._local_iter < DECLARATION_ITER - 1
                         and (self.use_error_feedback or self.warm_start)):
            # Before start_powerSGD_iter; or due, but DDP may still rebuild its buckets in this process and no
            # final layout is known (iter restored by hand, or a checkpoint saved in its process's first
            # iterations): error memory and warm start need the final layout, declared in iteration 2.
            future = allreduce_hook(self.process_group, bucket)
            self._plain_bytes += buffer.numel() * buffer.element_size()
        elif self._local_iter < DECLARATION_ITER:
            # DDP's layout may not be final in this process yet: the iteration is reduced at its last bucket,
            # through the declared buckets (declared there from this iteration's layout if there are none).
            future = _checkpoint.defer(self, bucket, buffer, final=self._local_iter == DECLARATION_ITER - 1,
                                       prepare=lambda: self._prepare_deferred(whole_bucket))
        else:
            timer = self._timer if self._failure is None else None
            if timer is not None:
                timer.bucket_entered(_capi.lib, self._reducer, self._comm)
            future = self._reduce(bucket, index, buffer, whole_bucket, timer)
            if timer is not None and self._failure is not None:
                timer.abandon()  # the step failed here: nothing of it is recorded
                timer = None
            if timer is not None:
                timer.bucket_left(time.monotonic() - entered)
                if last:
                    timer.last_entered(entered)
        if last and self._pending:
            self._complete_step(timer)
        if last and self._reducer is not None and self._failure is None:
            self._maybe_report()
        if last:
            self._close_iteration()
        return future

    def _complete_step(self, timer):
        """At the step's last bucket: waits for the step's reductions in the order they started (the engine's)
        and completes their futures, on this thread. No waiter thread and no hand-off between threads: DDP
        hands over its last bucket once backward's compute is over and then waits for every future anyway;
        ctypes releases the GIL while psgd_reduce_handle_wait blocks."""
        pending, self._pending = self._pending, []
        failed = False
        for handle, future, buffer, work in pending:
            # Every future completes, whatever fails on the way (a copy, the timing): DDP waits for each.
            try:
                status = _capi.lib.psgd_reduce_handle_wait(handle)
                if status != 0:
                    raise PowerSGDError(status, _capi.last_error())
                if timer is not None:
                    timer.reduction_finished(_timing.handle_times(_capi.lib, handle))
                if work is not buffer:
                    start = time.monotonic()
                    buffer.copy_(work)
                    if timer is not None:
                        timer.copy_took(time.monotonic() - start)
            except Exception as error:
                failed = True
                future.set_exception(error)
                continue
            finally:
                _capi.lib.psgd_reduce_handle_free(handle)
            future.set_result(buffer)
        if timer is not None:
            if failed:
                timer.abandon()
            else:
                timer.step_completed(time.monotonic(), _capi.lib, self._reducer, self._comm)

    # ---- rank policy ----

    def note_lr_change(self):
        """Reducer::note_lr_change(): the next lr_boost_steps compressed steps of every bucket at rank_high.
        Between iterations (or from the lr_watch watcher), on every rank alike: a note on some ranks only fails
        the next iteration's reductions on every rank (MismatchError)."""
        self.lr_notes += 1
        self._note_pending = True
        self._flush_note()

    def _flush_note(self):
        if self._note_pending and self._reducer is not None and self._failure is None:
            self._note_pending = False
            _capi.check(_capi.lib.psgd_reducer_note_lr_change(self._reducer))

    def decisions(self):
        """The engine's decision log since the last call: dicts {iteration, step, bucket, rank, reason}: from DDP
        iteration `iteration` on (self.iter's count), bucket `bucket` compresses at `rank` because of `reason`;
        `step` is the same moment in the engine's count of its reductions, iteration - start_powerSGD_iter
        (the engine reducer is created at start_powerSGD_iter)."""
        out = []
        if self._reducer is None:
            return out
        capacity = 256
        steps = (ctypes.c_int64 * capacity)()
        buckets, ranks, reasons = (ctypes.c_int * capacity)(), (ctypes.c_int * capacity)(), (ctypes.c_int * capacity)()
        count = ctypes.c_size_t(capacity)
        while count.value == capacity:
            _capi.check(_capi.lib.psgd_reducer_decisions(self._reducer, steps, buckets, ranks, reasons, capacity,
                                                         ctypes.byref(count)))
            for i in range(count.value):
                out.append({"iteration": steps[i] + self._declared_at, "step": steps[i], "bucket": buckets[i],
                            "rank": ranks[i],
                            "reason": _capi.lib.psgd_rank_reason_name(reasons[i]).decode()})
        return out

    def _close_iteration(self):
        self.iter += 1
        self._local_iter += 1
        self._previous_layout, self._layout = self._layout, {}
        if self._local_iter <= DECLARATION_ITER:
            self._previous_layout_keys, self._layout_keys = self._layout_keys, {}
            self._previous_order, self._order = self._order, []
        if self.iter == self.start_powerSGD_iter:
            logger.info("Start to apply PowerSGD after %d iterations.", self.iter)

    def _maybe_report(self):
        """PyTorch's _report_compression_stats: in a compressed iteration, at its last bucket, every
        compression_stats_logging_frequency iterations from the first. Logged once the iteration's reductions
        completed (_complete_step), so the figures include them."""
        if self.iter >= self.start_powerSGD_iter and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info("Compression stats: iter %d, total before compression %d, total after compression "
                        "%d, rate %s", self.iter, before, after, rate)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def _agree(self):
        """Collective, at the first hook call of this process: every rank of the group must hold the same
        arguments and iter, or the engine would be declared in different iterations (one rank's allreduce
        against another's engine: a hang until the timeout). A difference fails every rank, naming it in
        PowerSGDState's terms."""
        self._agreed = True
        mine = dict({name: getattr(self, name) for name in _checkpoint.CONFIG_FIELDS}, iter=self.iter)
        everyone = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(everyone, mine, group=self.process_group)
        differing = []
        for name, value in mine.items():
            values = [other[name] for other in everyone]
            if any(v != value for v in values):
                ranks = {}
                for r, v in enumerate(values):
                    ranks.setdefault(repr(v), []).append(r)
                differing.append("%s = %s" % (name, ", ".join("%s on rank%s %s" % (v, "s" if len(r) > 1 else "",
                                                                                   ", ".join(map(str, r)))
                                                              for v, r in ranks.items())))
        if differing:
            self._failure = PowerSGDError(_checkpoint.MISMATCH, "the ranks of the process group hold different "
                                          "PowerSGDStates: %s; construct it with the same arguments on every rank "
                                          "(and load the same checkpoint)" % "; ".join(differing))

    def _declare_at_first_bucket(self, whole_bucket):
        """Compression is due and there is no reducer: at the first bucket, from a loaded checkpoint, from the
        last iteration's layout where that is final, or from a loaded final layout; else (DDP's layout of this
        process not final yet) at this iteration's last bucket (_prepare_deferred)."""
        if self._restored is not None:
            _checkpoint.declare_restored(self, whole_bucket)
        elif self._local_iter >= DECLARATION_ITER:
            self._declare(self._previous_layout, self._previous_layout_keys, self._previous_order, whole_bucket)
        elif self._restored_layout is not None:
            layout, self._restored_layout = self._restored_layout, None
            self._declare(layout["declared"], layout["declared_keys"], layout["declared_order"], whole_bucket)

    def _prepare_deferred(self, whole_bucket):
        """At the last bucket of a compressed iteration in which DDP's layout may not be final (the process's
        first DECLARATION_ITER): declares this iteration's layout where none is declared; declares it again
        where DDP rebuilt its buckets since a provisional declaration (in iteration 0 or 1: error feedback and
        warm start off, so the replaced reducer carries nothing a step needs)."""
        if self._reducer is not None and self._provisional and self._layout_keys != self._declared_keys:
            s = self._stats()
            self._retired = (self._retired[0] + s.numel_before, self._retired[1] + s.numel_after,
                             self._retired[2] + s.bytes_sent)
            self.close()
        if self._reducer is None:
            self._declare(self._layout, self._layout_keys, self._order, whole_bucket)
            self._provisional = self._local_iter < DECLARATION_ITER - 1

    def _declare(self, layout, keys, order, whole_bucket):
        """Collective: creates the engine reducer and declares `layout` (bucket index -> shapes) with its
        parameters' keys and reduction order (checkpoints)."""
        try:
            if sorted(layout) != list(range(len(layout))):
                raise PowerSGDError(1, "DDP's bucket indices %s in iteration %d are not 0 to %d"
                                    % (sorted(layout), self.iter - 1, len(layout) - 1))
            self._create_reducer(layout, whole_bucket, self.iter)
        except PowerSGDError as e:
            self._failure = e
            return
        self._declared = dict(layout)
        self._whole_bucket = whole_bucket
        self._declared_keys, self._declared_order = dict(keys), tuple(order)
        self._declared_at = self.iter
        self._after_declare()

    def _after_declare(self):
        """Once the reducer exists (a declaration here or a checkpoint's in _checkpoint.declare_restored)."""
        if _TIMING_LOG_EVERY and self._timer is None:
            self._timer = _timing.StepTimer(_TIMING_LOG_EVERY)
        self._flush_note()

    def _create_reducer(self, layout, whole_bucket, declared_at):
        """Collective: the engine reducer with `layout` (bucket index -> shapes), compressing from
        start_powerSGD_iter counted from `declared_at` (at once for a reducer created when compression is due;
        a checkpoint of an earlier version may have declared earlier)."""
        config = self._engine_config(whole_bucket)
        config.start_iter = max(0, int(self.start_powerSGD_iter) - declared_at)
        comm = _engine_comm(self._group, _group_timeout(self.process_group))
        reducer = ctypes.c_void_p()
        status = _capi.lib.psgd_reducer_create(comm, ctypes.byref(config), ctypes.byref(reducer))
        if status != 0:
            raise PowerSGDError(status, _user_terms(_capi.last_error()))
        self._reducer = reducer
        self._comm = comm
        for index in range(len(layout)):
            shapes = layout[index]
            ndims = (ctypes.c_int * len(shapes))(*[len(s) for s in shapes])
            flat = [d for s in shapes for d in s]
            dims = (ctypes.c_int64 * max(1, len(flat)))(*flat)
            declared = ctypes.c_int(-1)
            _capi.check(_capi.lib.psgd_reducer_add_bucket(reducer, len(shapes), ndims, dims, ctypes.byref(declared)))
        return comm

    # ---- checkpoints (python/powersgd/_checkpoint.py) ----

    def state_dict(self):
        """The state as a dict of plain values (torch.save, pickle): iter, the configuration and, once the hook
        declared DDP's buckets, this rank's own engine checkpoint (error memory, warm start, step count). Local
        and cheap, as PyTorch's: no collective, so `if rank == 0: torch.save(...)` works. Loaded on the rank
        that saved it (same group size, the same ranks sharing hosts): the run continues bitwise; loaded on other
        ranks (rank 0's file on every rank): the warm start and step count, and error memory zero (docs/torch.md,
        "Checkpoints"). Between iterations."""
        return _checkpoint.state_dict(self)

    def job_state_dict(self):
        """state_dict() plus the job checkpoint: the ranks' mean error memory, which every rank takes when the
        dict is loaded where not every rank has its own (another world size, or one rank's file on every rank).
        Collective: every rank of the group calls it, between iterations (a rank calling it alone waits for the
        others until the group's timeout, then fails)."""
        return _checkpoint.state_dict(self, job=True)

    def load_state_dict(self, state_dict):
        """Restores a state_dict() or job_state_dict(): iter and the configuration now; the engine's state now
        when the engine reducer exists (collective: a dict refused on any rank, e.g. one saved before the first
        compressed iteration, raises on every rank at once, nothing loaded), else at the first bucket of the next
        compressed iteration, which declares the checkpoint's buckets. A fresh DDP's first iterations (before DDP
        rebuilt its buckets) are reduced through the declared buckets, so the resumed run continues the saved
        one."""
        _checkpoint.load_state_dict(self, state_dict)

    def __getstate__(self):
        """Pickling (torch.save(state)): state_dict() (local), without the process group (as PyTorch's, which
        logs that on every save: this one does not; a subgroup's members are kept to warn at loading)."""
        return self.state_dict()

    def __setstate__(self, state):
        """Unpickling: the default process group (as PyTorch's), then load_state_dict(state). Warns when the
        saved state served another group than the whole job."""
        if state.get("group") is not None:
            logger.warning("NOTE: the saved PowerSGDState served the process group of global ranks %s; it is set "
                           "to the default group (every rank): set `process_group` after loading if a group is "
                           "desired", list(state["group"]))
        self.process_group = None
        self.iter = 0
        self.next_stats_report = 0
        self.lr_watch = None         # an optimizer is not part of the state: pass lr_watch again
        self._watched_lrs = None
        self.lr_notes = 0
        self._note_pending = False
        self._init_runtime()
        self.load_state_dict(state)

    def _failed_future(self, error):
        future = torch.futures.Future()
        future.set_exception(error)
        return _as_error_future(future)

    def _reduce(self, bucket, index, buffer, whole_bucket, timer):
        if self._failure is not None:
            return self._failed_future(self._failure)
        if whole_bucket != self._whole_bucket:
            self._failure = PowerSGDError(1, "this PowerSGDState serves %s; it cannot also serve %s: "
                                          "use one state per hook" % (self._hook_name(self._whole_bucket),
                                                                      self._hook_name(whole_bucket)))
            return self._failed_future(self._failure)
        declared = self._declared.get(index)
        if declared != self._layout[index]:
            self._failure = PowerSGDError(4, "DDP's bucket %d changed after powersgd declared the layout in "
                                          "iteration %d: it holds gradients of shapes %s, declared %s; the "
                                          "engine's per-bucket state (error feedback, warm start) cannot "
                                          "follow a layout change. A state serves one DDP model: for a new "
                                          "DDP wrapper, register a new PowerSGDState and load_state_dict() "
                                          "this one's state_dict() into it" % (
                                              index, self._declared_at, list(self._layout[index]), declared))
            return self._failed_future(self._failure)
        if not buffer.is_contiguous():
            raise TypeError("powersgd.torch: bucket %d's buffer is not contiguous" % index)
        # The engine reduces float32: another dtype is converted at the boundary (exact for float16 and
        # bfloat16; float64 rounds) and the result copied back into the bucket when it completes. A float32
        # bucket is the engine's input and output itself: no copy.
        work = buffer
        if buffer.dtype != torch.float32:
            start = time.monotonic()
            work = buffer.to(torch.float32)
            if timer is not None:
                timer.copy_took(time.monotonic() - start)
        submit = time.monotonic()
        handle = ctypes.c_void_p()
        status = _capi.lib.psgd_reducer_reduce_async_n(self._reducer, index, work.data_ptr(), work.numel(),
                                                       ctypes.byref(handle))
        if timer is not None:
            timer.submit_took(time.monotonic() - submit)
        if status != 0:
            self._failure = PowerSGDError(status, _capi.last_error())
            return self._failed_future(self._failure)
        future = torch.futures.Future()
        self._pending.append((handle, future, buffer, work))
        return _as_error_future(future)

    @staticmethod
    def _hook_name(whole_bucket):
        return "batched_powerSGD_hook" if whole_bucket else "powerSGD_hook"


# The bucket dtypes the hook accepts; all but float32 are converted at the boundary (PowerSGDState._reduce).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _as_error_future(future):
    """The future DDP gets: set_exception() stores the exception as the future's value, which DDP's C++
    side would try to read as a tensor ("Unable to cast ..."); then() turns it into a real error of the
    returned future, raised by DDP with the exception's message."""
    return future.then(lambda done: done.value())


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD of each gradient tensor of the bucket (PyTorch's powerSGD_hook), on the engine."""
    return state._hook(bucket, whole_bucket=False)


def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD of the whole bucket as one zero-padded square matrix (PyTorch's batched_powerSGD_hook)."""
    return state._hook(bucket, whole_bucket=True)


# Local steps with a compressed outer step, without DDP (issue 31): _local_steps.py, over this module's helpers.
from powersgd._local_steps import LocalSteps  # noqa: E402  (imports this module)
