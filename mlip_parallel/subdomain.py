"""One rank's share of a decomposed system: what ``forward_decomposed`` reads (docs/architecture.md §3)."""
from __future__ import annotations

import numpy as np
import torch

from potentials.graph import neighbour_pairs

from .comm import Comm
from .domain import Domain
from .grid import Grid


class Subdomain:
    """This rank's brick of ``grid`` over ``domain``, its halo ``comm`` and its atoms.

    After ``build``: ``positions`` [n_local, 3] Å owned atoms (callers keep them current between builds),
    ``ids`` [n_local] their global ids, ``numbers`` [n_local + n_ghost] atomic numbers of the local rows
    (owned, then ghosts), ``skin`` (Å) the ghost shell holds beyond the model's reach, ``candidates``
    (i, j) int64 [E] tensors (on the model's device) of local row pairs that include every pair closer
    than the model's cutoff until the atoms have moved skin/2 (None: ``forward_decomposed`` searches the
    pairs at each call).
    Migration (MD) is ``comm.exchange`` before ``build``."""

    domain: Domain
    grid: Grid
    comm: Comm
    positions: np.ndarray
    ids: np.ndarray
    numbers: np.ndarray
    skin: float = 0.0
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, backend, domain: Domain, grid: Grid):
        self.domain, self.grid, self.comm = domain, grid, Comm(backend, grid, domain)

    def build(self, positions, ids, numbers, r_ghost: float, skin: float = 0.0, pair_cutoff: float | None = None,
              layerwise: bool = False, device=None) -> "Subdomain":
        """Ghosts of every atom image within ``r_ghost`` + ``skin`` (Å) of the brick and their numbers
        (collective); with ``pair_cutoff`` (Å), the candidate pairs within it (``layerwise``: owned
        receivers i only), searched on ``device`` (the model's; default CPU). positions [n_local, 3] Å,
        ids [n_local], numbers [n_local]."""
        self.comm.borders(positions, ids, r_ghost + skin)
        self.positions, self.ids, self.skin = positions, ids, float(skin)
        ghosts = self.comm.forward_comm(torch.as_tensor(numbers, dtype=torch.float64))
        self.numbers = np.concatenate([numbers, ghosts.numpy().round().astype(np.int64)])
        self.reference, self.reference_cell = positions.copy(), self.domain.cell.copy()
        if pair_cutoff is not None:
            local = torch.as_tensor(np.concatenate([positions, self.ghost_positions()]), device=device)
            i, j = neighbour_pairs(local, pair_cutoff)
            keep = i < len(positions) if layerwise else slice(None)  # only owned atoms receive
            self.candidates = (i[keep], j[keep])
        return self

    def ghost_positions(self) -> np.ndarray:
        """[n_ghost, 3] Å: the ghosts' positions from their owners' current ``positions`` (collective)."""
        owned = torch.as_tensor(self.positions, dtype=torch.float64)
        return self.comm.ghost_positions(owned, torch.as_tensor(self.domain.cell)).numpy()

    def set_cell(self, cell) -> None:
        """A new cell [3, 3] (same pbc and region, e.g. a barostat's): ghosts follow it at once."""
        self.domain = self.comm.domain = Domain(cell, self.domain.pbc, self.domain.lo, self.domain.hi)

    def displacement(self, positions) -> tuple[float, float]:
        """Since ``build`` (this rank, Å): the farthest move of an owned atom to ``positions`` [n_local, 3],
        and of a ghost through the cell's change (its image shift @ Δcell)."""
        moved = np.sqrt(((positions - self.reference) ** 2).sum(axis=1)).max(initial=0.0)
        shift = self.comm.ghost_image @ (self.domain.cell - self.reference_cell)
        return moved, np.sqrt((shift**2).sum(axis=1)).max(initial=0.0)

    def within(self, positions: np.ndarray, r: float) -> np.ndarray:
        """[n] bool: which of ``positions`` [n, 3] lie within ``r`` (Å, per fractional direction) of the brick."""
        lo, hi = self.grid.bounds(self.comm.rank)
        cut = self.domain.fractional_distance(r) * (1 + 1e-9) + 1e-12
        frac = self.domain.fractional(positions)
        return np.all((frac >= lo - cut) & (frac < hi + cut), axis=1)
