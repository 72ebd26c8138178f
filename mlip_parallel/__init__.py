"""Spatial decomposition, halo exchange and distributed evaluation of message-passing potentials.

Names are imported on first use (so that command-line tools answer ``--help`` and report bad input
before torch is loaded); under mpiexec, importing the package installs the abort-on-error hook.
"""
from importlib import import_module

from .launch import install_abort_on_error, launched_by_mpiexec

_EXPORTS = {
    "backend": ("MPIBackend", "SerialBackend", "get_backend", "rank_device"),
    "comm": ("Comm", "FeatureHalo", "Swap"),
    "domain": ("Domain",),
    "errors": ("DecompositionError", "InvalidStructureError", "LostAtomsError", "MLIPError", "UnknownSpeciesError"),
    "evaluate": ("MODES", "Decomposition", "evaluate", "forward_decomposed"),
    "grid": ("Grid", "choose_dims"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE) + ["install_abort_on_error", "launched_by_mpiexec"]


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if launched_by_mpiexec():
    install_abort_on_error()  # under mpiexec, an uncaught exception on any rank aborts the whole job
