"""Checkpoints of powersgd.torch.PowerSGDState: state_dict() / load_state_dict() and pickling (docs/torch.md,
"Checkpoints").

A state_dict holds plain values only (ints, floats, bytes, dicts, tuples): iter, next_stats_report, the
configuration, the group's members (None: the whole job), and once the hook has declared DDP's buckets to the
engine, under "engine":
- the declared layout (bucket index -> gradient shapes), the declared buckets' parameters as keys (a
  parameter's place in DDP's buckets of a process's first iteration, which DDP computes from the model alone),
  the order the buckets were reduced in, the iteration of the declaration and which hook declared them;
- "rank_data": this rank's own checkpoint (psgd_reducer_save: its own error memory, warm start, step count),
  with "rank" and "world_size". Local: state_dict() issues no collective.
- "job", in job_state_dict()'s only (collective): the engine's job checkpoint (psgd_reducer_save_job: the mean
  error memory over the ranks, warm start, step count), the same bytes on every rank.
Before the declaration, "layout" holds DDP's final layout when this process has seen it (the same three
entries), so that a process resumed shortly before compression starts declares it at once.

Loading (the choice agreed by one allreduce): every rank holds its own rank's data from a group of the same
size -> each loads its own (bitwise the uninterrupted run on the same placement: host staging's sums follow
it); else every rank holds a job checkpoint -> the mean error memory (psgd_reducer_load_job); else -> the
data's shared state, error memory zero (psgd_reducer_load_shared: rank 0's file on every rank). The same
allreduce says which ranks refused the dict (checked before it): then every rank raises, nothing loaded.

Resuming: DDP rebuilds its buckets after its first iteration (the second with static_graph), so a fresh DDP's
buckets differ from the declared ones for up to DECLARATION_ITER iterations. The engine's per-bucket state
follows the declared buckets; so in those iterations the hook collects the iteration's buckets, copies every
gradient into its place in the declared buckets (by parameter key), reduces those through the engine at the
iteration's last bucket, copies the results back and completes the futures. From iteration DECLARATION_ITER
of the process on, DDP's buckets must be the declared ones (checked) and the hook reduces them directly.
"""
import ctypes
import numbers
import os
import shutil
import tempfile

import torch

from powersgd import _capi
from powersgd._capi import PowerSGDError

# The configuration a state_dict carries: PowerSGDState's attributes of the same names.
CONFIG_FIELDS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback",
                 "warm_start", "orthogonalization_epsilon", "random_seed", "compression_stats_logging_frequency",
                 "batch_tensors_with_same_shape", "adaptive", "rank_low", "rank_high", "adaptive_interval",
                 "adaptive_threshold", "alternating", "warmup_steps", "lr_boost_steps", "wire_dtype",
                 "divergence_check_interval")
# CONFIG_FIELDS added since VERSION 1's first release, with the value a dict without them meant.
_ADDED_FIELDS = {"divergence_check_interval": 100}
VERSION = 2
# The first iteration of a process in which DDP's bucket layout is known final (powersgd.torch.DECLARATION_ITER):
# DDP may rebuild its buckets before iteration 1 (2 with static_graph), so the layout seen in iteration 2 is final.
DECLARATION_ITER = 3
# Version 1 (before issue 30) always held "job"; it loads as a job_state_dict().
READABLE_VERSIONS = (1, 2)
IO = 2
MISMATCH = 4


def record_keys(state, bucket, index):
    """Before the declaration (and in a resumed process's first iterations): names this bucket's parameters.
    In the process's first iteration every parameter gets the next key, in DDP's call order (bucket index
    order, then the bucket's own order)."""
    pointers = [p.data_ptr() for p in bucket.parameters()]
    if state._local_iter == 0:
        for pointer in pointers:
            state._param_keys.setdefault(pointer, len(state._param_keys))
    state._layout_keys[index] = tuple(state._param_keys.get(pointer, -1) for pointer in pointers)
    state._order.append(index)


def _temporary_dir():
    return tempfile.mkdtemp(prefix="powersgd-checkpoint-")


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


_NO_DATA = 2**64 - 1  # the size _broadcast_bytes sends for rank 0's None


