"""Distributed evaluation of a potential over a spatial decomposition (docs/architecture.md §3)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from potentials.graph import AtomGraph, NoHalo, check_positions, neighbour_list
from potentials.predict import strained_coordinates, voigt_stress

from .backend import get_backend, rank_device
from .comm import Comm, FeatureHalo
from .domain import Domain
from .errors import LostAtomsError
from .grid import Grid

MODES = ("layerwise", "wide")


class Decomposition:
    """One rank's share of a replicated structure: the grid, the halo (``comm``) with its ghosts, and
    ``owned`` [n_local] indices of this rank's atoms in the caller's order.

    What ``forward_decomposed`` reads (MD builds the same attributes from rank-local atoms):
    ``domain``, ``grid``, ``comm`` (after borders), ``positions`` [n_local, 3] Å, ``numbers``
    [n_local + n_ghost] atomic numbers of the local rows, ``skin`` (Å) the ghost shell holds beyond the
    model's reach."""

    skin = 0.0

    def __init__(self, atoms, r_ghost: float, backend, grid=None):
        positions = check_positions(atoms.positions)
        self.domain = Domain.from_positions(positions, atoms.cell, atoms.pbc)
        self.grid = Grid.for_ranks(backend.size, self.domain, grid)
        wrapped, _ = self.domain.wrap(positions)
        owner = self.grid.owner(self.domain.wrapped_fractional(wrapped))
        self.owned = np.flatnonzero(owner == backend.rank)
        self.comm = Comm(backend, self.grid, self.domain)
        self.comm.borders(wrapped[self.owned], self.owned, r_ghost)
        self.positions = wrapped[self.owned]  # [n_local, 3] Å, wrapped
        self.local_ids = np.concatenate([self.owned, self.comm.ghost_ids])  # [n_local + n_ghost]
        self.numbers = np.asarray(atoms.numbers)[self.local_ids]  # atomic numbers of local rows


def ghost_reach(model, mode: str) -> float:
    """The ghost shell (Å) a rank needs beyond its subdomain: one cutoff in layerwise mode (ghost
    features are refreshed between layers), layers × cutoff in wide mode (no communication inside)."""
    return model.cutoff * (model.layers if mode == "wide" else 1)


class GlobalSums(NamedTuple):
    """A decomposed evaluation's totals over every rank: ``energy`` (eV) and ``virial`` = dE/dε [3, 3]."""

    energy: float
    virial: np.ndarray


def global_sums(backend, energies, dE_dstrain) -> GlobalSums:
    """Sum this rank's owned energies [n_local] and dE/dstrain [3, 3] over all ranks (one allreduce)."""
    totals = backend.allreduce(np.append(dE_dstrain.detach().cpu().numpy().ravel(), energies.detach().sum().item()))
    return GlobalSums(float(totals[9]), totals[:9].reshape(3, 3))


def _within_shell(part: Decomposition, positions: np.ndarray, r: float) -> np.ndarray:
    """[n] bool: local atoms within fractional distance ``r`` (Å) of this rank's subdomain."""
    lo, hi = part.grid.bounds(part.comm.rank)
    cut = part.domain.fractional_distance(r) * (1 + 1e-9) + 1e-12
    frac = part.domain.fractional(positions)
    return np.all((frac >= lo - cut) & (frac < hi + cut), axis=1)


