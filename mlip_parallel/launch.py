"""How this process was launched, MPICH's waiting on oversubscribed nodes, and the abort-on-error hook
for MPI jobs. Imports neither torch nor (until an MPI job installs the hook) mpi4py, so command-line
tools can report bad input quickly."""
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


# MPICH: a rank waiting for a message or a collective sleeps (nanosleep) every 1,000 polls that found nothing,
# where MPICH would only call sched_yield, which lets no other process onto the CPU. With more ranks than CPUs,
# polling ranks take the CPUs from the ranks they wait for. On 2 cores, 4 ranks: one rank computing 0.37-0.44 s
# while three wait in a barrier, an allreduce or a receive took 0.83-0.88 s polling, 0.39-0.46 s with this; a
# 4-rank launch of tests/mpi/pipeline.py took 59 and 41 s polling, 35 and 35 s with it (alternating runs).
# (MPIR_CVAR_CH4_PROGRESS_THROTTLE, a usleep in the progress loop, left those waits at 0.83-0.89 s.)
MPICH_YIELD = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity set; all of the machine's where that is unknown)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ranks_on_node(environ=os.environ) -> int:
    """How many ranks of this job share this node, from the launcher's environment (MPICH's hydra, Open
    MPI, torchrun, Slurm); 1 where none says."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(environ[key].split("(")[0]))
        except (KeyError, ValueError):
            continue
    return 1


def yield_when_oversubscribed(environ=os.environ, ranks: int | None = None) -> None:
    """Before MPI starts (the first ``from mpi4py import MPI``): where more ranks share this node than this
    process has CPUs (``ranks``, default the launcher's ``MPI_LOCALNRANKS``: MPICH's hydra), add
    ``MPICH_YIELD`` to ``environ`` (settings already there win)."""
    if ranks is None:
        try:
            ranks = int(environ.get("MPI_LOCALNRANKS", "1"))
        except ValueError:
            return
    if ranks > usable_cpus():
        for key, value in MPICH_YIELD.items():
            environ.setdefault(key, value)


def launch_rank() -> int:
    """This process's rank in its MPI job (0 outside one), without initialising MPI: MPI's own answer
    when mpi4py has already initialised it, else the launcher's environment (MPICH/Hydra PMI_RANK, Open
    MPI, PMIx, Slurm, torchrun)."""
    if launched_by_torchrun():  # an MPI initialised under torchrun is a world of one
        return int(os.environ["RANK"])
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def mpi_world():
    """MPI's world communicator (mpi4py's; importing it starts MPI), for a library that takes one (LAMMPS). Ranks
    otherwise talk through ``mlip_parallel.backend``."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def finalize_mpi() -> None:
    """End MPI in this process where it runs (every rank together: no rank waits for another)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


_HOOK_INSTALLED = False


def _job_abort():
    """(this rank, a function ending the whole job at once) in a job of more than one process, else None."""
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) == 1:
            return None
        return int(os.environ["RANK"]), lambda code=1: os._exit(code)
    if launched_by_mpiexec() or "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            return MPI.COMM_WORLD.Get_rank(), lambda code=1: MPI.COMM_WORLD.Abort(code)
    return None


def end_job(prog: str, exc, code: int = 1) -> None:
    """Print ``prog: error: exc`` (one line, from this rank) and, in a job of several processes, end all
    of them at once with exit status ``code`` (the others may be waiting in a collective for this one).
    Alone, it returns: the caller exits with ``code``."""
    sys.stderr.write(f"{prog}: error: {exc}\n")
    sys.stderr.flush()
    job = _job_abort()
    if job is not None:
        time.sleep(0.5)  # let the launcher forward the message before the abort tears the job down
        job[1](code)


def abort_job(exc, code: int = 1) -> None:
    """An exception on this rank alone, caught by its caller: its traceback and ``rank N: <type>: <message>`` on
    stderr, then the whole job ends at once with ``code`` (this process alone where it is alone). Never returns."""
    job = _job_abort()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stdout.flush()
    sys.stderr.write(f"{text}rank {job[0] if job else 0}: {type(exc).__name__}: {exc}\n")
    sys.stderr.flush()
    if job is not None:
        time.sleep(0.5)  # let the launcher forward the message before the abort tears the job down
        job[1](code)
    os._exit(code)


def install_abort_on_error():
    """Make an uncaught exception on any rank print ``rank N: <type>: <message>`` and end the whole
    job at once (MPI_Abort under an MPI launcher; under torchrun this process exits and torchrun stops
    the others), instead of leaving the other ranks waiting in a collective forever."""
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    job = _job_abort()
    if job is None:
        return
    rank, abort = job

    def hook(exc_type, exc, tb):
        # the process's own stderr: torch.distributed's excepthook calls this one with sys.stderr swapped
        # for a buffer it prints afterwards, and the abort below comes first
        stderr = sys.__stderr__ or sys.stderr
        if issubclass(exc_type, KeyboardInterrupt):
            stderr.write(f"rank {rank}: interrupted\n")
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            stderr.write(f"{text}rank {rank}: {exc_type.__name__}: {exc}\n")
        stderr.flush()
        time.sleep(0.5)  # let the launcher forward the message before the abort tears the job down
        abort()

    sys.excepthook = hook
    _HOOK_INSTALLED = True