def _broadcast_bytes(comm, data):
    """Collective: rank 0's `data` (bytes, or None where it has none: then None on every rank) on every rank
    of the engine communicator."""
    size = ctypes.c_uint64(len(data) if data is not None else _NO_DATA)
    _capi.check(_capi.lib.psgd_comm_broadcast(comm, ctypes.byref(size), ctypes.sizeof(size), 0))
    if size.value == _NO_DATA:
        return None
    buffer = ctypes.create_string_buffer(data if data is not None else b"", size.value)
    _capi.check(_capi.lib.psgd_comm_broadcast(comm, buffer, size.value, 0))
    return buffer.raw[:size.value]


def _layout_entry(state):
    """DDP's final layout as this process saw it (before any declaration), or None where it has not."""
    if state._local_iter >= DECLARATION_ITER:
        return {"declared": dict(state._previous_layout), "declared_keys": dict(state._previous_layout_keys),
                "declared_order": tuple(state._previous_order)}
    return state._restored_layout


def state_dict(state, job=False):
    if state._layout:
        raise RuntimeError("PowerSGDState.%s() inside an iteration (%d of DDP's buckets reduced): call it between "
                           "iterations, e.g. after optimizer.step()" % ("job_state_dict" if job else "state_dict",
                                                                        len(state._layout)))
    if state._failure is not None:
        raise state._failure
    result = {"version": VERSION, "iter": state.iter, "next_stats_report": state.next_stats_report,
              "config": {name: getattr(state, name) for name in CONFIG_FIELDS}, "engine": None,
              "note_pending": bool(state._note_pending),
              "group": None if state._group is None else tuple(state._group.members)}
    if state._reducer is not None:
        comm = state._comm
        rank, world = _capi.lib.psgd_comm_rank(comm), _capi.lib.psgd_comm_size(comm)
        directory = None
        try:
            # Local work first; a job checkpoint's collectives follow on every rank whatever failed here (a full
            # temporary directory, an unreadable file), so that no rank waits for one that raised before them,
            # and every rank fails alike: a null path makes save_job refuse on every rank.
            local_error = None
            try:
                directory = _temporary_dir()
                own = os.path.join(directory, "rank.ckpt")
                _capi.check(_capi.lib.psgd_reducer_save(state._reducer, own.encode()))
                rank_data = _read(own)
            except Exception as e:
                if not job:
                    raise
                local_error = e
            if job:
                path = os.path.join(directory, "job.ckpt") if local_error is None else None
                status = _capi.lib.psgd_reducer_save_job(state._reducer, path.encode() if path else None)
                if local_error is not None:
                    raise local_error
                _capi.check(status)
                job_data = None
                if rank == 0:
                    try:
                        job_data = _read(path)
                    except OSError as e:
                        local_error = e
                job_data = _broadcast_bytes(comm, job_data)
                if local_error is not None:
                    raise local_error
                if job_data is None:
                    raise PowerSGDError(IO, "job_state_dict: rank 0 could not read the job checkpoint it wrote "
                                        "(its own error says why)")
        finally:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        result["engine"] = {"declared": dict(state._declared), "declared_keys": dict(state._declared_keys),
                            "declared_order": tuple(state._declared_order), "declared_at": state._declared_at,
                            "whole_bucket": bool(state._whole_bucket), "rank": rank, "world_size": world,
                            "rank_data": rank_data}
        if job:
            result["engine"]["job"] = job_data
    elif state._restored is not None:
        result["engine"] = state._restored  # loaded, not applied yet: passed on as it came
        if job and "job" not in state._restored:
            raise RuntimeError("PowerSGDState.job_state_dict(): the state loaded from a state_dict() is not applied "
                               "yet (it is at the next compressed iteration's first bucket); take the job "
                               "checkpoint after one iteration")
    else:
        result["layout"] = _layout_entry(state)
    return result


