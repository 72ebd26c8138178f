"""How a nequip-framework model's layers run, read from the model itself (``nequip.layers_of``): NequIP's message
passing (``NequIPLayers``, here) or Allegro's strictly local layers (``allegro_layers.AllegroLayers``). Both answer the
adapter's questions alike:

* ``layers`` (message-passing steps: the halo's reach in cutoffs), ``n_blocks`` (pipeline blocks),
  ``state_per_edge`` (what travels between pipeline stages has a row per edge), ``splits`` (runs as parts);
* ``first``, ``last``: where its layer modules lie among the network's; ``block_modules``: {part: module names}
  (with any modules of "embed" beyond those before ``first``);
* ``width(k)``, ``embed(data, ctx)``, ``block(k, h, ctx)``, ``readout_input(h, ctx)``: the parts' steps, each with
  the framework's own modules;
* ``evaluate(framework, data, rows, budget)``: per-row energies of a whole evaluation within a memory budget.

NequIP's convolutions run their edge steps in chunks (``chunked_convolutions``): the framework's own modules per
chunk of edges, recomputed in the backward (``messages.chunked_edge_sum``).
"""
from __future__ import annotations

import functools
import re
import warnings
from contextlib import contextmanager

import torch

from ..base import block_part
from ..messages import chunked_edge_sum
from .nequip_loading import NequIPFrameworkError

# Edges per chunk at least (potentials.messages' default is 2,048): a NequIP or Allegro edge carries several KB of
# tensor-product weights and outputs (set by benchmarks/memory_per_atom.py).
MIN_CHUNK_EDGES = 256
_NOTED = set()


def run_modules(network, names, data: dict) -> dict:
    """The network's modules ``names`` in order on ``data``."""
    for name in names:
        data = network._modules[name](data)
    return data


class NequIPLayers:
    """NequIP's message passing: the network's ``layer{k}_convnet`` modules, one message-passing step each (ghost
    rows refreshed through the framework's ghost-exchange slots before each after the first). As pipeline parts,
    "block.k" is ``layer{k}_convnet``; between stages travel the node features and the type embedding's node
    attributes (which every layer's self-connection reads), side by side."""

    state_per_edge = False
    splits = True
    embed_modules = ()

    def __init__(self, network, names):
        from nequip.data import AtomicDataDict

        convnets = [name for name in names if re.fullmatch(r"layer\d+_convnet", name)]
        if convnets != [f"layer{k}_convnet" for k in range(len(convnets))]:
            raise NequIPFrameworkError(f"its network's layers {convnets} are not layer0_convnet, layer1_convnet, ... in "
                                       f"order")
        self.network = network
        self.layers = self.n_blocks = len(convnets)
        self.first, self.last = names.index(convnets[0]), names.index(convnets[-1])
        self.block_modules = {block_part(k): [name] for k, name in enumerate(convnets)}
        features, attrs = AtomicDataDict.NODE_FEATURES_KEY, AtomicDataDict.NODE_ATTRS_KEY
        self.attrs_width = network._modules[convnets[0]].irreps_in[attrs].dim
        self.widths = [network._modules[name].irreps_in[features].dim + self.attrs_width for name in convnets] + \
            [network._modules[convnets[-1]].irreps_out[features].dim + self.attrs_width]

    def width(self, k: int) -> int:
        """Columns of h entering block k: the node features, then the node attributes."""
        return self.widths[k]

    def embed(self, data: dict, ctx) -> torch.Tensor:
        from nequip.data import AtomicDataDict

        return torch.cat([data[AtomicDataDict.NODE_FEATURES_KEY], data[AtomicDataDict.NODE_ATTRS_KEY]], dim=1)

    def block(self, k: int, h: torch.Tensor, ctx) -> torch.Tensor:
        from nequip.data import AtomicDataDict

        data = self.readout_input(h, ctx)
        attrs = data[AtomicDataDict.NODE_ATTRS_KEY]
        feats = run_modules(self.network, self.block_modules[block_part(k)], data)[AtomicDataDict.NODE_FEATURES_KEY]
        return torch.cat([feats, attrs[: feats.shape[0]]], dim=1)

    def readout_input(self, h: torch.Tensor, ctx) -> dict:
        """The framework's data with h's node features and attributes."""
        from nequip.data import AtomicDataDict

        data = dict(ctx["data"])
        data[AtomicDataDict.NODE_FEATURES_KEY] = h[:, : h.shape[1] - self.attrs_width]
        data[AtomicDataDict.NODE_ATTRS_KEY] = h[:, h.shape[1] - self.attrs_width:]
        return data

    def evaluate(self, framework, data: dict, rows: int, budget: int | None) -> torch.Tensor:
        """The framework's forward, its convolutions' edge steps in chunks of ``budget`` bytes (None: plain)."""
        from nequip.data import AtomicDataDict

        with chunked_convolutions(framework, budget):
            return framework(data)[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1)


