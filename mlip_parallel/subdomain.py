"""One rank's share of a decomposed system: what ``forward_decomposed`` reads (docs/architecture.md §3)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from potentials.graph import neighbour_pairs

from .comm import Comm
from .domain import Domain
from .grid import Grid


class Displacement(NamedTuple):
    """Since the last ``Subdomain.build`` (this rank, Å): ``owned`` the farthest move of an owned atom,
    ``ghost`` the farthest move of a ghost through the cell's change (its image shift @ Δcell), ``step``
    the farthest move since the ``previous`` positions (0 without them)."""

    owned: float
    ghost: float
    step: float


class Subdomain:
    """This rank's brick of ``grid`` over ``domain``, its halo ``comm`` and its atoms.

    After ``build``: ``positions`` [n_local, 3] Å owned atoms (numpy, or a float64 tensor on the model's
    device; callers keep them current between builds), ``ids`` [n_local] their global ids, ``numbers``
    [n_local + n_ghost] atomic numbers of the local rows (owned, then ghosts), ``skin`` (Å) the ghost
    shell holds beyond the model's reach, ``candidates`` (i, j) int64 [E] tensors (on the model's device)
    of local row pairs that include every pair closer than the model's cutoff until the atoms have moved
    skin/2 (None: ``forward_decomposed`` searches the pairs at each call).
    Migration (MD) is ``comm.exchange`` before ``build``."""

    domain: Domain
    grid: Grid
    comm: Comm
    positions: np.ndarray | torch.Tensor
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
        receivers i only), searched on ``device`` (the model's; default CPU). positions [n_local, 3] Å
        (numpy), ids [n_local], numbers [n_local]."""
        self.comm.borders(positions, ids, r_ghost + skin)
        self.positions, self.ids, self.skin = positions, ids, float(skin)
        ghosts = self.comm.forward_comm(torch.as_tensor(numbers, dtype=torch.float64))
        self.numbers = np.concatenate([numbers, ghosts.numpy().round().astype(np.int64)])
        self.reference = torch.as_tensor(positions, dtype=torch.float64, device=device).clone()
        self.reference_cell = self.domain.cell.copy()
        self.images = np.unique(self.comm.ghost_image, axis=0)  # the distinct image shifts of the ghosts
        self._species = None  # (model, its species index)
        if pair_cutoff is not None:
            cell = torch.as_tensor(self.domain.cell, device=self.reference.device)
            local = torch.cat([self.reference, self.comm.ghost_positions(self.reference, cell)])
            i, j = neighbour_pairs(local, pair_cutoff)
            keep = i < len(positions) if layerwise else slice(None)  # only owned atoms receive
            self.candidates = (i[keep], j[keep])
        return self

    def species(self, model) -> torch.Tensor:
        """int64 [n_local + n_ghost] on the model's device: ``model.species_index(numbers)``, kept until
        the next ``build`` (no per-step host → device copy)."""
        held = self._species
        if held is None or held[0] is not model or held[1].device != model.device:
            held = self._species = (model, torch.as_tensor(model.species_index(self.numbers), device=model.device))
        return held[1]

    def set_cell(self, cell) -> None:
        """A new cell [3, 3] (same pbc and region, e.g. a barostat's): ghosts follow it at once."""
        self.domain = self.comm.domain = Domain(cell, self.domain.pbc, self.domain.lo, self.domain.hi)

    def displacement(self, positions, previous=None) -> Displacement:
        """How far atoms moved since ``build`` (and since ``previous`` [n_local, 3]) to ``positions``
        [n_local, 3] (numpy or tensors; tensors are reduced where they are, one device → host copy)."""
        pos = torch.as_tensor(positions, dtype=torch.float64, device=self.reference.device)
        moves = [pos - self.reference]
        if previous is not None:
            moves.append(pos - torch.as_tensor(previous, dtype=torch.float64, device=pos.device))
        farthest = torch.stack([(d * d).sum(dim=1).max() if len(d) else d.new_zeros(()) for d in moves])
        owned, *step = torch.sqrt(farthest).tolist()
        shift = self.images @ (self.domain.cell - self.reference_cell)
        return Displacement(owned, float(np.sqrt((shift**2).sum(axis=1)).max(initial=0.0)), step[0] if step else 0.0)

    def within(self, positions: np.ndarray, r: float) -> np.ndarray:
        """[n] bool: which of ``positions`` [n, 3] lie within ``r`` (Å, per fractional direction) of the brick."""
        lo, hi = self.grid.bounds(self.comm.rank)
        cut = self.domain.fractional_distance(r) * (1 + 1e-9) + 1e-12
        frac = self.domain.fractional(positions)
        return np.all((frac >= lo - cut) & (frac < hi + cut), axis=1)
