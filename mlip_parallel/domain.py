"""The box: cell, periodicity, fractional ("lamda") coordinates, wrapping, and the decomposed region."""
from __future__ import annotations

import numpy as np

from potentials.graph import check_positions, complete_cell

from .errors import DecompositionError

_PAD_ANGSTROM = 1e-6  # non-periodic extent padding, so a flat layer still has a width


class Domain:
    """cell: [3, 3] full-rank rows a, b, c (Å); pbc: [3] bool; lo, hi: [3] fractional bounds of the
    region split among ranks — [0, 1) along periodic dimensions, the atoms' extent (padded) along
    non-periodic ones."""

    def __init__(self, cell, pbc, lo, hi):
        self.pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)).copy()
        self.cell = complete_cell(cell, self.pbc)
        self.inverse = np.linalg.inv(self.cell)
        self.lo = np.asarray(lo, dtype=np.float64)
        self.hi = np.asarray(hi, dtype=np.float64)

    @classmethod
    def from_positions(cls, positions, cell, pbc, backend=None):
        """Build the domain for atoms at ``positions`` [N, 3] (Å). With ``backend``, each rank passes its
        own atoms and the non-periodic extent is reduced over ranks (collective)."""
        positions = check_positions(positions)
        domain = cls(cell, pbc, np.zeros(3), np.ones(3))
        s = positions @ domain.inverse
        lo = s.min(axis=0) if len(s) else np.full(3, np.inf)
        hi = s.max(axis=0) if len(s) else np.full(3, -np.inf)
        if backend is not None and backend.size > 1:
            lo = backend.allreduce(lo, op="min")
            hi = backend.allreduce(hi, op="max")
        if not np.all(np.isfinite(lo)):
            raise DecompositionError("the system has no atoms")
        pad = _PAD_ANGSTROM * np.linalg.norm(domain.inverse, axis=0)
        domain.lo = np.where(domain.pbc, 0.0, lo - pad)
        domain.hi = np.where(domain.pbc, 1.0, hi + pad)
        return domain

    def fractional(self, positions: np.ndarray) -> np.ndarray:
        """[N, 3] Å → [N, 3] fractional coordinates."""
        return positions @ self.inverse

    def wrapped_fractional(self, wrapped: np.ndarray) -> np.ndarray:
        """Fractional coordinates [N, 3] of positions already wrapped by ``wrap``, clamped into 0 ≤ s < 1
        along periodic dimensions (rounding can leave x = -1e-17 at s = -1e-18, or a point just below the
        upper face at s = 1.0): every decision of which subdomain *owns* an atom reads these (as LAMMPS's
        remap bounds lamda coordinates). The positions themselves are not moved, so the clamp goes to the
        nearest value inside; ghost selection reads the plain ``fractional`` coordinates."""
        s = self.fractional(wrapped)
        return np.where(self.pbc, np.clip(s, 0.0, np.nextafter(1.0, 0.0)), s)

    def wrap(self, positions: np.ndarray):
        """Map atoms into the cell along periodic dimensions.

        Returns (wrapped [N, 3] Å, image [N, 3] int64) with positions = wrapped + image @ cell.
        """
        s = self.fractional(positions)
        image = np.where(self.pbc, np.floor(s), 0.0)
        s_wrapped = s - image
        image = image + np.where(self.pbc & (s_wrapped >= 1.0), 1.0, 0.0)  # s = -1e-17 wraps to 1.0
        image = image.astype(np.int64)
        return positions - image @ self.cell, image

    def fractional_distance(self, r: float) -> np.ndarray:
        """[3]: the largest change of each fractional coordinate over a Cartesian distance ``r`` (Å),
        i.e. r / h_d with h_d the distance between the two cell faces normal to dimension d."""
        return r * np.linalg.norm(self.inverse, axis=0)

    def face_areas(self) -> np.ndarray:
        """[3] areas (Å²) of the decomposed region's faces normal to each dimension."""
        v = self.cell * (self.hi - self.lo)[:, None]
        return np.array([np.linalg.norm(np.cross(v[(d + 1) % 3], v[(d + 2) % 3])) for d in range(3)])
