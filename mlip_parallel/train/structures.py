"""Training structures as records: ``Structure`` (one labelled structure: geometry, labels, its source), made from a
frame ASE read (``structure_of``: checked, the labels found by their names), and the errors of unusable data. Where they
come from (files, databases, streamed or held) is ``sources.py``; what training does with them, ``training.py``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from potentials.graph import SYSTEM_RANGES, check_positions, complete_cell, neighbour_list, system_value

from ..errors import MLIPError


class DataError(MLIPError, ValueError):
    """Training data that cannot be used; the message names the file and the structure."""


class DataErrorMidRun(DataError):
    """A structure that could not be read once training ran (a streamed file changed under the run), found by the
    rank that read it: the whole job ends (``launch.end_job``); the message names the last checkpoint."""

    ends_job = True


@dataclass
class Structure:
    """One labelled structure. numbers [n]; positions [n, 3] Å; cell [3, 3]; pbc [3]; energy (eV) or
    None; forces [n, 3] eV/Å or None; stress [3, 3] eV/Å³ (ASE sign) or None. ``source``: file:index."""

    numbers: np.ndarray
    positions: np.ndarray
    cell: np.ndarray
    pbc: np.ndarray
    energy: float | None
    forces: np.ndarray | None
    stress: np.ndarray | None
    source: str
    config_type: str | None = None  # its kind, for ``loss.config_type_weights`` (MACE's and nequip's config_type)
    charge: int | None = None  # total charge (e), for a model that reads it (None: the model's default)
    spin: int | None = None  # spin multiplicity, likewise
    _edges: tuple | None = None

    def edges(self, cutoff: float):
        """(i, j, shifts) of the pairs within ``cutoff`` (cached: the geometry never changes)."""
        if self._edges is None or self._edges[0] != cutoff:
            self._edges = (cutoff, neighbour_list(self.positions, self.cell, self.pbc, cutoff))
        return self._edges[1]

    def system(self) -> dict:
        """Its inputs beside the geometry, as ``AtomGraph.system`` holds them for a graph of this structure."""
        return {name: [getattr(self, name)] for name in SYSTEM_RANGES}

    def to_atoms(self):
        from ase import Atoms
        return Atoms(numbers=self.numbers, positions=self.positions, cell=self.cell, pbc=self.pbc)


def _full_stress(stress) -> np.ndarray:
    """A stress as given by ASE (6 Voigt components or 3 × 3) → [3, 3]."""
    from ase.stress import voigt_6_to_full_3x3_stress

    s = np.asarray(stress, dtype=np.float64).reshape(-1)
    return s.reshape(3, 3) if s.size == 9 else voigt_6_to_full_3x3_stress(s)


def label(atoms, results: dict, name: str):
    """The label ``name`` of a frame: its calculator's result, else its info or arrays entry (None: unlabelled)."""
    for table in (results, atoms.info, atoms.arrays):
        if name in table:
            return table[name]
    return None


def structure_of(atoms, path: str, k: int, keys: dict | None = None) -> Structure:
    """Frame ``k`` of ``path`` (ASE Atoms) as a ``Structure`` named ``path:k``, its labels by ``keys`` ({quantity:
    name}, and config_type's, charge's and spin's, ``atoms.info`` entries; default their own names); DataError for no
    atoms, bad positions or cell, a non-finite label, or a charge or spin that is not a whole number in range."""
    keys = keys or {}
    results = dict(atoms.calc.results) if atoms.calc is not None else {}
    energy, forces, stress = (label(atoms, results, keys.get(q, q)) for q in ("energy", "forces", "stress"))
    source = f"{path}:{k}"
    if len(atoms) == 0:
        raise DataError(f"{source}: a structure with no atoms")
    try:
        positions = check_positions(atoms.positions)
        cell = complete_cell(atoms.cell[:], atoms.pbc)
    except MLIPError as exc:
        raise DataError(f"{path}: structure {k} (counting from 0): {exc}") from None
    for quantity, value in (("energy", energy), ("forces", forces), ("stress", stress)):
        values = None if value is None else np.asarray(value, dtype=np.float64)
        if values is not None and not np.isfinite(values).all():
            where = ""
            if quantity == "forces" and values.ndim == 2:
                atom = int(np.flatnonzero(~np.all(np.isfinite(values), axis=1))[0])
                where = f" (atom {atom} first)"
            raise DataError(f"{path}: structure {k} (counting from 0) has a non-finite {quantity} label"
                            f"{where}: {values.ravel()[~np.isfinite(values.ravel())][0]}")
    def contiguous(values):  # the same memory layout from every format: the same order of numpy's sums
        return None if values is None else np.ascontiguousarray(values, dtype=np.float64)

    try:
        system = {name: system_value(atoms.info, name, keys.get(name)) for name in SYSTEM_RANGES}
    except MLIPError as exc:
        raise DataError(f"{path}: structure {k} (counting from 0) has {exc}") from None
    config_type = atoms.info.get(keys.get("config_type", "config_type"))
    return Structure(np.ascontiguousarray(atoms.numbers, dtype=np.int64), contiguous(positions), contiguous(cell),
                     np.array(atoms.pbc, dtype=bool), None if energy is None else float(np.asarray(energy).reshape(())),
                     contiguous(forces), contiguous(_full_stress(stress)) if stress is not None and atoms.pbc.all()
                     else None, source, None if config_type is None else str(config_type), **system)
