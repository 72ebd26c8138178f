"""What ``mlip-train`` must know of a data set before its first step, from one pass over its files, shared by the
ranks and kept on disk, so that a data set is read once — not once per check, per rank or per run.

``facts(structures, procs)``: each structure's ``Facts`` — its atom count, energy label, which labels it lacks,
its squared forces, its atoms per volume and its element counts ([n] arrays, a few tens of bytes a structure). Each
file's facts are read once: every rank reads a strided share (structures rank, rank + P, ...) and the shares are
merged; then they are kept in the cache directory beside the extxyz index (``sources.cache_directory``, under the
file's path, size, modification time and label names), so a run on the same files reads none of them again before
its first step. A data part (training, validation, test: a shuffled split's view, or files read whole) takes its
structures' facts by position.

A ``Survey`` of one part, from its facts:

* its elements, each with the first structure that holds it (a new model's species; the species check);
* each structure's atom count (batches of at most ``batch_atoms`` atoms);
* per label (energy, forces, stress), how many structures lack it and the first that does (the label check);
* the least squares of the labelled energies on the element counts (``LeastSquares``: a new model's reference
  energies) and the sum of squared force components (its energy scale);
* the structures the memory check weighs: the ``MEMORY_CANDIDATES`` largest by atom count and by atom count ×
  atoms per volume (the cell's, or a cluster's bounding box's: a structure's pair count grows with both), read
  again by position, so that the check runs on 16 structures per part, not on every one.

"First" is in the files' order (of a shuffled split's part: its structures' places in the data set, so that an error
names the lowest index that fails). A structure that cannot be read stops the pass on every rank with the same error
(the first such structure of its file).
"""
from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from potentials.errors import UnknownSpeciesError

from .sources import FileSource, Source, Subset, cached_file, file_stamp, load_cached, save_cached
from .structures import DataError
from .training import QUANTITIES, predicted_energies

FACTS_VERSION = 1  # of the cached facts' layout; another version is read again
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

    def add_rows(self, rows: np.ndarray, values: np.ndarray, count: int | None = None) -> None:
        """Add the rows ``rows`` [m, c] with values [m] (as ``add`` each); ``count``: how many rows they stand for
        (m identical-row groups, each as one row √n·a, √n·mean(y): the same least squares), default m."""
        if len(rows):
            self._fold(np.vstack([np.array(self.pending).reshape(-1, self.columns + 1),
                                  np.column_stack([rows, values])]))
            self.rows += len(rows) if count is None else count

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


LACKS = {"energy": 1, "forces": 2, "stress": 4}  # the bits of Facts.lacks


