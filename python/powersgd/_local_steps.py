"""powersgd.torch.LocalSteps: local steps with a PowerSGD-compressed outer step (DiLoCo-style), without DDP.

Over the C API's psgd_outer_* (powersgd::OuterOptimizer, docs/local-steps.md): every `local_steps` inner steps
each rank's pseudo-gradient (start point minus its parameters) is reduced by an engine reducer (PowerSGD with
error feedback on the pseudo-gradients) and applied from the synchronised start point with Nesterov momentum,
the same bits on every rank. The model's parameters are laid out in engine buckets as DDP would bucket them
(torch's own bucket assignment: bucket_cap_mb, the first bucket 1 MiB), in float32 flat buffers the wrapper
owns: an outer step copies the parameters in, runs psgd_outer_step on the buffers and copies the result back
only when it succeeded, so a failed outer step leaves the model as it was.
"""
import ctypes
import math
import numbers
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from powersgd import _capi
from powersgd import torch as _pst
from powersgd._capi import PowerSGDError

# Outer steps "never" compress: the reducer's start_iter for compression=False (a plain averaged allreduce).
_NEVER = 2**62
VERSION = 1
# The engine's names of the outer settings and the wrapper's.
_OUTER_TERMS = {"outer.local_steps": "local_steps", "outer.lr": "outer_lr", "outer.momentum": "outer_momentum"}
# The configuration a state_dict carries and load_state_dict compares: LocalSteps's attributes of these names.
_CONFIG = ("local_steps", "outer_lr", "outer_momentum", "compression", "matrix_approximation_rank",
           "start_powerSGD_iter", "min_compression_rate", "use_error_feedback", "warm_start",
           "orthogonalization_epsilon", "random_seed", "divergence_check_interval")


# The reducer's (PowerSGDState's) arguments: LocalSteps's attributes of these names.
_ENGINE_ARGUMENTS = _CONFIG[4:]


def _terms(message):
    """An engine message in LocalSteps's terms (outer.lr -> outer_lr, config.rank -> matrix_approximation_rank)."""
    for engine, ours in _OUTER_TERMS.items():
        message = message.replace(engine, ours)
    return _pst._user_terms(message)


def _check_outer(local_steps, outer_lr, outer_momentum):
    """The engine's ranges (OuterConfig), checked here with the wrapper's names before any collective."""
    if isinstance(local_steps, bool) or not isinstance(local_steps, numbers.Integral):
        raise TypeError("LocalSteps: local_steps = %r: expected an integer >= 1 (inner steps per outer step)"
                        % (local_steps,))
    if local_steps < 1:
        raise ValueError("LocalSteps: local_steps = %r: expected an integer >= 1 (inner steps per outer step)"
                         % (local_steps,))
    for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError("LocalSteps: %s = %r: expected a number" % (name, value))
    if not (math.isfinite(outer_lr) and outer_lr > 0):
        raise ValueError("LocalSteps: outer_lr = %r: expected a finite learning rate > 0" % (outer_lr,))
    if not (math.isfinite(outer_momentum) and 0 <= outer_momentum < 1):
        raise ValueError("LocalSteps: outer_momentum = %r: expected 0 <= outer_momentum < 1" % (outer_momentum,))


