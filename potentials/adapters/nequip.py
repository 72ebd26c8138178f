"""Adapter: a NequIP or Allegro model of the nequip framework (PyPI ``nequip``, ``nequip-allegro``) as a
potentials model — not ``potentials.NequIP``, this package's own NequIP-style model.

Loading (``nequip_loading``): the framework's own ``load_saved_model`` on a ``.ckpt`` or ``.nequip.zip`` (both
pickles: naming the file is the user's choice to run them), the process's global state put back after.

Running (``NequIPFramework.forward``): the model with its force/stress output removed (the framework's
``disable_ForceStressOutput`` modifier: we differentiate ourselves) and, for NequIP, its ghost-exchange
slots filled (the framework's ``enable_LAMMPSMLIAPGhostExchange`` modifier, as its LAMMPS ML-IAP
integration does): each interaction block after the first pads its node features with ghost rows and
calls ``lmp_mliap_data.forward_exchange`` / ``reverse_exchange``, here ``GhostExchange`` over our halo.
Edges go in as the framework's (receiver, sender) pairs with our edge vectors. How the model's layers run —
NequIP's message passing or Allegro's strictly local layers — is read from the model itself
(``layers_of``): one strategy each behind this one adapter.
"""
from __future__ import annotations

import os
import re
import warnings

import numpy as np
import torch
from ase.data import atomic_numbers

from ..base import EMBED, READOUT, BlockPotential, PackageModel, all_parts
from ..exchange import GhostExchange, default_dtype
from ..files import atomic_write
from ..graph import AtomGraph
from .allegro_layers import AllegroLayers
from .nequip_layers import NequIPLayers, run_modules
from .nequip_loading import (NequIPFrameworkError, build_framework_model, framework_architecture,  # noqa: F401
                             load_framework_model, process_state_kept)


def layers_of(network, where: str):
    """The layers of the framework's sequential ``network``: Allegro's (one ``Allegro_Module``) or NequIP's
    (``layer{k}_convnet`` modules). NequIPFrameworkError for a network with neither: its message-passing steps,
    hence the ghost atoms it needs, are not known here."""
    names = list(network._modules)
    allegro = [k for k, name in enumerate(names) if type(network._modules[name]).__name__ == "Allegro_Module"]
    if len(allegro) == 1:
        return AllegroLayers(network, names, allegro[0])
    if any(re.fullmatch(r"layer\d+_convnet", name) for name in names):
        return NequIPLayers(network, names)
    raise NequIPFrameworkError(f"{where}: its network holds neither NequIP's layerK_convnet modules nor one "
                               f"Allegro_Module: how many message-passing steps it takes, hence which ghost atoms it "
                               f"needs, is not known here")


