"""ASE calculator over ``mlip_parallel.evaluate``: serial, or spatially decomposed under mpiexec."""
from __future__ import annotations

import math

import numpy as np
from ase.calculators.calculator import Calculator, all_changes

import mlip_parallel
import potentials
from mlip_parallel import allocator
from potentials.base import Potential
from potentials.committee import Committee
from potentials.graph import MIN_DISTANCE
from potentials.messages import memory_budget_bytes
from mlip_parallel import MODES

ARRAY_CHANGES = [name for name in all_changes if name not in ("cell", "pbc")]  # what ASE compares in Atoms.arrays


def unchanged(before, atoms) -> bool:
    """Whether ``atoms`` are exactly ``before`` in everything ASE's ``compare_atoms`` compares: cell, pbc, and the
    arrays of ``all_changes`` (each present in both or in neither)."""
    return np.array_equal(before.cell.array, atoms.cell.array) and np.array_equal(before.pbc, atoms.pbc) and all(
        (name in before.arrays) == (name in atoms.arrays)
        and (name not in atoms.arrays or np.array_equal(before.arrays[name], atoms.arrays[name]))
        for name in ARRAY_CHANGES)


class ExactStateCheck:
    """An ASE calculator's ``check_state`` (what changed since its results) answered by an exact comparison where
    nothing changed, ASE's own (``np.allclose`` of each array, within 1e-15) otherwise: the same answer, without ASE's
    0.1-0.2 ms on each read of a result (an optimizer reads the forces twice a step, a script energy, forces and
    stress: 6 % of a batched FIRE step of 8-32-atom cells)."""

    def check_state(self, atoms, tol=1e-15):
        if self.atoms is not None and unchanged(self.atoms, atoms):
            return []
        return super().check_state(atoms, tol)


class MLIPCalculator(ExactStateCheck, Calculator):
    """Energy, free energy, per-atom energies, forces and stress of a potentials model, in one pass.

    Launched with ``mpiexec -n P python script.py``, every rank builds the same Atoms and attaches its
    own calculator; each evaluation is split by space over the ranks and every rank gets the full
    results, so ASE optimizers and integrators run unchanged. Serial without MPI. ``mode``, ``grid``,
    ``comm``, ``memory_budget_gb`` and ``min_distance`` are those of ``mlip_parallel.evaluate``: by default one
    process evaluates the whole structure (periodic images as edge shifts, as the packages' own calculators) and
    every edge at once where that fits half the free memory, in chunks where it does not. Stress is given when the
    cell has a volume. ``keep_freed_memory``: set glibc's malloc of this process to keep freed memory for reuse
    (``mlip_parallel.allocator``; fewer page faults, the resident size stays near its peak), as the tools do.

    ``model`` may be a model spec, as the tools take it: ``MLIPCalculator("sevennet:7net-0")``, ``"mace:FILE.model"``,
    ``"cu-emt"`` or a checkpoint path (``potentials.load_model``; this package's checkpoints run in float64, as in
    mlip-md); a bad spec fails here, not at the first call.

    A committee — a list of models or specs (``potentials.Committee`` of their mean; pass a ``Committee`` for
    ``forces="first"``) — gives its members' mean (or first) energy, forces and stress, and its model deviation:
    "devi_f" (σ_F per atom, eV/Å), "devi_energies", "max_devi_f", "min_devi_f", "avg_devi_f", "devi_e" and
    "member_energies" in ``results`` (``mlip_parallel.evaluate``).
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]
    DEVIATION = ["devi_f", "devi_energies", "max_devi_f", "min_devi_f", "avg_devi_f", "devi_e", "member_energies"]

    def __init__(self, model, mode: str = "layerwise", grid=None, comm=None, memory_budget_gb: float | None = None,
                 min_distance: float = MIN_DISTANCE, keep_freed_memory: bool = True, **kwargs):
        super().__init__(**kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if memory_budget_gb is not None:
            memory_budget_bytes(memory_budget_gb, "cpu")  # a bad value raises here, not at the first step
        if isinstance(model, (list, tuple)) and model and all(isinstance(member, str) for member in model):
            model = potentials.load_committee(model, checkpoint_dtype="float64")  # (an error names the member)
        elif isinstance(model, (list, tuple)):
            model = Committee([self.model_of(member) for member in model])
        model = self.model_of(model)
        if not isinstance(model, (Potential, Committee)):
            raise TypeError(f"model must be a potentials model, a list of them (a committee) or a model spec such as "
                            f"'sevennet:7net-0' or 'cu-emt', got {type(model).__name__}")
        if isinstance(model, Committee):
            self.implemented_properties = [*self.implemented_properties, *self.DEVIATION]
        self.model, self.mode, self.grid, self.comm = model, mode, grid, comm
        if not (math.isfinite(min_distance) and min_distance >= 0):
            raise ValueError(f"min_distance must be a finite number >= 0 (Å), got {min_distance}")
        self.memory_budget_gb, self.min_distance = memory_budget_gb, min_distance
        if keep_freed_memory:
            allocator.keep_freed_memory()

    @staticmethod
    def model_of(model):
        """``model`` itself, or the model a spec string names (``potentials.load_model``)."""
        return potentials.load_model(model, checkpoint_dtype="float64") if isinstance(model, str) else model

    def calculate(self, atoms=None, properties=None, system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        result = mlip_parallel.evaluate(self.model, self.atoms, mode=self.mode, grid=self.grid, comm=self.comm,
                                        memory_budget_gb=self.memory_budget_gb, min_distance=self.min_distance)
        result["free_energy"] = result["energy"]
        self.results = result
