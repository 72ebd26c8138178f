"""SchNet (Schütt et al., 2018) built from torch-geometric's interaction blocks, with a halo hook."""
from __future__ import annotations

from typing import Sequence

import torch
from torch_geometric.nn.models.schnet import InteractionBlock, ShiftedSoftplus

from .base import BlockPotential, SpeciesScaleShift
from .graph import AtomGraph
from .radial import GaussianBasis


class SchNet(BlockPotential):
    """Continuous-filter convolutions over edges within ``cutoff`` (cosine envelope, Gaussian RBFs).

    h0 = embedding(species); for each layer l: [l > 0: h = halo(h)]; h = h + interaction_l(h, edges);
    e_i = scale[z_i] * MLP(h_i) + shift[z_i]   (eV, ``scale_shift``).
    """

    PART_MODULES = {"embed": ("embedding",), "block": ("interactions.{k}",), "readout": ("readout", "scale_shift")}

    def __init__(self, species: Sequence[str], cutoff: float, features: int = 64, layers: int = 3,
                 rbf: int = 50, filters: int | None = None, *, parts=None, seed: int | None = None):
        super().__init__(species)
        if not species:
            raise ValueError("SchNet needs a non-empty species list")
        if cutoff <= 0 or features < 2 or layers < 1 or rbf < 2:
            raise ValueError(f"invalid SchNet hyper-parameters: cutoff={cutoff}, features={features}, "
                             f"layers={layers}, rbf={rbf}")
        self.cutoff, self.features, self.layers = float(cutoff), int(features), int(layers)
        self.hyperparameters = dict(species=self.species, cutoff=self.cutoff, features=self.features,
                                    layers=self.layers, rbf=int(rbf), filters=filters)
        self._init_parts(parts, seed)  # ``parts``: the parts to build (a pipeline stage's); see BlockPotential
        self.distance_expansion = GaussianBasis(0.0, self.cutoff, rbf)
        self.embedding = self._build("embed", lambda: torch.nn.Embedding(len(self.species), features))
        self.interactions = self._build_blocks(lambda k: InteractionBlock(features, rbf, filters or features, self.cutoff))
        self.readout, self.scale_shift = self._build("readout", lambda: (torch.nn.Sequential(
            torch.nn.Linear(features, features // 2), ShiftedSoftplus(), torch.nn.Linear(features // 2, 1)),
            SpeciesScaleShift(len(self.species)))) or (None, None)

    def feature_width(self, k: int) -> int:
        return self.features

    def context(self, graph: AtomGraph):
        distance = graph.edge_vec.to(self.dtype).norm(dim=1)
        return distance, self.distance_expansion(distance)

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        return self.embedding(graph.species)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        if k > 0:
            h = graph.halo(h)
        distance, expanded = ctx
        return h + self.interactions[str(k)](h, graph.edge_index, distance, expanded)

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        out = self.readout(h[: graph.n_local]).squeeze(-1)
        return self.scale_shift(out, graph.species[: graph.n_local])
