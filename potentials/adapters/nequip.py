"""Adapter: a NequIP or Allegro model of the nequip framework (PyPI ``nequip``, ``nequip-allegro``) as a
potentials model — not ``potentials.NequIP``, this package's own NequIP-style model.

Loading (``load_framework_model``): the framework's own ``load_saved_model`` on a training checkpoint
(``.ckpt``) or a package (``.nequip.zip``), eager. Both are pickles (a package holds code too), so naming
the file (``nequip:`` in the CLIs) is the user's choice to run them. The framework's
``set_global_state`` (which loading needs) sets the default dtype to float64, seeds every generator and
changes e3nn's and torch's compile settings for the process: all of it is put back as it was.

Running (``NequIPFramework.forward``): the model with its force/stress output removed (the framework's
``disable_ForceStressOutput`` modifier: we differentiate ourselves) and, for NequIP, its ghost-exchange
slots filled (the framework's ``enable_LAMMPSMLIAPGhostExchange`` modifier, as its LAMMPS ML-IAP
integration does): each interaction block after the first pads its node features with ghost rows and
calls ``lmp_mliap_data.forward_exchange`` / ``reverse_exchange``, here ``GhostExchange`` over our halo.
Allegro is strictly local (one r_max of receptive field) and has no slots. Edges go in as the
framework's (receiver, sender) pairs with our edge vectors.
"""
from __future__ import annotations

import functools
import os
import warnings
from contextlib import contextmanager

import numpy as np
import torch
from ase.data import atomic_numbers

from ..base import EMBED, READOUT, BlockPotential, PackageModel, all_parts, block_part
from ..errors import MLIPError
from ..graph import AtomGraph
from .exchange import GhostExchange, default_dtype
from .process import process_kept

INSTALL = "pip install -e .[nequip]"
COMPILED = (".nequip.pth", ".nequip.pt2", ".pth", ".pt2")


class NequIPFrameworkError(MLIPError, ValueError):
    """A nequip-framework model file cannot be used: compiled, missing, unreadable, or with type names
    that are not chemical elements."""


@contextmanager
def process_state_kept():
    """Run the framework's loading, then put back what its ``set_global_state`` changes: torch's default
    dtype, the torch / numpy / Python random states and the environment variables it sets (``process_kept``),
    torch's JIT fusion strategy, e3nn's optimization defaults, the dynamo flags and the multiprocessing
    sharing strategy."""
    import e3nn

    with warnings.catch_warnings():  # torch.jit's fusion settings are deprecated; the framework still sets them
        warnings.simplefilter("ignore", DeprecationWarning)
        fusion = torch.jit.set_fusion_strategy([("STATIC", 2), ("DYNAMIC", 10)])
        torch.jit.set_fusion_strategy(fusion)
    e3nn_defaults = dict(e3nn.get_optimization_defaults())
    dynamo = {k: getattr(torch._dynamo.config, k) for k in ("capture_dynamic_output_shape_ops",
                                                            "capture_scalar_outputs")}
    sharing = torch.multiprocessing.get_sharing_strategy()
    try:
        with process_kept(random=True, dtype=True):
            yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.set_fusion_strategy(fusion)
        e3nn.set_optimization_defaults(**e3nn_defaults)
        for key, value in dynamo.items():
            setattr(torch._dynamo.config, key, value)
        torch.multiprocessing.set_sharing_strategy(sharing)