class NequIPFramework(PackageModel, BlockPotential):
    """A trained NequIP or Allegro model of the nequip framework, from its ``.ckpt`` checkpoint or its
    ``.nequip.zip`` package (eager; compiled ``.nequip.pth`` / ``.pt2`` files are refused), or from an
    ``architecture`` (``framework_architecture``'s JSON, as a potentials checkpoint of a fine-tuned model
    stores it: built with untrained weights, for a state dict to be loaded into it). dtype from the
    model's metadata; cutoff = its r_max; layers = its message-passing steps (interaction blocks for
    NequIP, 1 for Allegro, which is strictly local), read from its network (a network of neither kind is
    refused). Type names must be chemical symbols. Needs the ``nequip`` extra. (``potentials.NequIP`` is this
    package's own NequIP-style model.)

    Trainable through the ``Potential`` contract: its weights are the framework's parameters (named as in
    its GraphModel: "model.func.layer0_convnet.conv.linear_1.weight", ...), its reference energies the
    per-type energy shifts, and ``save_native`` writes a framework checkpoint (``best.ckpt``) that its
    loader, ``nequip-package build`` and ``nequip-compile`` read.

    As a ``BlockPotential`` (pipeline stages): "embed" the modules with weights before the first layer (and,
    for Allegro, its module's first projection), "block.k" layer k, "readout" the modules after the last (energy
    readout, per-type scale/shift, pair potential, sums); the parameter-free modules before the first layer
    (spherical harmonics, radial basis, edge lengths) run in ``context``. What travels between stages is the
    strategy's (``nequip_layers``): NequIP's node features beside the node attributes, Allegro's per-edge state."""

    @property
    def package_module(self):
        return self.framework

    # ------------------------------------------------------------------ memory model
    # In chunks (NequIP's convolutions, Allegro's groups of atoms) the edge embedding and attributes are kept for all
    # edges (~800 B per edge measured); every edge at once adds its tensor products' tensors (``one_pass_costs``).
    EVALUATION_BYTES_PER_EDGE = 1_000

    def __init__(self, path=None, model_key: str = "sole_model", architecture: dict | None = None, parts=None,
                 seed: int = 0):
        if (path is None) == (architecture is None):
            raise TypeError("NequIPFramework takes a model file (path) or an architecture, one of the two")
        if architecture is not None:
            where, model_key = "the checkpoint's nequip architecture", architecture["model_key"]
            model = build_framework_model(architecture["model"])
        else:
            where = path = os.fspath(path)
            model = load_framework_model(path, model_key)
            architecture = framework_architecture(path, model_key)
        metadata = model.metadata
        names = metadata["type_names"].split(" ")
        unknown = [n for n in names if n not in atomic_numbers or n == "X"]
        if unknown:
            raise NequIPFrameworkError(f"{where}: type names {unknown} are not chemical symbols; this adapter maps "
                                       f"elements to the model's types by name")
        super().__init__(names)
        with process_state_kept():  # modifiers rebuild modules under the framework's defaults
            from nequip.model.modify_utils import get_all_modifiers, modify

            modifiers = get_all_modifiers(model)
            torch.set_default_dtype(torch.float64)
            if "disable_ForceStressOutput" in modifiers:
                model = modify(model, [{"modifier": "disable_ForceStressOutput"}])
            else:  # older models: the energy model inside the force output
                model.model = model.model.func
            # each interaction block holds a ghost-exchange slot, which the framework's modifier fills; a model built
            # without slots, or a framework without the modifier, leaves layerwise evaluation impossible (wide: exact)
            slots = sum(type(m).__name__ == "NoOpGhostExchangeModule" for m in model.modules())
            self.exchange_filled = bool(slots) and "enable_LAMMPSMLIAPGhostExchange" in modifiers
            if self.exchange_filled:
                model = modify(model, [{"modifier": "enable_LAMMPSMLIAPGhostExchange"}])
        self.framework = model.eval()
        self.framework.requires_grad_(False)
        dtype = {"float32": torch.float32, "float64": torch.float64}[metadata["model_dtype"]]
        self.to(dtype)
        self.cutoff = float(metadata["r_max"])
        self.strategy = layers_of(self.network, where)  # NequIP's message passing or Allegro's local layers
        self.layers = self.strategy.layers
        self.hyperparameters = {"architecture": architecture}
        self.pruner = None
        if metadata.get("per_edge_type_cutoff") is not None:
            from nequip.data.transforms.neighborlist import NeighborListPruneTransform
            from nequip.nn.embedding.utils import cutoff_str_to_fulldict

            cutoffs = metadata["per_edge_type_cutoff"]  # a string in the metadata, as the framework's calculator reads it
            cutoffs = cutoff_str_to_fulldict(cutoffs, names) if isinstance(cutoffs, str) else cutoffs
            self.pruner = NeighborListPruneTransform(r_max=self.cutoff, per_edge_type_cutoff=cutoffs, type_names=names)
        self._split_into_parts(parts, seed, where)

    # ------------------------------------------------------------------ pipeline parts
    def _split_into_parts(self, parts, seed: int, where) -> None:
        """The framework's sequential network by part (see the class docstring)."""
        strategy, network = self.strategy, self.network
        self.network_path = next(name for name, module in self.named_modules() if module is network)
        if not strategy.splits:
            self.part_modules = None
            if parts is not None and set(parts) != set(all_parts(self.n_blocks)):
                raise NequIPFrameworkError(f"{where}: {strategy.why}: it does not split into pipeline stages; "
                                           f"fine-tune it with parallel: data or graph")
            self._init_parts(None, seed)
            return
        names = list(network._modules)
        before = names[:strategy.first]
        self.embed_modules = [n for n in before if any(True for _ in network._modules[n].parameters())]
        self.context_modules = [n for n in before if n not in self.embed_modules]
        self.part_modules = {EMBED: self.embed_modules + list(strategy.embed_modules), **strategy.block_modules,
                             READOUT: names[strategy.last + 1:]}
        self._init_parts(parts, seed)
        self._drop_parts_not_held()

    @property
    def n_blocks(self) -> int:
        """NequIP: its interaction blocks; Allegro: its layers (one message-passing step, ``layers`` = 1)."""
        return self.strategy.n_blocks

    @property
    def state_per_edge(self) -> bool:
        """Allegro's state between its layers is per edge."""
        return self.strategy.state_per_edge

    @property
    def network(self):
        """The framework's sequential network (its modules in order), inside the force output it may wrap."""
        return getattr(self.framework.model, "func", self.framework.model)

    def part_prefixes(self, part: str) -> list:
        if self.part_modules is None:  # (a network that does not split: every model whole)
            return []
        return [f"{self.network_path}.{name}" for name in self.part_modules[part]]

    def feature_width(self, k: int) -> int:
        return self.strategy.width(k)

    def context(self, graph: AtomGraph) -> dict:
        """The framework's data (as ``forward`` prepares it) after its parameter-free modules before the first
        layer (spherical harmonics and radial embedding of the edges, or edge lengths); "kept": the indices of
        the graph's ``edges`` that per-edge-type cutoffs keep (None: all)."""
        data, exchange, kept = self._data(graph, kept=True)
        with default_dtype(torch.float64):
            return {"data": run_modules(self.network, self.context_modules, data), "exchange": exchange, "kept": kept,
                    "edges": graph.edge_index.shape[1]}

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        with default_dtype(torch.float64):
            return self.strategy.embed(run_modules(self.network, self.embed_modules, dict(ctx["data"])), ctx)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        with default_dtype(torch.float64):
            return self.strategy.block(k, h, ctx)

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        from nequip.data import AtomicDataDict

        with default_dtype(torch.float64):
            out = run_modules(self.network, self.part_modules[READOUT], self.strategy.readout_input(h, ctx))
        return ctx["exchange"].owned(out[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1), graph.n_local)

    def _data(self, graph: AtomGraph, kept: bool = False) -> tuple:
        """(the framework's input data for ``graph``: edge vectors, (receiver, sender) edges, atom types and the
        ghost exchange, per-edge-type cutoffs applied; the exchange; with ``kept`` the indices of the graph's
        edges those cutoffs keep, else or without cutoffs None)."""
        from nequip.data import AtomicDataDict

        if self.layers > 1 and not self.exchange_filled and graph.receivers < graph.n_nodes:
            raise NequIPFrameworkError("this model's ghost-exchange slots cannot be filled (built without them, or a "
                                       "framework without the enable_LAMMPSMLIAPGhostExchange modifier): evaluate it "
                                       "in wide mode")
        exchange, types = GhostExchange.for_graph(graph)
        data = {
            AtomicDataDict.EDGE_VECTORS_KEY: graph.edge_vec.to(torch.float64, copy=True),
            # the framework's edges are (receiver, sender)
            AtomicDataDict.EDGE_INDEX_KEY: graph.edge_index.flip(0) + exchange.pad,
            AtomicDataDict.ATOM_TYPE_KEY: types,
            AtomicDataDict.LMP_MLIAP_DATA_KEY: exchange,
            AtomicDataDict.NUM_LOCAL_GHOST_NODES_KEY: torch.tensor([exchange.nlocal, exchange.ntotal - exchange.nlocal],
                                                                   device=types.device),
        }
        if self.pruner is None or not kept:
            return (data if self.pruner is None else self.pruner(data)), exchange, None
        # the pruner's own rule (an edge stays where its length over its type pair's cutoff is at most 1)
        normed = self.pruner._normalizer(dict(data))[AtomicDataDict.NORM_LENGTH_KEY].view(-1)
        return self.pruner(data), exchange, torch.nonzero(normed <= 1.0).view(-1)

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        if not self.complete:
            return super().forward(graph)  # (raises: a stage's parts alone do not evaluate)
        data, exchange, _ = self._data(graph)
        budget = graph.memory_budget if graph.n_local else None
        with default_dtype(torch.float64):  # the framework's global dtype, as its calculator runs
            energies = self.strategy.evaluate(self.framework, data, graph.n_local + exchange.pad, budget)
        return exchange.owned(energies, graph.n_local)

    # ------------------------------------------------------------------ training contract
    def _scale_shift(self):
        for module in self.framework.modules():
            if type(module).__name__ == "PerTypeScaleShift" and getattr(module, "has_shifts", False):
                return module
        raise NequIPFrameworkError("this nequip model has no per-type energy shifts (PerTypeScaleShift): no "
                                   "reference energies to keep or refit")

    def reference_energies(self):
        """The per-type shifts; None on a pipeline stage without the readout, which holds them."""
        if READOUT not in self.parts:
            return None
        shifts = self._scale_shift().shifts.detach().reshape(-1).cpu().double().numpy()
        return np.broadcast_to(shifts, (len(self.species),)).copy()

    def set_reference_energies(self, energies) -> None:
        """Set the per-type shifts; a model that shares one shift among its types (the framework's shortcut)
        gets one per type, in its architecture too (its ``per_type_energy_shifts`` then a dict by type; also on a
        pipeline stage without the readout, whose architecture the assembled checkpoint takes)."""
        if READOUT not in self.parts:
            self.hyperparameters["architecture"]["model"]["per_type_energy_shifts"] = dict(
                zip(self.species, np.asarray(energies, dtype=float).tolist()))
            return
        module = self._scale_shift()
        values = torch.as_tensor(np.asarray(energies, dtype=np.float64), dtype=module.shifts.dtype,
                                 device=module.shifts.device).reshape(-1, 1)
        with torch.no_grad():
            if module.shifts.shape == values.shape:
                module.shifts.copy_(values)
            else:  # a shared (shortcut) buffer of shape [1, 1]
                module.shifts = values
                module.shifts_shortcut = False
        self.hyperparameters["architecture"]["model"]["per_type_energy_shifts"] = dict(
            zip(self.species, np.asarray(energies, dtype=float).tolist()))

    def save_native(self, path, data=None) -> None:
        """``path``: a framework checkpoint (.ckpt) of this model: the training module of the original run
        (its config: loss, metrics, optimizer) built by the framework with these weights (also as its EMA
        weights, which the framework's loader evaluates), as Lightning writes one. ``data``: the file of
        structures the model was trained on, which the checkpoint names as its training data (``nequip-package
        build`` takes an example structure from it)."""
        import json

        import lightning
        from hydra.utils import get_class
        from nequip.utils import get_current_code_versions
        from nequip.utils.global_state import set_global_state

        if not self.complete:
            raise NequIPFrameworkError(f"this model holds only the parts {sorted(self.parts)} (a pipeline stage); its "
                                       f"checkpoint is written from the whole model")
        architecture = self.hyperparameters["architecture"]
        module_config = json.loads(json.dumps(architecture["training_module"]))
        target = module_config.pop("_target_", "nequip.train.NequIPLightningModule")
        module_config.pop("model", None)
        model_config = architecture["model"]
        model_key = architecture["model_key"]
        species = list(self.species)
        info = {
            "versions": get_current_code_versions(verbose=False),
            "data": {"_target_": "nequip.data.datamodule.ASEDataModule", "seed": 0,
                     "train_file_path": [os.path.abspath(os.fspath(data))] if data is not None else [],
                     "val_file_path": [os.path.abspath(os.fspath(data))] if data is not None else [],
                     "transforms": [
                         {"_target_": "nequip.data.transforms.ChemicalSpeciesToAtomTypeMapper",
                          "model_type_names": species, "chemical_species_to_atom_type_map": {s: s for s in species}},
                         {"_target_": "nequip.data.transforms.NeighborListTransform", "r_max": self.cutoff}],
                     "train_dataloader": {"_target_": "torch.utils.data.DataLoader", "batch_size": 1}},
            "trainer": {"_target_": "lightning.Trainer"}, "global_options": {"allow_tf32": False}, "runs": ["train"],
            "training_module": {"_target_": target, "model": model_config if model_key == "sole_model" else
                                {model_key: model_config}, **module_config},
        }
        hyper_parameters = dict(module_config, model=info["training_module"]["model"], info_dict=info,
                                num_datasets={"train": 1, "val": 1, "test": 0, "predict": 0})
        weights = {k: v.detach().cpu() for k, v in self.framework.state_dict().items()}
        with process_state_kept(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            set_global_state()
            try:
                training = get_class(target)(**hyper_parameters)
                package_model = training.model[model_key]
                package_model.load_state_dict(weights, strict=True)
            except Exception as exc:  # the framework raises many types for a config it rejects
                raise NequIPFrameworkError(f"cannot write {path}: the nequip framework cannot rebuild the training "
                                           f"module ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})") \
                    from None
            ema = getattr(training, "ema", None)
            if ema is not None:  # the EMA weights are the ones the framework's loader evaluates
                with torch.no_grad():
                    for averaged, weight in zip(ema.ema_weights, training.model.parameters()):
                        averaged.copy_(weight)
            state = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in training.state_dict().items()}
        checkpoint = {"epoch": 0, "global_step": 0, "pytorch-lightning_version": lightning.__version__,
                      "state_dict": state, "hparams_name": "kwargs", "hyper_parameters": hyper_parameters,
                      "loops": {}, "callbacks": {}, "optimizer_states": [], "lr_schedulers": []}
        with atomic_write(path) as f:
            torch.save(checkpoint, f)
