"""PowerSGD for PyTorch DDP, backed by the powersgd engine: a drop-in for
torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.

    from powersgd.torch import PowerSGDState, powerSGD_hook
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
    ddp_model.register_comm_hook(state, powerSGD_hook)

What happens per DDP bucket and iteration (details: docs/torch.md):
- Until DDP's bucket layout is final, the hook is PyTorch's averaged allreduce (default_hooks.allreduce_hook
  on the state's process group). DDP rebuilds its buckets once, before the forward pass of iteration 1
  (iteration 2 with static_graph=True), or never (find_unused_parameters=True without static_graph); so the
  layout seen in iteration 2 is final in every mode.
- In iteration DECLARATION_ITER (3) the hook declares iteration 2's layout to the engine (one engine bucket per DDP
  bucket, keyed by bucket.index()) and from then on starts each bucket's reduction asynchronously on the
  engine's worker thread; the returned torch.futures.Future is completed by a waiter thread that holds no
  GIL while it waits. The engine compresses from DDP iteration max(start_powerSGD_iter, DECLARATION_ITER).
- A layout that changes after the declaration, a lost peer, NaN/Inf gradients, a mismatch between ranks:
  the future fails with PowerSGDError (a RuntimeError) naming the failure, which DDP raises from backward().

The engine's communicator has its own rendezvous store, on PSGD_STORE_PORT, else MASTER_PORT + 1 (torch's
TCPStore holds MASTER_PORT), else, under powersgd-run, the launcher's store on MASTER_PORT (docs/env.md).
Under powersgd-run the launcher's store holds MASTER_PORT, so create torch's process group with
init_process_group() below instead of torch.distributed.init_process_group().

process_group is honoured: with a group other than the whole job, the engine's communicator is one of the
group's members (psgd_comm_init_group), rendezvousing under a key of the group's ranks; a group this process
is not in, or anything torch.distributed does not know as a group, is a ValueError at construction.

One PowerSGDState per process group at a time: its engine reducer and the process's engine communicator for
the group are used from the thread that runs backward(), and its waiter thread.
"""
import ctypes
import datetime
import hashlib
import os
import queue
import socket
import threading

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from powersgd import _capi
from powersgd._capi import PowerSGDError

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook", "init_process_group", "PowerSGDError",
           "DECLARATION_ITER"]

# The DDP iteration in which the hook declares the buckets: the one after the last that DDP may rebuild them in.
DECLARATION_ITER = 3

_comm_lock = threading.Lock()
# The process's engine communicators (psgd_comm*), created on first use and kept for the process's life: None
# keys the whole job's, a _Group's members the one of that subgroup.
_comms = {}


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


def _engine_comm(group=None):
    """The process's engine communicator for the whole job (group None) or for `group` (a _Group). Collective
    on first use: a rendezvous of every rank of the job, or of the group's members."""
    key = None if group is None else group.members
    with _comm_lock:
        if key not in _comms:
            handle = ctypes.c_void_p()
            if group is None:
                _capi.check(_capi.lib.psgd_comm_init_beside_torch(ctypes.byref(handle)))
            else:
                _capi.check(_capi.lib.psgd_comm_init_group(group.rank, len(group.members), group.id.encode(),
                                                           ctypes.byref(handle)))
            _comms[key] = handle
        return _comms[key]


