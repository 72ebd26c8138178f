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


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher setting RANK and WORLD_SIZE) started this process and no
    MPI launcher did."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not launched_by_mpiexec()


_HOOK_INSTALLED = False


def install_abort_on_error():
    """Make an uncaught exception on any rank print ``rank N: <type>: <message>`` and end the whole
    job at once (MPI_Abort under an MPI launcher; under torchrun this process exits and torchrun stops
    the others), instead of leaving the other ranks waiting in a collective forever."""
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) == 1:
            return
        rank, abort = int(os.environ["RANK"]), lambda: os._exit(1)
    else:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() == 1:
            return
        rank, abort = MPI.COMM_WORLD.Get_rank(), lambda: MPI.COMM_WORLD.Abort(1)

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            sys.stderr.write(f"rank {rank}: interrupted\n")
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            sys.stderr.write(f"{text}rank {rank}: {exc_type.__name__}: {exc}\n")
        sys.stderr.flush()
        time.sleep(0.5)  # let the launcher forward the message before the abort tears the job down
        abort()

    sys.excepthook = hook
    _HOOK_INSTALLED = True
