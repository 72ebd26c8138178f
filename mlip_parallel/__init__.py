"""Spatial decomposition, halo exchange and distributed evaluation of message-passing potentials.

Names are imported on first use (so that command-line tools answer ``--help`` and report bad input
before torch is loaded); under mpiexec, importing the package makes MPICH's waiting ranks sleep where the
node has more ranks than CPUs (``launch.yield_when_oversubscribed``; import it before mpi4py) and installs
the abort-on-error hook.
"""
from potentials.lazy import lazy_exports

from .launch import install_abort_on_error, launched_by_mpiexec, yield_when_oversubscribed

__all__ = lazy_exports(__name__, {
    "backend": ("MPIBackend", "SerialBackend", "get_backend", "rank_device"),
    "comm": ("Comm", "FeatureHalo", "Swap"),
    "domain": ("Domain",),
    "errors": ("DecompositionError", "InvalidStructureError", "LostAtomsError", "MemoryLimitError", "MLIPError",
               "SimulationError", "UnknownSpeciesError"),
    "evaluate": ("MODES", "Decomposition", "evaluate", "forward_decomposed"),
    "grid": ("Grid", "choose_dims"),
    "many": ("predict_many",),
    "subdomain": ("Subdomain",),
}) + ["install_abort_on_error", "launched_by_mpiexec"]

if launched_by_mpiexec():
    yield_when_oversubscribed()  # before MPI starts: mpi4py starts it in install_abort_on_error
    install_abort_on_error()  # under mpiexec, an uncaught exception on any rank aborts the whole job
