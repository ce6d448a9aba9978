"""ctypes binding of the C API (include/powersgd/powersgd.h): the one place that mirrors its types.

Only what the Python package uses is bound. Every call that returns a psgd_status goes through check(),
which turns a failure into PowerSGDError carrying the status and psgd_last_error()'s message.
"""
import ctypes
import os

from powersgd import _library

# psgd_status values (powersgd.h).
STATUS_NAMES = {
    0: "PSGD_OK",
    1: "PSGD_ERR_INVALID_ARGUMENT",
    2: "PSGD_ERR_IO",
    3: "PSGD_ERR_TIMEOUT",
    4: "PSGD_ERR_MISMATCH",
    5: "PSGD_ERR_NONFINITE",
    6: "PSGD_ERR_UNSUPPORTED",
    7: "PSGD_ERR_INTERNAL",
}


class PowerSGDError(RuntimeError):
    """A failed C API call: `status` is the psgd_status name, the message is the library's."""

    def __init__(self, status, message):
        self.status = STATUS_NAMES.get(status, "status %d" % status)
        self._arguments = (status, message)
        super().__init__("powersgd: %s: %s" % (self.status, message))

    def __reduce__(self):
        # Pickled as its arguments (multiprocessing, an error sent between processes): the default passes
        # the formatted message alone, which __init__ cannot take.
        return type(self), self._arguments


class Config(ctypes.Structure):
    """psgd_config, field for field. Obtain it only from default_config() (psgd_config_init with this
    struct's ctypes.sizeof) and set fields by name, so a field added to the C struct is one line here."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),  # set by psgd_config_init to ctypes.sizeof(Config); the library checks it
        ("rank", ctypes.c_int),
        ("start_iter", ctypes.c_int64),
        ("min_compression_rate", ctypes.c_double),
        ("error_feedback", ctypes.c_int),
        ("warm_start", ctypes.c_int),
        ("orthogonalization_epsilon", ctypes.c_double),
        ("seed", ctypes.c_uint64),
        ("batch_same_shape", ctypes.c_int),
        ("whole_bucket", ctypes.c_int),
        ("device", ctypes.c_int),
        ("device_index", ctypes.c_int),
        ("adaptive", ctypes.c_int),
        ("rank_low", ctypes.c_int),
        ("rank_high", ctypes.c_int),
        ("adaptive_interval", ctypes.c_int64),
        ("adaptive_threshold", ctypes.c_double),
        ("alternating", ctypes.c_int),
        ("divergence_check_interval", ctypes.c_int64),  # appended in 0.2 as well
        ("warmup_steps", ctypes.c_int64),  # issue 19: the rank policy
        ("lr_boost_steps", ctypes.c_int64),
        ("wire_dtype", ctypes.c_int),  # appended (issue 20): WIRE_DTYPES' values
    ]


# psgd_config.wire_dtype: PSGD_WIRE_F32, PSGD_WIRE_BF16, PSGD_WIRE_FP16.
WIRE_DTYPES = {"f32": 0, "bf16": 1, "fp16": 2}


class Stats(ctypes.Structure):
    """psgd_stats."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),  # must be set before psgd_reducer_stats (see __init__)
        ("numel_before", ctypes.c_uint64),
        ("numel_after", ctypes.c_uint64),
        ("compression_rate", ctypes.c_double),
        ("bytes_sent", ctypes.c_uint64),
        ("relative_error", ctypes.c_double),
        ("last_step_bytes", ctypes.c_uint64),
    ]

    def __init__(self):
        super().__init__()
        self.struct_size = ctypes.sizeof(Stats)


