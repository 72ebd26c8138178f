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
        planes = [domain.lo[d] + (domain.hi[d] - domain.lo[d]) * np.arange(dims[d] + 1) / dims[d]
                  for d in range(3)]
        return cls(dims, domain.pbc, planes)

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