def _address_towards(host):
    """This host's address on the route to `host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


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
    """torch.distributed.init_process_group(backend) that works under torchrun and under powersgd-run.

    Under torchrun (PSGD_STORE_HOSTED unset) this is torch's env:// rendezvous on MASTER_ADDR:MASTER_PORT.
    Under powersgd-run (PSGD_STORE_HOSTED=1) the launcher's store holds MASTER_PORT; rank 0 then hosts torch's
    TCPStore on a free port and broadcasts its address and port over the engine's communicator; with
    PSGD_ADDR set (the emulated cluster) torch's Gloo uses the interface holding that address
    (GLOO_SOCKET_IFNAME, unless already set). Collective.
    """
    if os.environ.get("PSGD_STORE_HOSTED") != "1":
        dist.init_process_group(backend, timeout=timeout)
        return
    comm = _engine_comm()
    rank, world = _capi.lib.psgd_comm_rank(comm), _capi.lib.psgd_comm_size(comm)
    # powersgd-run's emulated cluster gives each worker PSGD_ADDR (its host's address); torch's Gloo would
    # otherwise bind to the address its hostname resolves to (loopback there).
    if os.environ.get("PSGD_ADDR") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        interface = _interface_of(os.environ["PSGD_ADDR"])
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    endpoint = ctypes.create_string_buffer(64)
    store = None
    if rank == 0:
        host = os.environ.get("PSGD_ADDR") or _address_towards(os.environ["MASTER_ADDR"])
        store = dist.TCPStore(host, 0, world, True, timeout, wait_for_workers=False)
        endpoint.value = ("%s:%d" % (host, store.port)).encode()
    _capi.check(_capi.lib.psgd_comm_broadcast(comm, endpoint, len(endpoint), 0))
    if rank != 0:
        host, port = endpoint.value.decode().rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _bool(name, value):
    if value not in (True, False, 0, 1):
        raise ValueError("PowerSGDState: %s = %r: expected True or False" % (name, value))
    return int(bool(value))


class PowerSGDState:
    """PyTorch's PowerSGDState, by name, signature and defaults; the arguments mean what they mean there
    (docs/torch.md lists the one difference: compression starts no earlier than DECLARATION_ITER)."""

    def __init__(self, process_group, matrix_approximation_rank=1, start_powerSGD_iter=1_000,
                 min_compression_rate=2, use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0,
                 random_seed=0, compression_stats_logging_frequency=10_000,
                 batch_tensors_with_same_shape: bool = False):
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.compression_stats_logging_frequency = compression_stats_logging_frequency
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self._group = _group_of(process_group)  # None: the whole job
        if not isinstance(matrix_approximation_rank, int) or matrix_approximation_rank < 1:
            raise ValueError("PowerSGDState: matrix_approximation_rank = %r: expected an integer >= 1"
                             % (matrix_approximation_rank,))
        if not isinstance(start_powerSGD_iter, int) or start_powerSGD_iter < 0:
            raise ValueError("PowerSGDState: start_powerSGD_iter = %r: expected an integer >= 0"
                             % (start_powerSGD_iter,))
        # The flags are checked now, not at the declaration inside backward(), so a bad value fails at once.
        self._engine_config(whole_bucket=False)
        self.iter = 0               # DDP iterations completed (bucket.is_last() closes one), as the reference
        self._plain_bytes = 0       # bytes this rank passed to torch's allreduce before the declaration
        self._layout = {}           # bucket index -> gradient shapes, of the iteration in progress
        self._previous_layout = {}  # ... of the last completed iteration
        self._declared = None       # the layout given to the engine
        self._whole_bucket = None   # which hook declared it
        self._reducer = None
        self._failure = None        # the first error: every later bucket fails with it, no collective issued
        self._pending = queue.Queue()
        self._waiter = None

    # ---- configuration ----

    def _engine_config(self, whole_bucket):
        c = _capi.default_config()
        c.rank = int(self.matrix_approximation_rank)
        c.start_iter = 0
        c.min_compression_rate = float(self.min_compression_rate)
        c.error_feedback = _bool("use_error_feedback", self.use_error_feedback)
        c.warm_start = _bool("warm_start", self.warm_start)
        c.orthogonalization_epsilon = float(self.orthogonalization_epsilon)
        if not 0 <= int(self.random_seed) < 2**64:
            raise ValueError("PowerSGDState: random_seed = %r: expected 0 to 2**64 - 1" % (self.random_seed,))
        c.seed = int(self.random_seed)
        c.batch_same_shape = _bool("batch_tensors_with_same_shape", self.batch_tensors_with_same_shape)
        c.whole_bucket = int(whole_bucket)
        # The engine validates every field (rank 1 to 64, finite rates, ...) when the reducer is created.
        return c

    # ---- statistics ----

    def compression_stats(self):
        """(compress_rate, numel_before_compression, numel_after_compression), cumulative over compressed
        steps, as the reference's compression_stats()."""
        s = self._stats()
        return s.compression_rate, s.numel_before, s.numel_after

    def bytes_sent(self):
        """Payload bytes this rank passed to collectives for gradients: torch's allreduce before the
        declaration, the engine's collectives after it."""
        return self._plain_bytes + self._stats().bytes_sent

    def _stats(self):
        s = _capi.Stats()
        if self._reducer is not None:
            _capi.check(_capi.lib.psgd_reducer_stats(self._reducer, ctypes.byref(s)))
        return s

    def close(self):
        """Waits for reductions in flight and frees the engine reducer (also done at garbage collection)."""
        if self._waiter is not None:
            self._pending.put(None)
            self._waiter.join()
            self._waiter = None
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
        buffer = bucket.buffer()
        index = bucket.index()
        if buffer.dtype != torch.float32 or buffer.device.type != "cpu":
            raise TypeError("powersgd.torch: bucket %d holds %s gradients on %s: expected float32 on the CPU"
                            % (index, buffer.dtype, buffer.device))
        self._layout[index] = tuple(tuple(g.shape) for g in bucket.gradients())
        if self._reducer is None and self._failure is None and self.iter >= DECLARATION_ITER:
            self._declare(whole_bucket)
        if self._reducer is None and self._failure is None:
            future = allreduce_hook(self.process_group, bucket)
            self._plain_bytes += buffer.numel() * buffer.element_size()
        else:
            future = self._reduce(bucket, index, buffer, whole_bucket)
        if bucket.is_last():
            self._close_iteration()
        return future

    def _close_iteration(self):
        self.iter += 1
        self._previous_layout, self._layout = self._layout, {}

    def _declare(self, whole_bucket):
        """Collective: creates the engine reducer and declares the last iteration's buckets."""
        layout = self._previous_layout
        try:
            if sorted(layout) != list(range(len(layout))):
                raise PowerSGDError(1, "DDP's bucket indices %s in iteration %d are not 0 to %d"
                                    % (sorted(layout), self.iter - 1, len(layout) - 1))
            config = self._engine_config(whole_bucket)
            config.start_iter = max(0, int(self.start_powerSGD_iter) - self.iter)
            comm = _engine_comm(self._group)
            reducer = ctypes.c_void_p()
            _capi.check(_capi.lib.psgd_reducer_create(comm, ctypes.byref(config), ctypes.byref(reducer)))
            self._reducer = reducer
            for index in range(len(layout)):
                shapes = layout[index]
                ndims = (ctypes.c_int * len(shapes))(*[len(s) for s in shapes])
                flat = [d for s in shapes for d in s]
                dims = (ctypes.c_int64 * max(1, len(flat)))(*flat)
                declared = ctypes.c_int(-1)
                _capi.check(_capi.lib.psgd_reducer_add_bucket(reducer, len(shapes), ndims, dims,
                                                              ctypes.byref(declared)))
        except PowerSGDError as e:
            self._failure = e
            return
        self._declared = layout
        self._whole_bucket = whole_bucket
        self._waiter = threading.Thread(target=self._wait_loop, name="powersgd-waiter", daemon=True)
        self._waiter.start()

    def _failed_future(self, error):
        future = torch.futures.Future()
        future.set_exception(error)
        return _as_error_future(future)

    def _reduce(self, bucket, index, buffer, whole_bucket):
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
                                          "follow a layout change" % (index, DECLARATION_ITER,
                                                                       list(self._layout[index]), declared))
            return self._failed_future(self._failure)
        if not buffer.is_contiguous():
            raise TypeError("powersgd.torch: bucket %d's buffer is not contiguous" % index)
        handle = ctypes.c_void_p()
        status = _capi.lib.psgd_reducer_reduce_async(self._reducer, index, ctypes.c_void_p(buffer.data_ptr()),
                                                     ctypes.byref(handle))
        if status != 0:
            self._failure = PowerSGDError(status, _capi.last_error())
            return self._failed_future(self._failure)
        future = torch.futures.Future()
        self._pending.put((handle, future, buffer))
        return _as_error_future(future)

    @staticmethod
    def _hook_name(whole_bucket):
        return "batched_powerSGD_hook" if whole_bucket else "powerSGD_hook"

    def _wait_loop(self):
        """Completes the futures in the order the reductions started (the engine's order). ctypes releases
        the GIL for the duration of psgd_reduce_handle_wait."""
        while True:
            item = self._pending.get()
            if item is None:
                return
            handle, future, buffer = item
            status = _capi.lib.psgd_reduce_handle_wait(handle)
            message = _capi.last_error() if status != 0 else ""
            _capi.lib.psgd_reduce_handle_free(handle)
            if status == 0:
                future.set_result(buffer)
            else:
                future.set_exception(PowerSGDError(status, message))


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