def forward_decomposed(model, part: Decomposition, mode: str = "layerwise", create_graph: bool = False,
                       candidates=None):
    """Differentiable evaluation of this rank's share (collective: every rank calls it together).

    Returns torch float64 (energies [n_local], forces [n_local, 3], dE/dstrain [3, 3]) for the owned
    atoms, on the model's device. Forces are those of the *total* energy (ghost gradients come home
    through the reverse exchange); dE/dstrain is this rank's part — sum it over ranks. With
    ``create_graph`` the results stay differentiable w.r.t. the parameters: a loss on them
    backpropagates through the halo (training on decomposed structures). ``candidates``: (i, j) local
    row pairs known to include every pair closer than the cutoff (a neighbour list with a skin); by
    default the pairs are searched anew.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    halo, device = part.comm, model.device
    pos, strain, pos_s, cell_s = strained_coordinates(part.positions, part.domain.cell, device)
    all_pos = torch.cat([pos_s, halo.ghost_positions(pos_s, cell_s)])

    positions = all_pos.detach().cpu().numpy()
    if candidates is None:
        i, j, _ = neighbour_list(positions, part.domain.cell, False, model.cutoff)
        near = np.ones(len(i), dtype=bool)
    else:
        i, j = candidates
        delta = positions[j] - positions[i]
        near = np.einsum("ij,ij->i", delta, delta) < model.cutoff**2
    if mode == "layerwise":
        receives = np.arange(len(all_pos)) < halo.n_local
    else:  # atoms farther than (layers - 1) cutoffs (+ skin) from the subdomain only ever send
        receives = _within_shell(part, positions, (model.layers - 1) * model.cutoff + part.skin)
    keep = receives[i] & near
    i, j = i[keep], j[keep]
    i_t, j_t = torch.as_tensor(i, device=device), torch.as_tensor(j, device=device)
    graph = AtomGraph(
        species=torch.as_tensor(model.species_index(part.numbers), device=device),
        edge_index=torch.stack([j_t, i_t]),
        edge_vec=all_pos[j_t] - all_pos[i_t],
        n_local=halo.n_local,
        halo=FeatureHalo(halo) if mode == "layerwise" else NoHalo(),
        n_receivers=halo.n_local if mode == "layerwise" else None,
    )
    energies = model(graph).to(torch.float64)
    # Every rank differentiates the same op sequence, so the reverse exchanges run in lock-step.
    dE_dpos, dE_dstrain = torch.autograd.grad(energies.sum(), [pos, strain], create_graph=create_graph)
    return energies, -dE_dpos, dE_dstrain


def evaluate(model, atoms, *, mode: str = "layerwise", grid=None, comm=None, stress: bool = True,
             device=None) -> dict:
    """Energy, forces, per-atom energies and stress of ``atoms``, computed spatially decomposed.

    Every rank calls this with the same ``atoms``. ``mode``: "layerwise" (ghost shell = cutoff, ghost
    node features refreshed between layers) or "wide" (ghost shell = layers × cutoff, no communication
    inside the model). ``grid``: (px, py, pz) or None for the minimum-surface grid. ``comm``: an mpi4py
    communicator, a backend, or None (MPI.COMM_WORLD under mpiexec, serial otherwise). ``device``: None
    puts each rank's model on ``cuda:<local rank>`` where CUDA exists, else CPU (the model is moved).

    Returns numpy float64 in the caller's atom order, identical on every rank: "energy" (eV),
    "energies" (N,), "forces" (N, 3) eV/Å, and "stress" (6,) eV/Å³ in ASE's Voigt order and sign when
    ``stress`` and the cell has a volume.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    backend = get_backend(comm)
    device = torch.device(device) if device is not None else rank_device(backend)
    if model.device != device:
        model.to(device)
    model.species_index(atoms.numbers)  # unknown elements raise here, on every rank alike
    part = Decomposition(atoms, ghost_reach(model, mode), backend, grid)
    energies, forces, dE_dstrain = forward_decomposed(model, part, mode)

    parts = backend.allgather((part.owned, energies.detach().cpu().numpy(), forces.cpu().numpy(),
                               dE_dstrain.cpu().numpy()))
    n = len(atoms)
    counts = np.zeros(n, dtype=np.int64)
    all_energies, all_forces = np.zeros(n), np.zeros((n, 3))
    for ids, e, f, _ in parts:
        counts[ids] += 1
        all_energies[ids], all_forces[ids] = e, f
    if np.any(counts != 1):
        raise LostAtomsError(f"{int((counts == 0).sum())} atom(s) owned by no rank and "
                             f"{int((counts > 1).sum())} by several")
    result = {"energy": float(all_energies.sum()), "energies": all_energies, "forces": all_forces}
    if stress and atoms.cell.rank == 3:
        result["stress"] = voigt_stress(sum(p[3] for p in parts), atoms.cell.volume)
    return result