def load_framework_model(path, model_key: str = "sole_model"):
    """The eager GraphModel saved at ``path`` (.ckpt or .nequip.zip), in eval mode, on the CPU; the
    process's global state as it was before."""
    path = os.fspath(path)
    if path.endswith(COMPILED):
        raise NequIPFrameworkError(f"{path}: a compiled nequip model (nequip-compile output) is opaque here; pass "
                                   f"the .nequip.zip package or the .ckpt checkpoint it was compiled from")
    if not os.path.isfile(path):
        raise NequIPFrameworkError(f"{path}: no such file")
    if not path.endswith((".ckpt", ".nequip.zip")):
        raise NequIPFrameworkError(f"{path}: not a nequip-framework model file (a .ckpt checkpoint or a .nequip.zip "
                                   f"package)")
    try:
        from nequip.model.saved_models.load_utils import load_saved_model
        from nequip.utils.global_state import set_global_state
    except ImportError as exc:
        raise ImportError(f"potentials.NequIPFramework needs the nequip framework: {INSTALL} ({exc})") from None
    with process_state_kept():
        set_global_state()
        try:
            model = load_saved_model(path, compile_mode="eager", model_key=model_key)
        except Exception as exc:  # the framework raises many types for a damaged or foreign file
            raise NequIPFrameworkError(f"{path}: the nequip framework cannot load it ({type(exc).__name__}: "
                                       f"{(str(exc).splitlines() or [''])[0]})") from None
    return model.eval()


def framework_architecture(path, model_key: str) -> dict:
    """What rebuilds the model saved at ``path`` without the file (JSON): {"model": the model's config (its
    builder's ``_target_`` and arguments), "training_module": the training module's config, "versions": the
    package versions it was trained with, "model_key"}. Read from a .ckpt's hyper-parameters (the
    framework's own loader has unpickled the file already) or a .nequip.zip's ``model/config.yaml``."""
    import json
    import zipfile

    import yaml

    if path.endswith(".nequip.zip"):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/model/config.yaml")]
            config = yaml.safe_load(archive.read(names[0])) if names else {}
        training_module, versions = config.get("training_module", {}), {}
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        info = checkpoint.get("hyper_parameters", {}).get("info_dict", {})
        training_module, versions = info.get("training_module", {}), info.get("versions", {})
    model = training_module.get("model")
    if isinstance(model, dict) and model_key != "sole_model":
        model = model.get(model_key)
    if not isinstance(model, dict) or "_target_" not in model:
        raise NequIPFrameworkError(f"{path}: holds no model config for {model_key!r} (its training_module.model)")
    return json.loads(json.dumps({"model": model, "training_module": training_module, "versions": versions,
                                  "model_key": model_key}))


def build_framework_model(model_config: dict):
    """The GraphModel ``model_config`` describes, built by its builder (``_target_``) as the framework's
    training module builds it, eager, under the framework's global state (then put back)."""
    from hydra.utils import get_method
    from nequip.model.utils import override_model_compile_mode
    from nequip.utils.global_state import set_global_state

    config = dict(model_config)
    with process_state_kept():
        set_global_state()
        with override_model_compile_mode("eager"):
            try:
                return get_method(config.pop("_target_"))(**config).eval()
            except Exception as exc:  # the framework's builders raise many types for a config they reject
                raise NequIPFrameworkError(f"the nequip framework cannot build this model ({type(exc).__name__}: "
                                           f"{(str(exc).splitlines() or [''])[0]})") from None


# Edges per chunk at least (potentials.messages' default is 2,048): a NequIP or Allegro edge carries several KB of
# tensor-product weights and outputs (set by benchmarks/memory_per_atom.py).
MIN_CHUNK_EDGES = 256
_NOTED = set()


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
    from ..messages import chunked_edge_sum

    same = shared.get("pieces") is not None and all(a is b for a, b in zip(shared["pieces"], (edge_weight, edge_attr))) \
        and shared["index"] == (edge_src.data_ptr(), edge_dst.data_ptr(), edge_dst.shape)
    if not same:
        shared.update(pieces=(edge_weight, edge_attr), index=(edge_src.data_ptr(), edge_dst.data_ptr(), edge_dst.shape),
                      edge_data=torch.cat([edge_weight, edge_attr], dim=1), edge_index=torch.stack([edge_src, edge_dst]))
    basis, mlp = edge_weight.shape[1], block.edge_mlp

    def message(edge, x_j):  # [e, basis + attrs], [e, irreps_in] -> [e, irreps_mid]
        return block.tp_scatter.tp(x_j, edge[:, basis:], type(mlp).forward(mlp, edge[:, :basis]))

    return chunked_edge_sum(message, shared["edge_data"], shared["edge_index"], [x], x.size(0), budget, MIN_CHUNK_EDGES)


