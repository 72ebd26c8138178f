"""Adapter: a SevenNet checkpoint (``pip install -e .[sevenn]``) as a potentials model.

The sevenn model runs module by module on our AtomGraph; the halo refresh goes on the node features
``x`` right after each ``{t}_self_interaction_1``, t ≥ 1 — exactly where sevenn's own LAMMPS parallel
build cuts its segments (the convolution is the only module that reads neighbours' features). Its
final reduction and autograd force modules are skipped: we sum and differentiate ourselves. Each
convolution's edge step (sevenn's tensor product and radial weight network on the edge embedding) runs
as one ``messages.edge_sum``, so that it takes the memory-bounded path of every other model.
"""
from __future__ import annotations

import torch
from ase.data import chemical_symbols

from ..base import Potential
from ..graph import AtomGraph
from ..messages import edge_sum

_SKIPPED_MODULES = ("reduce_total_enegy", "force_output")  # sevenn's own spelling
_EDGE_EMBEDDING = "edge_embedding"


class SevenNet(Potential):
    """A pretrained SevenNet model. ``checkpoint``: a name sevenn knows offline ("7net-0", shipped
    inside the sevenn package) or a path to a sevenn checkpoint. float32 only (sevenn's embedding casts
    to float32); cutoff and layer count come from the checkpoint."""

    def __init__(self, checkpoint: str = "7net-0"):
        try:
            import sevenn.util
        except ImportError as exc:
            raise ImportError("SevenNet needs the sevenn package: pip install -e .[sevenn]") from exc
        loaded = sevenn.util.load_checkpoint(checkpoint)
        model = loaded.build_model(enable_cueq=False, enable_flash=False, enable_oeq=False)
        model.set_is_batch_data(False)
        config = loaded.config
        type_map = config["_type_map"]  # atomic number -> one-hot index
        by_index = sorted(type_map, key=type_map.get)
        super().__init__([chemical_symbols[z] for z in by_index])
        self.sevenn = model.eval()
        self.cutoff = float(config["cutoff"])
        self.layers = int(config["num_convolution_layer"])
        self.hyperparameters = {"checkpoint": checkpoint}
        self.requires_grad_(False)

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        data = {"x": graph.species, "edge_index": graph.edge_index.flip(0),  # sevenn: (receiver, sender)
                "edge_vec": graph.edge_vec.to(self.dtype)}
        for name, module in self.sevenn._modules.items():
            if name in _SKIPPED_MODULES:
                continue
            if name == _EDGE_EMBEDDING:
                continue  # each convolution's edge step computes it (self.edge_features)
            if name.endswith("_convolution"):
                data[module.key_x] = self._convolve(module, data[module.key_x], graph)
                continue
            data = module(data)
            if name.endswith("_self_interaction_1") and not name.startswith("0_"):
                data["x"] = graph.halo(data["x"])
        return data["atomic_energy"].squeeze(-1)[: graph.n_local]

    def edge_features(self, vec: torch.Tensor) -> dict:
        """sevenn's edge embedding (radial basis × cutoff, spherical harmonics) of edge vectors [e, 3]."""
        return self.sevenn._modules[_EDGE_EMBEDDING]({"edge_vec": vec.to(self.dtype)})

    def _convolve(self, conv, x: torch.Tensor, graph: AtomGraph) -> torch.Tensor:
        """sevenn's IrrepsConvolution.forward with its message sum as an ``edge_sum`` (every row out, as
        sevenn's own ``message_gather``): tensor product of x_j with Y(r̂), weights from its radial network."""
        def message(feats, x_j):
            return conv.convolution(x_j, feats[conv.key_filter], conv.weight_nn(feats[conv.key_weight_input]))

        return edge_sum(graph, self.edge_features, message, [x], rows=graph.n_nodes).div(conv.denominator)