def _load():
    # Relative to this package (python/powersgd/_library.py.in): the same code serves the build tree, a
    # `meson install` under any prefix or DESTDIR, and a wheel, with no PYTHONPATH or LD_LIBRARY_PATH.
    path = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), _library.RELATIVE_PATH))
    if not os.path.exists(path):
        raise ImportError(
            "powersgd: the C library %s does not exist (this package looks for it at %s, relative to its "
            "directory); build it (ninja -C BUILD), install it (meson install -C BUILD) or reinstall the "
            "package (pip install .)" % (path, _library.RELATIVE_PATH)
        )
    lib = ctypes.CDLL(path)
    lib.psgd_version.restype = ctypes.c_char_p
    lib.psgd_version.argtypes = []
    version = lib.psgd_version().decode("ascii", "replace")
    if version != _library.VERSION:
        raise ImportError(
            "powersgd: the C library %s is version %s, this package is %s: install both from one build"
            % (path, version, _library.VERSION)
        )
    handle = ctypes.c_void_p
    status = ctypes.c_int
    signatures = {
        "psgd_last_error": (ctypes.c_char_p, []),
        "psgd_comm_init_beside_torch": (status, [ctypes.POINTER(handle)]),
        "psgd_comm_init_group": (status, [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(handle)]),
        "psgd_comm_rank": (ctypes.c_int, [handle]),
        "psgd_comm_size": (ctypes.c_int, [handle]),
        "psgd_comm_broadcast": (status, [handle, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
        "psgd_comm_barrier": (status, [handle]),
        "psgd_comm_destroy": (None, [handle]),
        "psgd_store_port_beside_torch": (status, [ctypes.POINTER(ctypes.c_int)]),
        "psgd_config_init": (status, [ctypes.POINTER(Config), ctypes.c_size_t]),
        "psgd_config_validate": (status, [ctypes.POINTER(Config)]),
        "psgd_reducer_create": (status, [handle, ctypes.POINTER(Config), ctypes.POINTER(handle)]),
        "psgd_reducer_add_bucket": (
            status,
            [handle, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64),
             ctypes.POINTER(ctypes.c_int)],
        ),
        "psgd_reducer_reduce_async_n": (status, [handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                                 ctypes.POINTER(handle)]),
        "psgd_reduce_handle_wait": (status, [handle]),
        "psgd_reduce_handle_free": (None, [handle]),
        "psgd_reduce_handle_times": (status, [handle, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double),
                                              ctypes.POINTER(ctypes.c_double)]),
        "psgd_reducer_worker_seconds": (status, [handle, ctypes.POINTER(ctypes.c_double), ctypes.c_size_t,
                                                 ctypes.POINTER(ctypes.c_size_t)]),
        "psgd_reducer_iteration": (ctypes.c_int64, [handle]),
        "psgd_reducer_stats": (status, [handle, ctypes.POINTER(Stats)]),
        "psgd_reducer_destroy": (None, [handle]),
        "psgd_reducer_save": (status, [handle, ctypes.c_char_p]),
        "psgd_reducer_load": (status, [handle, ctypes.c_char_p]),
        "psgd_reducer_save_job": (status, [handle, ctypes.c_char_p]),
        "psgd_reducer_load_job": (status, [handle, ctypes.c_char_p]),
        "psgd_reducer_load_shared": (status, [handle, ctypes.c_char_p]),
        "psgd_reducer_bucket_size": (status, [handle, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]),
        "psgd_reducer_error_feedback_n": (status, [handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]),
        "psgd_store_value_set": (status, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]),
        "psgd_comm_init_on_store": (status, [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                                             ctypes.c_char_p, ctypes.POINTER(handle)]),
        "psgd_comm_allreduce_sum_f32": (status, [handle, ctypes.c_void_p, ctypes.c_size_t]),
        "psgd_reducer_note_lr_change": (status, [handle]),
        "psgd_reducer_decisions": (
            status,
            [handle, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
             ctypes.POINTER(ctypes.c_int), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
        ),
        "psgd_rank_reason_name": (ctypes.c_char_p, [ctypes.c_int]),
        # issue 31: the outer optimizer of local steps (powersgd.torch.LocalSteps).
        "psgd_outer_create": (status, [handle, handle, ctypes.c_int64, ctypes.c_double, ctypes.c_double,
                                       ctypes.POINTER(ctypes.POINTER(ctypes.c_float)), ctypes.c_size_t,
                                       ctypes.POINTER(handle)]),
        "psgd_outer_step": (status, [handle, ctypes.POINTER(ctypes.POINTER(ctypes.c_float)), ctypes.c_size_t]),
        "psgd_outer_due": (ctypes.c_int, [handle, ctypes.c_int64]),
        "psgd_outer_start": (status, [handle, ctypes.c_int, ctypes.c_void_p]),
        "psgd_outer_steps": (ctypes.c_int64, [handle]),
        "psgd_outer_save": (status, [handle, ctypes.c_char_p]),
        "psgd_outer_load": (status, [handle, ctypes.c_char_p]),
        "psgd_outer_destroy": (None, [handle]),
        # issue 28: the rounds a step pays (PowerSGDState.timing_breakdown()).
        "psgd_comm_communication_rounds": (status, [handle, ctypes.POINTER(ctypes.c_uint64)]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


lib = _load()


def last_error():
    """psgd_last_error() of the calling thread."""
    return lib.psgd_last_error().decode("utf-8", "replace")


def check(status):
    """Raises PowerSGDError for a failed call (the message is this thread's psgd_last_error())."""
    if status != 0:
        raise PowerSGDError(status, last_error())


def default_config():
    """The library's defaults in a Config: psgd_config_init is told this binding's struct size, never the
    library's (a library with more fields writes only ctypes.sizeof(Config) bytes; docs/abi.md)."""
    config = Config()
    check(lib.psgd_config_init(ctypes.byref(config), ctypes.sizeof(Config)))
    return config
