"""Single-process reference evaluation: a periodic neighbour list and autograd, nothing else."""
from __future__ import annotations

import numpy as np
import torch

from .base import Potential
from .messages import memory_budget_bytes
from .graph import (AtomGraph, check_positions, complete_cell, edge_vectors, neighbour_list, strained_coordinates,
                    system_of)


def voigt_stress(dE_dstrain: np.ndarray, volume: float) -> np.ndarray:
    """(1/V) dE/dε as 6 Voigt components (xx, yy, zz, yz, xz, xy), eV/Å³ — ASE's order and sign."""
    from ase.stress import full_3x3_to_voigt_6_stress

    return full_3x3_to_voigt_6_stress(0.5 * (dE_dstrain + dE_dstrain.T) / volume)


def energy_forces(model: Potential, atoms, create_graph: bool = False, memory_budget_gb: float | None = None):
    """Differentiable single-process evaluation.

    Returns torch float64 (energies [N], forces [N, 3], dE/dstrain [3, 3]) on the model's device;
    with ``create_graph`` they stay differentiable w.r.t. the model's parameters (force training).
    Without it the blocks' edge steps run in chunks of at most ``memory_budget_gb`` (None: chosen from
    the device's free memory; ``messages.memory_budget_bytes``). ``atoms.info``'s charge and spin go to the graph's
    ``system`` (a model that reads them uses them).
    """
    positions = check_positions(atoms.positions)
    cell = complete_cell(atoms.cell, atoms.pbc)
    device = model.device
    species = torch.as_tensor(model.species_index(atoms.numbers), device=device)
    i, j, shifts = neighbour_list(positions, cell, atoms.pbc, model.cutoff)

    x = strained_coordinates(positions, cell, device)
    i_t, j_t = torch.as_tensor(i, device=device), torch.as_tensor(j, device=device)
    edge_vec = edge_vectors(x.positions, i_t, j_t, torch.as_tensor(shifts, dtype=torch.float64, device=device), x.cell)
    graph = AtomGraph(species=species, edge_index=torch.stack([j_t, i_t]), edge_vec=edge_vec,
                      n_local=len(positions), system=system_of(atoms.info),
                      memory_budget=None if create_graph else memory_budget_bytes(memory_budget_gb, device))
    energies = model(graph).to(torch.float64)
    dE_dpos, dE_dstrain = torch.autograd.grad(energies.sum(), [x.pos, x.strain], create_graph=create_graph)
    return energies, -dE_dpos, dE_dstrain


def predict(model: Potential, atoms, stress: bool = True, memory_budget_gb: float | None = None) -> dict:
    """Energy (float, eV), energies (N,), forces (N, 3) eV/Å, and stress (6,) eV/Å³ when asked for and
    the cell has a volume. numpy float64, atom order of ``atoms``. Runs on the model's device, its edge
    steps in chunks of at most ``memory_budget_gb`` (None: automatic)."""
    energies, forces, dE_dstrain = energy_forces(model, atoms, memory_budget_gb=memory_budget_gb)
    energies = energies.detach().cpu().numpy()
    result = {"energy": float(energies.sum()), "energies": energies, "forces": forces.cpu().numpy()}
    if stress and atoms.cell.rank == 3:
        result["stress"] = voigt_stress(dE_dstrain.cpu().numpy(), atoms.cell.volume)
    return result
