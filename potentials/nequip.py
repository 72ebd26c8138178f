"""An E(3)-equivariant NequIP-style model (Batzner et al., 2022) built from e3nn's irreps operations."""
from __future__ import annotations

import math
from typing import Sequence

import torch
from e3nn import nn as enn
from e3nn import o3

from .base import BlockPotential, ScaleShiftReferences, SpeciesScaleShift
from .graph import AtomGraph
from .messages import edge_sum
from .radial import SincBasis, polynomial_cutoff


class Interaction(torch.nn.Module):
    """NequIP interaction: linear → uvu tensor product of sender features with Y(r̂), weights from a
    radial MLP → sum over neighbours / sqrt(avg_neighbors) → linear, plus a species-dependent
    self-connection. h [n, irreps_in.dim] → [n, irreps_out.dim]."""

    def __init__(self, irreps_in, irreps_out, irreps_sh, irreps_attr, radial: int, radial_hidden: int,
                 avg_neighbors: float):
        super().__init__()
        irreps_in, irreps_out, irreps_sh = o3.Irreps(irreps_in), o3.Irreps(irreps_out), o3.Irreps(irreps_sh)
        self.linear_in = o3.Linear(irreps_in, irreps_in)
        mid, instructions = [], []
        for i, (mul, ir_in) in enumerate(irreps_in):
            for j, (_, ir_sh) in enumerate(irreps_sh):
                for ir_out in ir_in * ir_sh:
                    if ir_out in irreps_out:
                        instructions.append((i, j, len(mid), "uvu", True))
                        mid.append((mul, ir_out))
        mid = o3.Irreps(mid)
        mid_sorted, permutation, _ = mid.sort()
        instructions = [(i, j, permutation[k], mode, train) for i, j, k, mode, train in instructions]
        self.tp = o3.TensorProduct(irreps_in, irreps_sh, mid_sorted, instructions,
                                   shared_weights=False, internal_weights=False)
        self.radial_net = enn.FullyConnectedNet([radial, radial_hidden, radial_hidden, self.tp.weight_numel],
                                                torch.nn.functional.silu)
        self.linear_out = o3.Linear(mid_sorted.simplify(), irreps_out)
        self.self_connection = o3.FullyConnectedTensorProduct(irreps_in, irreps_attr, irreps_out)
        self.norm = 1.0 / math.sqrt(avg_neighbors)

    def forward(self, h, attr, graph: AtomGraph, edge_features):
        """Output rows [0, graph.receivers). ``edge_features(vec [e, 3] float64)`` -> (Y(r̂) [e, sh dim],
        radial embedding [e, radial]) of edges (``edge_sum``)."""
        n = graph.receivers

        def message(feats, x_j):
            sh, radial_embedding = feats
            return self.tp(x_j, sh, self.radial_net(radial_embedding))

        summed = edge_sum(graph, edge_features, message, [self.linear_in(h)])
        return self.linear_out(summed * self.norm) + self.self_connection(h[:n], attr[:n])


