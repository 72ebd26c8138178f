"""Spatial decomposition, halo exchange and distributed evaluation of message-passing potentials.

Names are imported on first use (so that command-line tools answer ``--help`` and report bad input
before torch is loaded); under mpiexec, importing the package installs the abort-on-error hook.
"""
from potentials.lazy import lazy_exports

from .launch import install_abort_on_error, launched_by_mpiexec

__all__ = lazy_exports(__name__, {
    "backend": ("MPIBackend", "SerialBackend", "get_backend", "rank_device"),
    "comm": ("Comm", "FeatureHalo", "Swap"),
    "domain": ("Domain",),
    "errors": ("DecompositionError", "InvalidStructureError", "LostAtomsError", "MLIPError", "UnknownSpeciesError"),
    "evaluate": ("MODES", "Decomposition", "evaluate", "forward_decomposed"),
    "grid": ("Grid", "choose_dims"),
    "subdomain": ("Subdomain",),
}) + ["install_abort_on_error", "launched_by_mpiexec"]

if launched_by_mpiexec():
    install_abort_on_error()  # under mpiexec, an uncaught exception on any rank aborts the whole job