@contextmanager
def chunked_convolutions(framework, budget: int | None):
    """Within it, the convolutions of ``framework``'s NequIP interaction blocks run their edge step — the radial
    network ``edge_mlp`` on the edge embedding, the tensor product with the sender's features and the scatter
    to the receivers — in chunks of at most ``budget`` bytes, recomputed in the backward
    (``messages.chunked_edge_sum``), with the framework's own modules: ``edge_mlp`` hands its input through
    and the block's ``tp_scatter`` applies it per chunk. The rest of the block's forward is the framework's.
    None: nothing changes (training). A block with another tensor-product kernel (OpenEquivariance,
    cuEquivariance) keeps its own forward; a one-time warning names it. Every module patched is restored on leaving,
    also when a warning raised as an error stops the patching."""
    patched, shared = [], {}
    try:
        if budget is not None:
            for block in framework.modules():
                if _class_path(block) != "nequip.nn.interaction_block.InteractionBlock":
                    continue
                kernel = _class_path(getattr(block, "tp_scatter", None))
                if kernel == "nequip.nn._tp_scatter_base.TensorProductScatter" and \
                        _class_path(getattr(block, "edge_mlp", None)) == "nequip.nn.mlp.ScalarMLPFunction":
                    block.edge_mlp.forward = _handed_through
                    block.tp_scatter.forward = functools.partial(chunked_tp_scatter, block, budget, shared)
                    patched += [block.edge_mlp, block.tp_scatter]
                elif kernel not in _NOTED:
                    _NOTED.add(kernel)
                    warnings.warn(f"a nequip convolution with {kernel.rpartition('.')[2] or 'no tp_scatter'} runs its "
                                  f"own forward over all edges at once (its edge step is not memory-bounded)",
                                  stacklevel=3)
        yield
    finally:
        for module in patched:
            del module.forward


def _class_path(obj) -> str:
    """``module.Class`` of ``obj``, the same for the installed framework's classes and a package's copies of
    them (a .nequip.zip loads its own code, under a ``<torch_package_N>.`` prefix)."""
    path = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return path.split(">.", 1)[1] if path.startswith("<torch_package_") else path


def _handed_through(edge_embedding: torch.Tensor) -> torch.Tensor:
    return edge_embedding


def chunked_tp_scatter(block, budget: int, shared: dict, x, edge_attr, edge_weight, edge_dst, edge_src):
    """[x.size(0), irreps_mid]: ``TensorProductScatter.forward`` of ``block`` with ``edge_weight`` the edge
    embedding [E, basis] (``edge_mlp`` handed it through): Σ over the edges into each row of
    ``tp(x[src], edge_attr, edge_mlp(embedding))``, in chunks (``messages.chunked_edge_sum``). Every block of
    one forward reads the same embedding and attributes: packed once."""
    same = shared.get("pieces") is not None and all(a is b for a, b in zip(shared["pieces"], (edge_weight, edge_attr))) \
        and shared["index"] == (edge_src.data_ptr(), edge_dst.data_ptr(), edge_dst.shape)
    if not same:
        shared.update(pieces=(edge_weight, edge_attr), index=(edge_src.data_ptr(), edge_dst.data_ptr(), edge_dst.shape),
                      edge_data=torch.cat([edge_weight, edge_attr], dim=1), edge_index=torch.stack([edge_src, edge_dst]))
    basis, mlp = edge_weight.shape[1], block.edge_mlp

    def message(edge, x_j):  # [e, basis + attrs], [e, irreps_in] -> [e, irreps_mid]
        return block.tp_scatter.tp(x_j, edge[:, basis:], type(mlp).forward(mlp, edge[:, :basis]))

    return chunked_edge_sum(message, shared["edge_data"], shared["edge_index"], [x], x.size(0), budget, MIN_CHUNK_EDGES)
