"""Allegro's layers (``nequip_layers`` describes what the adapter asks of them): strictly local, one message-passing
step in all (one cutoff of ghosts), evaluated whole in groups of atoms within a memory budget, or one layer at a
time for pipeline stages.

Allegro keeps its state per edge: between its layers travel, for every edge, the scalar features accumulated
so far (a dense net), the weights of the next layer's environment embedding and the tensor features.
``AllegroLayers`` runs the framework's ``Allegro_Module`` layer by layer with the module's own submodules
(its environment weighter, neighbour normalisation, tensor products and latent MLPs), as its ``forward``
runs them all, over that state packed into one tensor [edges, width] (what travels between stages).
"""
from __future__ import annotations

import math

import torch

from ..base import block_part
from ..messages import chunked_local
from .nequip_layers import MIN_CHUNK_EDGES

# the Allegro_Module attributes its forward reads (nequip-allegro 0.8)
_READ = ("first_layer_env_embed_projection", "latents", "tps", "_env_weighter", "avg_num_neighbors_norm",
         "_n_scalar_outs", "num_scalar_features", "num_tensor_features", "num_layers", "tensor_basis_in_field",
         "tensor_features_in_field", "scalar_in_field", "scalar_out_field")


class AllegroLayers:
    """The network's ``Allegro_Module`` (``names[index]``), layer by layer. Strictly local: ``layers`` is 1 (each
    atom's energy reads its own edges only), ``n_blocks`` its layers. Parts: "embed" adds the module's first
    projection to the two-body embeddings before it, "block.k" is its layer k.

    The state entering layer k (k = ``n_blocks``: the readout) is {field: [E, ...]}: ``carried`` (the
    edge fields the embedding wrote that the layers or the readout read again: the tensor basis, and the
    edge cutoff where the embedding writes one, which a pair potential reads), "scalars" [E, S (k + 1)]
    and, for k < ``n_blocks``, "env_w" [E, W] and "tensors" [E, mul, dim_k]. ``pack`` joins it into
    [E, ``width(k)``], ``unpack`` splits it. A module lacking what this code reads (another nequip-allegro)
    does not split (``splits`` False, ``why``): it still evaluates whole."""

    layers = 1
    state_per_edge = True

    def __init__(self, network, names, index: int):
        from nequip.data import AtomicDataDict

        name = names[index]
        module = network._modules[name]
        self.network, self.module, self.first = network, module, index
        self.last = index
        missing = [attribute for attribute in _READ if not hasattr(module, attribute)]
        self.splits = not missing
        self.why = f"its {type(module).__name__} lacks {missing} of what Allegro_Module holds in nequip-allegro 0.8"
        self.n_blocks = int(getattr(module, "num_layers", 1))
        if not self.splits:
            return
        embedded = network._modules[names[index - 1]].irreps_out
        self.embed_modules = [f"{name}.first_layer_env_embed_projection"]
        self.block_modules = {block_part(k): [f"{name}.latents.{k}", f"{name}.tps.{k}"] for k in range(self.n_blocks)}
        self.carried = [module.tensor_basis_in_field] + \
            [AtomicDataDict.EDGE_CUTOFF_KEY] * (AtomicDataDict.EDGE_CUTOFF_KEY in embedded)
        scalars, weights, mul = module.num_scalar_features, module._env_weighter.weight_numel, module.num_tensor_features
        tensor_dims = [embedded[module.tensor_features_in_field].dim] + [tp.irreps_out.dim for tp in module.tps]
        self._fields = [[*((field, (embedded[field].dim,)) for field in self.carried), ("scalars", (scalars * (k + 1),)),
                         *((("env_w", (weights,)), ("tensors", (mul, tensor_dims[k]))) if k < self.n_blocks else ())]
                        for k in range(self.n_blocks + 1)]

    def width(self, k: int) -> int:
        """Columns of the packed state entering layer k."""
        return sum(math.prod(shape) for _, shape in self._fields[k])

    def pack(self, k: int, state: dict) -> torch.Tensor:
        """The state entering layer k → [E, width(k)]."""
        return torch.cat([state[field].reshape(len(state["scalars"]), -1) for field, _ in self._fields[k]], dim=1)

    def unpack(self, k: int, h: torch.Tensor) -> dict:
        """[E, width(k)] → the state entering layer k."""
        sizes = [math.prod(shape) for _, shape in self._fields[k]]
        return {field: part.reshape(len(h), *shape)
                for (field, shape), part in zip(self._fields[k], torch.split(h, sizes, dim=1))}

    def initial(self, data: dict) -> dict:
        """The state entering layer 0 from the embedding's fields in ``data``: the module's first projection
        of the two-body scalar embedding into scalar features and the first environment weights."""
        module = self.module
        projection = module.first_layer_env_embed_projection(data[module.scalar_in_field])
        scalars = module.num_scalar_features
        return {**{field: data[field] for field in self.carried}, "scalars": projection[:, :scalars],
                "env_w": projection[:, scalars: scalars + module._env_weighter.weight_numel],
                "tensors": data[module.tensor_features_in_field]}

    def layer(self, k: int, state: dict, data: dict) -> dict:
        """Layer k on ``state`` (the graph's fields in ``data``: edges, atom types), as the module's forward runs
        it: the environment embedding scattered to the centre atoms and normalised, the tensor product with the
        tensor features, the latent MLP on the accumulated scalars and the tensor product's scalars."""
        from nequip.data import AtomicDataDict
        from nequip.nn import scatter

        module = self.module
        centre = data[AtomicDataDict.EDGE_INDEX_KEY][0]
        env = scatter(module._env_weighter(state[module.tensor_basis_in_field], state["env_w"]), centre, dim=0,
                      dim_size=AtomicDataDict.num_nodes(data))
        data = dict(data)
        data[AtomicDataDict.NODE_FEATURES_KEY] = env.view(env.shape[0], -1)
        env = module.avg_num_neighbors_norm(data)[AtomicDataDict.NODE_FEATURES_KEY].view(env.shape)
        tensors = module.tps[k](state["tensors"], env, centre)
        n_scalars = module._n_scalar_outs[k]
        latents = module.latents[k](torch.cat([state["scalars"], tensors[:, :, :n_scalars].reshape(
            tensors.shape[0], -1)], dim=-1))
        width = module.num_scalar_features
        out = {field: state[field] for field in self.carried}
        out["scalars"] = torch.cat([state["scalars"], latents[:, :width]], dim=-1)
        if k < self.n_blocks - 1:
            out["env_w"] = latents[:, width: width + module._env_weighter.weight_numel]
            out["tensors"] = tensors
        return out

    # ------------------------------------------------------------------ parts, for the adapter
    def embed(self, data: dict, ctx) -> torch.Tensor:
        return _all_edges(self.pack(0, self.initial(data)), ctx)

    def block(self, k: int, h: torch.Tensor, ctx) -> torch.Tensor:
        state = self.layer(k, self.unpack(k, _kept_edges(h, ctx)), ctx["data"])
        return _all_edges(self.pack(k + 1, state), ctx)

    def readout_input(self, h: torch.Tensor, ctx) -> dict:
        """The framework's data with the last layer's fields (the carried ones, the scalar output)."""
        state = self.unpack(self.n_blocks, _kept_edges(h, ctx))
        data = dict(ctx["data"], **{field: state[field] for field in self.carried})
        data[self.module.scalar_out_field] = state["scalars"]
        return data

    def evaluate(self, framework, data: dict, rows: int, budget: int | None) -> torch.Tensor:
        """[rows] per-atom energies: each atom's energy a function of its own edges, so within a ``budget`` in groups
        of atoms whose edges' tensors take at most that many bytes, each group the framework's own forward on its
        atoms' edges, recomputed in the backward (``messages.chunked_local``); None: the framework's forward."""
        from nequip.data import AtomicDataDict

        if budget is None:
            return framework(data)[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1)
        types = data[AtomicDataDict.ATOM_TYPE_KEY]
        edge_index = data[AtomicDataDict.EDGE_INDEX_KEY].flip(0)  # back to (sender, receiver)

        def group(sub_index, vectors, nodes):
            out = framework({AtomicDataDict.EDGE_VECTORS_KEY: vectors, AtomicDataDict.EDGE_INDEX_KEY: sub_index.flip(0),
                             AtomicDataDict.ATOM_TYPE_KEY: types[nodes]})
            return out[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1)

        return chunked_local(group, edge_index, data[AtomicDataDict.EDGE_VECTORS_KEY], rows, budget, MIN_CHUNK_EDGES)


def _kept_edges(h: torch.Tensor, ctx) -> torch.Tensor:
    """A per-edge state over the graph's edges [E, w] → over the edges the per-edge-type cutoffs keep."""
    return h if ctx["kept"] is None else h.index_select(0, ctx["kept"])


def _all_edges(h: torch.Tensor, ctx) -> torch.Tensor:
    """A per-edge state over the kept edges → over the graph's edges [E, w] (zero rows where pruned): the rows of the
    tensor that travels between stages do not depend on the cutoffs."""
    if ctx["kept"] is None:
        return h
    return h.new_zeros(ctx["edges"], h.shape[1]).index_copy(0, ctx["kept"], h)
