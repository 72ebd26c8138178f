"""What ``mlip-train`` must know of a data set before its first step, from one pass over it: each rank reads a
strided share (structures rank, rank + P, ...) and the shares are merged over the ranks, so a streamed set is read
once, by all ranks together, however many checks and fits need it.

A ``Survey`` of one part (training, validation or test) holds:

* its elements, each with the first structure that holds it (a new model's species; the species check);
* each structure's atom count (batches of at most ``batch_atoms`` atoms);
* per label (energy, forces, stress), how many structures lack it and the first that does (the label check);
* the least squares of the labelled energies on the element counts (``LeastSquares``: a new model's reference
  energies) and the sum of squared force components (its energy scale);
* the structures the memory check weighs: the ``MEMORY_CANDIDATES`` largest by atom count and by atom count ×
  atoms per volume (the cell's, or a cluster's bounding box's: a structure's pair count grows with both), so that
  the check runs on 16 structures per part, not on every one.

"First" is by position in the part (its own order: a shuffled split's). A structure that cannot be read stops the
pass on every rank with the same error (the first such structure's).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .training import QUANTITIES, DataError

MEMORY_CANDIDATES = 8  # structures kept per ranking for the memory check
ELEMENTS = 119  # least-squares columns: atomic numbers 0..118
CHUNK = 512  # rows folded into the QR factor at a time


class LeastSquares:
    """Least squares of y ≈ A x (A [m, c], y [m]) accumulated row by row in bounded memory: a tall-skinny QR,
    keeping only the triangular factor of [A | y] ([c + 1, c + 1]). ``merge`` adds another accumulator's rows (a
    rank's); ``solve`` gives what ``np.linalg.lstsq(A, y)`` gives on all the rows (the minimum-norm solution; equal to
    rounding, as A and R share their singular values)."""

    def __init__(self, columns: int):
        self.columns, self.rows, self.factor, self.pending = columns, 0, np.zeros((0, columns + 1)), []

    def add(self, row, value: float) -> None:
        self.pending.append(np.append(np.asarray(row, dtype=np.float64), value))
        self.rows += 1
        if len(self.pending) >= CHUNK:
            self._fold(np.array(self.pending))

    def _fold(self, rows: np.ndarray) -> None:
        self.pending = []
        stacked = np.vstack([self.factor, rows])
        self.factor = np.linalg.qr(stacked, mode="r") if len(stacked) else stacked

    def merge(self, other: "LeastSquares") -> None:
        other._fold(np.array(other.pending).reshape(-1, other.columns + 1))
        self._fold(np.vstack([np.array(self.pending).reshape(-1, self.columns + 1), other.factor]))
        self.rows += other.rows

    def solve(self) -> np.ndarray:
        """x [c] (zeros where no row was added)."""
        self._fold(np.array(self.pending).reshape(-1, self.columns + 1))
        if not len(self.factor):
            return np.zeros(self.columns)
        # the singular-value cut-off numpy's lstsq takes on all the rows (eps × max(rows, columns)), not R's own
        # (eps × columns): R's rounding grows with the rows folded in (in the tests, exact dependences stay exact)
        cutoff = np.finfo(np.float64).eps * max(self.rows, self.columns)
        return np.linalg.lstsq(self.factor[:, :-1], self.factor[:, -1], rcond=cutoff)[0]


def element_counts(numbers) -> np.ndarray:
    """[ELEMENTS] how many atoms of each atomic number."""
    return np.bincount(numbers, minlength=ELEMENTS).astype(np.float64)


@dataclass
class Survey:
    """One part of a data set, surveyed (see the module docstring). ``first_*``: (position in the part, source)."""

    size: int = 0
    first_element: dict = field(default_factory=dict)  # Z -> (position, source)
    missing: dict = field(default_factory=lambda: dict.fromkeys(QUANTITIES, 0))
    first_missing: dict = field(default_factory=dict)  # quantity -> (position, source)
    energies: LeastSquares = field(default_factory=lambda: LeastSquares(ELEMENTS))
    force_squares: float = 0.0
    force_components: int = 0
    candidates: dict = field(default_factory=lambda: {"atoms": [], "density": []})  # heaps of (key, position, s)
    error: tuple | None = None  # (position, message) of the first structure that could not be read
    atoms: list = field(default_factory=list)  # a share's atom counts in its order; merged: [len(part)] all of them

    @property
    def elements(self) -> list:
        """The atomic numbers present, sorted."""
        return sorted(self.first_element)

    def look_at(self, position: int, s) -> None:
        """Add structure ``s`` (a ``training.Structure``) at ``position`` in the part."""
        self.size += 1
        for z in np.unique(s.numbers):
            if int(z) not in self.first_element:
                self.first_element[int(z)] = (position, s.source)
        for q, lacks in (("energy", s.energy is None), ("forces", s.forces is None or s.forces.shape != s.positions.shape),
                         ("stress", s.pbc.all() and s.stress is None)):
            if lacks:
                self.missing[q] += 1
                self.first_missing.setdefault(q, (position, s.source))
        if s.energy is not None:
            self.energies.add(element_counts(s.numbers), s.energy)
        if s.forces is not None:
            self.force_squares += float(np.sum(s.forces ** 2))
            self.force_components += s.forces.size
        # the volume the atoms fill: the cell's when periodic, else their bounding box's (a ranking, not a model)
        volume = abs(np.linalg.det(s.cell)) if s.pbc.all() else float(np.prod(np.ptp(s.positions, axis=0) + 1.0))
        n = len(s.numbers)
        self.atoms.append(n)
        for ranking, key in (("atoms", float(n)), ("density", n * n / volume)):
            self._keep(ranking, (key, -position, s))

    def _keep(self, ranking: str, entry) -> None:
        heap = self.candidates[ranking]
        entry = (entry[0], entry[1], id(entry[2]), entry[2])  # ties: the earlier structure; never compare structures
        (heapq.heappush if len(heap) < MEMORY_CANDIDATES else heapq.heappushpop)(heap, entry)

    def merge(self, other: "Survey") -> None:
        """Add another rank's survey of the other structures of the same part."""
        self.size += other.size
        for z, first in other.first_element.items():
            self.first_element[z] = min(self.first_element.get(z, first), first)
        for q in QUANTITIES:
            self.missing[q] += other.missing[q]
            if q in other.first_missing:
                self.first_missing[q] = min(self.first_missing.get(q, other.first_missing[q]), other.first_missing[q])
        self.energies.merge(other.energies)
        self.force_squares += other.force_squares
        self.force_components += other.force_components
        for ranking, heap in other.candidates.items():
            for key, minus_position, _, s in heap:
                self._keep(ranking, (key, minus_position, s))
        if other.error is not None and (self.error is None or other.error < self.error):
            self.error = other.error

    @property
    def memory_candidates(self) -> list:
        """The structures the memory check weighs (each once, in the part's order)."""
        kept = {-e[1]: e[3] for heap in self.candidates.values() for e in heap}
        return [kept[p] for p in sorted(kept)]

    # ----------------------------------------------------------------- checks and fits
    def check_labels(self, weights: dict, keys: dict | None = None) -> None:
        """DataError naming the first structure that lacks a label whose loss weight is not 0 (stress: a periodic
        structure), the label's name where ``keys`` renames it, and how many of the part lack it."""
        what = {"energy": "no energy", "forces": "no forces (or not one finite 3-vector per atom)",
                "stress": "no stress (a periodic structure)"}
        for q in QUANTITIES:
            if weights[q] > 0 and self.missing[q]:
                path, _, index = self.first_missing[q][1].rpartition(":")
                named = f" under the name {keys[q]!r}" if keys and keys.get(q, q) != q else ""
                raise DataError(f"{path}: structure {index} (counting from 0) has {what[q]}{named}, but the {q} weight "
                                f"is {weights[q]}; {self.missing[q]} of these {self.size} structures lack {q}")

    def check_species(self, model, role: str, error=DataError) -> None:
        """``error`` naming the first structure that holds an element ``model`` does not know."""
        from potentials.errors import UnknownSpeciesError

        for z, (_, source) in sorted(self.first_element.items(), key=lambda item: item[1]):
            try:
                model.species_index(np.array([z]))
            except UnknownSpeciesError as exc:
                raise error(f"{source} ({role}): {exc}") from None

    def reference_energies(self, numbers) -> np.ndarray:
        """Per-element reference energies [len(numbers)] (eV) of the atomic numbers ``numbers``: the least squares
        of the labelled energies on the element counts (0 for an element absent from the labelled structures)."""
        return self.energies.solve()[np.asarray(numbers, dtype=np.int64)]

    @property
    def force_rms(self) -> float | None:
        """The root mean square of the force labels' components (None: no forces)."""
        return float(np.sqrt(self.force_squares / self.force_components)) if self.force_components else None


