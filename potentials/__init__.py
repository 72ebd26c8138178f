"""Interatomic potentials as torch modules (no MPI here): models, the graph they read, the reference
single-process ``predict``, and safe checkpoints. Names are imported on first use (torch and e3nn load
only when a model is needed)."""
from importlib import import_module

from .errors import InvalidStructureError, MLIPError, UnknownSpeciesError

_EXPORTS = {
    "base": ("BlockPotential", "Potential", "SpeciesScaleShift", "all_parts", "stage_parts"),
    "checkpoint": ("CheckpointError", "load", "save", "save_parts"),
    "graph": ("AtomGraph", "NoHalo"),
    "lj": ("LennardJones",),
    "nequip": ("NequIP",),
    "painn": ("PaiNN",),
    "predict": ("energy_forces", "predict"),
    "schnet": ("SchNet",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE) + ["InvalidStructureError", "MLIPError", "UnknownSpeciesError"]


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
