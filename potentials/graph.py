"""The graph a model reads, the halo hook, structure checks, the neighbour list, and the strained
coordinates and edge vectors every evaluation (one process, decomposed, batched) builds graphs from.

Edge convention (torch-geometric's ``source_to_target`` flow): ``edge_index[0]`` holds senders j,
``edge_index[1]`` receivers i, and ``edge_vec[e] = r_j - r_i`` (Å) points from the receiver to the
sender, periodic image included.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch
import vesin
from ase.cell import Cell

from .errors import InvalidStructureError


class NoHalo:
    """The halo hook when every row is computed locally (no ghosts, or wide mode): the identity."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def adjoint(self, g: torch.Tensor) -> torch.Tensor:
        return g


def _whole(x: torch.Tensor) -> torch.Tensor:
    """``AtomGraph.total`` of a graph holding the whole structure: its own sums are the totals."""
    return x


def _gather_whole(x: torch.Tensor) -> tuple:
    """``AtomGraph.rank_gather`` of a graph holding the whole structure: its own rows, from row 0."""
    return x, 0


class WholeAlltoall:
    """``AtomGraph.rank_alltoall`` of a graph holding the whole structure: one rank, its pieces its own."""

    rank, size = 0, 1

    def __call__(self, pieces: list) -> list:
        return list(pieces)


@dataclass
class AtomGraph:
    """Input of every model.

    species:    [n] long, index into ``model.species`` (owned rows first, then ghosts).
    edge_index: [2, E] long, (sender j, receiver i).
    edge_vec:   [E, 3] float64, r_j - r_i in Å (differentiable w.r.t. positions and strain).
    n_local:    number of owned rows; models return per-atom energies for these rows only.
    n_receivers: rows [0, n_receivers) are the only receivers of edges (None: every row may be).
                A model may update node features of these rows only: the other rows are refreshed
                by ``halo`` before they are read again.
    halo:       ``halo(h)``, h [m, ...] with m ≥ n_receivers rows, returns [n, ...]: the owned rows
                of h, then the ghost rows freshly copied from their owners. A model calls it before
                every message-passing layer after the first, on the node features that layer reads
                from senders. ``halo.adjoint(g)``, g [n, ...], is its transpose: the owned rows of g
                plus the ghost rows added into their owners, then zero ghost rows (for a package
                whose own exchange hook takes both directions, e.g. MACE's).
    memory_budget: bytes one chunk of a block's per-edge temporaries may take (``messages.edge_sum``);
                None: every edge at once under plain autograd (needed for a second derivative or
                parameter gradients, i.e. training).
    total:      ``total(x)``: the sum of ``x`` (a tensor of per-rank partial sums, e.g. the element counts of
                the owned rows) over every rank holding a part of the structure, the same on each (collective:
                every rank calls it alike); no gradient. For a model whose parameters depend on the whole
                system (fairchem's experts routed by composition). The identity for a graph that holds all.
    structure:  [n] long, the structure each row belongs to in a graph of several structures (a training batch:
                rows and edges grouped by structure, in order), or None: one structure (a model whose parameters
                depend on the whole structure reads each structure's own).
    positions:  [≥ n_local, 3] float64, the strained positions of the rows (owned first; Å), the cell [3, 3] (or
                [B, 3, 3] with ``structure``) they are strained with, and pbc [3] bool (or [B, 3]): what a long-range
                term reads (``potentials.coulomb``); None where an evaluation does not give them.
    rank_sum:   ``rank_sum(x)``: ``x`` summed over every rank holding a part of the structure, differentiable (its
                gradient is summed back the same way; collective, in lock-step like ``halo``). The identity for a
                graph that holds all.
    rank_gather: ``rank_gather(x)`` → (every rank's ``x`` [n_r, ...] concatenated in rank order, the first row of
                this rank's), differentiable, collective; (x, 0) for a graph that holds all.
    rank_alltoall: ``rank_alltoall(pieces)``, ``pieces`` one 1-D tensor per rank → the pieces every rank sent this
                one, in rank order, differentiable, collective; its ``rank`` and ``size`` say which of how many
                ranks hold the structure (a mesh split over them: ``potentials.coulomb``). One rank for a whole graph.
    system:     per-structure inputs beside the geometry, {name: [B] an int or None per structure (None: the
                model's own default)}, B the structures of the graph (1, or those of ``structure``): ``charge``
                (e) and ``spin`` (multiplicity) as the data give them. None: every structure at the model's
                defaults. A model that takes no such input ignores them.
    """

    species: torch.Tensor
    edge_index: torch.Tensor
    edge_vec: torch.Tensor
    n_local: int
    halo: Callable[[torch.Tensor], torch.Tensor] = field(default_factory=NoHalo)
    n_receivers: int | None = None
    memory_budget: int | None = None
    total: Callable[[torch.Tensor], torch.Tensor] = field(default_factory=lambda: _whole, repr=False, compare=False)
    structure: torch.Tensor | None = None
    system: dict | None = None
    positions: torch.Tensor | None = None
    cell: torch.Tensor | None = None
    pbc: tuple | None = None
    rank_sum: Callable[[torch.Tensor], torch.Tensor] = field(default_factory=lambda: _whole, repr=False, compare=False)
    rank_gather: Callable = field(default_factory=lambda: _gather_whole, repr=False, compare=False)
    rank_alltoall: Callable = field(default_factory=WholeAlltoall, repr=False, compare=False)
    # per-edge features computed once on all edges and shared by the blocks (messages.edge_sum, plain path)
    edge_features_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_nodes(self) -> int:
        return int(self.species.shape[0])

    @property
    def receivers(self) -> int:
        """Number of leading rows whose features a layer must update."""
        return self.n_nodes if self.n_receivers is None else self.n_receivers

    def structure_sums(self, values: torch.Tensor) -> torch.Tensor:
        """[B, k]: ``values`` [n_local, k] of the owned rows summed per structure (B = 1, or the structures of
        ``structure``), then over the ranks holding the structure (``rank_sum``: differentiable; collective)."""
        n = self.n_local
        if self.structure is None:
            return self.rank_sum(values[:n].sum(dim=0, keepdim=True))
        count = len(next(iter(self.system.values()))) if self.system else int(self.structure.max()) + 1
        return self.rank_sum(values.new_zeros((count, values.shape[1])).index_add(0, self.structure[:n], values[:n]))


