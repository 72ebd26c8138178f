"""The process's C allocator: glibc's malloc set to keep freed memory for reuse (``keep_freed_memory``).

A force call or a training step frees and reallocates the same large tensors. By default glibc serves blocks above
its mmap threshold from mmaps of their own and hands the heap's free top back to the system beyond its trim
threshold, so each call faults those pages in again: system time. Kept, the freed memory serves the next call (``benchmarks/kernel_time.py``,
``benchmarks/pipeline_epoch.py --allocator``). The tools call ``keep_freed_memory`` at start (mlip-train's config key
``keep_freed_memory``, mlip-md's the same, mlip-lammps always; MLIPCalculator's argument of that name); a user's own
thresholds in the environment win.
"""
from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters and the values set: every block from the heap (no mmaps of their own: above glibc's
# largest mmap threshold, 32 MiB, a block would otherwise be mmapped and faulted in at every call; SchNet on 4,000
# atoms in one pass spent half its time in the kernel so), the heap's top trimmed only beyond 2 GiB and grown
# 256 MiB at a time
MALLOPT = {"M_TRIM_THRESHOLD": (-1, 2 ** 31 - 1), "M_TOP_PAD": (-2, 256 << 20), "M_MMAP_THRESHOLD": (-3, 32 << 20),
           "M_MMAP_MAX": (-4, 0)}
USER_MALLOC = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse in this process (``MALLOPT``; the resident size then stays
    near its peak). Returns False, changing nothing, where the user set one of these thresholds (``USER_MALLOC``, or
    ``glibc.malloc`` in ``GLIBC_TUNABLES``) or the C library has no ``mallopt``."""
    if any(key in os.environ for key in USER_MALLOC) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no such symbol; TypeError: no CDLL(None) (Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([mallopt(param, value) == 1 for param, value in MALLOPT.values()])