def load_state_dict(state, loaded):
    """Nothing of `state` changes unless the whole load succeeds: every field is read and checked, and the engine's
    state loaded (where its reducer exists), before any attribute is assigned.

    Where the engine reducer exists the load is collective (_load_engine's agreement), and every rank joins that
    agreement whatever it found wrong here (a mangled dict, one saved before the declaration, other buckets): it
    then refuses, and every rank raises at once with nothing loaded. A rank that raised before the agreement
    left the others waiting in it for the whole timeout, and the communicator broken."""
    if state._layout:
        raise RuntimeError("PowerSGDState.load_state_dict() inside an iteration: call it between iterations")
    previous = {name: getattr(state, name, None) for name in CONFIG_FIELDS}
    refusal = engine = None
    try:
        config, counters, engine = _checked(state, loaded)
        for name, value in config.items():
            setattr(state, name, value)
        state._engine_config(whole_bucket=False)  # every field checked again, as at construction
    except Exception as e:
        for name, value in previous.items():
            setattr(state, name, value)
        if state._reducer is None:
            raise  # no collective to join: this rank alone
        refusal = e
    if state._reducer is not None:
        try:
            _load_engine(state, state._comm, engine, refusal)  # refused anywhere: the engine's state as it was
        except BaseException:
            for name, value in previous.items():
                setattr(state, name, value)
            raise
    state.iter, state.next_stats_report = counters
    # A note_lr_change() made before the engine reducer existed (after it, the engine's checkpoint has it).
    state._note_pending = bool(loaded.get("note_pending", False))
    state._agreed = False  # compared over the group again at the next hook call
    state._restored = None
    state._restored_layout = loaded.get("layout") if engine is None else None
    if engine is None:
        return
    if state._reducer is not None:
        state._declared_keys = dict(engine["declared_keys"])
        state._declared_order = tuple(engine["declared_order"])
        state._declared_at = engine["declared_at"]
    else:
        state._restored = engine