# AtomGraph.system's inputs and their ranges: total charge (e), spin multiplicity
SYSTEM_RANGES = {"charge": (-100, 100), "spin": (0, 100)}


def system_value(info: dict, name: str, key: str | None = None) -> int | None:
    """A structure's ``name`` (charge or spin) from its ``atoms.info`` entry ``key`` (default ``name``) as an int;
    None when absent. InvalidStructureError for one that is not a whole number in ``SYSTEM_RANGES[name]``."""
    value = info.get(key or name)
    if value is None:
        return None
    number, (low, high) = np.asarray(value), SYSTEM_RANGES[name]
    if (number.shape != () or number.dtype.kind not in "iuf" or not np.isfinite(number)
            or number != np.round(number) or not low <= number <= high):
        shown = value if isinstance(value, str) else number.tolist()
        raise InvalidStructureError(f"{name} {shown!r}: a whole number in [{low}, {high}] is needed")
    return int(number)


def system_of(info: dict) -> dict:
    """``AtomGraph.system`` of one structure from its ``atoms.info`` (charge and spin, None where absent)."""
    return {name: [system_value(info, name)] for name in SYSTEM_RANGES}


def complete_cell(cell, pbc) -> np.ndarray:
    """Return a full-rank 3×3 cell (rows = lattice vectors, Å) for the given pbc flags.

    Zero vectors along non-periodic directions are replaced by orthogonal unit vectors (ASE's
    ``Cell.complete``). Raises InvalidStructureError when a periodic direction has no length or the
    cell has zero volume.
    """
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    if not np.isfinite(cell).all():
        raise InvalidStructureError(f"cell contains non-finite values: {cell.tolist()}")
    lengths = np.linalg.norm(cell, axis=1)
    for d in range(3):
        if pbc[d] and lengths[d] < 1e-8:
            raise InvalidStructureError(
                f"zero-volume cell: direction {'xyz'[d]} is periodic but cell vector {d} is {cell[d].tolist()}")
    if cell.any(axis=1).all():  # no vector missing: Cell.complete would return a copy (the common case, made cheap)
        full = cell.copy()
    else:
        full = np.asarray(Cell(cell).complete())
        lengths = np.linalg.norm(full, axis=1)
    volume = abs(np.linalg.det(full))
    if volume < 1e-8 * max(1.0, float(np.prod(np.maximum(lengths, 1e-300)))):
        raise InvalidStructureError(f"zero-volume cell (volume {volume:.3g} Å^3): {cell.tolist()}")
    return full


