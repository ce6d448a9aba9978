"""powersgd: PowerSGD gradient compression over Gloo, from Python through the C API (ctypes).

powersgd.torch is the PyTorch DDP comm hook (a drop-in for
torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook). The C library is loaded on first import of
powersgd._capi, from the path recorded in powersgd/_library.py when this package was configured.
"""
