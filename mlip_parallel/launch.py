"""How this process was launched, and the abort-on-error hook for MPI jobs. Imports neither torch nor
(until an MPI job installs the hook) mpi4py, so command-line tools can report bad input quickly."""
from __future__ import annotations

import os
import sys
import time
import traceback


def launched_by_mpiexec() -> bool:
    """True when this process was started by an MPI launcher (mpiexec / mpirun / srun with PMI)."""
    return any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                                          "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD"))


_HOOK_INSTALLED = False


def install_abort_on_error():
    """Make an uncaught exception on any rank print ``rank N: <type>: <message>`` and abort the whole
    MPI job at once, instead of leaving the other ranks waiting in a collective forever."""
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1:
        return

    def hook(exc_type, exc, tb):
        rank = MPI.COMM_WORLD.Get_rank()
        if issubclass(exc_type, KeyboardInterrupt):
            sys.stderr.write(f"rank {rank}: interrupted\n")
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            sys.stderr.write(f"{text}rank {rank}: {exc_type.__name__}: {exc}\n")
        sys.stderr.flush()
        time.sleep(0.5)  # let the launcher forward the message before the abort tears the job down
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
    _HOOK_INSTALLED = True