def check_positions(positions) -> np.ndarray:
    """Return positions as float64 [N, 3]; raise InvalidStructureError on non-finite rows."""
    positions = np.asarray(positions, dtype=np.float64)
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise InvalidStructureError(f"positions must have shape (N, 3), got {positions.shape}")
    if not np.isfinite(positions).all():
        bad = np.flatnonzero(~np.isfinite(positions).all(axis=1))
        raise InvalidStructureError(
            f"non-finite positions (NaN or inf) for {bad.size} atom(s), first indices {bad[:5].tolist()}")
    return positions


MIN_DISTANCE = 0.5  # Å: closer atoms are a mistake in the structure (the shortest bond, H2's, is 0.74 Å)
UNBINNED_ATOMS = 64  # up to this many atoms N² pairs per image are no more than a dense structure's list: no binning


def check_structure(positions, cell, pbc, min_distance: float = MIN_DISTANCE, search: bool = True) -> tuple:
    """(positions float64 [N, 3], the complete cell [3, 3]), checked: InvalidStructureError unless ``positions``
    [N, 3] (Å) are finite, the ``cell`` [3, 3] has a real vector along every periodic direction and a volume
    (``complete_cell``), and no two atoms (periodic images included) are closer than ``min_distance`` Å (0: not
    checked); the error names the pair.

    Memory stays O(N) whatever the input (all atoms on one point included): atoms are first binned in
    cubes of side min_distance/√3, where two atoms in one cube are already too close; only when every
    cube holds at most one atom (so each atom has a bounded number of neighbours within min_distance)
    does a neighbour list look for the closest pair. ``search`` False: the binning only, for a caller that
    then passes its own neighbour list (of at least ``min_distance``) to ``check_pair_distances``; none up to
    ``UNBINNED_ATOMS`` atoms, whose list holds at most N² pairs per periodic image wherever they sit."""
    checked = check_positions(positions), complete_cell(cell, pbc)
    check_min_distance(*checked, pbc, min_distance, search)
    return checked


def check_min_distance(positions: np.ndarray, full_cell: np.ndarray, pbc, min_distance: float,
                       search: bool = True) -> None:
    """The distance part of ``check_structure``: ``positions`` [N, 3] finite, ``full_cell`` complete."""
    if not min_distance > 0 or len(positions) < 2 or (not search and len(positions) <= UNBINNED_ATOMS):
        return
    full = full_cell
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    fractional = positions @ np.linalg.inv(full)
    wrapped = (fractional - np.where(pbc, np.floor(fractional), 0.0)) @ full
    crowded = crowded_bin(np.floor(wrapped / (min_distance / np.sqrt(3.0))).astype(np.int64))
    if crowded is not None:  # two atoms in one cube: closer than its diagonal, min_distance
        a, b = crowded
        raise_too_close(a, b, float(np.linalg.norm(wrapped[b] - wrapped[a])), min_distance)
    if search:
        i, j, d = vesin.NeighborList(cutoff=float(min_distance), full_list=False).compute(
            points=positions, box=full, periodic=pbc, quantities="ijd")
        check_pair_distances(i, j, d, min_distance)


def crowded_bin(bins: np.ndarray) -> tuple | None:
    """The first two atoms (by index) of the lowest bin that holds more than one atom, or None;
    ``bins`` [N, 3] int64 the atoms' bin indices. Sorts one int64 key per atom (the bins' lexicographic order)
    where the bins' span allows, else the rows themselves."""
    low = bins.min(axis=0)
    span = bins.max(axis=0) - low + 1
    if float(np.prod(span.astype(np.float64))) < 2.0 ** 62:
        shifted = bins - low
        key = (shifted[:, 0] * span[1] + shifted[:, 1]) * span[2] + shifted[:, 2]
    else:
        key = np.unique(bins, axis=0, return_inverse=True)[1].ravel()
    order = np.argsort(key, kind="stable")
    repeated = np.flatnonzero(key[order[1:]] == key[order[:-1]])
    if not repeated.size:
        return None
    first = order[repeated[0]]
    a, b = np.flatnonzero(key == key[first])[:2]
    return int(a), int(b)


def check_pair_distances(i, j, d, min_distance: float) -> None:
    """InvalidStructureError naming the closest of the pairs (atoms ``i``, ``j``, ``d`` [E] Å apart, periodic
    images included) when it is closer than ``min_distance`` Å."""
    if not len(d):
        return
    k = int(np.argmin(d))
    if d[k] < min_distance:
        raise_too_close(i[k], j[k], d[k], min_distance)