@dataclass
class Facts:
    """What the survey needs of n structures ([n] arrays, in their order): ``atoms`` (count), ``energy`` (the label;
    NaN: none), ``lacks`` (``LACKS`` bits: no energy, no forces or not one 3-vector per atom, no stress on a periodic
    structure), ``force_squares`` (sum of squared force components; 0: none), ``density`` (atoms² per volume: the
    cell's, or a cluster's bounding box's), and the element counts as rows ``element_start`` [n + 1] into
    ``element_numbers`` / ``element_counts`` (each structure's atomic numbers, ascending, and their counts)."""

    atoms: np.ndarray
    energy: np.ndarray
    lacks: np.ndarray
    force_squares: np.ndarray
    density: np.ndarray
    element_start: np.ndarray
    element_numbers: np.ndarray
    element_counts: np.ndarray

    FIELDS = ("atoms", "energy", "lacks", "force_squares", "density", "element_start", "element_numbers",
              "element_counts")

    def __len__(self) -> int:
        return len(self.atoms)

    @classmethod
    def of(cls, structures) -> "Facts":
        """The facts of ``structures`` (``training.Structure`` each, an iterable)."""
        rows = {name: [] for name in ("atoms", "energy", "lacks", "force_squares", "density")}
        numbers, counts, lengths = array("B"), array("i"), []  # compact: a few bytes an element
        for s in structures:
            n = len(s.numbers)
            lacks = (LACKS["energy"] * (s.energy is None)
                     + LACKS["forces"] * (s.forces is None or s.forces.shape != s.positions.shape)
                     + LACKS["stress"] * bool(s.pbc.all() and s.stress is None))
            volume = abs(np.linalg.det(s.cell)) if s.pbc.all() else float(np.prod(np.ptp(s.positions, axis=0) + 1.0))
            for name, value in (("atoms", n), ("energy", np.nan if s.energy is None else s.energy),
                                ("lacks", lacks), ("force_squares", 0.0 if s.forces is None else np.sum(s.forces ** 2)),
                                ("density", n * n / volume)):
                rows[name].append(value)
            z, c = np.unique(s.numbers, return_counts=True)
            numbers.extend(z.tolist())
            counts.extend(c.tolist())
            lengths.append(len(z))
        return cls(np.asarray(rows["atoms"], dtype=np.int32), np.asarray(rows["energy"], dtype=np.float64),
                   np.asarray(rows["lacks"], dtype=np.uint8), np.asarray(rows["force_squares"], dtype=np.float64),
                   np.asarray(rows["density"], dtype=np.float64),
                   np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
                   np.frombuffer(numbers, dtype=np.uint8).copy(), np.frombuffer(counts, dtype=np.intc).astype(np.int32))

    def take(self, indices) -> "Facts":
        """The facts of the structures at ``indices`` [m], in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        first, lengths = self.element_start[indices], np.diff(self.element_start)[indices]
        start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.repeat(first - start[:-1], lengths) + np.arange(start[-1], dtype=np.int64)
        return Facts(self.atoms[indices], self.energy[indices], self.lacks[indices], self.force_squares[indices],
                     self.density[indices], start, self.element_numbers[flat], self.element_counts[flat])

    @staticmethod
    def joined(parts) -> "Facts":
        """The facts of ``parts`` (Facts each) one after another."""
        starts = [p.element_start[:-1] + offset for p, offset in
                  zip(parts, np.cumsum([0] + [p.element_start[-1] for p in parts]))]
        total = sum(int(p.element_start[-1]) for p in parts)
        return Facts(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("atoms", "energy", "lacks",
                                                                                       "force_squares", "density")),
                     np.concatenate(starts + [[total]]).astype(np.int64),
                     *(np.concatenate([getattr(p, name) for p in parts]) for name in ("element_numbers",
                                                                                      "element_counts")))

    def count_rows(self) -> np.ndarray:
        """[n, ELEMENTS] each structure's element counts."""
        dense = np.zeros((len(self), ELEMENTS))
        dense[np.repeat(np.arange(len(self)), np.diff(self.element_start)), self.element_numbers] = self.element_counts
        return dense


def share_facts(structures, rank: int, size: int) -> tuple:
    """(positions [m], Facts, error) of the structures at positions rank, rank + size, ... of ``structures``; one
    that cannot be read ends the share: ``error`` = (position, message), else None."""
    positions, error = [], None

    def read():  # one structure at a time: none is kept
        nonlocal error
        mine = range(rank, len(structures), size)
        # a file's structures in turn from one open file (sources.FileSource.read), others by index
        found = structures.read(mine) if hasattr(structures, "read") else (structures[p] for p in mine)
        for position in mine:
            try:
                s = next(found)
            except DataError as exc:
                error = (position, str(exc))
                return
            positions.append(position)
            yield s

    found = Facts.of(read())
    return np.asarray(positions, dtype=np.int64), found, error


def merged_facts(shares) -> Facts:
    """The ranks' ``share_facts`` as the facts of the whole; DataError: the first structure that could not be
    read (every rank alike)."""
    errors = [share[2] for share in shares if share[2] is not None]
    if errors:
        raise DataError(min(errors)[1])
    positions = np.concatenate([share[0] for share in shares])
    return Facts.joined([share[1] for share in shares]).take(np.argsort(positions, kind="stable"))


def shared(procs, mine) -> list:
    """Every rank's ``mine`` in rank order (``procs`` None or of one rank: [mine]); collective."""
    return procs.allgather(mine) if procs is not None and procs.size > 1 else [mine]