def _checked(state, loaded):
    """The configuration to take, (iter, next_stats_report) and the engine entry (or None) of `loaded`, every
    field that a load reads checked: ValueError or PowerSGDError saying why not. Local."""
    if not isinstance(loaded, dict) or loaded.get("version") not in READABLE_VERSIONS:
        raise ValueError("PowerSGDState.load_state_dict: expected a dict from PowerSGDState.state_dict() (version "
                         "%d), got %s" % (VERSION, type(loaded).__name__ if not isinstance(loaded, dict)
                                          else "version %r" % (loaded.get("version"),)))
    try:
        config = {name: loaded["config"][name] if name in loaded["config"] else _ADDED_FIELDS[name]
                  for name in CONFIG_FIELDS}
        counters = int(loaded["iter"]), int(loaded["next_stats_report"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError("PowerSGDState.load_state_dict: the dict lacks or mangles %s: expected a dict from "
                         "PowerSGDState.state_dict()" % (e,)) from None
    engine = loaded.get("engine")
    if engine is None and state._reducer is not None:
        # Its buckets were never declared: the running engine's error memory and warm start would stay, and the
        # run would not be the one the dict continues.
        raise PowerSGDError(MISMATCH, "load_state_dict: the checkpoint was saved before the first compressed "
                            "iteration (it holds no engine state), and this state's engine already runs from "
                            "iteration %d: load it into a new PowerSGDState" % (state._declared_at,))
    if engine is not None:
        _check_engine(engine)
    if engine is not None and state._reducer is not None:
        # The running engine keeps the configuration it was made with, and its load compares the fields in use
        # with the checkpoint's engine data (those it lets differ, e.g. wire_dtype, stay the running ones): the
        # attributes, which made that engine, stay as they are. Assigned from the dict, they and the engine
        # went apart, and a later state_dict() was one no process could load.
        config = {name: getattr(state, name) for name in CONFIG_FIELDS}
        if engine["declared"] != state._declared or bool(engine["whole_bucket"]) != bool(state._whole_bucket):
            raise PowerSGDError(MISMATCH, "load_state_dict: the checkpoint's buckets %s (%s) are not the ones "
                                "this state declared, %s (%s)" % (engine["declared"], _hook_name(engine),
                                                                  state._declared, state._hook_name(
                                                                      state._whole_bucket)))
    return config, counters, engine


def _check_engine(engine):
    """The engine entry's fields that a load reads, checked before anything is loaded (a mangled entry raised
    KeyError half-way, with the engine loaded or the other ranks waiting in the agreement)."""
    def refuse(what):
        raise ValueError("PowerSGDState.load_state_dict: the dict's engine state %s: expected a dict from "
                         "PowerSGDState.state_dict()" % what)
    if not isinstance(engine, dict):
        refuse("is %s" % type(engine).__name__)
    missing = [key for key in ("declared", "declared_keys", "declared_order", "declared_at", "whole_bucket")
               if key not in engine]
    if missing:
        refuse("lacks %s" % ", ".join(map(repr, missing)))
    if not all(isinstance(engine[key], dict) for key in ("declared", "declared_keys")):
        refuse("has declared %r, declared_keys %r" % (type(engine["declared"]).__name__,
                                                      type(engine["declared_keys"]).__name__))
    if not isinstance(engine["declared_order"], (tuple, list)) or not _integer(engine["declared_at"]):
        refuse("has declared_order %r, declared_at %r" % (engine["declared_order"], engine["declared_at"]))
    for key in ("rank_data", "job"):
        if engine.get(key) is not None and not isinstance(engine[key], (bytes, bytearray)):
            refuse("has %s of type %s, expected bytes" % (key, type(engine[key]).__name__))
    if engine.get("rank_data") is None and engine.get("job") is None:
        refuse("holds neither rank_data nor job")
    if engine.get("rank_data") is not None and not all(_integer(engine.get(key)) for key in ("rank", "world_size")):
        refuse("has rank %r, world_size %r" % (engine.get("rank"), engine.get("world_size")))


def _integer(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _hook_name(engine):
    return "batched_powerSGD_hook" if engine["whole_bucket"] else "powerSGD_hook"


def _load_engine(state, comm, engine, refusal=None):
    """Collective: the engine's state from the checkpoint: every rank's own data where every rank has it (same
    group size, its own rank's): bitwise the saved run (on the same placement); else the job checkpoint where
    every rank has one (the ranks' mean error memory); else the data's shared state with error memory zero (one
    rank's state_dict() on every rank: another rank's error memory is not this rank's own residual, and the same
    one on W ranks would add it W times), where every rank has data of its own to take it from. The choice is
    agreed by one allreduce, which also says which ranks refused (`refusal`: this rank's reason, an exception;
    `engine` is then not read; a failure writing the data to a temporary file is a refusal too): then every
    rank raises, nothing loaded (the refusing ranks their own reason); so does a choice some rank cannot make
    (a rank with a job checkpoint only, where not every rank has one)."""
    rank, world = _capi.lib.psgd_comm_rank(comm), _capi.lib.psgd_comm_size(comm)
    directory, paths = None, {}
    try:
        if refusal is None:
            try:  # before the agreement: a full temporary directory is this rank's refusal, agreed on
                directory = _temporary_dir()
                for key in ("rank_data", "job"):
                    if engine.get(key) is not None:
                        paths[key] = os.path.join(directory, key + ".ckpt")
                        _write(paths[key], engine[key])
            except OSError as e:
                refusal = PowerSGDError(IO, "load_state_dict: cannot write the checkpoint's engine data to a "
                                        "temporary file: %s; nothing loaded" % (e,))
        has_own_data = refusal is None and "rank_data" in paths
        own = has_own_data and engine["rank"] == rank and engine["world_size"] == world
        job = refusal is None and "job" in paths
        flags = (ctypes.c_float * (3 + world))(1.0 if own else 0.0, 1.0 if job else 0.0,
                                               1.0 if has_own_data else 0.0)
        flags[3 + rank] = 0.0 if refusal is None else 1.0
        _capi.check(_capi.lib.psgd_comm_allreduce_sum_f32(comm, flags, 3 + world))
        refusing = [r for r in range(world) if flags[3 + r] != 0]
        if refusal is not None:
            raise refusal
        if refusing:
            raise PowerSGDError(MISMATCH, "load_state_dict: refused on rank(s) %s (their own errors say why); "
                                "nothing loaded" % refusing)
        kind = "rank" if flags[0] == world else "job" if flags[1] == world else "shared" if flags[2] == world \
            else None
        if kind is None:  # the same on every rank: the flags are summed
            raise PowerSGDError(MISMATCH, "load_state_dict: some ranks' dicts hold a job checkpoint only, and not "
                                "every rank's holds one (nor data of its own to load the shared state from); "
                                "nothing loaded")
        load = {"rank": _capi.lib.psgd_reducer_load, "job": _capi.lib.psgd_reducer_load_job,
                "shared": _capi.lib.psgd_reducer_load_shared}[kind]
        _capi.check(load(state._reducer, paths["job" if kind == "job" else "rank_data"].encode()))
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    state._resumed_from = kind


def declare_restored(state, whole_bucket):
    """Collective, at the first bucket of an iteration: the engine reducer for the checkpoint's buckets, with
    the checkpoint's state. A failure becomes the state's failure (every later bucket fails with it)."""
    engine = state._restored
    state._restored = None
    try:
        if bool(engine["whole_bucket"]) != bool(whole_bucket):
            raise PowerSGDError(MISMATCH, "the checkpoint was saved by %s; this state now serves %s"
                                % (_hook_name(engine), state._hook_name(whole_bucket)))
        declared = dict(engine["declared"])
        state._create_reducer(declared, whole_bucket, engine["declared_at"])
        _load_engine(state, state._comm, engine)
    except PowerSGDError as e:
        state._failure = e
        return
    state._declared = declared
    state._whole_bucket = whole_bucket
    state._declared_keys = dict(engine["declared_keys"])
    state._declared_order = tuple(engine["declared_order"])
    state._declared_at = engine["declared_at"]
    state._after_declare()


def defer(state, bucket, buffer, final, prepare):
    """A bucket of an iteration whose layout may not be the declared one yet: kept until the iteration's last
    bucket; there prepare() (which declares the buckets where needed), then the iteration is reduced through
    the declared buckets (_reduce_deferred). `final`: DDP's layout of this iteration is final (it must be the
    declared one)."""
    future = torch.futures.Future()
    if state._failure is not None:
        future.set_exception(state._failure)
    else:
        state._deferred.append((future, buffer, bucket.parameters(), bucket.gradients()))
    if bucket.is_last():
        deferred, state._deferred = state._deferred, []
        try:
            if state._failure is None:
                prepare()
            if state._failure is None:
                _reduce_deferred(state, deferred, final)
        except Exception as error:
            # Whatever else fails here (an attribute the engine refuses at the declaration, memory) is the state's
            # failure, as in the hook (torch.py, _hook): every deferred future completes, or backward waits forever.
            if state._failure is None:
                state._failure = error
        for item in deferred:
            if not item[0].done():
                item[0].set_exception(state._failure)
    return future.then(lambda done: done.value())


def _reduce_deferred(state, deferred, final):
    gradients = {}
    for _, _, parameters, views in deferred:
        for parameter, view in zip(parameters, views):
            gradients[state._param_keys.get(parameter.data_ptr(), -1)] = view
    sticky = True  # a layout that does not match; not a failed step (NaN, a timeout), as in the direct path
    # The first reduction the engine failed: the step's other buckets still go (the engine closes a step once
    # every bucket came; the next iteration's first was refused as "already reduced"), then every future fails.
    failed_step = None
    try:
        for index in state._declared_order:
            keys = state._declared_keys[index]
            missing = [key for key in keys if key not in gradients]
            if missing or len(gradients) != sum(len(k) for k in state._declared_keys.values()):
                raise PowerSGDError(MISMATCH, "DDP's buckets of this iteration hold other parameters than the "
                                    "checkpoint's declared buckets (bucket %d's parameters %s not found among %s): "
                                    "resume the same model with the same DDP options" % (index, missing,
                                                                                         sorted(gradients)))
            shapes = [tuple(gradients[key].shape) for key in keys]
            if shapes != [tuple(shape) for shape in state._declared[index]]:
                raise PowerSGDError(MISMATCH, "DDP's parameters of declared bucket %d have the shapes %s, declared "
                                    "%s: resume the same model with the same DDP options" % (
                                        index, shapes, list(state._declared[index])))
            work = torch.cat([gradients[key].reshape(-1).to(torch.float32) for key in keys])
            handle = ctypes.c_void_p()
            _capi.check(_capi.lib.psgd_reducer_reduce_async_n(state._reducer, index, work.data_ptr(), work.numel(),
                                                              ctypes.byref(handle)))
            status = _capi.lib.psgd_reduce_handle_wait(handle)
            message = _capi.last_error() if status != 0 else ""
            _capi.lib.psgd_reduce_handle_free(handle)
            if status != 0:
                failed_step = failed_step or PowerSGDError(status, message)
                continue
            offset = 0
            for key in keys:
                view = gradients[key]
                view.copy_(work[offset:offset + view.numel()].view(view.shape))
                offset += view.numel()
        if final and state._layout_keys != state._declared_keys:
            # DDP's layout is final from here on: it must be the declared one, parameters included.
            raise PowerSGDError(MISMATCH, "DDP's buckets after its rebuild, %s, are not the checkpoint's "
                                "declared buckets %s: resume the same model with the same DDP options"
                                % (state._layout_keys, state._declared_keys))
        if failed_step is not None:
            sticky = False
            raise failed_step
    except PowerSGDError as e:
        # A step the engine failed fails this iteration only (NaN or Inf: the engine changed nothing, and the
        # step is skipped, as AMP's GradScaler does; a broken group fails every later step by itself).
        if sticky:
            state._failure = e
        for future, _, _, _ in deferred:
            future.set_exception(e)
        return
    for future, buffer, _, _ in deferred:
        future.set_result(buffer)