def raise_too_close(a: int, b: int, distance: float, min_distance: float):
    """The InvalidStructureError of atoms ``a`` and ``b`` ``distance`` Å apart, closer than ``min_distance``."""
    raise InvalidStructureError(
        f"atoms {min(a, b)} and {max(a, b)} are {distance:.3g} Å apart (periodic images included), closer than "
        f"{min_distance:g} Å: atoms on top of each other (check the structure's units, lattice constant and cell)")


def neighbour_pairs(positions: torch.Tensor, cutoff: float) -> tuple:
    """(i, j) int64 [E] on ``positions``' device: pairs of rows of ``positions`` [N, 3] Å closer than
    ``cutoff`` (both directions), without periodic images (a rank's owned + ghost atoms hold them
    explicitly). Searched where the positions are (vesin-torch: on the GPU for CUDA tensors)."""
    from vesin_torch import NeighborList

    if len(positions) == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=positions.device)
        return empty, empty
    box = torch.zeros((3, 3), dtype=positions.dtype, device=positions.device)
    i, j = NeighborList(cutoff=float(cutoff), full_list=True).compute(
        points=positions.detach(), box=box, periodic=False, quantities="ij")
    return i.to(torch.int64), j.to(torch.int64)


def neighbour_list(positions: np.ndarray, cell: np.ndarray, pbc, cutoff: float, distances: bool = False):
    """Pairs closer than ``cutoff`` (both directions), via vesin.

    Returns (i, j, shifts): int64 [E], int64 [E], int64 [E, 3] with r_j - r_i + shifts @ cell the pair
    vector, and with ``distances`` their lengths float64 [E] (Å) as a fourth. Without periodicity the cell is
    ignored and shifts are zero.
    """
    pbc = [bool(p) for p in np.broadcast_to(pbc, (3,))]
    if len(positions) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return (empty, empty, np.zeros((0, 3), dtype=np.int64)) + ((np.zeros(0),) if distances else ())
    box = cell if any(pbc) else np.zeros((3, 3))
    found = vesin.NeighborList(cutoff=float(cutoff), full_list=True).compute(
        points=positions, box=box, periodic=pbc, quantities="ijSd" if distances else "ijS")
    return (found[0].astype(np.int64), found[1].astype(np.int64), found[2].astype(np.int64)) + tuple(found[3:])


class StrainedCoordinates(NamedTuple):
    """Leaves ``pos`` [N, 3] and ``strain`` (zero, the shape of the cell: [3, 3] or [B, 3, 3]), float64,
    requiring grad: dE/dpos and dE/dstrain give forces and stress. ``positions`` [N, 3] = pos (1 + ε) and
    ``cell`` = cell (1 + ε), each structure by its own ε, are what edges are built from."""

    pos: torch.Tensor
    strain: torch.Tensor
    positions: torch.Tensor
    cell: torch.Tensor


def strained_coordinates(positions, cell, device=None, batch=None) -> StrainedCoordinates:
    """Fresh leaves for ``positions`` [N, 3] Å and ``cell`` [3, 3], or cells [B, 3, 3] with ``batch`` [N]
    long, the structure of each atom (numpy or torch; ``device`` None: that of ``positions``)."""
    pos = torch.as_tensor(positions, dtype=torch.float64, device=device).detach().clone().requires_grad_(True)
    cell = torch.as_tensor(cell, dtype=torch.float64, device=pos.device)
    strain = torch.zeros_like(cell, requires_grad=True)
    deform = torch.eye(3, dtype=torch.float64, device=pos.device) + strain
    moved = pos @ deform if batch is None else torch.einsum("ni,nij->nj", pos, deform[batch])
    return StrainedCoordinates(pos, strain, moved, cell @ deform)


def edge_vectors(positions: torch.Tensor, i, j, shifts=None, cell=None, edge_batch=None) -> torch.Tensor:
    """[E, 3] r_j - r_i (+ ``shifts`` [E, 3] float64 image counts @ ``cell`` [3, 3], or @ the cell of each
    edge's structure, ``cell[edge_batch]`` of [B, 3, 3]); ``positions`` [N, 3], ``i``, ``j`` [E] long."""
    vec = positions[j] - positions[i]
    if shifts is None:
        return vec
    return vec + (shifts @ cell if edge_batch is None else torch.einsum("ei,eij->ej", shifts, cell[edge_batch]))