class NequIPFramework(PackageModel, BlockPotential):
    """A trained NequIP or Allegro model of the nequip framework, from its ``.ckpt`` checkpoint or its
    ``.nequip.zip`` package (eager; compiled ``.nequip.pth`` / ``.pt2`` files are refused), or from an
    ``architecture`` (``framework_architecture``'s JSON, as a potentials checkpoint of a fine-tuned model
    stores it: built with untrained weights, for a state dict to be loaded into it). dtype from the
    model's metadata; cutoff = its r_max; layers = its message-passing steps (interaction blocks for
    NequIP, 1 for Allegro, which is strictly local). Type names must be chemical symbols. Needs the
    ``nequip`` extra. (``potentials.NequIP`` is this package's own NequIP-style model.)

    Trainable through the ``Potential`` contract: its weights are the framework's parameters (named as in
    its GraphModel: "model.func.layer0_convnet.conv.linear_1.weight", ...), its reference energies the
    per-type energy shifts, and ``save_native`` writes a framework checkpoint (``best.ckpt``) that its
    loader, ``nequip-package build`` and ``nequip-compile`` read."""

    @property
    def package_module(self):
        return self.framework

    # ------------------------------------------------------------------ memory model
    # In chunks (NequIP's convolutions, Allegro's groups of atoms) the edge embedding and attributes are kept for all
    # edges (~800 B per edge measured); every edge at once adds its tensor products' tensors, ``plain_bytes_per_edge``.
    EVALUATION_BYTES_PER_EDGE = 1_000

    def evaluation_bytes(self, rows: float, edges: float, chunked: bool = True) -> float:
        per_edge = self.EVALUATION_BYTES_PER_EDGE + (0 if chunked else self.plain_bytes_per_edge())
        return self.EVALUATION_BYTES_PER_ROW * rows + per_edge * edges

    def plain_bytes_per_edge(self) -> float:
        """Bytes the framework's forward keeps per edge under autograd with every edge at once (saved tensors,
        doubled for their gradients), measured once on 13 atoms of fcc: the difference between all pairs within
        r_max and only the centre's pairs, so that weights and per-atom tensors cancel."""
        if getattr(self, "_plain_bytes_per_edge", None) is None:
            shell = torch.tensor([[a, b, 0.0] for a in (1, -1) for b in (1, -1)], dtype=torch.float64)
            points = torch.cat([torch.zeros(1, 3, dtype=torch.float64), shell, shell[:, [2, 0, 1]], shell[:, [1, 2, 0]]])
            points = points * 0.45 * self.cutoff
            receiver, sender = torch.nonzero(torch.cdist(points, points) < self.cutoff).T
            pairs = torch.stack([sender, receiver])[:, receiver != sender]
            centre = pairs[:, (pairs[0] == 0) | (pairs[1] == 0)]

            def saved_bytes(index) -> int:
                saved = 0

                def pack(t):
                    nonlocal saved
                    saved += t.numel() * t.element_size()
                    return t

                graph = AtomGraph(species=torch.zeros(len(points), dtype=torch.long, device=self.device),
                                  edge_index=index.to(self.device), n_local=len(points),
                                  edge_vec=(points[index[0]] - points[index[1]]).to(self.device).requires_grad_())
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    self._held_parts(graph)
                return saved

            extra = saved_bytes(pairs) - saved_bytes(centre)
            self._plain_bytes_per_edge = 2 * max(extra, 0) / (pairs.shape[1] - centre.shape[1])
        return self._plain_bytes_per_edge

    def __init__(self, path=None, model_key: str = "sole_model", architecture: dict | None = None, parts=None,
                 seed: int = 0):
        from nequip.model.modify_utils import get_all_modifiers, modify

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
        modifiers = get_all_modifiers(model)
        with process_state_kept():  # modifiers rebuild modules under the framework's defaults
            torch.set_default_dtype(torch.float64)
            if "disable_ForceStressOutput" in modifiers:
                model = modify(model, [{"modifier": "disable_ForceStressOutput"}])
            else:  # older models: the energy model inside the force output
                model.model = model.model.func
            self.exchanges = sum(type(m).__name__ == "NoOpGhostExchangeModule" for m in model.modules())
            # a framework without the modifier leaves the slots empty: then only wide mode is exact
            self.exchange_filled = "enable_LAMMPSMLIAPGhostExchange" in modifiers
            if self.exchanges and self.exchange_filled:
                model = modify(model, [{"modifier": "enable_LAMMPSMLIAPGhostExchange"}])
        self.framework = model.eval()
        self.framework.requires_grad_(False)
        dtype = {"float32": torch.float32, "float64": torch.float64}[metadata["model_dtype"]]
        self.to(dtype)
        self.cutoff = float(metadata["r_max"])
        # every interaction block holds one slot (the first block's is never called); Allegro holds none
        self.layers = max(1, self.exchanges)
        self.is_allegro = self.exchanges == 0
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
        """The framework's sequential network by part. NequIP: "embed" its type embedding, "block.k" its
        ``layer{k}_convnet``, "readout" the modules after the last (energy readout, per-type scale/shift, pair
        potential, sums); between stages travel the node features and the type embedding's node attributes
        (which every layer's self-connection reads) side by side. Allegro: "embed" its two-body embeddings and
        its Allegro module's first projection, "block.k" that module's layer k (``AllegroLayers``), "readout"
        the modules after it; between stages travels the per-edge state. Either way the parameter-free modules
        before the first layer (spherical harmonics, radial basis, edge lengths) run in ``context``."""
        network = self.network
        self.network_path = next(name for name, module in self.named_modules() if module is network)
        names = list(network._modules)
        self.allegro_layers = None
        try:
            if self.is_allegro:
                first = last = self._split_allegro(names)
            else:
                layers = [f"layer{k}_convnet" for k in range(self.layers)]
                if not set(layers) <= set(names):
                    raise ValueError("its network has no layerK_convnet modules")
                first, last = names.index(layers[0]), names.index(layers[-1])
                self.part_modules = {block_part(k): [name] for k, name in enumerate(layers)}
        except ValueError as exc:
            self.part_modules = None
            if parts is not None and set(parts) != set(all_parts(self.n_blocks)):
                raise NequIPFrameworkError(f"{where}: {exc}: it does not split into pipeline stages; fine-tune it "
                                           f"with parallel: data or graph") from None
            self._init_parts(None, seed)
            return
        before = names[:first]
        self.embed_modules = [n for n in before if any(True for _ in network._modules[n].parameters())]
        self.context_modules = [n for n in before if n not in self.embed_modules]
        self.part_modules[EMBED] = self.embed_modules + self.part_modules.get(EMBED, [])
        self.part_modules[READOUT] = names[last + 1:]
        if not self.is_allegro:
            from nequip.data import AtomicDataDict

            self._attrs_width = network._modules[self.embed_modules[-1]].irreps_out[AtomicDataDict.NODE_ATTRS_KEY].dim
            self._widths = [network._modules[name].irreps_in[AtomicDataDict.NODE_FEATURES_KEY].dim + self._attrs_width
                            for name in layers] + [network._modules[layers[-1]].irreps_out[
                                AtomicDataDict.NODE_FEATURES_KEY].dim + self._attrs_width]
        self._init_parts(parts, seed)
        self._drop_parts_not_held()

    def _split_allegro(self, names) -> int:
        """Set up Allegro's parts (``allegro_layers``, ``part_modules``' blocks and the first projection);
        the index of its Allegro module among the network's ``names``. ValueError where it does not split."""
        from .allegro_layers import AllegroLayers

        network = self.network
        index = [k for k, name in enumerate(names) if type(network._modules[name]).__name__ == "Allegro_Module"]
        if len(index) != 1:
            raise ValueError(f"its network holds {len(index)} Allegro_Module(s), not one")
        name = names[index[0]]
        module = network._modules[name]
        self.allegro_layers = AllegroLayers(module, network._modules[names[index[0] - 1]].irreps_out)
        self.part_modules = {EMBED: [f"{name}.first_layer_env_embed_projection"],
                             **{block_part(k): [f"{name}.latents.{k}", f"{name}.tps.{k}"]
                                for k in range(self.allegro_layers.layers)}}
        return index[0]

    @property
    def n_blocks(self) -> int:
        """NequIP: its interaction blocks; Allegro: its layers (one message-passing step, ``layers`` = 1)."""
        return self.allegro_layers.layers if self.allegro_layers is not None else self.layers

    @property
    def state_per_edge(self) -> bool:
        """Allegro's state between its layers is per edge."""
        return self.allegro_layers is not None

    @property
    def network(self):
        """The framework's sequential network (its modules in order), inside the force output it may wrap."""
        return getattr(self.framework.model, "func", self.framework.model)

    def _held_parts(self, graph: AtomGraph):
        """The whole model's forward, or a pipeline stage's parts on ``graph`` (its first block fed zeros)."""
        if self.complete:
            return self(graph)
        ctx = self.context(graph)
        blocks = sorted(int(p.split(".")[1]) for p in self.parts if p.startswith("block."))
        rows = self.state_rows(graph.n_nodes, graph.edge_index.shape[1])
        h = self.embed(graph, ctx) if EMBED in self.parts else \
            torch.zeros(rows, self.feature_width(blocks[0]), dtype=torch.float64, device=self.device)
        for k in blocks:
            h = self.block(k, h, graph, ctx)
        return self.readout_energies(h, graph, ctx) if READOUT in self.parts else h

    def part_prefixes(self, part: str) -> list:
        if self.part_modules is None:  # (a network that does not split: every model whole)
            return []
        return [f"{self.network_path}.{name}" for name in self.part_modules[part]]

    def feature_width(self, k: int) -> int:
        return self.allegro_layers.width(k) if self.allegro_layers is not None else self._widths[k]

    def context(self, graph: AtomGraph) -> dict:
        """The framework's data (as ``forward`` prepares it) after its parameter-free modules before the first
        layer (spherical harmonics and radial embedding of the edges, or edge lengths); "kept": the indices of
        the graph's ``edges`` that per-edge-type cutoffs keep (None: all)."""
        data, exchange, kept = self._data(graph, kept=True)
        with default_dtype(torch.float64):
            return {"data": self._run(self.context_modules, data), "exchange": exchange, "kept": kept,
                    "edges": graph.edge_index.shape[1]}

    def embed(self, graph: AtomGraph, ctx) -> torch.Tensor:
        from nequip.data import AtomicDataDict

        with default_dtype(torch.float64):
            data = self._run(self.embed_modules, dict(ctx["data"]))
            if self.allegro_layers is not None:
                return self._all_edges(self.allegro_layers.pack(0, self.allegro_layers.first(data)), ctx)
        return torch.cat([data[AtomicDataDict.NODE_FEATURES_KEY], data[AtomicDataDict.NODE_ATTRS_KEY]], dim=1)

    def block(self, k: int, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        from nequip.data import AtomicDataDict

        if self.allegro_layers is not None:
            layers = self.allegro_layers
            with default_dtype(torch.float64):
                state = layers.layer(k, layers.unpack(k, self._kept_edges(h, ctx)), ctx["data"])
            return self._all_edges(layers.pack(k + 1, state), ctx)
        data = self._with_features(ctx, h)
        attrs = data[AtomicDataDict.NODE_ATTRS_KEY]
        with default_dtype(torch.float64):
            feats = self._run(self.part_modules[block_part(k)], data)[AtomicDataDict.NODE_FEATURES_KEY]
        return torch.cat([feats, attrs[: feats.shape[0]]], dim=1)

    def readout_energies(self, h: torch.Tensor, graph: AtomGraph, ctx) -> torch.Tensor:
        from nequip.data import AtomicDataDict

        if self.allegro_layers is not None:
            layers = self.allegro_layers
            state = layers.unpack(layers.layers, self._kept_edges(h, ctx))
            data = dict(ctx["data"], **{field: state[field] for field in layers.carried})
            data[layers.module.scalar_out_field] = state["scalars"]
        else:
            data = self._with_features(ctx, h)
        with default_dtype(torch.float64):
            out = self._run(self.part_modules[READOUT], data)
        return ctx["exchange"].owned(out[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1), graph.n_local)

    @staticmethod
    def _kept_edges(h: torch.Tensor, ctx) -> torch.Tensor:
        """A per-edge state over the graph's edges [E, w] → over the edges the per-edge-type cutoffs keep."""
        return h if ctx["kept"] is None else h.index_select(0, ctx["kept"])

    @staticmethod
    def _all_edges(h: torch.Tensor, ctx) -> torch.Tensor:
        """A per-edge state over the kept edges → over the graph's edges [E, w] (zero rows where pruned): the rows
        of the tensor that travels between stages do not depend on the cutoffs."""
        if ctx["kept"] is None:
            return h
        return h.new_zeros(ctx["edges"], h.shape[1]).index_copy(0, ctx["kept"], h)

    def _with_features(self, ctx, h) -> dict:
        from nequip.data import AtomicDataDict

        data = dict(ctx["data"])
        data[AtomicDataDict.NODE_FEATURES_KEY] = h[:, : h.shape[1] - self._attrs_width]
        data[AtomicDataDict.NODE_ATTRS_KEY] = h[:, h.shape[1] - self._attrs_width:]
        return data

    def _run(self, names, data: dict) -> dict:
        for name in names:
            data = self.network._modules[name](data)
        return data

    def _data(self, graph: AtomGraph, kept: bool = False) -> tuple:
        """(the framework's input data for ``graph``: edge vectors, (receiver, sender) edges, atom types and the
        ghost exchange, per-edge-type cutoffs applied; the exchange; with ``kept`` the indices of the graph's
        edges those cutoffs keep, else or without cutoffs None)."""
        from nequip.data import AtomicDataDict

        if self.exchanges and not self.exchange_filled and graph.receivers < graph.n_nodes:
            raise NequIPFrameworkError("this model's framework version cannot fill its ghost-exchange slots "
                                       "(no enable_LAMMPSMLIAPGhostExchange modifier): evaluate it in wide mode")
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
        from nequip.data import AtomicDataDict

        if not self.complete:
            return super().forward(graph)  # (raises: a stage's parts alone do not evaluate)
        data, exchange, _ = self._data(graph)
        with default_dtype(torch.float64):  # the framework's global dtype, as its calculator runs
            if self.is_allegro and graph.memory_budget is not None and graph.n_local:
                return self._local_in_groups(data, graph.n_local + exchange.pad, graph.memory_budget)[exchange.pad:]
            with chunked_convolutions(self.framework, graph.memory_budget):
                out = self.framework(data)
        return exchange.owned(out[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1), graph.n_local)

    def _local_in_groups(self, data: dict, rows: int, budget: int) -> torch.Tensor:
        """[rows] per-atom energies of a strictly local model (Allegro: each atom's energy a function of its own
        edges) in groups of atoms whose edges' tensors take at most ``budget`` bytes, each group the framework's
        own forward on its atoms' edges, recomputed in the backward (``messages.chunked_local``)."""
        from nequip.data import AtomicDataDict

        from ..messages import chunked_local

        types = data[AtomicDataDict.ATOM_TYPE_KEY]
        edge_index = data[AtomicDataDict.EDGE_INDEX_KEY].flip(0)  # back to (sender, receiver)

        def group(sub_index, vectors, nodes):
            out = self.framework({AtomicDataDict.EDGE_VECTORS_KEY: vectors,
                                  AtomicDataDict.EDGE_INDEX_KEY: sub_index.flip(0),
                                  AtomicDataDict.ATOM_TYPE_KEY: types[nodes]})
            return out[AtomicDataDict.PER_ATOM_ENERGY_KEY].reshape(-1)

        return chunked_local(group, edge_index, data[AtomicDataDict.EDGE_VECTORS_KEY], rows, budget, MIN_CHUNK_EDGES)

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

        from ..files import atomic_write

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
