"""Spatial decomposition, halo exchange and distributed evaluation of message-passing potentials."""
from .backend import (MPIBackend, SerialBackend, get_backend, install_abort_on_error, launched_by_mpiexec,
                      rank_device)
from .comm import Comm, FeatureHalo, Swap
from .domain import Domain
from .errors import DecompositionError, InvalidStructureError, LostAtomsError, MLIPError, UnknownSpeciesError
from .evaluate import MODES, Decomposition, evaluate, forward_decomposed
from .grid import Grid, choose_dims

__all__ = ["Comm", "Decomposition", "DecompositionError", "Domain", "FeatureHalo", "Grid", "InvalidStructureError",
           "LostAtomsError", "MLIPError", "MPIBackend", "SerialBackend", "Swap", "UnknownSpeciesError",
           "MODES", "choose_dims", "evaluate", "forward_decomposed", "get_backend", "install_abort_on_error", "rank_device"]

if launched_by_mpiexec():
    install_abort_on_error()  # under mpiexec, an uncaught exception on any rank aborts the whole job