def read_facts(structures, procs) -> Facts:
    """The facts of ``structures``, each of ``procs``' ranks reading its share (collective)."""
    rank, size = (0, 1) if procs is None else (procs.rank, procs.size)
    return merged_facts(shared(procs, share_facts(structures, rank, size)))


def file_facts(part, procs) -> Facts:
    """The facts of one file's structures (a ``sources.FileSource``): from the cache (``sources.load_cached``, keyed
    by the file's absolute path, the labels' names and ``FACTS_VERSION``) when every rank's holds this very file's,
    else read (the ranks sharing it) and cached by the first rank, where writable (collective)."""
    path = os.path.abspath(part.path)
    cached = cached_file(json.dumps([path, part.keys, FACTS_VERSION], sort_keys=True), ".facts.npz")
    stamp = file_stamp(path)
    saved = load_cached(cached, stamp)
    found = Facts(*(saved[name] for name in Facts.FIELDS)) \
        if saved is not None and len(saved.get("atoms", ())) == len(part) else None
    if all(shared(procs, found is not None)):  # every rank found them (ranks may have caches of their own)
        return found
    found = read_facts(part, procs)
    if procs is None or procs.rank == 0:
        save_cached(cached, stamp, {name: getattr(found, name) for name in Facts.FIELDS})
    return found


def facts(structures, procs, known=None) -> Facts:
    """The facts of ``structures`` (a list, a ``sources.Source``, ``Subset`` or file part), by position; each file's
    read once (``file_facts``) and kept in ``known`` ({id: Facts}) for the other parts of the same files.
    Collective."""
    known = {} if known is None else known
    key = id(structures)
    if key not in known:
        if isinstance(structures, Subset):
            known[key] = facts(structures.structures, procs, known).take(structures.indices)
        elif isinstance(structures, Source):
            known[key] = Facts.joined([facts(part, procs, known) for part in structures.parts])
        elif isinstance(structures, FileSource):
            known[key] = file_facts(structures, procs)
        else:  # structures held in memory
            known[key] = read_facts(structures, procs)
    return known[key]