def _buckets(params, bucket_cap_mb):
    """The parameters' indices per bucket, as DDP buckets them (torch's _compute_bucket_assignment_by_size with
    DDP's limits, the buckets reversed: bucket 0 holds the last parameters, as in DDP's initial layout)."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real) or not bucket_cap_mb > 0:
        raise ValueError("LocalSteps: bucket_cap_mb = %r: expected a number > 0" % (bucket_cap_mb,))
    cap = max(1, int(bucket_cap_mb * 1024 * 1024))
    limits = [min(dist._DEFAULT_FIRST_BUCKET_BYTES, cap), cap]  # DDP's first bucket (1 MiB), unless cap is less
    indices, _ = dist._compute_bucket_assignment_by_size([p.detach() for p in params], limits,
                                                         [False] * len(params))
    return [list(bucket) for bucket in reversed(indices)]


class LocalSteps:
    """Local steps with a compressed outer step (DiLoCo, arXiv 2311.08105, with PowerSGD on the pseudo-gradients),
    for a model trained WITHOUT DDP: each rank runs `optimizer` (the inner optimizer) on its own data, and every
    `local_steps` inner steps one outer step synchronises the ranks (docs/local-steps.md).

        model = Net()                                   # the same initial model on every rank, or rank 0's:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        outer = powersgd.torch.LocalSteps(model, optimizer, local_steps=4)   # collective: rank 0's parameters
        for x, y in my_shard:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            outer.step()                                # optimizer.step(); every 4th call also the outer step
        outer.outer_step()                              # optionally: end on the synchronised model

    The outer step: the pseudo-gradients (start point minus parameters) are averaged through an engine reducer
    (PowerSGD at matrix_approximation_rank with error feedback on the pseudo-gradients; compression=False: a
    plain averaged allreduce), then v = outer_momentum v + mean, start -= outer_lr (mean + outer_momentum v)
    (PyTorch's SGD(nesterov=True)), and the parameters become the new start point: the same bits on every rank.

    Defaults: outer_lr=1.0, outer_momentum=0.0, i.e. plain model averaging (local SGD), not DiLoCo's 0.7/0.9:
    with an inner SGD with momentum 0.9 at small H, DiLoCo's settings diverged on Fashion-MNIST (wide MLP, H = 4
    and 16, compressed and uncompressed: 10% and 29% accuracy after 2 epochs) while 1.0/0.0 trained (85.2% at
    H = 4 with rank 2, allreduce 86.1%); a steady pseudo-gradient g gets an outer step of outer_lr g /
    (1 - outer_momentum), 7 g for 0.7/0.9, on top of the inner momentum's own gain. DiLoCo pairs 0.7/0.9 with
    AdamW inner steps and H = 500: pass them for that regime (docs/local-steps.md, "The Python wrapper").
    matrix_approximation_rank=4: on a 784-256-10 MLP (examples/torch_local_steps.py, 4 ranks, 2 epochs) rank 2
    lost 14 points at H = 4 (71.5% against 85.9% uncompressed) where rank 4 lost 0.2 (85.7%, 150x fewer bytes
    than averaging every step); one seed decides nothing, but rank 2 is not a safe default.

    Arguments: `model` an nn.Module (its parameters that require gradients) or an iterable of parameters;
    `optimizer` the inner optimizer (anything with step() and zero_grad()); the PowerSGD arguments mean what
    they mean for PowerSGDState, counted in outer steps (start_powerSGD_iter: outer steps before compression;
    0 by default: the pseudo-gradients of the first outer step are compressed); `bucket_cap_mb` DDP's bucket
    size; `process_group` as for PowerSGDState. Bad values are TypeError or ValueError naming the argument and
    the range. Construction is collective (the ranks rendezvous through torch's store: torch.distributed must
    be initialized): rank 0's parameters are copied into every rank's model and become the start point, and
    ranks constructed with other settings fail together (PowerSGDError, PSGD_ERR_MISMATCH).

    Not averaged: buffers (BatchNorm's running statistics) and the inner optimizer's state stay each rank's own.
    Parameters of any floating dtype and device are reduced in float32 (a float64 parameter is rounded at each
    outer step). Call step(), outer_step(), state_dict() and load_state_dict() from one thread on every rank.
    """

    def __init__(self, model, optimizer, local_steps=4, *, outer_lr=1.0, outer_momentum=0.0, compression=True,
                 matrix_approximation_rank=4, start_powerSGD_iter=0, min_compression_rate=2,
                 use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0, random_seed=0,
                 divergence_check_interval=100, bucket_cap_mb=25, process_group=None):
        arguments = dict(locals())
        self._outer = None
        self._reducer = None
        _check_outer(local_steps, outer_lr, outer_momentum)
        if not (hasattr(optimizer, "step") and hasattr(optimizer, "zero_grad")):
            raise TypeError("LocalSteps: optimizer = %r: expected the inner optimizer (a torch.optim optimizer)"
                            % (optimizer,))
        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("LocalSteps: model = %r: expected an nn.Module or an iterable of tensors" % (model,))
        params = [p for p in params if p.requires_grad]
        bad = [tuple(p.shape) for p in params if not p.is_floating_point() or p.is_sparse]
        if not params or bad:
            raise ValueError("LocalSteps: model: expected dense floating-point parameters that require gradients; "
                             "%s" % ("there are none" if not params else "got other tensors of shapes %s" % bad))
        self.local_steps, self.outer_lr, self.outer_momentum = int(local_steps), float(outer_lr), float(outer_momentum)
        self.compression = _pst._bool("compression", compression, "LocalSteps")
        for name in _ENGINE_ARGUMENTS:  # checked by _engine_config
            setattr(self, name, arguments[name])
        config = self._engine_config()
        self.optimizer = optimizer
        self.process_group = process_group
        group = _pst._group_of(process_group)
        self._params = params
        self._buckets = _buckets(params, bucket_cap_mb)
        self.inner_steps = 0  # inner steps taken (step() calls), the count due() is asked about

        comm = _pst._engine_comm(group, _pst._group_timeout(process_group))
        reducer = ctypes.c_void_p()
        status = _capi.lib.psgd_reducer_create(comm, ctypes.byref(config), ctypes.byref(reducer))
        if status != 0:
            raise PowerSGDError(status, _terms(_capi.last_error()))
        self._reducer, self._comm = reducer, comm
        self._flat, self._views = [], []
        for bucket in self._buckets:
            shapes = [tuple(params[i].shape) for i in bucket]
            ndims = (ctypes.c_int * len(shapes))(*[len(s) for s in shapes])
            dims = [d for s in shapes for d in s]
            dims = (ctypes.c_int64 * max(1, len(dims)))(*dims)
            _capi.check(_capi.lib.psgd_reducer_add_bucket(reducer, len(shapes), ndims, dims,
                                                          ctypes.byref(ctypes.c_int(-1))))
            flat = torch.zeros(sum(params[i].numel() for i in bucket), dtype=torch.float32)
            views, offset = [], 0
            for i in bucket:
                views.append((params[i], flat[offset:offset + params[i].numel()]))
                offset += params[i].numel()
            self._flat.append(flat)
            self._views.append(views)
        self._pointers = (ctypes.POINTER(ctypes.c_float) * len(self._flat))(
            *[ctypes.cast(f.data_ptr(), ctypes.POINTER(ctypes.c_float)) for f in self._flat])
        self._gather()
        outer = ctypes.c_void_p()
        status = _capi.lib.psgd_outer_create(comm, reducer, self.local_steps, self.outer_lr, self.outer_momentum,
                                             self._pointers, len(self._flat), ctypes.byref(outer))
        if status != 0:
            raise PowerSGDError(status, _terms(_capi.last_error()))
        self._outer = outer
        self._scatter()  # rank 0's parameters, the start point, on every rank

    def _engine_config(self):
        c = _capi.default_config()
        for argument in ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                         "orthogonalization_epsilon", "random_seed", "divergence_check_interval"):
            _pst._set_field(c, argument, getattr(self, argument), "LocalSteps")
        c.error_feedback = _pst._bool("use_error_feedback", self.use_error_feedback, "LocalSteps")
        c.warm_start = _pst._bool("warm_start", self.warm_start, "LocalSteps")
        if not self.compression:
            c.start_iter = _NEVER
        _pst._validate(c, "LocalSteps")
        return c

    def _gather(self):
        """The parameters into the float32 bucket buffers."""
        with torch.no_grad():
            for views in self._views:
                for param, view in views:
                    view.copy_(param.detach().reshape(-1))

    def _scatter(self):
        """The bucket buffers into the parameters."""
        with torch.no_grad():
            for views in self._views:
                for param, view in views:
                    param.copy_(view.view(param.shape))

    # ---- steps ----

    def step(self, closure=None):
        """optimizer.step(closure) (one inner step), then the outer step when one is due (every local_steps
        inner steps). Returns the inner step's result. Collective every local_steps calls."""
        result = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.inner_steps += 1
        if self.due():
            self.outer_step()
        return result

    def zero_grad(self, set_to_none=False):
        """The inner optimizer's zero_grad."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def due(self):
        """Whether an outer step is due after inner_steps inner steps (a multiple of local_steps > 0)."""
        return _capi.lib.psgd_outer_due(self._handle(), self.inner_steps) == 1

    def outer_step(self):
        """Collective: one outer step now (step() calls it when due; call it yourself to end training on the
        synchronised model). On success the parameters are the new start point, the same bits on every rank. On
        failure (NaN or Inf in any rank's parameters, ranks that disagree, a lost peer, a timeout) every rank
        raises PowerSGDError and the parameters, the start point, the outer momentum and the error memory are as
        they were: fix the cause (e.g. load_start() or a checkpoint) and call outer_step() again."""
        self._gather()
        status = _capi.lib.psgd_outer_step(self._handle(), self._pointers, len(self._flat))
        if status != 0:
            raise PowerSGDError(status, _terms(_capi.last_error()))
        self._scatter()

    def load_start(self):
        """Copies the synchronised start point into the parameters (e.g. after a failed outer step, to drop the
        local steps since the last outer step). Local."""
        for index, flat in enumerate(self._flat):
            _capi.check(_capi.lib.psgd_outer_start(self._handle(), index, ctypes.c_void_p(flat.data_ptr())))
        self._scatter()

    @property
    def outer_steps(self):
        """Successful outer steps."""
        return int(_capi.lib.psgd_outer_steps(self._handle()))

    def bytes_sent(self):
        """Payload bytes this rank passed to collectives for outer steps (the reducer's)."""
        s = _capi.Stats()
        _capi.check(_capi.lib.psgd_reducer_stats(self._reducer, ctypes.byref(s)))
        return s.bytes_sent

    def _handle(self):
        if self._outer is None:
            raise RuntimeError("LocalSteps: closed")
        return self._outer

    # ---- checkpoints ----

    def state_dict(self):
        """This rank's outer state as plain values (torch.save, pickle): inner_steps, the configuration, the
        outer optimizer's state (start point, outer momentum, outer steps; the same on every rank) and this
        rank's reducer checkpoint (its error memory of the pseudo-gradients, warm start, step count). Local (no
        collective). Save it with each rank's model and optimizer state: between outer steps the parameters
        are the rank's own."""
        directory = tempfile.mkdtemp(prefix="powersgd-local-steps-")
        try:
            outer, reducer = os.path.join(directory, "outer.ckpt"), os.path.join(directory, "reducer.ckpt")
            _capi.check(_capi.lib.psgd_outer_save(self._handle(), outer.encode()))
            _capi.check(_capi.lib.psgd_reducer_save(self._reducer, reducer.encode()))
            with open(outer, "rb") as f:
                outer_data = f.read()
            with open(reducer, "rb") as f:
                reducer_data = f.read()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return {"version": VERSION, "inner_steps": self.inner_steps,
                "config": {name: getattr(self, name) for name in _CONFIG},
                "layout": [[tuple(self._params[i].shape) for i in bucket] for bucket in self._buckets],
                "rank": _capi.lib.psgd_comm_rank(self._comm), "world_size": _capi.lib.psgd_comm_size(self._comm),
                "outer": outer_data, "reducer": reducer_data}

    def load_state_dict(self, state_dict):
        """Collective: restores a state_dict() this rank saved (same world size, configuration and model), on
        every rank at once. A refusal on any rank (another version, configuration, layout, rank or world size; a
        damaged checkpoint; ranks holding different outer states) raises on every rank and changes nothing."""
        reason = self._refusal(state_dict)
        directory = tempfile.mkdtemp(prefix="powersgd-local-steps-")
        try:
            backup = os.path.join(directory, "backup.ckpt")
            _capi.check(_capi.lib.psgd_reducer_save(self._reducer, backup.encode()))
            reducer, outer = os.path.join(directory, "reducer.ckpt"), os.path.join(directory, "outer.ckpt")
            if reason is None:
                # Both files first: nothing is loaded before every local step succeeded, and a local failure (a
                # full disk) is a refusal the ranks agree on, not an exception that leaves them waiting.
                try:
                    for path, data in ((reducer, state_dict["reducer"]), (outer, state_dict["outer"])):
                        with open(path, "wb") as f:
                            f.write(data)
                except OSError as e:
                    reason = "cannot write the checkpoint's data to %s: %s" % (directory, e)
            if reason is None and _capi.lib.psgd_reducer_load(self._reducer, reducer.encode()) != 0:
                reason = _terms(_capi.last_error())
            refusing = self._refusing_ranks(reason is not None)
            if refusing:
                _capi.check(_capi.lib.psgd_reducer_load(self._reducer, backup.encode()))
                raise PowerSGDError(4 if reason is None else 1, "LocalSteps.load_state_dict: %s; nothing loaded"
                                    % (reason if reason is not None else "refused on rank(s) %s" % refusing))
            status = _capi.lib.psgd_outer_load(self._handle(), outer.encode())
            if status != 0:
                message = _terms(_capi.last_error())
                _capi.check(_capi.lib.psgd_reducer_load(self._reducer, backup.encode()))
                raise PowerSGDError(status, "LocalSteps.load_state_dict: %s; nothing loaded" % message)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.inner_steps = int(state_dict["inner_steps"])

    def _refusal(self, state_dict):
        """Why this rank cannot load `state_dict`, or None (never an exception: the ranks must reach the
        collective that agrees on it)."""
        try:
            return self._check_state(state_dict)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            return "not a LocalSteps.state_dict(): %s: %s" % (type(e).__name__, e)

    def _check_state(self, state_dict):
        if not isinstance(state_dict, dict) or state_dict.get("version") != VERSION:
            return "expected a LocalSteps.state_dict() of version %d, got %s" % (
                VERSION, "version %r" % state_dict.get("version") if isinstance(state_dict, dict) else repr(state_dict))
        for name in _CONFIG:
            if state_dict["config"].get(name) != getattr(self, name):
                return "the checkpoint has %s = %r, this LocalSteps %r" % (name, state_dict["config"].get(name),
                                                                          getattr(self, name))
        layout = [[tuple(self._params[i].shape) for i in bucket] for bucket in self._buckets]
        if [[tuple(s) for s in bucket] for bucket in state_dict["layout"]] != layout:
            return "the checkpoint's buckets hold parameters of shapes %s, this model's %s" % (state_dict["layout"],
                                                                                             layout)
        # Every field read after the agreement is checked before it (a missing "outer", an inner_steps of "x",
        # were found once the reducer had been loaded: the state changed, and the other ranks waited).
        for key in ("reducer", "outer"):
            if not isinstance(state_dict[key], (bytes, bytearray)):
                return "the checkpoint's %r is %s, expected bytes" % (key, type(state_dict[key]).__name__)
        inner = state_dict["inner_steps"]
        if isinstance(inner, bool) or not isinstance(inner, numbers.Integral) or inner < 0:
            return "the checkpoint's inner_steps = %r: expected an integer >= 0" % (inner,)
        rank, world = _capi.lib.psgd_comm_rank(self._comm), _capi.lib.psgd_comm_size(self._comm)
        if (state_dict["rank"], state_dict["world_size"]) != (rank, world):
            return ("the checkpoint is rank %d's of %d ranks, this is rank %d of %d: each rank loads its own"
                    % (state_dict["rank"], state_dict["world_size"], rank, world))
        return None

    def _refusing_ranks(self, refused):
        """Collective: the ranks that refused (one float per rank, summed over the engine communicator)."""
        world = _capi.lib.psgd_comm_size(self._comm)
        flags = (ctypes.c_float * world)()
        flags[_capi.lib.psgd_comm_rank(self._comm)] = 1.0 if refused else 0.0
        _capi.check(_capi.lib.psgd_comm_allreduce_sum_f32(self._comm, flags, world))
        return [r for r in range(world) if flags[r] != 0]

    def close(self):
        """Frees the engine's outer optimizer and reducer (also done at garbage collection)."""
        if self._outer is not None:
            _capi.lib.psgd_outer_destroy(self._outer)
            self._outer = None
        if self._reducer is not None:
            _capi.lib.psgd_reducer_destroy(self._reducer)
            self._reducer = None

    def __del__(self):
        self.close()
