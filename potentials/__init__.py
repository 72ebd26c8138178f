"""Interatomic potentials as torch modules (no MPI here): models, the graph they read, the reference
single-process ``predict``, and safe checkpoints."""
from .base import BlockPotential, Potential, SpeciesScaleShift, all_parts, stage_parts
from .checkpoint import CheckpointError, load, save, save_parts
from .errors import InvalidStructureError, MLIPError, UnknownSpeciesError
from .graph import AtomGraph, NoHalo
from .lj import LennardJones
from .nequip import NequIP
from .painn import PaiNN
from .predict import energy_forces, predict
from .schnet import SchNet

__all__ = ["AtomGraph", "BlockPotential", "CheckpointError", "InvalidStructureError", "LennardJones", "MLIPError", "NequIP", "NoHalo",
           "PaiNN", "Potential", "SchNet", "SpeciesScaleShift", "UnknownSpeciesError", "energy_forces", "load",
           "predict", "save", "save_parts", "all_parts", "stage_parts"]