class Survey:
    """One part of a data set (``structures``), surveyed from its ``Facts`` (see the module docstring)."""

    def __init__(self, structures, part_facts: Facts):
        self.structures, f = structures, part_facts
        self.size = len(f)
        self.atoms = f.atoms

        # "first": in the files' order (a shuffled split's structures by their place in the data set)
        self.order = order = structures.indices if isinstance(structures, Subset) else np.arange(len(f))
        rows = np.repeat(np.arange(len(f)), np.diff(f.element_start))
        by_element = np.lexsort((order[rows], f.element_numbers))
        numbers, first = np.unique(f.element_numbers[by_element], return_index=True)
        self.first_element = {int(z): int(rows[by_element[k]]) for z, k in zip(numbers, first)}  # Z -> position
        self.missing, self.first_missing = {}, {}
        for q, bit in LACKS.items():
            lacking = np.flatnonzero(f.lacks & bit)
            self.missing[q] = len(lacking)
            if len(lacking):
                self.first_missing[q] = int(lacking[np.argmin(order[lacking])])
        # the least squares of the energies on the element counts, a chunk of structures at a time, each chunk's
        # structures of one composition as one row (√n × counts, √n × their mean energy: the same minimum)
        self.energies = LeastSquares(ELEMENTS)
        self.labelled_elements = set()  # the atomic numbers of the structures with an energy
        labelled = np.flatnonzero(~np.isnan(f.energy))
        present = np.unique(f.element_numbers)
        for lo in range(0, len(labelled), 128 * CHUNK):
            some = f.take(labelled[lo:lo + 128 * CHUNK])
            compositions, group = np.unique(some.count_rows()[:, present], axis=0, return_inverse=True)
            group = group.reshape(-1)
            n = np.bincount(group).astype(np.float64)
            mean = np.bincount(group, weights=some.energy) / n
            rows = np.zeros((len(compositions), ELEMENTS))
            rows[:, present] = compositions * np.sqrt(n)[:, None]
            self.energies.add_rows(rows, mean * np.sqrt(n), count=len(some))
            self.labelled_elements.update(present[(compositions > 0).any(axis=0)].tolist())
        has_forces = (f.lacks & LACKS["forces"]) == 0
        self.force_squares = float(np.sum(f.force_squares[has_forces]))
        self.force_components = int(3 * np.sum(f.atoms[has_forces], dtype=np.int64))
        # the largest by each ranking, ties to the earlier structure
        self.candidate_positions = sorted({int(p) for key in (f.atoms, f.density)
                                           for p in np.lexsort((np.arange(len(f)), -key))[:MEMORY_CANDIDATES]})

    def source(self, position: int) -> str:
        """The name (``PATH:k``) of the structure at ``position``."""
        return self.structures[position].source

    @property
    def elements(self) -> list:
        """The atomic numbers present, sorted."""
        return sorted(self.first_element)

    @cached_property
    def memory_candidates(self) -> list:
        """The structures the memory check weighs (each once, in the part's order; read again, once)."""
        return [self.structures[p] for p in self.candidate_positions]

    # ----------------------------------------------------------------- checks and fits
    def check_labels(self, weights: dict, keys: dict | None = None) -> None:
        """DataError naming the first structure that lacks a label whose loss weight is not 0 (stress: a periodic
        structure), the label's name where ``keys`` renames it, and how many of the part lack it."""
        what = {"energy": "no energy", "forces": "no forces (or not one finite 3-vector per atom)",
                "stress": "no stress (a periodic structure)"}
        for q in QUANTITIES:
            if weights[q] > 0 and self.missing[q]:
                path, _, index = self.source(self.first_missing[q]).rpartition(":")
                named = f" under the name {keys[q]!r}" if keys and keys.get(q, q) != q else ""
                raise DataError(f"{path}: structure {index} (counting from 0) has {what[q]}{named}, but the {q} weight "
                                f"is {weights[q]}; {self.missing[q]} of these {self.size} structures lack {q}")

    def check_species(self, model, role: str, error=DataError) -> None:
        """``error`` naming the first structure that holds an element ``model`` does not know."""
        for z, position in sorted(self.first_element.items(), key=lambda item: self.order[item[1]]):
            try:
                model.species_index(np.array([z]))
            except UnknownSpeciesError as exc:
                raise error(f"{self.source(position)} ({role}): {exc}") from None

    def reference_energies(self, numbers) -> np.ndarray:
        """Per-element reference energies [len(numbers)] (eV) of the atomic numbers ``numbers``: the least squares
        of the labelled energies on the element counts (0 for an element absent from the labelled structures)."""
        return self.energies.solve()[np.asarray(numbers, dtype=np.int64)]

    @property
    def force_rms(self) -> float | None:
        """The root mean square of the force labels' components (None: no forces)."""
        return float(np.sqrt(self.force_squares / self.force_components)) if self.force_components else None


def surveys(parts, procs) -> list:
    """The ``Survey`` of each of ``parts`` (training, validation, test), every file read at most once (collective:
    every rank returns the same surveys, or raises the same DataError)."""
    known = {}
    return [Survey(part, facts(part, procs, known)) for part in parts]


def energy_residuals(model, structures, procs, batch_size: int, device) -> LeastSquares:
    """The least squares of the energy residuals (label − ``model``'s prediction) of the labelled ``structures`` on
    their element counts, read and predicted a batch at a time, each of ``procs``' ranks its share (collective:
    merged over the ranks; ``procs`` None: this process alone, all of them)."""
    rank, size = (0, 1) if procs is None else (procs.rank, procs.size)
    mine, positions = LeastSquares(ELEMENTS), range(rank, len(structures), size)
    for start in range(0, len(positions), batch_size):
        labelled = [s for s in (structures[p] for p in positions[start:start + batch_size]) if s.energy is not None]
        if labelled:
            for s, e in zip(labelled, predicted_energies(model, labelled, batch_size, device)):
                mine.add(element_counts(s.numbers), s.energy - e)
    whole, *others = shared(procs, mine)
    for other in others:
        whole.merge(other)
    return whole
