"""mlip_parallel.allocator: glibc's malloc set to keep freed memory for reuse, by the tools and the calculator."""
import ctypes
import os
import subprocess
import sys

import pytest

from mlip_parallel.allocator import USER_MALLOC

# A fresh process's script head: ``mmapped(mib)``, the bytes in mmaps of their own while a block of ``mib`` MiB is held
MALLINFO = """
import ctypes, sys, numpy as np
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
def mmapped(mib):
    block = np.ones(mib << 17)
    return libc.mallinfo2().hblkhd
"""


def printed(body: str, *args, **environment) -> list:
    """What ``MALLINFO + body`` prints, run with ``args`` in a fresh Python without the user's malloc settings (plus
    ``environment``)."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    env = {k: v for k, v in os.environ.items() if k not in USER_MALLOC and k != "GLIBC_TUNABLES"}
    run = subprocess.run([sys.executable, "-c", MALLINFO + body, *args], capture_output=True, text=True,
                         env={**env, **environment})
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_keep_freed_memory_serves_large_blocks_from_the_heap():
    """keep_freed_memory (glibc's mallopt): 16 and 64 MiB blocks (the latter above glibc's largest mmap threshold),
    mmapped by default, then come from the heap (where freed memory is kept for the next step); a MALLOC_*_ variable
    the user set wins."""
    body = ("from mlip_parallel.allocator import keep_freed_memory\n"
            "print(mmapped(8) >= 8 << 20, keep_freed_memory(), mmapped(16) < 1 << 20, mmapped(64) < 1 << 20)")
    assert printed(body) == ["True", "True", "True", "True"]
    assert printed(body, MALLOC_TOP_PAD_="0") == ["True", "False", "False", "False"]


@pytest.mark.parametrize("keep", ["keep", "leave"])
def test_calculator_keeps_freed_memory_unless_told_not_to(keep):
    """MLIPCalculator sets this process's malloc to serve even a 64 MiB tensor from the heap, where freed memory is
    kept for the next call (the mmapped blocks glibc uses by default are faulted in afresh at every call: system
    time); keep_freed_memory=False leaves glibc's defaults."""
    body = ("import potentials\nfrom md import MLIPCalculator\n"
            "MLIPCalculator(potentials.LennardJones(0.0104, 3.4, 8.5), keep_freed_memory=sys.argv[1] == 'keep')\n"
            "print(mmapped(64) >= 64 << 20)")
    assert printed(body, keep) == [str(keep == "leave")]
