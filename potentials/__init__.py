"""Interatomic potentials as torch modules (no MPI here): models, the graph they read, the reference
single-process ``predict``, safe checkpoints, and adapters running other packages' models (SevenNet,
MACE, the nequip framework's NequIP and Allegro, fairchem's UMA and eSEN: ``potentials.adapters``), and the
model families every tool reads (``potentials.families``: ``load_model``). Names are imported on first use (torch
and e3nn load only when a model is needed)."""
from .errors import InvalidStructureError, MLIPError, UnknownSpeciesError
from .lazy import lazy_exports

__all__ = lazy_exports(__name__, {
    "families": ("Family", "Option", "load_model"),
    "adapters.fairchem": ("FAIRChem",),
    "adapters.mace": ("MACE",),
    "adapters.nequip": ("NequIPFramework",),
    "adapters.sevennet": ("SevenNet",),
    "batch": ("predict_many",),
    "born": ("BornCoulomb",),
    "base": ("BlockPotential", "Potential", "SpeciesScaleShift", "all_parts", "stage_parts"),
    "checkpoint": ("CheckpointError", "load", "save", "save_parts"),
    "committee": ("Committee", "deviations", "load_committee"),
    "coulomb": ("Coulomb", "LongRangeError"),
    "graph": ("AtomGraph", "NoHalo"),
    "lj": ("LennardJones",),
    "nequip": ("NequIP",),
    "painn": ("PaiNN",),
    "predict": ("energy_forces", "predict"),
    "schnet": ("SchNet",),
}) + ["InvalidStructureError", "MLIPError", "UnknownSpeciesError"]
