"""torch.distributed's store as the engine's rendezvous store (psgd_comm_init_on_store, powersgd.h).

The engine's communicator rendezvouses through the store of torch's default process group (TCPStore,
FileStore, whatever init_process_group made), under the key prefix KEY_PREFIX: no second store, port or
launcher variable. The callbacks run on the thread that creates the communicator, during that call
(ctypes takes the GIL for them).
"""
import ctypes
import datetime
import os
import socket

import torch.distributed as dist

from powersgd import _capi

KEY_PREFIX = "powersgd"

_OK, _INVALID_ARGUMENT, _IO, _TIMEOUT, _INTERNAL = 0, 1, 2, 3, 7

_ERROR = (ctypes.c_void_p, ctypes.c_size_t)  # the library's buffer for a reason
_SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, *_ERROR)
_GET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p, *_ERROR)
_ADD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64,
                        ctypes.POINTER(ctypes.c_int64), *_ERROR)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
                         ctypes.c_int64, *_ERROR)
_REMOVE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), *_ERROR)


class Callbacks(ctypes.Structure):
    """psgd_store_callbacks."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("user", ctypes.c_void_p), ("set", _SET), ("get", _GET),
                ("add", _ADD), ("wait", _WAIT), ("remove", _REMOVE)]


def _failure(error, error_size, exception):
    """The status for a torch store exception; its message into the library's error buffer."""
    text = ("%s: %s" % (type(exception).__name__, exception)).encode("utf-8", "replace")[:max(0, error_size - 1)]
    ctypes.memmove(error, text + b"\0", len(text) + 1)
    message = str(exception).lower()
    if "timeout" in message or "timed out" in message:
        return _TIMEOUT
    if isinstance(exception, (ValueError, TypeError)):
        return _INVALID_ARGUMENT
    return _IO if isinstance(exception, (RuntimeError, OSError)) else _INTERNAL


def _guarded(store, function):
    """A callback body: any exception becomes a status and a reason, never an exception through C (ctypes
    would print it and hand the library an undefined status). KeyboardInterrupt, SystemExit and the like fail
    the call too and are kept on `store`, for init_comm to raise once the library returned (a Ctrl-C during the
    rendezvous is the user's, not a store error)."""
    def callback(*args):
        try:
            return function(*args[:-2])
        except Exception as e:
            return _failure(args[-2], args[-1], e)
        except BaseException as e:  # noqa: B902 (every exception: none may cross into the library)
            if store.interrupted is None:
                store.interrupted = e
            return _failure(args[-2], args[-1], e)
    return callback


def _milliseconds(timeout_ms):
    # torch's wait() takes a timedelta; 0 means "check once": the shortest wait torch offers.
    return datetime.timedelta(milliseconds=max(1, timeout_ms))


class TorchStore:
    """A torch.distributed Store under KEY_PREFIX, as psgd_store_callbacks. Keep the object alive while the
    library may call it (the creation of a communicator)."""

    def __init__(self, store):
        self.store = dist.PrefixStore(KEY_PREFIX, store)
        self.interrupted = None  # the first KeyboardInterrupt (or other BaseException) a callback caught
        self.callbacks = Callbacks(ctypes.sizeof(Callbacks), None, _SET(_guarded(self, self._set)),
                                   _GET(_guarded(self, self._get)), _ADD(_guarded(self, self._add)),
                                   _WAIT(_guarded(self, self._wait)), _REMOVE(_guarded(self, self._remove)))

    def _set(self, user, key, data, size):
        self.store.set(key.decode(), ctypes.string_at(data, size) if size else b"")
        return _OK

    def _get(self, user, key, timeout_ms, value):
        name = key.decode()
        self.store.wait([name], _milliseconds(timeout_ms))
        data = self.store.get(name)
        return _capi.lib.psgd_store_value_set(value, data, len(data))

    def _add(self, user, key, delta, result):
        result[0] = self.store.add(key.decode(), delta)
        return _OK

    def _wait(self, user, keys, count, timeout_ms):
        self.store.wait([keys[i].decode() for i in range(count)], _milliseconds(timeout_ms))
        return _OK

    def _remove(self, user, key, existed):
        existed[0] = int(self.store.delete_key(key.decode()))
        return _OK


def address_towards(host):
    """This host's address on the route to `host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def local_address(store):
    """The address the engine's TCP transport binds to, unless PSGD_IFACE or PSGD_ADDR says: the one facing
    torch's TCPStore (or MASTER_ADDR), as torch's own Gloo would reach the other ranks; loopback for a store
    that is not a TCPStore and no MASTER_ADDR (a FileStore on one host)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host = store.host if isinstance(store, dist.TCPStore) else os.environ.get("MASTER_ADDR")
    return address_towards(host) if host else "127.0.0.1"


def init_comm(rank, size, group_id):
    """Collective over the members: psgd_comm_init_on_store on torch's default store (group_id None: the
    whole job). Returns the psgd_comm handle."""
    store = dist.distributed_c10d._get_default_store()
    adapter = TorchStore(store)
    handle = ctypes.c_void_p()
    status = _capi.lib.psgd_comm_init_on_store(rank, size, group_id.encode() if group_id else None,
                                               ctypes.byref(adapter.callbacks), local_address(store).encode(),
                                               ctypes.byref(handle))
    if adapter.interrupted is not None:
        if status == 0:
            _capi.lib.psgd_comm_destroy(handle)
        raise adapter.interrupted
    _capi.check(status)
    return handle
