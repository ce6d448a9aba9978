"""powersgd: PowerSGD gradient compression over Gloo, from Python through the C API (ctypes).

powersgd.torch is the PyTorch DDP comm hook (a drop-in for
torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook). The C library is loaded on first import of
powersgd._capi, from the path (relative to this package) recorded in powersgd/_library.py when this package was
configured. __version__ is the project's version, which the library's psgd_version() is checked against on load.
"""
from powersgd._library import VERSION as __version__  # noqa: F401
