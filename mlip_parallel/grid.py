"""The processor grid: P ranks as px × py × pz bricks with cut planes in fractional coordinates.

Rank ↔ coordinates follow MPI_Cart's row-major order: rank = (cx * py + cy) * pz + cz.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from .domain import Domain
from .errors import DecompositionError


def choose_dims(size: int, domain: Domain) -> tuple[int, int, int]:
    """The px × py × pz = size that minimises the surface of one subdomain (ties: the first found)."""
    areas = domain.face_areas()
    best, best_surface = None, math.inf
    for px in range(1, size + 1):
        if size % px:
            continue
        for py in range(1, size // px + 1):
            if (size // px) % py:
                continue
            p = (px, py, size // px // py)
            surface = sum(areas[d] / (p[(d + 1) % 3] * p[(d + 2) % 3]) for d in range(3))
            if surface < best_surface * (1 - 1e-12):
                best, best_surface = p, surface
    return best


class Grid:
    """dims: (px, py, pz); periodic: [3] bool; planes: three arrays of p_d + 1 increasing fractional
    cut positions (planes[d][0] = lower end of the region, planes[d][-1] = upper end). Plain data: the
    same on every rank. Non-uniform planes (load balance) keep the brick neighbour structure."""

    def __init__(self, dims, periodic, planes):
        self.dims = tuple(int(p) for p in dims)
        self.periodic = np.asarray(periodic, dtype=bool)
        self.planes = [np.asarray(pl, dtype=np.float64) for pl in planes]
        for d in range(3):
            if len(self.planes[d]) != self.dims[d] + 1 or np.any(np.diff(self.planes[d]) <= 0):
                raise DecompositionError(f"cut planes along {'xyz'[d]} must be {self.dims[d] + 1} increasing "
                                         f"values, got {self.planes[d].tolist()}")

    @classmethod
    def uniform(cls, dims, domain: Domain):
        dims = tuple(dims)
        if len(dims) != 3 or any(int(p) != p or p < 1 for p in dims):
            raise DecompositionError(f"grid must be three positive integers, got {dims}")
        return cls.from_cuts(dims, domain, [np.arange(p + 1) / p for p in dims])

    @classmethod
    def from_cuts(cls, dims, domain: Domain, cuts):
        """Cut planes given relative to the decomposed region: ``cuts[d]`` = p_d + 1 increasing values
        from 0 to 1 (0 = ``domain.lo[d]``, 1 = ``domain.hi[d]``)."""
        planes = [domain.lo[d] + (domain.hi[d] - domain.lo[d]) * np.asarray(cuts[d], dtype=np.float64)
                  for d in range(3)]
        return cls(dims, domain.pbc, planes)

    @staticmethod
    def balanced_cuts(dims, domain: Domain, positions: np.ndarray, backend=None, bins: int = 4096):
        """Relative cut planes (see ``from_cuts``) that give every slab along each dimension a similar
        number of atoms (LAMMPS ``balance shift``, one dimension at a time).

        ``positions``: [n, 3] Å, wrapped; with ``backend`` each rank passes its own atoms and the
        per-dimension histograms (``bins`` bins) are summed over ranks (collective). The planes are at
        the histogram's quantiles, so counts match to about one bin's worth of atoms; no slab is
        thinner than one bin.
        """
        span = domain.hi - domain.lo
        t = (domain.fractional(np.asarray(positions, dtype=np.float64)) - domain.lo) / span
        cuts = []
        for d, p in enumerate(dims):
            if p == 1:
                cuts.append(np.array([0.0, 1.0]))
                continue
            counts = np.histogram(np.clip(t[:, d], 0.0, 1.0), bins=bins, range=(0.0, 1.0))[0].astype(np.float64)
            if backend is not None and backend.size > 1:
                counts = backend.allreduce(counts)
            cumulative = np.concatenate([[0.0], np.cumsum(counts)])
            targets = cumulative[-1] * np.arange(1, p) / p
            k = np.clip(np.searchsorted(cumulative, targets, side="left"), 1, bins)  # target in bin k - 1
            inside = (targets - cumulative[k - 1]) / np.maximum(counts[k - 1], 1.0)
            inner = (k - 1 + np.clip(inside, 0.0, 1.0)) / bins
            width = 1.0 / bins
            for i in range(p - 1):  # strictly increasing, each slab at least one bin wide
                low = (inner[i - 1] if i else 0.0) + width
                inner[i] = max(inner[i], low)
            for i in reversed(range(p - 1)):
                high = (inner[i + 1] if i < p - 2 else 1.0) - width
                inner[i] = min(inner[i], high)
            cuts.append(np.concatenate([[0.0], inner, [1.0]]))
        return cuts

    @classmethod
    def for_ranks(cls, size: int, domain: Domain, dims=None):
        """The grid for ``size`` ranks: ``dims`` if given (its product must be ``size``), else the
        minimum-surface one."""
        if dims is None:
            dims = choose_dims(size, domain)
        elif int(np.prod(dims)) != size:
            raise DecompositionError(f"grid {tuple(dims)} has {int(np.prod(dims))} subdomains but the job "
                                     f"has {size} rank(s)")
        return cls.uniform(dims, domain)

    @property
    def size(self) -> int:
        return int(np.prod(self.dims))

    def coords(self, rank: int) -> tuple[int, int, int]:
        px, py, pz = self.dims
        return rank // (py * pz), (rank // pz) % py, rank % pz

    def rank_of(self, coords) -> int:
        _, py, pz = self.dims
        return (coords[0] * py + coords[1]) * pz + coords[2]

    def neighbour(self, rank: int, dim: int, step: int):
        """Rank one brick away along ``dim`` (step ±1), wrapping along periodic dimensions; None past a
        non-periodic end."""
        c = list(self.coords(rank))
        c[dim] += step
        if not 0 <= c[dim] < self.dims[dim]:
            if not self.periodic[dim]:
                return None
            c[dim] %= self.dims[dim]
        return self.rank_of(c)

    def bounds(self, rank: int):
        """Fractional (lo [3], hi [3]) of ``rank``'s subdomain."""
        c = self.coords(rank)
        lo = np.array([self.planes[d][c[d]] for d in range(3)])
        hi = np.array([self.planes[d][c[d] + 1] for d in range(3)])
        return lo, hi

    def owner(self, frac: np.ndarray) -> np.ndarray:
        """[N, 3] fractional coordinates (wrapped along periodic dims) → [N] owning rank. Points on a
        cut plane belong to the upper subdomain; points past the region's ends to the end subdomain."""
        c = [np.searchsorted(self.planes[d][1:-1], frac[:, d], side="right") for d in range(3)]
        return self.rank_of(c)

    def hops(self, dim: int, cut: float) -> int:
        """Swaps per direction along ``dim`` so every rank receives all atoms within fractional distance
        ``cut`` of its faces: the most neighbour bricks any rank must reach (wrapping as often as the
        cut needs along periodic dimensions)."""
        widths = np.diff(self.planes[dim])
        p = len(widths)
        if not self.periodic[dim]:
            if p == 1:
                return 0
            need = 0
            for c in range(p):
                for side in (-1, 1):
                    covered, k = 0.0, 0
                    while covered < cut and 0 <= c + side * (k + 1) < p:
                        k += 1
                        covered += widths[c + side * k]
                    need = max(need, k)
            return need
        need = 0
        for c, side in itertools.product(range(p), (-1, 1)):
            covered, k = 0.0, 0
            while covered < cut:
                k += 1
                covered += widths[(c + side * k) % p]
            need = max(need, k)
        return need
