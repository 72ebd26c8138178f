"""Interatomic potentials as torch modules (no MPI here): models, the graph they read, the reference
single-process ``predict``."""
from .base import Potential
from .errors import InvalidStructureError, MLIPError, UnknownSpeciesError
from .graph import AtomGraph, NoHalo
from .lj import LennardJones
from .predict import predict
from .schnet import SchNet

__all__ = ["AtomGraph", "InvalidStructureError", "LennardJones", "MLIPError", "NoHalo", "Potential",
           "SchNet", "UnknownSpeciesError", "predict"]
