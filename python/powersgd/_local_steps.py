"""powersgd.torch.LocalSteps: local steps with a PowerSGD-compressed outer step (DiLoCo-style), without DDP.

Over the C API's psgd_outer_* (powersgd::OuterOptimizer, docs/local-steps.md): every `local_steps` inner steps
each rank's pseudo-gradient (start point minus its parameters) is reduced by an engine reducer (PowerSGD with
error feedback on the pseudo-gradients) and applied from the synchronised start point with Nesterov momentum,
the same bits on every rank. The model's parameters are laid out in engine buckets by torch's own size-based
assignment with DDP's limits (bucket_cap_mb, the first bucket 1 MiB; the layout DDP builds at construction,
which it keeps with find_unused_parameters=True, while by default it rebuilds its buckets after the first
iteration in the order the gradients came), in float32 flat buffers the wrapper owns: an outer step copies
the parameters in, runs psgd_outer_step on the buffers and copies the result back only when it succeeded,
so a failed outer step leaves the model as it was.
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


# float's smallest normal and largest finite values (FLT_MIN, FLT_MAX): the engine's bounds of a learning rate.
_FLOAT_MIN, _FLOAT_MAX = 2.0**-126, float.fromhex("0x1.fffffep+127")


def _as_float(value):
    """A double as the engine's static_cast<float> makes it (round to nearest; beyond float's range: inf)."""
    return ctypes.c_float(value).value


def _check_outer(local_steps, outer_lr, outer_momentum):
    """The engine's ranges (OuterConfig::validate, src/engine/outer_optimizer.cpp), checked here with the
    wrapper's names before any collective: the engine computes the step in float, so outer_lr must be a normal
    float (1e39 was an infinite rate, 1e-50 none at all) and outer_momentum below 1 also as a float
    (0.99999999999 is 1.0f); local_steps an int64. Returns (local_steps, outer_lr, outer_momentum) as the engine
    takes them (int, float, float)."""
    if isinstance(local_steps, bool) or not isinstance(local_steps, numbers.Integral):
        raise TypeError("LocalSteps: local_steps = %r: expected an integer >= 1 (inner steps per outer step)"
                        % (local_steps,))
    if not 1 <= local_steps <= 2**63 - 1:
        raise ValueError("LocalSteps: local_steps = %r: expected an integer >= 1 and < 2**63 (inner steps per "
                         "outer step)" % (local_steps,))
    values = {}
    for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError("LocalSteps: %s = %r: expected a number" % (name, value))
        try:
            values[name] = float(value)
        except OverflowError:  # an int or Fraction beyond a double
            values[name] = math.inf if value > 0 else -math.inf
    lr, momentum = values["outer_lr"], values["outer_momentum"]
    if not (math.isfinite(lr) and lr > 0 and _FLOAT_MIN <= _as_float(lr) <= _FLOAT_MAX):
        raise ValueError("LocalSteps: outer_lr = %r: expected a finite learning rate > 0 that float holds (%g to %g)"
                         % (outer_lr, _FLOAT_MIN, _FLOAT_MAX))
    if not (math.isfinite(momentum) and 0 <= momentum < 1 and _as_float(momentum) < 1):
        raise ValueError("LocalSteps: outer_momentum = %r: expected 0 <= outer_momentum < 1 (below 1 also as a "
                         "float)" % (outer_momentum,))
    return int(local_steps), lr, momentum


def _buckets(params, bucket_cap_mb):
    """The parameters' indices per bucket: torch's _compute_bucket_assignment_by_size over the parameters in
    their order, with DDP's limits, the buckets reversed (bucket 0 holds the last parameters). That is the
    layout DDP builds at construction and keeps with find_unused_parameters=True (without static_graph); by
    default DDP rebuilds its buckets after the first iteration in the order the gradients became ready, which
    may differ."""
    if (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real)
            or not (math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0)):
        raise ValueError("LocalSteps: bucket_cap_mb = %r: expected a finite number > 0" % (bucket_cap_mb,))
    cap = min(max(1, int(bucket_cap_mb * 1024 * 1024)), 2**63 - 1)
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
        outer.outer_step()                              # optionally: end on the synchronised model (a
                                                        # no-op where the last step() took an outer step)

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
    size (the buckets are DDP's initial layout, which DDP keeps with find_unused_parameters=True; by default it
    rebuilds them after its first iteration); `process_group` as for PowerSGDState. Bad values are TypeError or
    ValueError naming the argument and the range (the engine's: outer_lr a normal float32, outer_momentum below
    1 also in float32). Construction is collective (the ranks rendezvous through torch's store: torch.distributed must
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
        outer_settings = _check_outer(local_steps, outer_lr, outer_momentum)
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
        self.local_steps, self.outer_lr, self.outer_momentum = outer_settings
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
        self._outer_at = 0    # inner_steps at the last successful outer step (or at construction, or as loaded)

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

    def zero_grad(self, set_to_none=None):
        """The inner optimizer's zero_grad(), given set_to_none only where the caller gives it (an optimizer's own
        zero_grad(self) takes none; torch's has its own default)."""
        if set_to_none is None:
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def due(self):
        """Whether an outer step is due after inner_steps inner steps (a multiple of local_steps > 0)."""
        return _capi.lib.psgd_outer_due(self._handle(), self.inner_steps) == 1

    def outer_step(self):
        """Collective: one outer step now (step() calls it when due; call it yourself to end training on the
        synchronised model). On success the parameters are the new start point, the same bits on every rank. On
        failure (NaN or Inf in any rank's parameters, ranks that disagree, a lost peer, a timeout) every rank
        raises PowerSGDError and the parameters, the start point, the outer momentum and the error memory are as
        they were: fix the cause (e.g. load_start() or a checkpoint) and call outer_step() again.

        A no-op, with no collective, where no inner step was counted since the last successful outer step
        (inner_steps unchanged since then, or since construction or load_state_dict(): the same on every rank),
        e.g. after a loop whose last step() took a due outer step: the parameters are the start point, and
        another outer step would still apply the error memory and the outer momentum. Inner steps are counted
        by step(); a loop that calls optimizer.step() itself adds them to inner_steps. Returns whether an outer
        step ran."""
        handle = self._handle()
        if self.inner_steps == self._outer_at:
            return False
        self._gather()
        status = _capi.lib.psgd_outer_step(handle, self._pointers, len(self._flat))
        if status != 0:
            raise PowerSGDError(status, _terms(_capi.last_error()))
        self._scatter()
        self._outer_at = self.inner_steps
        return True

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
        """This rank's outer state as plain values (torch.save, pickle): inner_steps (and outer_at, the
        inner_steps of the last outer step), the configuration, the outer optimizer's state (start point, outer
        momentum, outer steps; the same on every rank) and this rank's reducer checkpoint (its error memory of the
        pseudo-gradients, warm start, step count). Local (no collective). Save it with each rank's model and
        optimizer state: between outer steps the parameters are the rank's own."""
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
        return {"version": VERSION, "inner_steps": self.inner_steps, "outer_at": self._outer_at,
                "config": {name: getattr(self, name) for name in _CONFIG},
                "layout": [[tuple(self._params[i].shape) for i in bucket] for bucket in self._buckets],
                "rank": _capi.lib.psgd_comm_rank(self._comm), "world_size": _capi.lib.psgd_comm_size(self._comm),
                "outer": outer_data, "reducer": reducer_data}

    def load_state_dict(self, state_dict):
        """Collective: restores a state_dict() this rank saved (same world size, configuration and model), on
        every rank at once. A refusal on any rank (another version, configuration, layout, rank or world size; a
        damaged checkpoint; a local failure such as a full temporary directory; ranks holding different outer
        states) raises PowerSGDError on every rank and changes nothing."""
        reason = self._refusal(state_dict)
        directory, backup, loaded = None, None, False
        try:
            # Every local step before the agreement: a failure here (a full temporary directory, the backup's save)
            # is this rank's refusal, which the ranks agree on, never an exception that leaves them waiting in it.
            try:
                directory = tempfile.mkdtemp(prefix="powersgd-local-steps-")
                path = os.path.join(directory, "backup.ckpt")
                _capi.check(_capi.lib.psgd_reducer_save(self._reducer, path.encode()))
                backup = path
                reducer, outer = os.path.join(directory, "reducer.ckpt"), os.path.join(directory, "outer.ckpt")
                if reason is None:
                    # Both files first: nothing is loaded before every local step succeeded.
                    for target, data in ((reducer, state_dict["reducer"]), (outer, state_dict["outer"])):
                        with open(target, "wb") as f:
                            f.write(data)
            except Exception as e:  # every local failure: the agreement below must be reached
                if reason is None:
                    reason = "this rank could not prepare the load (%s: %s)" % (type(e).__name__, e)
            if reason is None:
                if _capi.lib.psgd_reducer_load(self._reducer, reducer.encode()) != 0:
                    reason = _terms(_capi.last_error())
                else:
                    loaded = True
            try:
                refusing = self._refusing_ranks(reason is not None)
                if refusing:
                    raise PowerSGDError(4 if reason is None else 1, "LocalSteps.load_state_dict: %s; nothing loaded"
                                        % (reason if reason is not None else "refused on rank(s) %s" % refusing))
                status = _capi.lib.psgd_outer_load(self._handle(), outer.encode())
                if status != 0:
                    raise PowerSGDError(status, "LocalSteps.load_state_dict: %s; nothing loaded"
                                        % _terms(_capi.last_error()))
            except BaseException:
                if loaded:  # this rank's reducer took the checkpoint: back to its state before
                    _capi.check(_capi.lib.psgd_reducer_load(self._reducer, backup.encode()))
                raise
        finally:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        self.inner_steps = int(state_dict["inner_steps"])
        self._outer_at = self._loaded_outer_at(state_dict)

    def _loaded_outer_at(self, state_dict):
        """The inner_steps of the last outer step a state_dict says (a dict without "outer_at": the last multiple
        of local_steps, where step() took it)."""
        if "outer_at" in state_dict:
            return int(state_dict["outer_at"])
        inner = int(state_dict["inner_steps"])
        return inner - inner % self.local_steps

    def _refusal(self, state_dict):
        """Why this rank cannot load `state_dict`, or None (never an exception: the ranks must reach the
        collective that agrees on it)."""
        if self._outer is None or self._reducer is None:
            return "this LocalSteps is closed"
        try:
            return self._check_state(state_dict)
        except Exception as e:  # whatever a mangled dict raises (a tensor compared, a missing key)
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
        for key in ("inner_steps", "outer_at") if "outer_at" in state_dict else ("inner_steps",):
            value = state_dict[key]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                return "the checkpoint's %s = %r: expected an integer >= 0" % (key, value)
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
