"""Lennard-Jones pair potential, shifted to zero at the cutoff (ASE's ``LennardJones(smooth=False)``)."""
from __future__ import annotations

import math
from numbers import Real

import torch

from .base import Potential
from .graph import AtomGraph


class LennardJones(Potential):
    """phi(r) = 4 eps [(sigma/r)^12 - (sigma/r)^6] - phi_LJ(cutoff) for r < cutoff, shared half-half
    between the two atoms of a pair. Element-agnostic; float64 by default (it is the reference)."""

    layers = 1
    EVALUATION_BYTES_PER_ROW = 200
    EVALUATION_BYTES_PER_EDGE = 300  # its pair terms over all edges at once, under autograd (float64)
    PLAIN_BYTES_PER_EDGE = 0

    def __init__(self, epsilon: float = 1.0, sigma: float = 1.0, cutoff: float = 3.0):
        super().__init__(species=None)
        for name, value in (("epsilon", epsilon), ("sigma", sigma), ("cutoff", cutoff)):
            if isinstance(value, bool) or not isinstance(value, Real) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self.epsilon, self.sigma, self.cutoff = float(epsilon), float(sigma), float(cutoff)
        self.hyperparameters = dict(epsilon=self.epsilon, sigma=self.sigma, cutoff=self.cutoff)
        self.double()

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        r2 = graph.edge_vec.to(self.dtype).pow(2).sum(dim=1)
        c6 = (self.sigma**2 / r2) ** 3
        e0 = (self.sigma / self.cutoff) ** 6
        pair = 4.0 * self.epsilon * (c6 * c6 - c6 - (e0 * e0 - e0))
        receivers = graph.edge_index[1]
        energies = torch.zeros(graph.n_nodes, dtype=pair.dtype, device=pair.device)
        energies = energies.index_add(0, receivers, 0.5 * pair)
        return energies[: graph.n_local]

    def extra_repr(self) -> str:
        return f"epsilon={self.epsilon}, sigma={self.sigma}, cutoff={self.cutoff}"