class NequIP(ScaleShiftReferences, BlockPotential):
    """Node features Fx0e + Fx1o + Fx2e + … up to ``l_max``; edges carry spherical harmonics Y_l(r̂),
    l ≤ l_max, and a Bessel radial basis with NequIP's polynomial envelope.

    h0 = linear(one-hot species) (F scalars); each layer: [l > 0: h = halo(h)]; h = h + gate(interaction(h))
    (no residual in the first, where the irreps grow); e_i = scale[z_i] * MLP(scalars of h_i) + shift[z_i]
    (eV). As pipeline parts, the irreps features h cross stage boundaries as one [n, irreps.dim] tensor.
    """

    # what an evaluation keeps per row (irreps features and gates of every layer): 22 KB measured at 864 atoms with
    # the defaults (benchmarks/preflight.py; the base class's 16 KB gave 1.00 of the peak)
    EVALUATION_BYTES_PER_ROW = 32_000
    PART_MODULES = {"embed": ("embedding",), "block": ("interactions.{k}", "gates.{k}"),
                    "readout": ("readout_linear", "readout", "scale_shift")}

    def __init__(self, species: Sequence[str], cutoff: float, l_max: int = 2, features: int = 16,
                 layers: int = 3, radial: int = 8, radial_hidden: int = 32, avg_neighbors: float = 12.0,
                 *, parts=None, seed: int | None = None):
        super().__init__(species)
        if not species or not 0 < cutoff < math.inf or l_max < 0 or features < 1 or layers < 1 \
                or not 0 < avg_neighbors < math.inf:
            raise ValueError(f"invalid NequIP hyper-parameters: species={species}, cutoff={cutoff}, l_max={l_max}, "
                             f"features={features}, layers={layers}, avg_neighbors={avg_neighbors}")
        self.cutoff, self.l_max, self.features, self.layers = float(cutoff), int(l_max), int(features), int(layers)
        self.hyperparameters = dict(species=self.species, cutoff=self.cutoff, l_max=self.l_max, features=self.features,
                                    layers=self.layers, radial=int(radial), radial_hidden=int(radial_hidden),
                                    avg_neighbors=float(avg_neighbors))
        self._init_parts(parts, seed)  # ``parts``: the parts to build (a pipeline stage's); see BlockPotential
        n = len(self.species)
        self.irreps_attr = o3.Irreps(f"{n}x0e")
        self.irreps_sh = o3.Irreps.spherical_harmonics(l_max)
        scalars = o3.Irreps(f"{features}x0e")
        gated = o3.Irreps([(features, (l, (-1) ** l)) for l in range(1, l_max + 1)])
        self.irreps_hidden = (scalars + gated).simplify()
        self.radial_basis = SincBasis(self.cutoff, radial)

        def gate():
            return enn.Gate(scalars, [torch.nn.functional.silu], o3.Irreps(f"{gated.num_irreps}x0e"),
                            [torch.sigmoid], gated)

        # block k maps irreps_in(k) → gate.irreps_out; the first reads the embedding's scalars
        self.irreps_in = [scalars] + [gate().irreps_out] * layers
        self.embedding = self._build("embed", lambda: o3.Linear(self.irreps_attr, scalars))
        self.interactions = self._build_blocks(lambda k: Interaction(
            self.irreps_in[k], gate().irreps_in, self.irreps_sh, self.irreps_attr, radial, radial_hidden, avg_neighbors))
        self.gates = self._build_blocks(lambda k: gate())
        self.readout_linear, self.readout, self.scale_shift = self._build("readout", lambda: (
            o3.Linear(self.irreps_in[layers], scalars), torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(features, 1)),
            SpeciesScaleShift(n))) or (None, None, None)

    def feature_width(self, k: int) -> int:
        return self.irreps_in[k].dim

    def __deepcopy__(self, memo):
        """A copy rebuilt from the hyper-parameters and the state (an EMA copy, say): e3nn's generated
        code does not deep-copy cleanly (for l_max ≥ 3 its constants come back as extra buffers)."""
        clone = NequIP(**self.hyperparameters, parts=self.parts, seed=self.seed).to(self.dtype).to(self.device)
        clone.load_state_dict(self.state_dict())
        clone.train(self.training)
        for mine, theirs in zip(clone.parameters(), self.parameters()):
            mine.requires_grad_(theirs.requires_grad)
        memo[id(self)] = clone
        return clone

    def edge_features(self, vec: torch.Tensor):
        """(Y_l(r̂) [e, sh dim], Bessel basis × polynomial envelope [e, radial]) of edge vectors [e, 3]."""
        vec = vec.to(self.dtype)
        r = vec.norm(dim=1)
        sh = o3.spherical_harmonics(self.irreps_sh, vec, normalize=True, normalization="component")
        return sh, self.radial_basis(r) * polynomial_cutoff(r, self.cutoff)[:, None]

    def context(self, graph: AtomGraph):
        """One-hot species [n, species] (the edge features are recomputed inside each block's edge step)."""
        return torch.nn.functional.one_hot(graph.species, len(self.species)).to(self.dtype)

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        return self.embedding(ctx)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        if k > 0:
            h = graph.halo(h)
        update = self.gates[str(k)](self.interactions[str(k)](h, ctx, graph, self.edge_features))
        return update + h[: update.shape[0]] if update.shape[1] == h.shape[1] else update

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        n_local = graph.n_local
        out = self.readout(self.readout_linear(h[:n_local])).squeeze(-1)
        return self.scale_shift(out, graph.species[:n_local])
