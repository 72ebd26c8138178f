"""Allegro's layers one at a time, for an Allegro model of the nequip framework in pipeline stages.

Allegro keeps its state per edge: between its layers travel, for every edge, the scalar features accumulated
so far (a dense net), the weights of the next layer's environment embedding and the tensor features.
``AllegroLayers`` runs the framework's ``Allegro_Module`` layer by layer with the module's own submodules
(its environment weighter, neighbour normalisation, tensor products and latent MLPs), as its ``forward``
runs them all, over that state packed into one tensor [edges, width] (what travels between stages).
"""
from __future__ import annotations

import math

import torch

# the Allegro_Module attributes its forward reads (nequip-allegro 0.8)
_READ = ("first_layer_env_embed_projection", "latents", "tps", "_env_weighter", "avg_num_neighbors_norm",
         "_n_scalar_outs", "num_scalar_features", "num_tensor_features", "num_layers", "tensor_basis_in_field",
         "tensor_features_in_field", "scalar_in_field", "scalar_out_field")


class AllegroLayers:
    """``module``, the network's ``Allegro_Module``, layer by layer. ``embedded``: the irreps of the fields
    the modules before it wrote (their ``irreps_out``).

    The state entering layer k (k = ``num_layers``: the readout) is {field: [E, ...]}: ``carried`` (the
    edge fields the embedding wrote that the layers or the readout read again: the tensor basis, and the
    edge cutoff where the embedding writes one, which a pair potential reads), "scalars" [E, S (k + 1)]
    and, for k < ``num_layers``, "env_w" [E, W] and "tensors" [E, mul, dim_k]. ``pack`` joins it into
    [E, ``width(k)``], ``unpack`` splits it. Raises ValueError for a module this code does not know."""

    def __init__(self, module, embedded: dict):
        from nequip.data import AtomicDataDict

        missing = [name for name in _READ if not hasattr(module, name)]
        if type(module).__name__ != "Allegro_Module" or missing:
            raise ValueError(f"its {type(module).__name__} lacks {missing or 'nothing'} of what Allegro_Module "
                             f"holds in nequip-allegro 0.8")
        self.module = module
        self.layers = int(module.num_layers)
        self.carried = [module.tensor_basis_in_field] + \
            [AtomicDataDict.EDGE_CUTOFF_KEY] * (AtomicDataDict.EDGE_CUTOFF_KEY in embedded)
        scalars, weights, mul = module.num_scalar_features, module._env_weighter.weight_numel, module.num_tensor_features
        tensor_dims = [embedded[module.tensor_features_in_field].dim] + [tp.irreps_out.dim for tp in module.tps]
        self._fields = [[*((field, (embedded[field].dim,)) for field in self.carried), ("scalars", (scalars * (k + 1),)),
                         *((("env_w", (weights,)), ("tensors", (mul, tensor_dims[k]))) if k < self.layers else ())]
                        for k in range(self.layers + 1)]

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

    def first(self, data: dict) -> dict:
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
        if k < self.layers - 1:
            out["env_w"] = latents[:, width: width + module._env_weighter.weight_numel]
            out["tensors"] = tensors
        return out