def survey_share(structures, rank: int, size: int) -> Survey:
    """The ``Survey`` of the structures at positions rank, rank + size, ... of ``structures`` (a list, a
    ``sources.Source`` or ``Subset``); one that cannot be read ends the share, its error kept."""
    mine = Survey()
    for position in range(rank, len(structures), size):
        try:
            mine.look_at(position, structures[position])
        except DataError as exc:
            mine.error = (position, str(exc))
            break
    return mine


def merged(shares) -> Survey:
    """The ranks' shares (in rank order; share r holds positions r, r + P, ...) as one survey; DataError: the first
    structure that could not be read."""
    atoms = np.zeros(sum(len(share.atoms) for share in shares), dtype=np.int32)
    whole = shares[0]
    for other in shares[1:]:
        whole.merge(other)
    if whole.error is not None:
        raise DataError(whole.error[1])
    for r, share in enumerate(shares):  # (every share complete: no error)
        atoms[r::len(shares)] = share.atoms
    whole.atoms = atoms
    return whole


def survey(structures, procs) -> Survey:
    """The ``Survey`` of ``structures``, each of ``procs``' ranks reading its share (collective: every rank returns
    the same survey, or raises the same DataError)."""
    mine = survey_share(structures, procs.rank, procs.size)
    return merged(procs.allgather(mine) if procs.size > 1 else [mine])


def energy_residuals(model, structures, procs, batch_size: int, device) -> LeastSquares:
    """The least squares of the energy residuals (label − ``model``'s prediction) of the labelled ``structures`` on
    their element counts, read and predicted a batch at a time, each of ``procs``' ranks its share (collective:
    merged over the ranks; ``procs`` None: this process alone, all of them)."""
    from .training import predicted_energies

    rank, size = (0, 1) if procs is None else (procs.rank, procs.size)
    mine, positions = LeastSquares(ELEMENTS), range(rank, len(structures), size)
    for start in range(0, len(positions), batch_size):
        labelled = [s for s in (structures[p] for p in positions[start:start + batch_size]) if s.energy is not None]
        if labelled:
            for s, e in zip(labelled, predicted_energies(model, labelled, batch_size, device)):
                mine.add(element_counts(s.numbers), s.energy - e)
    if size == 1:
        return mine
    shares = procs.allgather(mine)
    for other in shares[1:]:
        shares[0].merge(other)
    return shares[0]
