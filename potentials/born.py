"""Born–Mayer–Huggins pairs with fixed per-element charges and their long-range Coulomb energy: the model of LAMMPS's
``pair_style born/coul/long`` with a kspace solver (NaCl's Fumi–Tosi parameters are the textbook case)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real

import torch

from .base import Potential
from .coulomb import ChargeModel, LongRangeError
from .graph import AtomGraph

PAIR_PARAMETERS = ("A", "rho", "sigma", "C", "D")  # eV, Å, Å, eV·Å⁶, eV·Å⁸


class BornCoulomb(ChargeModel, Potential):
    """E = Σ_pairs [A exp((σ − r)/ρ) − C/r⁶ + D/r⁸] over the pairs closer than ``cutoff`` (truncated: LAMMPS's
    ``born``; ``shift``: minus its value at the cutoff, LAMMPS's ``pair_modify shift yes``, so that the energy is
    continuous and MD conserves it), each shared half-half between its atoms, plus the Coulomb energy
    of the fixed ``charges`` {element: e} summed over the whole periodic structure by ``long_range`` (a
    ``potentials.coulomb.Coulomb`` or its settings; its real-space part reaches ``cutoff``). ``pairs``: {"Na-Cl": [A,
    ρ, σ, C, D], ...} for every pair of the elements (either order). float64."""

    layers = 1
    needs_long_range = True
    EVALUATION_BYTES_PER_ROW = 400
    EVALUATION_BYTES_PER_EDGE = 500
    PLAIN_BYTES_PER_EDGE = 0

    def __init__(self, charges: Mapping, pairs: Mapping, cutoff: float, shift: bool = False, long_range=None):
        if not isinstance(charges, Mapping) or not charges:
            raise LongRangeError(f"charges: a mapping {{element: charge in e}}, got {charges!r}")
        super().__init__(species=list(charges))
        for element, charge in charges.items():
            if isinstance(charge, bool) or not isinstance(charge, Real) or not math.isfinite(charge):
                raise LongRangeError(f"charges.{element}: a finite number (e), got {charge!r}")
        if isinstance(cutoff, bool) or not isinstance(cutoff, Real) or not 0 < cutoff < math.inf:
            raise LongRangeError(f"cutoff: a length > 0 (Å), got {cutoff!r}")
        if not isinstance(shift, bool):
            raise LongRangeError(f"shift: true or false, got {shift!r}")
        self.cutoff = float(cutoff)
        table = self._pair_table(pairs)
        self.register_buffer("pair_table", table)
        # each species pair's energy at the cutoff (what ``shift`` takes off; zeros without it)
        self.register_buffer("pair_shift", self._pair(torch.tensor(self.cutoff, dtype=torch.float64), *table.unbind(
            dim=2)) if shift else torch.zeros(table.shape[:2], dtype=torch.float64), persistent=False)
        self.register_buffer("charge_table", torch.tensor([float(charges[s]) for s in self.species],
                                                          dtype=torch.float64))
        self.hyperparameters = dict(charges={k: float(v) for k, v in charges.items()},
                                    pairs={k: [float(x) for x in v] for k, v in pairs.items()}, cutoff=self.cutoff,
                                    shift=shift)
        self.double()
        self.set_long_range(long_range)

    def _pair_table(self, pairs) -> torch.Tensor:
        """[S, S, 5] the parameters of each ordered pair of species; LongRangeError for a missing or malformed one."""
        if not isinstance(pairs, Mapping):
            raise LongRangeError(f"pairs: a mapping {{'Na-Cl': [A, rho, sigma, C, D], ...}}, got {pairs!r}")
        index = {s: k for k, s in enumerate(self.species)}
        table = torch.full((len(index), len(index), len(PAIR_PARAMETERS)), math.nan, dtype=torch.float64)
        for name, values in pairs.items():
            a, _, b = str(name).partition("-")
            if a not in index or b not in index:
                raise LongRangeError(f"pairs.{name}: a pair 'A-B' of the elements given charges ({', '.join(index)})")
            if (not isinstance(values, (list, tuple)) or len(values) != 5
                    or any(isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v) for v in values)):
                raise LongRangeError(f"pairs.{name}: five finite numbers [A (eV), rho (Å), sigma (Å), C (eV·Å⁶), "
                                     f"D (eV·Å⁸)], got {values!r}")
            if not values[1] > 0:
                raise LongRangeError(f"pairs.{name}: rho must be > 0 Å, got {values[1]!r}")
            table[index[a], index[b]] = table[index[b], index[a]] = torch.tensor([float(v) for v in values])
        missing = [f"{a}-{b}" for k, a in enumerate(self.species) for b in self.species[k:]
                   if math.isnan(float(table[index[a], index[b], 0]))]
        if missing:
            raise LongRangeError(f"pairs: no parameters for {', '.join(missing)} (every pair of the elements needs "
                                 "[A, rho, sigma, C, D]; zeros for none)")
        return table

    def charges(self, graph: AtomGraph) -> torch.Tensor:
        return self.charge_table[graph.species]

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        senders, receivers = graph.edge_index
        r = graph.edge_vec.to(torch.float64).norm(dim=1)
        species_i, species_j = graph.species[receivers], graph.species[senders]
        pair = self._pair(r, *self.pair_table[species_i, species_j].unbind(dim=1))
        pair = pair - self.pair_shift[species_i, species_j]
        energies = torch.zeros(graph.n_nodes, dtype=torch.float64, device=r.device).index_add(0, receivers, 0.5 * pair)
        return energies[: graph.n_local] + self.coulomb_energies(graph)

    @staticmethod
    def _pair(r, a, rho, sigma, c, d):
        r6 = r**6
        return a * torch.exp((sigma - r) / rho) - c / r6 + d / (r6 * r * r)

    def extra_repr(self) -> str:
        return f"charges={self.hyperparameters['charges']}, cutoff={self.cutoff}"
