"""Single-process reference evaluation: a periodic neighbour list and autograd, nothing else."""
from __future__ import annotations

import numpy as np
import torch

from .base import Potential
from .messages import evaluation_budget
from .graph import (AtomGraph, check_min_distance, check_pair_distances, check_positions, complete_cell, edge_vectors,
                    neighbour_list, strained_coordinates, system_of)


def voigt_stress(dE_dstrain: np.ndarray, volume: float) -> np.ndarray:
    """(1/V) dE/dε as 6 Voigt components (xx, yy, zz, yz, xz, xy), eV/Å³ — ASE's order and sign (its
    ``full_3x3_to_voigt_6_stress`` of the symmetric part, whose off-diagonal means are the elements themselves)."""
    return (0.5 * (dE_dstrain + dE_dstrain.T) / volume)[VOIGT]


VOIGT = ([0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1])  # (rows, columns) of xx, yy, zz, yz, xz, xy


def model_pairs(model, positions: np.ndarray, cell: np.ndarray, pbc, min_distance: float = 0.0) -> tuple:
    """(i, j, shifts) of the pairs within ``model.cutoff`` (``neighbour_list``; ``positions`` [n, 3] finite, ``cell``
    complete), two atoms closer than ``min_distance`` Å an InvalidStructureError naming them (0: unchecked): read
    off this list when the cutoff reaches that far, else from a search of their own. The caller has binned the
    atoms first (``check_structure(..., search=False)``), which bounds this list's memory."""
    if min_distance > 0 and model.cutoff >= min_distance:
        i, j, shifts, distances = neighbour_list(positions, cell, pbc, model.cutoff, distances=True)
        check_pair_distances(i, j, distances, min_distance)
        return i, j, shifts
    check_min_distance(positions, cell, pbc, min_distance)
    return neighbour_list(positions, cell, pbc, model.cutoff)


def periodic_graph(model: Potential, atoms, create_graph: bool = False, memory_budget_gb: float | None = None,
                   min_distance: float = 0.0, checked: tuple | None = None) -> tuple:
    """(the strained coordinates, the AtomGraph) of the whole structure ``atoms`` for ``model``: its atoms are the
    nodes and periodic images enter as edge shifts (no ghost atoms; what the packages' own calculators build).
    ``memory_budget_gb`` as in ``energy_forces``. ``min_distance`` (Å; 0: unchecked): atoms closer are an
    InvalidStructureError, found in the model's own neighbour list when its cutoff reaches that far; the caller
    first runs ``check_structure(..., search=False)``, whose binning bounds that list's memory. ``checked``: its
    return value (the positions and the complete cell), not computed again."""
    positions, cell = checked or (check_positions(atoms.positions), complete_cell(atoms.cell, atoms.pbc))
    device = model.device
    species = torch.as_tensor(model.species_index(atoms.numbers), device=device)
    i, j, shifts = model_pairs(model, positions, cell, atoms.pbc, min_distance)

    x = strained_coordinates(positions, cell, device)
    i_t, j_t = torch.as_tensor(i, device=device), torch.as_tensor(j, device=device)
    edge_vec = edge_vectors(x.positions, i_t, j_t, torch.as_tensor(shifts, dtype=torch.float64, device=device), x.cell)
    budget = None if create_graph else evaluation_budget(model, memory_budget_gb, len(positions), len(i), device)
    graph = AtomGraph(species=species, edge_index=torch.stack([j_t, i_t]), edge_vec=edge_vec,
                      n_local=len(positions), system=system_of(atoms.info), memory_budget=budget,
                      positions=x.positions, cell=x.cell, pbc=tuple(bool(p) for p in atoms.pbc))
    return x, graph


def energy_forces(model: Potential, atoms, create_graph: bool = False, memory_budget_gb: float | None = None):
    """Differentiable single-process evaluation.

    Returns torch float64 (energies [N], forces [N, 3], dE/dstrain [3, 3]) on the model's device;
    with ``create_graph`` they stay differentiable w.r.t. the model's parameters (force training).
    Without it the blocks' edge steps run in chunks of at most ``memory_budget_gb`` (None: every edge at once
    where that fits the device's free memory, else automatic chunks; ``messages.evaluation_budget``).
    ``atoms.info``'s charge and spin go to the graph's ``system`` (a model that reads them uses them).
    """
    x, graph = periodic_graph(model, atoms, create_graph, memory_budget_gb)
    energies = model(graph).to(torch.float64)
    dE_dpos, dE_dstrain = torch.autograd.grad(energies.sum(), [x.pos, x.strain], create_graph=create_graph)
    return energies, -dE_dpos, dE_dstrain


def predict(model: Potential, atoms, stress: bool = True, memory_budget_gb: float | None = None) -> dict:
    """Energy (float, eV), energies (N,), forces (N, 3) eV/Å, and stress (6,) eV/Å³ when asked for and
    the cell has a volume. numpy float64, atom order of ``atoms``. Runs on the model's device, its edge
    steps in chunks of at most ``memory_budget_gb`` (None: automatic, ``energy_forces``)."""
    energies, forces, dE_dstrain = energy_forces(model, atoms, memory_budget_gb=memory_budget_gb)
    energies = energies.detach().cpu().numpy()
    result = {"energy": float(energies.sum()), "energies": energies, "forces": forces.cpu().numpy()}
    if stress and atoms.cell.rank == 3:
        result["stress"] = voigt_stress(dE_dstrain.cpu().numpy(), atoms.cell.volume)
    return result
