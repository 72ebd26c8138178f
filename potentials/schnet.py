"""SchNet (Schütt et al., 2018) with torch-geometric's interaction blocks' parameters, with a halo hook."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .base import BlockPotential, ScaleShiftReferences, SpeciesScaleShift
from .graph import AtomGraph
from .messages import edge_sum
from .radial import GaussianBasis, cosine_cutoff


class SchNet(ScaleShiftReferences, BlockPotential):
    """Continuous-filter convolutions over edges within ``cutoff`` (cosine envelope, Gaussian RBFs).

    h0 = embedding(species); for each layer l: [l > 0: h = halo(h)]; h = h + interaction_l(h, edges);
    e_i = scale[z_i] * MLP(h_i) + shift[z_i]   (eV, ``scale_shift``). The interactions hold the parameters of
    torch-geometric's ``InteractionBlock`` (``InteractionBlock`` below: its state-dict keys, and its weights from the
    same seed), evaluated here with the edge step as one ``edge_sum`` so that it can run in memory-bounded chunks:
    lin(act(lin2(Σ_j lin1(h)_j · mlp(rbf(r_ij)) · C(r_ij)))), C the cosine envelope.
    """

    # what an evaluation keeps per row (owned or ghost): 7 KB measured with F=64, 3 layers (16,384 Cu atoms, 28,640
    # rows: 198-215 MB; benchmarks/preflight.py), where the base class's 16 KB overestimated 3x
    EVALUATION_BYTES_PER_ROW = 10_000
    PART_MODULES = {"embed": ("embedding",), "block": ("interactions.{k}",), "readout": ("readout", "scale_shift")}

    def __init__(self, species: Sequence[str], cutoff: float, features: int = 64, layers: int = 3,
                 rbf: int = 50, filters: int | None = None, *, parts=None, seed: int | None = None):
        super().__init__(species)
        if not species:
            raise ValueError("SchNet needs a non-empty species list")
        if not 0 < cutoff < math.inf or features < 2 or layers < 1 or rbf < 2:
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
        return None  # every edge feature is recomputed from edge_vec inside the block's edge step

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        return self.embedding(graph.species)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        if k > 0:
            h = graph.halo(h)
        interaction = self.interactions[str(k)]

        def message(feats, x_j):  # [e, filters] -> [e, filters]
            expanded, envelope = feats
            return x_j * (interaction.mlp(expanded) * envelope[:, None])

        x = edge_sum(graph, self.edge_features, message, [interaction.conv.lin1(h)])
        return h[: x.shape[0]] + interaction.lin(interaction.act(interaction.conv.lin2(x)))

    def edge_features(self, vec: torch.Tensor):
        """(Gaussian basis [e, rbf], cosine envelope [e]) of edge vectors [e, 3]."""
        r = vec.to(self.dtype).norm(dim=1)
        return self.distance_expansion(r), cosine_cutoff(r, self.cutoff)

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        out = self.readout(h[: graph.n_local]).squeeze(-1)
        return self.scale_shift(out, graph.species[: graph.n_local])


# torch-geometric's SchNet modules (torch_geometric.nn.models.schnet), as parameter holders: the same submodules,
# state-dict keys and initialisation, so the same seed gives the same weights and every checkpoint loads as before
# (tests/test_models.py compares them with torch-geometric's). SchNet above evaluates them itself (edge_sum), so
# only their parameters were ever used; importing torch_geometric cost every process 1.25 s (it imports torch._dynamo
# and its datasets): a rank that runs SchNet or PaiNN starts in 1.25 s instead of 2.3 s.
class ShiftedSoftplus(torch.nn.Module):
    """softplus(x) − log 2 (zero at x = 0; log 2 rounded to float32, as torch-geometric's). [..] → [..]."""

    def __init__(self):
        super().__init__()
        self.shift = torch.log(torch.tensor(2.0)).item()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(x) - self.shift


class CFConv(torch.nn.Module):
    """The continuous-filter convolution's parameters: ``lin1`` (no bias) into the filters, ``lin2`` out of them,
    ``nn`` the filter network (the block's ``mlp``, shared)."""

    def __init__(self, in_channels: int, out_channels: int, num_filters: int, nn: torch.nn.Module, cutoff: float):
        super().__init__()
        self.lin1 = torch.nn.Linear(in_channels, num_filters, bias=False)
        self.lin2 = torch.nn.Linear(num_filters, out_channels)
        self.nn, self.cutoff = nn, cutoff
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.xavier_uniform_(self.lin1.weight)
        torch.nn.init.xavier_uniform_(self.lin2.weight)
        self.lin2.bias.data.fill_(0)


class InteractionBlock(torch.nn.Module):
    """One SchNet interaction's parameters: ``mlp`` (the filter network over the radial basis), ``conv``
    (``CFConv``), ``act`` and ``lin``."""

    def __init__(self, hidden_channels: int, num_gaussians: int, num_filters: int, cutoff: float):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(num_gaussians, num_filters), ShiftedSoftplus(),
                                       torch.nn.Linear(num_filters, num_filters))
        self.conv = CFConv(hidden_channels, hidden_channels, num_filters, self.mlp, cutoff)
        self.act = ShiftedSoftplus()
        self.lin = torch.nn.Linear(hidden_channels, hidden_channels)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.xavier_uniform_(self.mlp[0].weight)
        self.mlp[0].bias.data.fill_(0)
        torch.nn.init.xavier_uniform_(self.mlp[2].weight)
        self.mlp[2].bias.data.fill_(0)
        self.conv.reset_parameters()
        torch.nn.init.xavier_uniform_(self.lin.weight)
        self.lin.bias.data.fill_(0)
