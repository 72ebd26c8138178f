"""PaiNN (Schütt, Unke, Gastegger 2021): scalar and vector node features, equivariant messages."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .base import BlockPotential, ScaleShiftReferences, SpeciesScaleShift
from .coulomb import ChargeModel, LongRangeError
from .graph import AtomGraph
from .messages import edge_sum
from .radial import SincBasis, cosine_cutoff


class PaiNNLayer(torch.nn.Module):
    """One message + update block on scalars s [n, F] and vectors v [n, 3, F] (the model sums the
    messages over edges, ``edge_sum``, between the two)."""

    def __init__(self, features: int, rbf: int):
        super().__init__()
        self.features = features
        self.message_mlp = torch.nn.Sequential(
            torch.nn.Linear(features, features), torch.nn.SiLU(), torch.nn.Linear(features, 3 * features))
        self.filter = torch.nn.Linear(rbf, 3 * features)
        self.mix_vectors = torch.nn.Linear(features, 2 * features, bias=False)  # U and V
        self.update_mlp = torch.nn.Sequential(
            torch.nn.Linear(2 * features, features), torch.nn.SiLU(), torch.nn.Linear(features, 3 * features))

    def messages(self, phi_j, v_j, unit, radial, envelope):
        """Per-edge Δs = φ_s(s_j) W_s(r), Δv = v_j φ_vv W_vv + r̂ φ_vs W_vs as one [e, 4F] tensor, from
        phi_j = message_mlp(s)_j [e, 3F], v_j [e, 3F] (flattened [e, 3, F]), unit r̂ [e, 3], radial
        basis [e, rbf] and envelope [e]."""
        f = self.features
        ds, dvv, dvs = torch.split(phi_j * (self.filter(radial) * envelope[:, None]), f, dim=1)
        dv = v_j.reshape(-1, 3, f) * dvv[:, None, :] + unit[:, :, None] * dvs[:, None, :]
        return torch.cat([ds, dv.reshape(-1, 3 * f)], dim=1)

    def update(self, s, v):
        """Node-local mixing of scalars s [n, F] and vector norms / inner products of v [n, 3, F]."""
        f = self.features
        uv, vv = torch.split(self.mix_vectors(v), f, dim=2)
        vv_norm = torch.sqrt(vv.pow(2).sum(dim=1) + 1e-8)
        a_vv, a_sv, a_ss = torch.split(self.update_mlp(torch.cat([s, vv_norm], dim=1)), f, dim=1)
        return s + a_ss + a_sv * (uv * vv).sum(dim=1), v + a_vv[:, None, :] * uv


class PaiNN(ChargeModel, ScaleShiftReferences, BlockPotential):
    """Polarizable atom interaction neural network.

    s0 = embedding(species), v0 = 0; each layer: [l > 0: (s, v) = halo(s, v)]; message; update.
    e_i = scale[z_i] * MLP(s_i) + shift[z_i] (eV, ``scale_shift``). The halo carries s and v in one
    exchange ([n, 4F] rows).

    ``charges``: a charge head as well (latent charges, the idea of LES: learned from energies and forces alone),
    q_i = MLP_q(s_i) shifted equally within each structure so that Σ q_i is its total charge (``AtomGraph.system``; 0
    where not given: the sums over the structure taken over the owned rows, then the ranks), whose Coulomb energy over
    the whole structure ``long_range`` adds (``potentials.coulomb``: needed with it).
    """

    PART_MODULES = {"embed": ("embedding",), "block": ("blocks.{k}",),
                    "readout": ("readout", "scale_shift", "charge_head")}

    def __init__(self, species: Sequence[str], cutoff: float, features: int = 64, layers: int = 3, rbf: int = 20,
                 charges: bool = False, long_range=None, *, parts=None, seed: int | None = None):
        super().__init__(species)
        if not species or not 0 < cutoff < math.inf or features < 1 or layers < 1 or rbf < 1:
            raise ValueError(f"invalid PaiNN hyper-parameters: species={species}, cutoff={cutoff}, "
                             f"features={features}, layers={layers}, rbf={rbf}")
        self.cutoff, self.features, self.layers = float(cutoff), int(features), int(layers)
        self.hyperparameters = dict(species=self.species, cutoff=self.cutoff, features=self.features,
                                    layers=self.layers, rbf=int(rbf), **({"charges": True} if charges else {}))
        self.predicts_charges = self.needs_long_range = bool(charges)
        self._init_parts(parts, seed)  # ``parts``: the parts to build (a pipeline stage's); see BlockPotential
        self.radial = SincBasis(self.cutoff, rbf)
        self.embedding = self._build("embed", lambda: torch.nn.Embedding(len(self.species), features))
        self.blocks = self._build_blocks(lambda k: PaiNNLayer(features, rbf))
        self.readout, self.scale_shift = self._build("readout", lambda: (torch.nn.Sequential(
            torch.nn.Linear(features, features // 2 or 1), torch.nn.SiLU(), torch.nn.Linear(features // 2 or 1, 1)),
            SpeciesScaleShift(len(self.species)))) or (None, None)
        self.charge_head = self._build("readout", lambda: torch.nn.Sequential(
            torch.nn.Linear(features, features // 2 or 1), torch.nn.SiLU(),
            torch.nn.Linear(features // 2 or 1, 1))) if charges else None
        if charges:
            self.set_long_range(long_range)
        elif long_range is not None:
            raise ValueError("long_range is given to a PaiNN without charges (charges: true gives it a charge head)")

    def feature_width(self, k: int) -> int:
        return 4 * self.features

    # h packs the scalars s [n, F] and the vectors v [n, 3, F] as one [n, 4F] tensor (halo, pipeline)
    def context(self, graph: AtomGraph):
        return None  # every edge feature is recomputed from edge_vec inside the block's edge step

    def edge_features(self, vec: torch.Tensor):
        """(r̂ [e, 3], sinc basis [e, rbf], cosine envelope [e]) of edge vectors [e, 3]."""
        vec = vec.to(self.dtype)
        r = vec.norm(dim=1)
        return vec / r[:, None], self.radial(r), cosine_cutoff(r, self.cutoff)

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        s = self.embedding(graph.species)
        return torch.cat([s, s.new_zeros(s.shape[0], 3 * self.features)], dim=1)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        if k > 0:
            h = graph.halo(h)
        layer, rows, f = self.blocks[str(k)], graph.receivers, self.features

        def message(feats, phi_j, v_j):  # [e, 3F], [e, 3F] -> [e, 4F]
            return layer.messages(phi_j, v_j, *feats)

        h = h[:rows] + edge_sum(graph, self.edge_features, message, [layer.message_mlp(h[:, :f]), h[:, f:]])
        s, v = layer.update(h[:, :f], h[:, f:].reshape(rows, 3, f))
        return torch.cat([s, v.reshape(rows, 3 * f)], dim=1)

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        out = self.readout(h[: graph.n_local, : self.features]).squeeze(-1)
        energies = self.scale_shift(out, graph.species[: graph.n_local])
        if self.charge_head is None:
            return energies
        if getattr(self, "long_range", None) is None:
            raise LongRangeError("a PaiNN with charges needs long_range: {method: ewald | pme | p3m, accuracy: 1.0e-6}")
        return energies + self.long_range(self.predicted_charges(h, graph), graph, self.cutoff)

    def predicted_charges(self, h: torch.Tensor, graph: AtomGraph) -> torch.Tensor:
        """[n_nodes] the charges (e) of the charge head on the final scalars of the owned rows, each structure's
        shifted equally to its total charge, the ghost rows refreshed by the halo."""
        if graph.n_receivers is None and graph.n_nodes > graph.n_local:
            raise LongRangeError("a PaiNN with charges runs in layerwise mode only: its charges are summed over the "
                                 "structure, which wide mode's redundant ghost rows would count twice")
        n = graph.n_local
        raw = self.charge_head(h[:n, : self.features]).squeeze(-1)
        sums = graph.structure_sums(torch.stack([raw, torch.ones_like(raw)], dim=1))
        target = torch.tensor([c or 0 for c in (graph.system or {}).get("charge") or [0] * len(sums)],
                              dtype=raw.dtype, device=raw.device)
        shift = (sums[:, 0] - target) / sums[:, 1].clamp(min=1)
        q = raw - (shift[graph.structure[:n]] if graph.structure is not None else shift)
        return graph.halo(q[:, None])[:, 0]
